"""Group-wise int4 weights for rollout engines that serve a compressed-tensors int4 checkpoint (Kimi-K2-Thinking and
Kimi-K2.5 as released).

A ``pack-quantized`` checkpoint stores each quantized linear weight ``W`` [rows, cols] as three tensors:
``<module>.weight_packed`` int32 [rows, ceil(cols / 8)] (eight 4-bit values per word, value i at bits 4i..4i+3,
stored as q + 8), ``<module>.weight_scale`` [rows, ceil(cols / group)] in the weights' dtype and
``<module>.weight_shape`` int32 [rows, cols]; ``W ~= q * scale`` per group of ``group`` columns, q in [-8, 7]. Its
config.json (at the top level, or a vision-language release's ``text_config``) says so::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                          "symmetric": true, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}

SGLang loads such checkpoints, and such weight updates, by those names. Quantized here: the 2-D projection weights
fp8.py quantizes, less the modules ``ignore`` names (a module name, or ``re:`` and a regular expression matched from
the start of the module name, as compressed-tensors matches them): Kimi's releases quantize the routed experts only.

Quantization as compressed-tensors computes it (its ``calculate_qparams`` and ``quantize``; the tests compare bit for
bit): scale = max |w| over the group / 7.5 (half the 15-step range) in the scale's dtype, a zero scale replaced by
that dtype's eps; q = clamp(round(w / scale), -8, 7). A quantized bf16 weight then travels as 4.5 bits per value
(group 32) instead of 16. The trainer's weights stay in full precision: the engine samples from their int4
rounding, which the off-policy corrections see as any other trainer-engine mismatch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from forge_megatron.weight_sync.fp8 import PROJ_WEIGHT

SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")
Q_MIN, Q_MAX = -8, 7


def quantization_config_of(hf_config: dict) -> dict | None:
    """A checkpoint's ``quantization_config``: the top level's, or a vision-language release's ``text_config``'s."""
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else {}
    return hf_config.get("quantization_config") or text.get("quantization_config")


def group_size_of(quantization: dict) -> int:
    """The group size of a compressed-tensors int4 config (pack-quantized, symmetric, group strategy, weights
    only); ValueError naming what else it is."""
    if quantization.get("quant_method") != "compressed-tensors" or quantization.get("format") != "pack-quantized":
        raise ValueError(f"not a compressed-tensors pack-quantized checkpoint (quant_method "
                         f"{quantization.get('quant_method')!r}, format {quantization.get('format')!r})")
    sizes = set()
    for name, group in (quantization.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (4, "int", True, "group") \
                or group.get("input_activations"):
            raise ValueError(f"config group {name!r}: only 4-bit symmetric group-wise integer weights without "
                             f"activation quantization are read, got weights {w}")
        sizes.add(int(w["group_size"]))
    if len(sizes) != 1:
        raise ValueError(f"expected one int4 group size, got {sorted(sizes) or 'none'}")
    return sizes.pop()


@dataclass(frozen=True)
class Int4Config:
    """Which weights are sent as packed int4, their group size, and the checkpoint's quantization_config."""

    group: int = 32
    ignore: tuple[str, ...] = ()  # compressed-tensors' ignore list: module names and "re:" patterns
    hf: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"int4 group size must be a positive integer, got {self.group!r}")
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise ValueError(f"int4 ignore pattern {pattern!r}: {exc}") from exc

    @classmethod
    def from_hf(cls, quantization_config: dict | None) -> "Int4Config | None":
        """The int4 config of a checkpoint's ``quantization_config`` (None when it has none); ValueError for
        anything the sync cannot produce."""
        if not quantization_config:
            return None
        group = group_size_of(quantization_config)
        return cls(group=group, ignore=tuple(quantization_config.get("ignore") or ()), hf=dict(quantization_config))

    def hf_dict(self) -> dict:
        if self.hf:
            return dict(self.hf)
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": list(self.ignore),
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": self.group}}}}

    def ignored(self, module: str) -> bool:
        return any(re.match(p[3:], module) if p.startswith("re:") else module == p for p in self.ignore)

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        m = PROJ_WEIGHT.fullmatch(name)
        return m is not None and tensor.dim() == 2 and not self.ignored(m.group(1))


