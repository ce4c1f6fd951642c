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
