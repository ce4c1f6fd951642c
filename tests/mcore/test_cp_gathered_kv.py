"""Context parallelism's all-gather mode keeps only this rank's keys and values for the backward.

``tree_attention_cp(..., comm_type="all_gather")`` on C gloo ranks against tree attention over the whole padded
tree on one process: the output rows and dq of this rank's chunks, and dk / dv of its rows (the reduce-scatter sums
every rank's queries' contributions), for the autograd backends (segment, reference: the backward recomputes) and
the Triton kernels under TRITON_INTERPRET=1 (forward and backward ops from the saved o and lse). What the backward
keeps is checked with saved-tensor hooks: no saved tensor lives in a buffer as large as the gathered [T_pad, K, H]
keys (which used to be saved, or views of them, per layer). Heads: N = K, so this rank's q and o buffers are
smaller than the gathered keys.
"""

import os

import pytest
import torch

from tests.dist_utils import run_distributed

SAMPLES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 17], [9, 10, 18, 19]]


def _body(rank, world_size, backend, Hv, gpt_oss=False, comm="all_gather"):
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    from forge_megatron.kernels.tree_attention import tree_attention
    from forge_megatron.mcore.context_parallel import (
        default_multiple, pad_sub_end, padded_length, take_shard, tree_attention_cp,
    )
    from forge_megatron.tree import build_tree

    layout = build_tree(SAMPLES)
    multiple = default_multiple(world_size)
    sub_end = pad_sub_end(torch.as_tensor(layout.sub_end, dtype=torch.int32), multiple)
    T_pad, N, K, H = padded_length(len(layout.sub_end), multiple), 4, 4, 16
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(T_pad, heads, dim, generator=g) for heads, dim in ((N, H), (K, H), (K, Hv), (N, Hv)))

    # gpt-oss: a sink logit per head and a window of 3 positions (the sinks' gradient: each rank's queries' part);
    # with them Gemma 2's soft-capped scores, at 1.0 where the scores are ~N(0, 1): the cap bites, and Llama 4's
    # chunks of 5 positions (samples of up to 8 tokens: chunk starts inside them)
    sinks = torch.randn(N, generator=g) if gpt_oss else None
    extras = {"sinks": sinks.clone().requires_grad_(), "window": 3, "softcap": 1.0, "chunk": 5} if gpt_oss else {}
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = tree_attention(*full, sub_end, backend=backend, **extras)
    (o_ref * w).sum().backward()
    full_dsinks = extras["sinks"].grad if gpt_oss else None
    if gpt_oss:
        extras = {"sinks": sinks.clone().requires_grad_(), "window": 3, "softcap": 1.0, "chunk": 5}

    local = [take_shard(x, world_size, rank).clone().requires_grad_() for x in (q, k, v)]
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = tree_attention_cp(*local, sub_end, backend=backend, comm_type=comm, **extras)
    (o * take_shard(w, world_size, rank)).sum().backward()
    shard = [take_shard(x, world_size, rank) for x in (o_ref.detach(), *(x.grad for x in full))]
    errors = [(a - b).abs().max().item() for a, b in zip([o.detach(), *(x.grad for x in local)], shard)]
    return {"errors": errors, "largest_saved": max(saved), "gathered_kv": T_pad * K * H * k.element_size(),
            "dsinks": extras["sinks"].grad if gpt_oss else None, "full_dsinks": full_dsinks}


@pytest.mark.parametrize("backend,cp,Hv", [("segment", 4, 16), ("reference", 2, 16), ("triton", 2, 8)])
def test_all_gather_mode_equals_whole_tree_and_saves_only_local_rows(backend, cp, Hv):
    """Hv = 8: value heads narrower than query/key heads (multi-latent attention; the sinks test below runs them on
    the segment backend and in a2a mode)."""
    if backend == "triton":
        pytest.importorskip("triton")
    results = run_distributed(_body, world_size=cp, parallel=_parallel(cp), backend=backend, Hv=Hv, timeout_s=400)
    for r in results:
        assert max(r["errors"]) < 2e-5, r  # o, dq, dk, dv of this rank's rows
        assert r["largest_saved"] < r["gathered_kv"], r


@pytest.mark.parametrize("backend,comm", [("segment", "all_gather"), ("triton", "all_gather"), ("segment", "a2a")])
def test_sinks_window_softcap_and_chunks_under_context_parallelism(backend, comm):
    """gpt-oss attention (with Gemma 2's soft cap and Llama 4's chunks) under CP = 2: o, dq, dk, dv of this rank's
    rows equal the whole tree's, and the ranks' sink gradients (each from its own queries; Megatron's DP x CP
    reduction sums them) add up to the whole tree's."""
    if backend == "triton":
        pytest.importorskip("triton")
    results = run_distributed(_body, world_size=2, parallel=_parallel(2), backend=backend, Hv=8, gpt_oss=True,
                              comm=comm, timeout_s=400)
    for r in results:
        assert max(r["errors"]) < 2e-5, r
    total = sum(r["dsinks"] for r in results)
    assert (total - results[0]["full_dsinks"]).abs().max().item() < 2e-5 and total.abs().sum() > 0


def _parallel(cp):
    from forge_megatron.mcore.parallel import ParallelConfig

    return ParallelConfig(cp=cp)
