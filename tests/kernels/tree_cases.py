"""Random forests for the tree-attention kernel tests: sample lists -> trie -> DFS pre-order sub_end.

A tiny local trie (independent of forge_megatron.tree) so the kernel tests do not depend on the builder under test
elsewhere. sub_end[i] = exclusive end of the subtree rooted at DFS position i.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch


def sub_end_from_samples(samples: list[list[int]]) -> torch.Tensor:
    """Merge samples into a trie (shared prefixes once) and return sub_end int32 [T] in DFS pre-order. Iterative:
    a prompt of 700 tokens is a chain 700 deep (recursion stopped at Python's limit of 1000 on the first GPU runs)."""
    root: dict = {}
    for sample in samples:
        node = root
        for tok in sample:
            node = node.setdefault(tok, {})
    sub_end: list[int] = []
    stack: list = [(root, iter(sorted(root)), -1)]  # (children, tokens left to visit, DFS position of their parent)
    while stack:
        children, tokens, parent = stack[-1]
        tok = next(tokens, None)
        if tok is None:
            stack.pop()
            if parent >= 0:
                sub_end[parent] = len(sub_end)
            continue
        sub_end.append(-1)
        stack.append((children[tok], iter(sorted(children[tok])), len(sub_end) - 1))
    return torch.tensor(sub_end, dtype=torch.int32)


def _random_samples(rng: random.Random, n: int, max_len: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def forest_cases() -> dict[str, torch.Tensor]:
    """Named sub_end arrays covering the shapes the tile classifier must handle (T not a multiple of 32)."""
    rng = random.Random(0)
    grpo_prompt = list(range(1000, 1037))
    return {
        "single_token_roots": sub_end_from_samples([[t] for t in range(45)]),
        "long_chain": sub_end_from_samples([list(range(77))]),
        "many_roots": sub_end_from_samples([[r] + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
                                            for r in range(14)]),
        "grpo": sub_end_from_samples([grpo_prompt + [rng.randrange(9) for _ in range(rng.randint(1, 20))]
                                      for _ in range(5)]),
        "random_trie": sub_end_from_samples(_random_samples(rng, 12, 16, 3)),
    }


def random_qkv(T: int, N: int, K: int, H: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
               Hv: int | None = None):
    """q [T, N, H], k [T, K, H], v [T, K, Hv] (Hv = H unless given: multi-latent attention's narrower values)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, N, H, generator=g)
    k = torch.randn(T, K, H, generator=g)
    v = torch.randn(T, K, Hv or H, generator=g)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def _forward_backward(fn, q, k, v, sub_end, do, scale, extras=None):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, sub_end, softmax_scale=scale, **(extras or {}))
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def low_precision_attention(q_TNH, k_TKH, v_TKH, sub_end_T, softmax_scale=None, **extras):
    """The reference as plain tensor ops in the inputs' dtype, every intermediate rounded to it (scores,
    probabilities, output; autograd's backward likewise: ``tree_attention_reference(explicit=True)``):
    FlashAttention's tests' low-precision reference (``attention_ref`` with upcast=False). SDPA's fused kernel keeps
    fp32 inside and rounds only its outputs, which gives a budget tighter than the roundings a FlashAttention-style
    kernel must make (P and dS in bf16 before their matmuls): on a GPU, where SDPA runs such a kernel, dK of a tree
    of many roots came out about 1.1-1.2x over it. ``extras``: sinks, window, key_end_T as in the reference."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    return tree_attention_reference(q_TNH, k_TKH, v_TKH, sub_end_T, softmax_scale, explicit=True, **extras)


def error_budget(lowp: torch.Tensor, exact: torch.Tensor) -> float:
    """The FlashAttention tolerance rule against the fp64 truth ``exact``: twice the error of the same math done in
    the inputs' dtype (``lowp``), plus a floor of 1e-5 relative to the output's magnitude (at least 1e-5): fp32
    kernels differ from the fp32 reference by their summation order alone, which grows with the sums (dV of heads of
    512 over a thousand queries was 2.05e-5 off on an H200 against an absolute floor of 1e-5 plus the fp32
    reference's own error)."""
    return 2 * (lowp.double() - exact).abs().max().item() + 1e-5 * max(1.0, exact.abs().max().item())


def check_against_reference(fn, sub_end, N, K, H, dtype, device="cpu", scale=None, seed=0, Hv=None, extras=None,
                            q_scale=1.0):
    """Assert fn matches the reference, forward and backward, by the FlashAttention tolerance rule
    (:func:`error_budget`): error(fn) <= 2 * error(the same math done in `dtype`) + 1e-5 (relative to the output's
    magnitude), per output (o, dq, dk, dv), errors measured against the reference in fp64; the low-precision math is
    :func:`low_precision_attention`, the same ops on CPU and GPU. ``extras`` (softcap, chunk, window, ...) go to all
    three; ``q_scale`` multiplies the queries (larger scores, where a soft cap bends)."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    sub_end = sub_end.to(device)
    q, k, v = random_qkv(sub_end.shape[0], N, K, H, dtype, device, seed, Hv)
    q = (q.float() * q_scale).to(dtype)
    do = torch.randn((*q.shape[:2], v.shape[2]), generator=torch.Generator().manual_seed(seed + 1)).to(
        device=device, dtype=dtype)
    got = _forward_backward(fn, q, k, v, sub_end, do, scale, extras)
    exact = _forward_backward(tree_attention_reference, q.double(), k.double(), v.double(), sub_end, do.double(),
                              scale, extras)
    lowp = _forward_backward(low_precision_attention, q, k, v, sub_end, do, scale, extras)
    for name, g, e, lp in zip(("o", "dq", "dk", "dv"), got, exact, lowp):
        assert g.dtype == dtype and g.shape == e.shape, name
        err = (g.double() - e).abs().max().item()
        budget = error_budget(lp, e)
        assert err <= budget, f"{name}: max error {err:.3g} exceeds {budget:.3g} ({dtype}, T={sub_end.shape[0]})"


def suffix_windows(T: int) -> list[tuple[int, int]]:
    """(q_start, end) query windows of a T-token tree for the suffix-query tests: tokens [q_start, end) are the
    queries and [0, end) the keys. Covers the whole tree, a window that is a tile-unaligned suffix, one cut before
    the end (subtrees continuing past it) and single tokens."""
    third = max(1, T // 3)
    return sorted({(0, T), (third + 1, T), (third, min(T, 2 * third + 5)), (T - 1, T), (third, third + 1)})


def check_suffix_queries(fn, sub_end, N, K, H, dtype=torch.float32, device="cpu", seed=0, atol=2e-5, Hv=None):
    """fn(q[a:b], k[:b], v[:b], min(sub_end[:b], b)) equals rows [a, b) of full tree attention, forward and
    backward (dq of those rows, and dk, dv of keys [0, b) summed over those queries only), for every window."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    T = sub_end.shape[0]
    q, k, v = random_qkv(T, N, K, H, torch.float32, device, seed, Hv)
    do = torch.randn((*q.shape[:2], v.shape[2]), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    for a, b in suffix_windows(T):
        do_window = torch.zeros_like(do)
        do_window[a:b] = do[a:b]
        o, dq, dk, dv = _forward_backward(tree_attention_reference, q, k, v, sub_end.to(device), do_window, None)
        want = (o[a:b], dq[a:b], dk[:b], dv[:b])
        if b < T:
            assert dk[b:].abs().max().item() == 0.0  # the oracle: keys past the window get nothing from it
        cut = torch.clamp(sub_end[:b], max=b).to(device)
        got = _forward_backward(fn, *(x.to(dtype) for x in (q[a:b], k[:b], v[:b])), cut, do[a:b].to(dtype), None)
        for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
            assert g.shape == w.shape, (name, a, b, tuple(g.shape), tuple(w.shape))
            err = (g.float() - w).abs().max().item() if g.numel() else 0.0
            assert err <= atol, f"{name}: queries [{a}, {b}) of T = {T}: max error {err:.3g} > {atol}"


def cuda_include_dir() -> str:
    """The CUDA toolkit's include directory (cuda_runtime.h, cuda_fp16.h), found from CUDA_HOME or nvcc."""
    from forge_megatron.utils import env

    nvcc = Path(env.nvcc_path()).resolve()
    candidates = [Path(os.environ.get("CUDA_HOME", "/nonexistent")) / "include", nvcc.parents[1] / "include",
                  Path("/usr/local/cuda/include")]
    found = [c for c in candidates if (c / "cuda_runtime.h").exists()]
    assert found, f"cuda_runtime.h not found in {candidates}"
    return str(found[0])


def sinks_window_oracle(q, k, v, sub_end, scale, sinks, window, softcap=None, chunk=None):
    """o [T, N, Hv] by the definition, one query at a time (independent of every backend's masks): query i sees the
    tokens j <= i whose subtree holds it and, with ``window``, whose depth is less than ``window`` below i's; the
    softmax has the head's sink logit as one more term without a value; ``softcap`` c caps each score s to
    c * tanh(s / c) (Gemma 2); with ``chunk`` C, only keys whose depth // C is the query's (Llama 4)."""
    T, N, _ = q.shape
    R = N // k.shape[1]
    se = sub_end.tolist()
    depth = [sum(1 for j in range(i) if se[j] > i) for i in range(T)]
    out = torch.zeros(T, N, v.shape[2], dtype=torch.float64)
    for i in range(T):
        seen = [j for j in range(i + 1) if se[j] > i and (not window or depth[i] - depth[j] < window)
                and (not chunk or depth[i] // chunk == depth[j] // chunk)]
        for n in range(N):
            s = torch.stack([(q[i, n].double() @ k[j, n // R].double()) * scale for j in seen])
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                s = torch.cat([sinks[n].double().reshape(1), s])
            p = s.softmax(0)[1:] if sinks is not None else s.softmax(0)
            out[i, n] = (p[:, None] * torch.stack([v[j, n // R].double() for j in seen])).sum(0)
    return out


def check_sinks_and_window(fn, sub_end, N, K, H, window, with_sinks=True, dtype=torch.float32, seed=0, atol=2e-5,
                           Hv=None, softcap=None, chunk=None):
    """fn(q, k, v, sub_end, sinks=..., window=..., softcap=...) against the fp32 reference with the same options
    (forward and backward, the sinks' gradient included), and the reference's output against
    :func:`sinks_window_oracle`. With ``softcap`` the queries are scaled up so that most scores reach the cap's bend."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    q, k, v = random_qkv(sub_end.shape[0], N, K, H, dtype, "cpu", seed, Hv)
    if softcap:
        q = (q.float() * 3.0).to(dtype)
    sinks = torch.randn(N, generator=torch.Generator().manual_seed(seed + 2)) if with_sinks else None
    extra = {**({"softcap": softcap} if softcap else {}), **({"chunk": chunk} if chunk else {})}
    do = torch.randn((*q.shape[:2], v.shape[2]), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)

    def run(f, q, k, v, sinks, do):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)] + \
            ([sinks.detach().requires_grad_()] if sinks is not None else [])
        o = f(*leaves[:3], sub_end, softmax_scale=0.3, sinks=leaves[3] if sinks is not None else None, window=window,
              **extra)
        return (o, *torch.autograd.grad(o, leaves, do))

    got = run(fn, q, k, v, sinks, do)
    want = run(tree_attention_reference, q.float(), k.float(), v.float(), sinks, do.float())
    for name, g, w in zip(("o", "dq", "dk", "dv", "dsinks"), got, want):
        assert g.shape == w.shape, name
        err = (g.float() - w).abs().max().item()
        assert err <= atol, f"{name}: max error {err:.3g} > {atol} (window {window}, sinks {with_sinks}, " \
            f"softcap {softcap}, chunk {chunk})"
    oracle = sinks_window_oracle(q.float(), k.float(), v.float(), sub_end, 0.3, sinks, window, softcap, chunk)
    assert (want[0].double() - oracle).abs().max().item() <= 1e-5
    if softcap:  # the cap bites: uncapped attention is far from it
        uncapped = sinks_window_oracle(q.float(), k.float(), v.float(), sub_end, 0.3, sinks, window, None, chunk)
        assert (uncapped - oracle).abs().max().item() > 0.05
    if chunk:  # the chunks bite
        whole = sinks_window_oracle(q.float(), k.float(), v.float(), sub_end, 0.3, sinks, window, softcap)
        assert (whole - oracle).abs().max().item() > 0.05
