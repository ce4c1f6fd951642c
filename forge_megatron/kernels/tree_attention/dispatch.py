"""Pick a tree-attention backend for each call; every backend computes the same thing (reference.py is the spec).

Choice, first match wins:
1. the ``backend`` argument;
2. the environment variable FORGE_TREE_ATTN_BACKEND ("reference" | "segment" | "triton" | "cuda");
3. automatic on CUDA tensors: "triton" (triton importable) -> "cuda" (forge_megatron._C_tree_attn built) ->
   "segment" (exact, any device); on CPU: "segment". "reference" (dense T x T mask) only on request.
   The CUDA kernel would move ahead of Triton once its GPU tests have passed on a GPU machine and it is the faster
   (``CUDA_VALIDATED``; benchmarks/gpu_check.sh runs both): on the one H200 run so far it was 0.6x of Triton's
   speed, so it is used only when asked for. Calls with suffix queries (fewer
   queries than keys, ops.py) never choose it automatically: it takes them only on its SIMT path; nor do calls with
   attention sinks, a sliding window, soft-capped scores, chunked attention or bidirectional blocks (key_end), which
   it does not have. A head size a
   kernel does not take (CUDA: 32 / 64 / 128 and values as wide as keys; Triton: up to 512; multi-latent
   attention's query/key heads are 192 wide, its value heads 128) passes over it too.
The Triton and CUDA backends live in their own modules and are imported lazily; a module that is absent or fails
to import makes its backend unavailable. Each (backend, device type) choice is logged once.

Legend: T = tree tokens, N = query heads, K = key/value heads, H = head dim.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable

import torch

from forge_megatron.kernels.tree_attention.cuda import SUPPORTED_HEAD_DIMS
from forge_megatron.kernels.tree_attention.reference import tree_attention_reference
from forge_megatron.kernels.tree_attention.segment import tree_attention_segment
from forge_megatron.utils import env

ENV_VAR = "FORGE_TREE_ATTN_BACKEND"
BACKENDS = ("reference", "segment", "triton", "cuda")
# Head sizes each compiled kernel takes; other sizes go to the next backend. triton_kernel.MAX_HEAD_DIM is 512 (that
# module needs triton to import; a test checks the two agree).
HEAD_DIMS = {"cuda": SUPPORTED_HEAD_DIMS, "triton": range(1, 513)}
# True only once `pytest -m gpu tests/kernels/test_cuda.py` has passed on an H100/H200 and the CUDA kernel beats
# Triton in benchmarks/tree_attention.py (benchmarks/gpu_check.sh runs both; the first H200 run: 75 vs 122 TFLOP/s).
CUDA_VALIDATED = False
_COMPILED = {  # backend -> (module, function, what env.require names when it is missing)
    "triton": ("forge_megatron.kernels.tree_attention.triton_kernel", "tree_attention_triton", "triton"),
    "cuda": ("forge_megatron.kernels.tree_attention.cuda", "tree_attention_cuda", "cuda_ext"),
}

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def tree_attention(
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    v_TKH: torch.Tensor,
    sub_end_T: torch.Tensor,
    softmax_scale: float | None = None,
    backend: str | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    key_end: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Tree attention over a DFS-ordered forest (key j visible to query i iff j <= i < sub_end[j]). Returns o_TNH.

    q may hold only the last tokens of the keys' tree (suffix queries, see ops.py); the automatic choice then
    passes over the CUDA kernel, which takes them on its SIMT path only (no tensor cores). ``sinks`` (per query
    head) and ``window`` (positions): gpt-oss's attention (ops.py); ``key_end`` (int32 [T], None: causal):
    bidirectional blocks (Gemma 3 / 4's images, ops.py), passed on as ``key_end_T``; ``softcap`` (None / 0: none):
    scores soft-capped to c * tanh(s / c) (Gemma 2); ``chunk`` (None / 0: none): Llama 4's chunked attention (a
    query sees the keys of its own chunk of positions); the CUDA kernel has none of them and is never chosen
    automatically for them."""
    name = resolve(q_TNH.device, backend, suffix_queries=q_TNH.shape[0] != k_TKH.shape[0], head_dim=q_TNH.shape[2],
                   v_head_dim=v_TKH.shape[2],
                   score_extras=sinks is not None or bool(window) or bool(softcap) or bool(chunk),
                   bidirectional_blocks=key_end is not None)
    extras = {} if sinks is None and not window else {"sinks": sinks, "window": window}
    if key_end is not None:
        extras["key_end_T"] = key_end
    if softcap:
        extras["softcap"] = softcap
    if chunk:
        extras["chunk"] = chunk
    return _function(name)(q_TNH, k_TKH, v_TKH, sub_end_T, softmax_scale=softmax_scale, **extras)


