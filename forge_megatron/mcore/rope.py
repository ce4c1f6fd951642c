"""RoPE frequency scaling of Hugging Face checkpoints: ``linear``, ``llama3``, ``yarn``, ``longrope`` and
``proportional``.

Long-context checkpoints stretch RoPE by changing its inverse frequencies (Llama 3.1-3.3: ``llama3``; Qwen2.5 / Qwen3
with a ``rope_scaling`` entry for 128k contexts, and many others: ``yarn``; older ones: ``linear``). The trainer must
rotate exactly as the engines do, or every logprob is off. Megatron's ``RotaryEmbedding`` computes its table as
``outer(positions, inv_freq)``, so a scaled model is the same module with other ``inv_freq`` (:func:`apply`), which
also serves the tree's depth positions unchanged (tree_attention.use_depth_rope indexes that table). YaRN also
multiplies cos and sin by an attention factor m; with RoPE on the whole head that scales every query-key product
by m^2, which is the softmax scale m^2 / sqrt(head_dim) (:func:`softmax_scale`).

With RoPE on part of each head (Phi-4-mini, GLM-4, Qwen3.5) the attention factor scales the rotated channels only,
which no softmax scale expresses: :func:`scale_rotated_channels` multiplies those channels of every query and key
(after any q/k norm, before the rotation, which is linear) instead.

``longrope`` (Phi-3.5, Phi-4-mini: per-frequency ``short_factor`` and ``long_factor`` divisors, attention factor
sqrt(1 + ln(s) / ln(original)) for s = max / original positions) switches between its two factor lists with the
length of the forward pass in transformers (longer than ``original_max_position_embeddings``: long) and with the
batch in SGLang (any position past it: long, for every request of that batch), so no fixed rotation equals either
for every sample. Here one list is chosen for the whole run (``longrope_factors``: ``"long"`` or ``"short"``; by
default long when the model's context exceeds the original one, as vLLM chooses by its context length), and the
engines must be pinned to the same list (the reference engine is, by the same option; SGLang through
``--json-model-override-args``, both lists set to the chosen one: :func:`pinned_longrope`). Types whose frequencies
depend on the sequence length at run time otherwise (``dynamic``) are refused (``ValueError``: the bridge reports it
as unsupported).

``proportional`` (Gemma 4's global layers, LFM3's full-attention layers) rotates the whole head in rotate-half pairs
(i, i + D / 2) but only the first ``partial_rotary_factor`` of the D / 2 frequencies, base^(-2i / D) (over the whole
head's D, not the rotated part's), the others 0 (pairs left as they are), all divided by ``factor``: the same table
shape as plain RoPE over the whole head, so it is a table like the others (rotary_percent 1).

``params`` below is the HF dict (``rope_scaling`` or transformers 5's ``rope_parameters``): ``rope_type`` (or
``type``), ``factor``, and per type ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``
(llama3, yarn), ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``
(yarn), ``short_factor``, ``long_factor``, ``longrope_factors`` (longrope).
"""

from __future__ import annotations

import math

import torch

SCALED_TYPES = ("linear", "llama3", "yarn", "longrope", "proportional")
LONGROPE_FACTORS = ("long", "short")


def rope_type(params: dict | None) -> str:
    params = params or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    return "longrope" if kind == "su" else kind  # (Phi-3's older name, as transformers reads it)


def check(params: dict | None, max_position_embeddings: int) -> dict | None:
    """``params`` normalised for :func:`inv_freq` (None for plain RoPE); ValueError naming what is missing or
    unsupported."""
    kind = rope_type(params)
    if kind == "default":
        return None
    if kind not in SCALED_TYPES:
        raise ValueError(f"RoPE scaling type {kind!r} is not supported (supported: default, "
                         f"{', '.join(SCALED_TYPES)})")
    out = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    out["rope_type"] = kind
    if kind == "longrope":
        return _check_longrope(out, max_position_embeddings)
    if kind == "proportional":  # (its rotated share of the frequencies is part of the table)
        share = float(params.get("partial_rotary_factor", 1.0))
        factor = float(params.get("factor", 1.0))
        if not 0.0 < share <= 1.0 or factor <= 0:
            raise ValueError(f"RoPE 'proportional' needs 0 < partial_rotary_factor <= 1 and factor > 0, got {share} "
                             f"and {factor}")
        return {"rope_type": kind, "partial_rotary_factor": share, "factor": factor}
    factor = out.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"RoPE scaling {kind!r} needs a positive 'factor', got {factor!r}")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in out:
                raise ValueError(f"RoPE scaling 'llama3' needs {key!r}")
        if out["high_freq_factor"] < out["low_freq_factor"]:  # (equal: no band between, Llama 4 Scout's 1 and 1)
            raise ValueError("RoPE scaling 'llama3' needs high_freq_factor >= low_freq_factor")
    if kind == "yarn":
        out.setdefault("original_max_position_embeddings", max_position_embeddings)
    return out


