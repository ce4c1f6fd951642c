"""Small model assets built locally (tiny HF checkpoints and tokenizer for tests and the demo)."""

import re


def _text_in_logits_out(method: str, source, **kwargs):
    """``AutoModelForCausalLM.<method>(source)``; for a causal LM transformers maps to no auto class (Mistral Small
    4's text model, released inside a vision-language checkpoint) the class its config names; for a vision-language
    model transformers has no causal-LM class for (Qwen3-VL), ``AutoModelForImageTextToText``'s (text-only input
    needs no image)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        return getattr(AutoModelForCausalLM, method)(source, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
    config = source if method == "from_config" else AutoConfig.from_pretrained(source)
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch.endswith("ForCausalLM") and hasattr(transformers, arch):
        return getattr(getattr(transformers, arch), method)(source, **kwargs)
    from transformers import AutoModelForImageTextToText

    return getattr(AutoModelForImageTextToText, method)(source, **kwargs)


def load_causal_lm(path: str, **kwargs):
    """The HF model of the checkpoint at ``path`` that takes token ids and returns next-token logits: transformers'
    causal-LM class, or its image-text-to-text model for a vision-language checkpoint that has none."""
    return _text_in_logits_out("from_pretrained", path, **kwargs)


def causal_lm_from_config(path: str, **kwargs):
    """:func:`load_causal_lm`'s model of the checkpoint at ``path``, built from its config without its
    ``quantization_config`` (top level or ``text_config``'s) and randomly initialised: for a caller that loads the
    weights itself (the reference engine dequantizing a compressed-tensors int4 checkpoint)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for c in (config, config.get_text_config()):  # the same object for a text-only model
        if getattr(c, "quantization_config", None) is not None:
            del c.quantization_config
    return _text_in_logits_out("from_config", config, **kwargs)


# transformers holds these experts as [E, 2F, H] / [E, H, F]; their checkpoints (and SGLang's loader) have the
# transposes. Its save_pretrained cannot write them back (5.24 raises inside the reverse conversion, and that
# conversion keeps whichever layout matches the model's), so save_checkpoint writes them itself.
TRANSPOSED_EXPERTS = {"qwen3_vl_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}


# vision-language models whose releases keep a flat config.json (transformers 5 writes a text_config)
FLAT_CONFIGS = ("qwen2_5_vl", "qwen2_vl")


def write_flat_config(out_dir: str) -> None:
    """Rewrite ``out_dir``'s config.json as Qwen2.5-VL / Qwen2-VL releases lay it out: the language model's fields at
    the top level beside ``vision_config``, RoPE as ``rope_theta`` and ``rope_scaling: {"type": "mrope",
    "mrope_section": ...}`` (transformers reads it back into a text_config)."""
    import json
    import os

    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    text = config.pop("text_config", None)
    if text is None:
        return
    rope = dict(text.pop("rope_parameters", None) or {})
    flat = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "dtype")}
    flat.update(config)
    flat["rope_theta"] = rope.pop("rope_theta", 10000.0)
    rope.pop("rope_type", None)
    flat["rope_scaling"] = {"type": "mrope", **rope}
    with open(path, "w") as f:
        json.dump(flat, f, indent=2, sort_keys=True)


def _kimi_k25_names(state: dict, config) -> dict:
    """Kimi-K2.5 as released: the language model under ``language_model.model.`` / ``language_model.lm_head``,
    experts one by one (transformers fuses them: [E, 2F, H] gate rows first, [E, H, F]), the MoonViT tower and
    projector under their own names (``vision_tower.encoder.blocks.*.wqkv``, ``mm_projector.proj.0``, ...:
    ``multimodal.families.kimi_k25_released_state``; transformers' reverse conversion cannot be used: 5.24's renames
    the language model's layers to ``blocks``)."""
    from forge_megatron.multimodal.families import kimi_k25_released_state

    tower = {name[len("model."):]: state.pop(name) for name in list(state)
             if name.startswith(("model.vision_tower.", "model.mm_projector."))}
    state.update(kimi_k25_released_state(tower, config.vision_config.num_attention_heads))
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            name = "language_model.lm_head.weight"
        elif name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model."):]
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, w in enumerate(t):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