def resolve(device: torch.device, backend: str | None = None, suffix_queries: bool = False,
            head_dim: int | None = None, v_head_dim: int | None = None, score_extras: bool = False,
            bidirectional_blocks: bool = False) -> str:
    """:func:`choose_backend`'s name, logging each (backend, device type) choice once."""
    name, why = choose_backend(device, backend, suffix_queries=suffix_queries, head_dim=head_dim,
                               v_head_dim=v_head_dim, score_extras=score_extras,
                               bidirectional_blocks=bidirectional_blocks)
    if (name, device.type) not in _logged:
        _logged.add((name, device.type))
        log.info("tree attention backend %r on %s (%s)", name, device.type, why)
    return name


def choose_backend(device: torch.device, backend: str | None = None, suffix_queries: bool = False,
                   head_dim: int | None = None, v_head_dim: int | None = None,
                   score_extras: bool = False, bidirectional_blocks: bool = False) -> tuple[str, str]:
    """(backend name, why it was chosen) for tensors on ``device``; ``suffix_queries``: fewer queries than keys;
    ``head_dim`` / ``v_head_dim``: the query/key and value head sizes (None: any); ``score_extras``: attention
    sinks, a sliding window, soft-capped scores or chunks, ``bidirectional_blocks``: a key_end (none of them the CUDA
    kernel's: the automatic choice passes over it)."""
    if backend is not None:
        return _requested(backend, "backend argument"), "backend argument"
    from_env = os.environ.get(ENV_VAR)
    if from_env:
        return _requested(from_env, f"{ENV_VAR}={from_env}"), f"{ENV_VAR}={from_env}"
    if device.type == "cuda":
        for name in ("cuda", "triton") if CUDA_VALIDATED else ("triton", "cuda"):
            if name in available_backends(device) and not (suffix_queries and name == "cuda") \
                    and (head_dim is None or head_dim in HEAD_DIMS[name]) \
                    and (v_head_dim is None or v_head_dim in HEAD_DIMS[name]) \
                    and not (name == "cuda" and None not in (head_dim, v_head_dim) and head_dim != v_head_dim) \
                    and not (name == "cuda" and (score_extras or bidirectional_blocks)):
                return name, "automatic"
    return "segment", "automatic"


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on ``device`` (None: this machine, CUDA counted when present)."""
    device_type = torch.device(device).type if device is not None else ("cuda" if env.has_cuda() else "cpu")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    names = ["reference", "segment"]
    if _load(*_COMPILED["triton"][:2])[0] is not None and (device_type == "cuda" or interpreted):
        names.append("triton")
    if device_type == "cuda" and _load(*_COMPILED["cuda"][:2])[0] is not None and _cuda_ext_ready():
        names.append("cuda")
    return names


def _cuda_ext_ready() -> bool:
    """The cuda module always imports; the backend needs the compiled extension and a device too."""
    from forge_megatron.kernels.tree_attention import cuda as cuda_backend

    return cuda_backend.is_available()


def _requested(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown tree attention backend {name!r} (from {source}); choose one of {BACKENDS}")
    if name in _COMPILED:
        module, fn, requirement = _COMPILED[name]
        if _load(module, fn)[0] is None or (name == "cuda" and not _cuda_ext_ready()):
            env.require(requirement, f"tree attention backend {name!r}")
            if name == "cuda":
                env.require("cuda", "tree attention backend 'cuda'")
            raise RuntimeError(f"tree attention backend {name!r} is unavailable: {_load(module, fn)[1]}")
    return name


def raw_ops(name: str):
    """(forward, backward) ops of a compiled backend (ops.py: forward -> (o, lse), backward from the saved o and
    lse), for callers that manage their own saved tensors (context parallelism's all-gather mode); None for the
    autograd backends ("reference", "segment"), whose backward is recomputed instead."""
    if name not in _COMPILED:
        return None
    _function(name)  # importing the module registers its ops
    namespace = torch.ops.forge
    return getattr(namespace, f"tree_attn_{name}_fwd"), getattr(namespace, f"tree_attn_{name}_bwd")


def function_of(name: str) -> Callable[..., torch.Tensor]:
    """The public (q, k, v, sub_end, softmax_scale=None) -> o function of backend ``name``."""
    return _function(name)


def _function(name: str) -> Callable[..., torch.Tensor]:
    if name == "reference":
        return tree_attention_reference
    if name == "segment":
        return tree_attention_segment
    return _load(*_COMPILED[name][:2])[0]


@functools.cache
def _load(module: str, fn: str) -> tuple[Callable | None, str]:
    """Import ``module.fn`` once; (function, "") or (None, why not)."""
    try:
        return getattr(importlib.import_module(module), fn), ""
    except Exception as exc:  # noqa: BLE001 - a broken optional backend must not break the dispatcher
        return None, f"importing {module}.{fn} failed: {type(exc).__name__}: {exc}"