def pack(q: torch.Tensor) -> torch.Tensor:
    """int32 [rows, ceil(cols / 8)] of int q [rows, cols] in [-8, 7]: value i of a word at bits 4i..4i+3, as q + 8
    (the padding past cols is raw zeros, as compressed-tensors pads)."""
    rows, cols = q.shape
    v = q.to(torch.int32) + 8
    words = math.ceil(cols / 8)
    v = torch.nn.functional.pad(v, (0, words * 8 - cols)).view(rows, words, 8)
    out = torch.zeros(rows, words, dtype=torch.int32, device=q.device)
    for i in range(8):
        out |= v[:, :, i] << (4 * i)
    return out


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The int q [rows, cols] of :func:`pack`'s words (bit operations: the host's byte order does not matter)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)[:, :cols] - 8


def round_to_groups(w: torch.Tensor, group: int, scale_dtype: torch.dtype | None = None):
    """(q [rows, cols], integers in [-8, 7] held in the scale dtype; scale [rows, ceil(cols / group)]) of a 2-D
    weight, groups of ``group`` columns (the last one partial: its padding does not enter its max); scales in
    ``scale_dtype`` (default: the weight's). What :func:`quantize` packs and int4 QAT computes with."""
    if w.dim() != 2:
        raise ValueError(f"int4 group quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    scale_dtype = scale_dtype or w.dtype
    groups = math.ceil(cols / group)
    padded = torch.nn.functional.pad(w, (0, groups * group - cols)).view(rows, groups, group)
    amax = padded.abs().amax(dim=-1)  # in the weight's dtype, as compressed-tensors' observer
    scale = (amax / 7.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype, device=w.device),
                        scale)
    full = scale.repeat_interleave(group, dim=1)[:, :cols]
    return torch.round(w.to(scale_dtype) / full).clamp(Q_MIN, Q_MAX), scale


def quantize(w: torch.Tensor, group: int, scale_dtype: torch.dtype | None = None):
    """(weight_packed, weight_scale, weight_shape) of a 2-D weight (:func:`round_to_groups`)."""
    q, scale = round_to_groups(w, group, scale_dtype)
    return pack(q), scale.contiguous(), torch.tensor(list(w.shape), dtype=torch.int32)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape, group: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * scale`` [rows, cols] of a packed weight, in ``dtype``; ValueError when the three do not fit together."""
    rows, cols = (int(x) for x in shape)
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != rows or packed.shape[1] * 8 < cols:
        raise ValueError(f"packed int4 weight {tuple(packed.shape)} {packed.dtype} does not hold a [{rows}, {cols}] "
                         "weight (int32, eight values per word)")
    if tuple(scale.shape) != (rows, math.ceil(cols / group)):
        raise ValueError(f"int4 scales {tuple(scale.shape)} are not one per {group} columns of [{rows}, {cols}]")
    full = scale.float().repeat_interleave(group, dim=1)[:, :cols]
    return (unpack(packed, cols).float() * full).to(dtype)


def quantize_named(named, cfg: Int4Config):
    """Yield the HF tensors to send: ``[(X.weight_packed, ..), (X.weight_scale, ..), (X.weight_shape, ..)]`` for a
    quantized ``X.weight`` (one item, so a bucket never splits them), others as ``(name, tensor)``."""
    for name, t in named:
        if cfg.quantizes(name, t):
            base = name[: -len(".weight")]
            yield list(zip((base + s for s in SUFFIXES), quantize(t, cfg.group)))
        else:
            yield name, t


def dequantize_named(named: dict[str, torch.Tensor], group: int | None,
                     dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors with every packed triple joined into its ``X.weight``, how many there were). A part without the
    other two is an error (one request or file must hold all three); so is a triple when ``group`` is None (the
    receiver serves no int4 checkpoint)."""
    out, n = {}, 0
    for name, t in named.items():
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            out[name] = t
            continue
        base = name[: -len(suffix)]
        missing = [base + s for s in SUFFIXES if base + s not in named]
        if missing:
            raise ValueError(f"{name!r} came without {missing[0]!r} (an int4 weight's three tensors travel together)")
        if suffix != SUFFIXES[0]:
            continue  # read with its weight_packed
        if group is None:
            raise ValueError(f"{name!r} is an int4 weight: this receiver serves no int4 checkpoint")
        out[base + ".weight"] = dequantize(t, named[base + SUFFIXES[1]], named[base + SUFFIXES[2]].tolist(), group,
                                           dtype)
        n += 1
    return out, n
