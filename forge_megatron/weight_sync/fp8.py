"""Block-wise FP8 weights for rollout engines that serve an FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8 format).

An FP8 checkpoint stores each quantized linear weight ``W`` [rows, cols] as ``<module>.weight`` in float8_e4m3fn and
``<module>.weight_scale_inv`` in float32 [ceil(rows / bm), ceil(cols / bn)], one scale per (bm x bn) block, with
``W ~= weight * weight_scale_inv`` block by block; its config.json says so::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

SGLang loads such checkpoints, and such weight updates, by those names. Quantized here: 2-D projection weights
(module names ending in ``proj``: attention q/k/v/o, the dense MLP's and every expert's gate/up/down, MLA's
``kv_a_proj_with_mqa``...; Mixtral-named experts' ``w1`` / ``w2`` / ``w3``: MiniMax-M2); embeddings, the LM head,
norms and MoE routers stay in the sync dtype, as in the published FP8 checkpoints, and so does any module named in
``modules_to_not_convert``.

Scale per block: ``amax / 448`` (448 is e4m3's largest finite value), so each block's largest entry maps to +-448
and nothing saturates. Sending FP8 halves the bytes of a bf16 sync for the quantized weights (plus 4 bytes per
16384 weights of scales).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIX = "weight_scale_inv"
# projections: attention and MLP ``*_proj`` (MLA's ``kv_a_proj_with_mqa``), Mixtral-named experts (MiniMax-M2's
# ``experts.{e}.w1`` / ``w2`` / ``w3``), and a DeepSeek-V3.2 indexer's ``wq_b`` and ``wk`` (its ``weights_proj`` stays
# in bf16 in the FP8 release, as DeepSeek's own inference code keeps it)
PROJ_WEIGHT = re.compile(r"(.*(?:(?<!indexer\.weights_)proj(?:_with_mqa)?|\.experts\.\d+\.w[123]"
                         r"|\.indexer\.w(?:q_b|k)))\.weight")


@dataclass(frozen=True)
class Fp8Config:
    """Which weights are sent as FP8, and the block shape of their scales."""

    block: tuple[int, int] = (128, 128)
    skip: tuple[str, ...] = ()  # modules_to_not_convert: a module is skipped when its name contains one of these

    def __post_init__(self):
        if len(self.block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"fp8 weight_block_size must be two positive integers, got {list(self.block)}")

    @classmethod
    def from_hf(cls, quantization_config: dict | None) -> "Fp8Config | None":
        """The block-wise FP8 config of a checkpoint's ``quantization_config`` (None when it has none); a clear
        error for FP8 without blocks or another method, which the sync cannot produce."""
        if not quantization_config:
            return None
        method = quantization_config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported (block-wise fp8 only)")
        if quantization_config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 fmt {quantization_config.get('fmt')!r} is not supported (e4m3 only)")
        block = quantization_config.get("weight_block_size")
        if not block:
            raise ValueError("fp8 quantization_config has no weight_block_size: per-tensor fp8 is not supported")
        skip = quantization_config.get("modules_to_not_convert") or quantization_config.get("ignored_layers") or ()
        return cls(block=tuple(int(b) for b in block), skip=tuple(skip))

    def hf_dict(self) -> dict:
        d = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(self.block)}
        if self.skip:
            d["modules_to_not_convert"] = list(self.skip)
        return d

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        m = PROJ_WEIGHT.fullmatch(name)
        return m is not None and tensor.dim() == 2 and not any(s in m.group(1) for s in self.skip)


def scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [rows, cols], float32 scales [ceil(rows / bm), ceil(cols / bn)]) of a 2-D weight; the edge
    blocks are partial (their padding does not enter their amax)."""
    if w.dim() != 2:
        raise ValueError(f"fp8 block quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    bm, bn = block
    gm, gn = math.ceil(rows / bm), math.ceil(cols / bn)
    x = w.float()
    padded = torch.zeros(gm * bm, gn * bn, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = x
    blocks = padded.view(gm, bm, gn, bn)
    amax = blocks.abs().amax(dim=(1, 3))
    # divided by a tensor, not the Python number: CUDA computes x / (CPU scalar) as x * (1 / scalar), which can land
    # an ulp away from the IEEE quotient the CPU gives (the first H200 run's GPU bytes differed from the CPU's)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gm * bm, gn * bn)[:rows, :cols]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` block by block. ``block``: the checkpoint's weight_block_size; without it the grid must divide
    the weight evenly (a ceil-divided grid does not tell the block shape: 70 rows in 5 blocks may be 14 or 16)."""
    rows, cols = q.shape
    gm, gn = scale.shape
    if block is None:
        if rows % gm or cols % gn:
            raise ValueError(f"scale grid {[gm, gn]} does not divide a [{rows}, {cols}] weight: give the block size")
        block = (rows // gm, cols // gn)
    bm, bn = block
    if (math.ceil(rows / bm), math.ceil(cols / bn)) != (gm, gn):
        raise ValueError(f"scale grid {[gm, gn]} is not weight_block_size {[bm, bn]} over [{rows}, {cols}]")
    full = scale.float().repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:rows, :cols]
    return (q.float() * full).to(dtype)


def quantize_named(named, cfg: Fp8Config):
    """Yield the HF tensors to send: ``[(name, fp8), (scale name, scales)]`` pairs for quantized weights, others
    as ``(name, tensor)``. A pair is one item, so a bucket never splits a weight from its scales."""
    for name, t in named:
        if cfg.quantizes(name, t):
            q, s = quantize(t, cfg.block)
            yield [(name, q), (scale_name(name), s)]
        else:
            yield name, t


def dequantize_named(named: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                     block: tuple[int, int] | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors with every FP8 weight joined to its ``weight_scale_inv``, how many were FP8). A weight without its
    scales or scales without their weight is an error (one request or file must hold both); with ``block`` the
    scale grid must be the one that block shape gives."""
    out, n = {}, 0
    for name, t in named.items():
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)] + "weight"
            if weight not in named or named[weight].dtype != FP8_DTYPE:
                raise ValueError(f"{name!r} came without its float8_e4m3fn weight {weight!r}")
            continue
        if t.dtype != FP8_DTYPE:
            out[name] = t
            continue
        scale = named.get(scale_name(name))
        if scale is None:
            raise ValueError(f"float8 weight {name!r} came without {scale_name(name)!r}")
        if scale.dim() != 2 or t.dim() != 2:
            raise ValueError(f"{name!r}: fp8 weights and their scales must be 2-D, got {tuple(t.shape)} and "
                             f"{tuple(scale.shape)}")
        if block is not None:
            want = (math.ceil(t.shape[0] / block[0]), math.ceil(t.shape[1] / block[1]))
            if tuple(scale.shape) != want:
                raise ValueError(f"{scale_name(name)!r} has shape {tuple(scale.shape)}; weight_block_size {list(block)} "
                                 f"over {tuple(t.shape)} gives {want}")
        out[name] = dequantize(t, scale, block, dtype)
        n += 1
    return out, n
