"""Tree attention through the CUDA extension ``forge_megatron._C_tree_attn`` (csrc/tree_attn).

Same contract as the Triton backend: key j is visible to query i  <=>  j <= i < sub_end[j]; forward returns
o = softmax(scale q k^T, masked) v and saves lse for a FlashAttention-2 backward (dq, dk, dv; dk/dv summed over the
query heads of each GQA group). Empty tiles are skipped and full ones run unmasked, by per-block min/max(sub_end)
computed on the device. Two implementations (csrc/tree_attn): tensor cores (mma.sync m16n8k16, fp16/bf16 on sm_80+,
64x64 tiles classified per warp, atomic fp32 dQ) and SIMT (any dtype, 32x32 tiles). The environment variable
FORGE_TREE_ATTN_CUDA_IMPL picks one: "auto" (default: tensor cores where they can run), "simt" or "mma" (an error
where they cannot). The extension is built by setup.py only where CUDA torch and nvcc exist; ``is_available()`` says
whether it can run here. Head dims 32, 64, 128; fp16/bf16/fp32 with fp32 accumulation. Suffix queries (fewer
queries than keys, ops.py) run on the SIMT kernels only ("auto" picks them; "mma" refuses). Attention sinks, sliding
windows, bidirectional blocks (key_end, ops.py), soft-capped scores and chunked attention are refused with a
ValueError: the dispatcher never passes them here (the triton and segment backends have them).

Legend: T = packed tree tokens, N = query heads, K = key/value heads, H = head dim.
"""

from __future__ import annotations

import os

import torch

from forge_megatron.kernels.tree_attention.ops import make_public_entry, register_tree_attention_ops
from forge_megatron.utils import env

SUPPORTED_HEAD_DIMS = (32, 64, 128)
IMPL_ENV_VAR = "FORGE_TREE_ATTN_CUDA_IMPL"
IMPLS = ("auto", "simt", "mma")


def implementation() -> str:
    """The kernel implementation FORGE_TREE_ATTN_CUDA_IMPL asks for ("auto" when unset)."""
    impl = os.environ.get(IMPL_ENV_VAR, "auto").strip().lower() or "auto"
    if impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV_VAR}={impl!r} is not one of {', '.join(IMPLS)}")
    return impl


def is_available() -> bool:
    """True when a CUDA device and the compiled extension are both present."""
    return env.has_cuda() and env.has_cuda_ext()


def _extension():
    env.require("cuda", "the CUDA tree attention kernel")
    env.require("cuda_ext", "the CUDA tree attention kernel")
    from forge_megatron import _C_tree_attn

    return _C_tree_attn


def _check_supported(q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor | None = None) -> None:
    if q_TNH.shape[0] != k_TKH.shape[0] and implementation() == "mma":
        raise ValueError(f"{IMPL_ENV_VAR}=mma: the tensor-core kernels need one query per key token "
                         f"({k_TKH.shape[0]}), got {q_TNH.shape[0]} queries; suffix queries (context parallelism's "
                         "all-gather mode) run on the SIMT kernels (auto) or the triton backend")
    if q_TNH.device.type != "cuda":
        raise ValueError(f"the CUDA tree attention kernel needs CUDA tensors, got q on {q_TNH.device}")
    if q_TNH.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q_TNH.shape[2]} is not supported by the CUDA kernel (supported: 32, 64, 128)")
    if v_TKH is not None and v_TKH.shape[2] != q_TNH.shape[2]:
        raise ValueError(f"the CUDA kernel needs value heads as wide as query/key heads, got {v_TKH.shape[2]} and "
                         f"{q_TNH.shape[2]} (multi-latent attention: the triton or segment backend)")


def _stream(q_TNH: torch.Tensor) -> int:
    return torch.cuda.current_stream(q_TNH.device).cuda_stream


KEY_END_REFUSED = "the CUDA kernel has no bidirectional blocks (key_end); use the triton or segment backend"
SOFTCAP_REFUSED = "the CUDA kernel has no soft-capped scores (Gemma 2); use the triton or segment backend"


def _refuse(key_end_T, softcap, chunk=0) -> None:
    if key_end_T is not None:
        raise ValueError(KEY_END_REFUSED)
    if softcap:
        raise ValueError(SOFTCAP_REFUSED)
    if chunk:
        raise ValueError("the CUDA kernel has no chunked attention (Llama 4); use the triton or segment backend")


def _forward(q_TNH, k_TKH, v_TKH, sub_end_T, scale, sinks_N=None, window=0, key_end_T=None, softcap=0.0, chunk=0):
    _refuse(key_end_T, softcap, chunk)
    ext = _extension()
    _check_supported(q_TNH, k_TKH, v_TKH)
    if sinks_N is not None or window:
        raise ValueError("the CUDA tree attention kernel has no attention sinks or sliding windows (gpt-oss): use "
                         "the triton or segment backend")
    with torch.cuda.device(q_TNH.device):
        o_TNH, lse_NT = ext.fwd(q_TNH, k_TKH, v_TKH, sub_end_T, scale, _stream(q_TNH), implementation())
    return o_TNH, lse_NT


def _backward(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, window=0, key_end_T=None, softcap=0.0,
              chunk=0):
    _refuse(key_end_T, softcap, chunk)
    ext = _extension()
    with torch.cuda.device(q_TNH.device):
        dq, dk, dv = ext.bwd(do_TNH.contiguous(), q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, _stream(q_TNH),
                             implementation())
    return dq, dk, dv


tree_attention_cuda_op = register_tree_attention_ops("cuda", _forward, _backward)
tree_attention_cuda = make_public_entry(tree_attention_cuda_op)
tree_attention_cuda.__doc__ = """Tree attention through the CUDA kernels. (q_TNH, k_TKH, v_TKH, sub_end_T int32,
softmax_scale=None) -> o_TNH; differentiable in q, k, v; CUDA tensors; head_dim 32/64/128; N % K == 0; q may hold
only the last tokens of the keys' tree (suffix queries, see ops.py: SIMT kernels only)."""
