"""Small model assets built locally (tiny HF checkpoints and tokenizer for tests and the demo)."""


def load_causal_lm(path: str, **kwargs):
    """The HF model of the checkpoint at ``path`` that takes token ids and returns next-token logits: transformers'
    causal-LM class, or, for a vision-language checkpoint that has none (Qwen3-VL), its image-text-to-text model
    (text-only input needs no image)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, **kwargs)


# transformers holds these experts as [E, 2F, H] / [E, H, F]; their checkpoints (and SGLang's loader) have the
# transposes. Its save_pretrained cannot write them back (5.24 raises inside the reverse conversion, and that
# conversion keeps whichever layout matches the model's), so save_checkpoint writes them itself.
TRANSPOSED_EXPERTS = {"qwen3_vl_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}


def save_checkpoint(model, out_dir: str) -> None:
    """Write ``model`` (a transformers model) to ``out_dir`` as its released checkpoints are laid out:
    ``save_pretrained``, except where transformers cannot write the layout back (Qwen3-VL-MoE's experts)."""
    import os

    from safetensors.torch import save_file

    fused = TRANSPOSED_EXPERTS.get(model.config.model_type)
    if fused is None:
        model.save_pretrained(out_dir, safe_serialization=True)
        return
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.get_text_config().tie_word_embeddings:
            continue  # tied: saved once, as the embedding
        state[name] = (t.transpose(1, 2) if name.endswith(fused) else t).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