def olmo_hybrid_conv_split(config) -> list[int]:
    """OLMo Hybrid's depthwise convolution channels as released: ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` (transformers
    concatenates them into one ``conv1d``)."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return [key, key, config.linear_num_value_heads * config.linear_value_head_dim]


def _olmo_hybrid_names(state: dict, config) -> dict:
    """OLMo Hybrid with its Gated DeltaNet layers' convolution as three tensors (``q_conv1d``, ``k_conv1d``,
    ``v_conv1d``: what SGLang's loader and transformers' read) and transformers' other names (transformers 5.24's
    reverse conversion splits the convolution into equal thirds and renames the layers' norms to OLMo-core's
    ``attention_layer_norm`` / ``feedforward_layer_norm``, the attention layers' too, so it cannot be used)."""
    linear = {i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"}
    out = {}
    for name, t in state.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None or int(m.group(1)) not in linear:
            out[name] = t
            continue
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest == "linear_attn.conv1d.weight":
            for part, piece in zip("qkv", t.split(olmo_hybrid_conv_split(config))):
                out[f"{prefix}linear_attn.{part}_conv1d.weight"] = piece
        else:
            out[prefix + rest] = t
    return out


def _kimi_linear_names(state: dict, config) -> dict:
    """Kimi Linear as released: the Kimi Delta Attention layers' three convolutions and forget-gate tensors under
    ``self_attn.``, the MoE layers under ``block_sparse_moe.`` with Mixtral's experts one by one (``w1`` gate, ``w3``
    up, ``w2`` down), the dense layers' MLP under ``mlp.`` (transformers 5.24's reverse conversion names those
    ``block_sparse_moe`` too)."""
    moe = {i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"}
    out = {}
    for name, t in state.items():
        m = re.match(r"(model\.layers\.(\d+)\.)(.+)", name)
        if m is None:
            out[name] = t
            continue
        prefix, rest = m.group(1), m.group(3)
        if rest == "self_attn.conv1d.weight":
            for part, piece in zip("qkv", t.chunk(3)):
                out[f"{prefix}self_attn.{part}_conv1d.weight"] = piece
        elif rest.startswith("self_attn.forget_gate."):
            out[prefix + "self_attn." + rest[len("self_attn.forget_gate."):]] = t
        elif int(m.group(2)) in moe and rest == "mlp.experts.gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{prefix}block_sparse_moe.experts.{e}.w1.weight"] = gate
                out[f"{prefix}block_sparse_moe.experts.{e}.w3.weight"] = up
        elif int(m.group(2)) in moe and rest == "mlp.experts.down_proj":
            for e, w in enumerate(t):
                out[f"{prefix}block_sparse_moe.experts.{e}.w2.weight"] = w
        elif int(m.group(2)) in moe and rest.startswith("mlp."):
            out[prefix + "block_sparse_moe." + rest[len("mlp."):]] = t
        else:
            out[name] = t
    return out


def _drop_tensors(out_dir: str, suffixes: tuple[str, ...]) -> None:
    """Rewrite the safetensors files of ``out_dir`` without the tensors whose names end with one of ``suffixes``
    (and its index, if it has one)."""
    import glob
    import json
    import os

    from safetensors.torch import load_file, save_file

    for path in glob.glob(os.path.join(out_dir, "*.safetensors")):
        tensors = load_file(path)
        kept = {name: t for name, t in tensors.items() if not name.endswith(suffixes)}
        if len(kept) != len(tensors):
            save_file(kept, path, metadata={"format": "pt"})
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = {n: v for n, v in data["weight_map"].items() if not n.endswith(suffixes)}
        with open(index, "w") as f:
            json.dump(data, f, indent=2)


def save_checkpoint(model, out_dir: str) -> None:
    """Write ``model`` (a transformers model) to ``out_dir`` as its released checkpoints are laid out:
    ``save_pretrained``, except where transformers cannot write the layout back (Qwen3-VL-MoE's experts,
    Kimi-K2.5's, OLMo Hybrid's and Kimi Linear's names; MiniMax-01's decay tables, which its releases do not hold)."""
    import os

    from safetensors.torch import save_file

    kind = model.config.model_type
    fused = TRANSPOSED_EXPERTS.get(kind, ())
    if not fused and kind not in ("kimi_k25", "olmo_hybrid", "kimi_linear"):
        model.save_pretrained(out_dir, safe_serialization=True)
        if kind in FLAT_CONFIGS:
            write_flat_config(out_dir)
        if kind == "minimax":  # MiniMax-01's releases hold no lightning decay tables (transformers rebuilds them)
            _drop_tensors(out_dir, ("slope_rate", "query_decay", "key_decay", "diagonal_decay"))
        return
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.get_text_config().tie_word_embeddings:
            continue  # tied: saved once, as the embedding
        state[name] = t.transpose(1, 2) if fused and name.endswith(fused) else t
    if kind == "kimi_k25":
        state = _kimi_k25_names(state, model.config)
    elif kind == "olmo_hybrid":
        state = _olmo_hybrid_names(state, model.config)
    elif kind == "kimi_linear":
        state = _kimi_linear_names(state, model.config)
    state = {name: t.contiguous() for name, t in state.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