def _check_longrope(out: dict, max_position_embeddings: int) -> dict:
    """:func:`check` for ``longrope``: both factor lists, the original context, the factor (max / original where the
    config gives none, as transformers and SGLang take it), the attention factor resolved, the factor list chosen."""
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if out.get(key) is None:
            raise ValueError(f"RoPE scaling 'longrope' needs {key!r}")
    for key in ("short_factor", "long_factor"):
        if not isinstance(out[key], (list, tuple)) or not out[key] or \
                not all(isinstance(x, (int, float)) and x > 0 for x in out[key]):
            raise ValueError(f"RoPE scaling 'longrope': {key} must be a list of positive numbers")
    if out.get("short_mscale") is not None or out.get("long_mscale") is not None:
        raise ValueError("RoPE scaling 'longrope' with short_mscale / long_mscale is not supported (transformers "
                         "applies one attention_factor to both lists, SGLang each list its own)")
    original = int(out["original_max_position_embeddings"])
    factor = out.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    out["factor"] = float(factor)
    if out.get("attention_factor") is None:
        out["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = out.get("longrope_factors")
    if chosen is None:
        chosen = "long" if max_position_embeddings > original else "short"
    if chosen not in LONGROPE_FACTORS:
        raise ValueError(f"longrope_factors must be one of {LONGROPE_FACTORS}, got {chosen!r}")
    out["longrope_factors"] = chosen
    return out


def pinned_longrope(params: dict, factors: str) -> dict:
    """A ``longrope`` config entry (``rope_scaling`` / ``rope_parameters``) whose two factor lists are both the
    ``factors`` one (``"long"`` / ``"short"``): an engine given it rotates every token alike whatever the length of
    its forward pass or batch (SGLang: ``--json-model-override-args '{"rope_scaling": ...}'``; the reference engine
    loads it so)."""
    if factors not in LONGROPE_FACTORS:
        raise ValueError(f"longrope factors must be one of {LONGROPE_FACTORS}, got {factors!r}")
    chosen = list(params[f"{factors}_factor"])
    return {**params, "short_factor": chosen, "long_factor": list(chosen)}


def inv_freq(params: dict | None, base: float, dim: int) -> torch.Tensor:
    """fp32 inverse frequencies [dim / 2] of RoPE with base ``base`` over ``dim`` rotated channels, scaled per
    ``params`` (from :func:`check`; None: plain RoPE)."""
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope_type(params)
    if kind == "default":
        return plain
    if kind == "proportional":  # the first share of the frequencies over the whole head, the others 0
        angles = int(params["partial_rotary_factor"] * dim // 2)
        return torch.cat([plain[:angles], plain.new_zeros(dim // 2 - angles)]) / float(params["factor"])
    if kind == "longrope":
        divisors = torch.tensor(params[f"{params['longrope_factors']}_factor"], dtype=torch.float32)
        if divisors.numel() != dim // 2:
            raise ValueError(f"RoPE scaling 'longrope': {divisors.numel()} factors for {dim // 2} rotated "
                             "frequencies")
        return 1.0 / (divisors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor = float(params["factor"])
    if kind == "linear":
        return plain / factor
    if kind == "llama3":
        old = params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / plain
        scaled = torch.where(wavelen > old / low, plain / factor, plain)
        if high == low:  # no band to blend in (Llama 4 Scout): each frequency kept or divided by the factor
            return scaled
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, blended, scaled)
    # yarn: interpolate the low frequencies, keep the high ones, blend linearly between two correction dims
    original = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies as trained), 0: interpolate by the factor
    return plain / factor * (1 - keep) + plain * keep


def attention_factor(params: dict | None) -> float:
    """The factor YaRN and longrope multiply cos and sin by (1 for the other types)."""
    if rope_type(params) == "longrope":
        return float(params["attention_factor"]) if params.get("attention_factor") is not None else 1.0
    if rope_type(params) != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def softmax_scale(params: dict | None, head_dim: int, base: float | None = None) -> float | None:
    """The attention softmax scale that stands for YaRN's scaled cos/sin, times ``base`` (the model's own scale;
    None: 1 / sqrt(head_dim)). None when both are Megatron's default 1 / sqrt(head_dim)."""
    m = attention_factor(params)
    if m == 1.0 and base is None:
        return None
    return m * m * (base if base is not None else 1 / math.sqrt(head_dim))


def rotary_modules(model) -> list:
    """The rotary embedding modules of ``model`` (a GPTModel stage): the model's own, or, under multi-latent
    attention (which rotates inside each attention layer), every layer's."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None:
        return [rotary]
    decoder = getattr(model, "decoder", None)
    return [layer.self_attention.rotary_pos_emb for layer in getattr(decoder, "layers", [])
            if getattr(layer.self_attention, "rotary_pos_emb", None) is not None]


def apply(model, params: dict | None, base: float, dim: int) -> None:
    """Give ``model``'s (a GPTModel stage) rotary embeddings the scaled inverse frequencies over its ``dim`` rotated
    channels per head (no-op for plain RoPE)."""
    if rope_type(params) == "default":
        return
    modules = rotary_modules(model)
    if not modules:
        raise ValueError("RoPE scaling needs a GPTModel built with position_embedding_type='rope'")
    new = inv_freq(params, base, dim)
    for rotary in modules:
        old = rotary.inv_freq
        if new.shape != old.shape:
            raise ValueError(f"RoPE scaling: {tuple(new.shape)} frequencies for a table of {tuple(old.shape)}")
        rotary.inv_freq = new.to(device=old.device, dtype=old.dtype)
        if hasattr(rotary.forward, "cache_clear"):  # Megatron memoises the table per length
            rotary.forward.cache_clear()


def apply_to_sliding_layers(model, sliding: dict | None, others: dict | None, base: float, dim: int,
                            head_dim: int, sliding_base: float | None = None, base_scale: float | None = None,
                            full_layers: tuple[bool, ...] | None = None) -> None:
    """Give the sliding-window layers of ``model`` (a GPTModel stage) RoPE scaled per ``sliding`` with base
    ``sliding_base`` (default ``base``) while the model's table is scaled per ``others`` with ``base`` (OLMo 3 extends
    its context with YaRN on the full-attention layers only; Gemma 3's local layers have base 10k, its global ones
    1M and linear scaling). Megatron computes one table of angles ``position * inv_freq`` for every layer: a sliding
    layer's self-attention gets it multiplied, column by column, by ``inv_freq(sliding) / inv_freq(others)`` (the
    table repeats the frequencies for the two rotated halves), which are that layer's angles, and its core attention
    the softmax scale of ``sliding``'s attention factor (times ``base_scale``, the model's own). Works on the
    depth-indexed table of the tree model as on the causal one.

    ``full_layers`` (one flag per layer of the model, True for the full-attention layers among the attention ones):
    the other way round, those layers get ``sliding`` (then their RoPE) over the model's table of the sliding ones
    (``others``). LFM3's full layers rotate ``proportional`` RoPE, some frequencies 0, which no ratio over them could
    undo: the model's table is its sliding layers' instead."""
    from megatron.core.transformer.utils import is_layer_window_attention

    ratio = inv_freq(sliding, sliding_base or base, dim) / inv_freq(others, base, dim)
    ratio_D = torch.cat([ratio, ratio])
    scale = softmax_scale(sliding, head_dim, base_scale) or head_dim ** -0.5
    config = model.config

    def rescale(module, args, kwargs):
        table = kwargs.get("rotary_pos_emb")
        if table is None:
            return None
        if isinstance(table, tuple):  # (query's, key's)
            kwargs["rotary_pos_emb"] = tuple(t * ratio_D.to(t.device, t.dtype) for t in table)
        else:
            kwargs["rotary_pos_emb"] = table * ratio_D.to(table.device, table.dtype)
        return args, kwargs

    for layer in model.decoder.layers:
        if full_layers is not None:
            if not full_layers[layer.layer_number - 1]:
                continue
        elif not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer.layer_number):
            continue
        layer.self_attention.core_attention.softmax_scale = scale
        layer.self_attention.register_forward_pre_hook(rescale, with_kwargs=True)


def llama4_query_scale(positions: torch.Tensor, beta: float, original_max: int, offset: int = 0) -> torch.Tensor:
    """Llama 4's attention temperature of tokens at ``positions``: 1 + beta * log(1 + floor((p + offset) /
    original_max)) (Ministral 3: offset 0; Llama 4's NoPE layers: 1, its floor_scale as original_max)."""
    return 1.0 + beta * torch.log1p(torch.floor((positions.float() + offset) / original_max))


def _scale_latent_queries(model, beta: float, original_max: int) -> None:
    """:func:`scale_queries` under multi-latent attention (Mistral Small 4): HF scales the whole query, its
    unrotated and rotated parts, after RoPE; RoPE is linear, so this scales the output rows of the query's up
    projection (``linear_q_up_proj``, or ``linear_q_proj`` without a query latent), every head of a token alike.
    A token's position is its depth in the tree (the packed params' ``position_ids``: this CP rank's tokens) or, in
    the causal model, its index; a pre-hook on each self-attention keeps them for its projection's forward hook (the
    projection's output holds the whole sequence also under sequence parallelism)."""
    import functools

    def positions_of(module, args, kwargs):
        params = kwargs.get("packed_seq_params")
        module._forge_query_positions = getattr(params, "position_ids", None)  # None: causal, 0..S-1
        if params is not None and module._forge_query_positions is None:
            raise ValueError("query scaling under multi-latent attention needs tree-packed sequences "
                             "(TreePackedSeqParams) or none")
        return None

    def scale(module, inputs, output, attention=None):
        out, bias = output if isinstance(output, tuple) else (output, None)
        if bias is not None:
            raise ValueError("query scaling with a bias added after the query projection is not supported")
        s = out.shape[0]
        pos = attention._forge_query_positions
        if pos is None:
            pos = torch.arange(s, device=out.device)
        if pos.numel() != s:
            raise ValueError(f"query scaling: {pos.numel()} positions for {s} tokens")
        factor = llama4_query_scale(pos.to(out.device), beta, original_max)
        scaled = out * factor.to(out.dtype).view(s, *([1] * (out.dim() - 1)))
        return (scaled, bias) if isinstance(output, tuple) else scaled

    for layer in model.decoder.layers:
        attention = layer.self_attention
        proj = getattr(attention, "linear_q_up_proj", None) or attention.linear_q_proj
        attention.register_forward_pre_hook(positions_of, with_kwargs=True)
        proj.register_forward_hook(functools.partial(scale, attention=attention))


def scale_rotated_channels(model, factor: float, rot_dim: int) -> None:
    """An attention factor on RoPE over part of each head (see the module docstring) in ``model`` (a GPTModel stage,
    standard attention): every self-attention's queries and keys are multiplied by ``factor`` on their first
    ``rot_dim`` channels (the ones Megatron rotates) as its ``get_query_key_value_tensors`` returns them, i.e. after
    the q/k norms and before the rotation. Rotation is linear, so this is cos and sin multiplied by ``factor`` there,
    as transformers and SGLang compute it; the unrotated channels are left as they are."""
    import types

    def scaled(t: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(t.shape[-1], dtype=t.dtype, device=t.device)
        scale[:rot_dim] = factor
        return t * scale

    def wrap(attention):
        inner = attention.get_query_key_value_tensors

        def get_query_key_value_tensors(self, *args, **kwargs):
            out = inner(*args, **kwargs)
            if len(out) == 2:  # (Megatron's unsplit fused-QKV path: rope fusion, which forge turns off)
                raise ValueError("a RoPE attention factor on part of each head needs the split q/k/v path")
            query, key, *rest = out
            return (scaled(query), scaled(key), *rest)

        attention.get_query_key_value_tensors = types.MethodType(get_query_key_value_tensors, attention)

    for layer in model.decoder.layers:
        attention = getattr(layer, "self_attention", None)
        if attention is not None and hasattr(attention, "get_query_key_value_tensors") and \
                hasattr(attention, "linear_qkv"):
            wrap(attention)


def leave_out(model, nope_layers) -> None:
    """No RoPE in the layers of ``model`` (a GPTModel stage) that ``nope_layers`` (one flag per global layer) marks:
    their self-attention is handed no rotary table (a pre-hook), so Megatron rotates nothing there (SmolLM3's NoPE
    layers: position reaches them only through the causal, or tree, mask)."""

    def no_rope(module, args, kwargs):
        if kwargs.get("rotary_pos_emb") is None:
            return None
        kwargs["rotary_pos_emb"] = None
        return args, kwargs

    for layer in model.decoder.layers:
        if nope_layers[layer.layer_number - 1]:
            layer.self_attention.register_forward_pre_hook(no_rope, with_kwargs=True)


def no_rotation(model) -> None:
    """RoPE that rotates nothing in ``model`` (a GPTModel stage): every rotary module's frequencies zero, so each
    angle is 0 and each rotation the identity, exactly (Kimi Linear's multi-latent attention, which Megatron always
    rotates: its shared key part stays as projected)."""
    for rotary in rotary_modules(model):
        rotary.inv_freq = torch.zeros_like(rotary.inv_freq)
        if hasattr(rotary.forward, "cache_clear"):
            rotary.forward.cache_clear()


def scale_queries(model, beta: float, original_max: int, layers=None, offset: int = 0) -> None:
    """Ministral 3's (Llama 4's) attention temperature in ``model`` (a GPTModel stage): the query of a token at
    position p is multiplied by ``1 + beta * log(1 + floor(p / original_max))`` (1 below ``original_max``). HF scales
    the rotated query; RoPE is linear, so this scales the query rows of ``linear_qkv``'s output instead. The positions
    are read off the rotary table the self-attention is handed (angle / frequency of its first channel, frequency
    1 / base^0 = 1 before scaling): the causal model's 0..S-1, the tree model's depths (this CP rank's tokens), so a
    recomputed layer sees its own positions. A pre-hook on each self-attention keeps its tokens' factors for the
    forward hook on its ``linear_qkv`` (TP: this rank's query groups; SP: the gathered sequence). ``layers`` (one
    flag per global layer; None: all) limits it to the layers it marks (Llama 4: its NoPE layers, whose table
    :func:`leave_out` hides afterwards: call this first), ``offset`` is added to every position."""
    if getattr(model.config, "multi_latent_attention", False):
        if layers is not None or offset:
            raise ValueError("query scaling per layer is for standard attention")
        return _scale_latent_queries(model, beta, original_max)
    rotary = rotary_modules(model)  # its frequencies are final: rope.apply has run
    freq0 = float(rotary[0].inv_freq[0]) if rotary else 1.0

    def positions_of(module, args, kwargs):
        table = kwargs.get("rotary_pos_emb")
        if isinstance(table, tuple):
            table = table[0]
        module._forge_query_scale = None
        if table is None:
            return None
        pos = torch.round(table.reshape(table.shape[0], -1)[:, 0].float() / freq0)  # [S]
        module._forge_query_scale = llama4_query_scale(pos, beta, original_max, offset)
        return None

    def scale(module, inputs, output, attention=None):
        factor = attention._forge_query_scale
        if factor is None:
            return None
        out, bias = output if isinstance(output, tuple) else (output, None)
        if bias is not None:
            raise ValueError("query scaling with a q/k/v bias added after linear_qkv is not supported")
        cfg = attention.config
        per_group = cfg.num_attention_heads // cfg.num_query_groups
        s, b = out.shape[:2]
        if factor.numel() != s:
            raise ValueError(f"query scaling: {factor.numel()} positions for {s} tokens (causal model under context "
                             "parallelism? train with the tree model)")
        per_row = torch.ones(s, per_group + 2, dtype=out.dtype, device=out.device)  # q heads, then k and v: 1
        per_row[:, :per_group] = factor.to(out.device, out.dtype)[:, None]
        scaled = (out.view(s, b, -1, per_group + 2, cfg.kv_channels) * per_row[:, None, None, :, None]).view_as(out)
        return (scaled, bias) if isinstance(output, tuple) else scaled

    import functools

    for layer in model.decoder.layers:
        if layers is not None and not layers[layer.layer_number - 1]:
            continue
        attention = layer.self_attention
        attention.register_forward_pre_hook(positions_of, with_kwargs=True)
        attention.linear_qkv.register_forward_hook(functools.partial(scale, attention=attention))
