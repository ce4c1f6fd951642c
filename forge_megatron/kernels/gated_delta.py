"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3.5 / Qwen3-Next) over a prefix forest.

A linear-attention layer carries a recurrent state along the sequence instead of attending to every earlier key,
so a prefix tree cannot be trained with a mask: token i must start from the state its *parent* left, and two
children of one token start from the same state. Merged training stays exactly equal to training each sample
alone if the recurrence runs along every root-to-leaf path, which is what this module computes.

Per value head, with the state S a [dk, dv] matrix, q and k L2-normalised and q scaled by 1 / sqrt(dk):

    S_i = exp(g_i) * S_parent(i) + k_i (beta_i * (v_i - exp(g_i) * S_parent(i)^T k_i))^T
    o_i = S_i^T q_i                                     (S of a root's parent: zeros)

and the layer's short causal convolution (kernel K, depthwise) reads the token's K - 1 nearest *ancestors*
rather than the K - 1 previous tokens of the packed sequence.

The forest (DFS pre-order, each token's ``depth``) is cut into **segments**: maximal runs of tokens each the only
child of the one before. A segment starts at a root or at a child of a branch point (a token with two or more
children) and ends at a branch point or a leaf, so the state a segment starts from is always the final state of
its parent segment. Segments are processed in **levels** (a segment's level is its parent segment's plus one):
the segments of one level run together by the chunked form of the rule with their parents' final states as initial
states, in batches of similar length (a batch's segments are at least half as long as its longest, so padding at
most doubles the work however uneven a level is). A GRPO group (one prompt, G completions) is two levels; an agent
episode whose calls extend one another, a few more. Padding (g = 0, beta = 0, zero k and v) leaves a state
unchanged, so the final state of a padded segment is that of its last real token.

Kimi Delta Attention (Kimi Linear) has the same rule with a decay per key channel: exp(g_i) is then a diagonal
[dk, dk] matrix scaling each row of S, and everything below holds with Dec[t, s] weighting each channel of the
products K K^T and Q K^T by its own exp(G_tc - G_sc) (a [C, C, dk] tensor per chunk, so such layers plan chunks of
16), exp(G) multiplying K and Q channel by channel, and the chunk's decay a vector.

Chunked form (chunk of C tokens, cumulative log decay G_t = g_1 + ... + g_t inside the chunk, Dec[t, s] =
exp(G_t - G_s) for s <= t, initial state S0):

    A   = strictly_lower(diag(beta) K K^T * Dec)        U = (I + A)^-1 diag(beta) V
    W   = (I + A)^-1 diag(beta exp(G)) K                 V' = U - W S0
    O   = diag(exp(G)) Q S0 + lower(Q K^T * Dec) V'     S_C = exp(G_C) S0 + (diag(exp(G_C - G)) K)^T V'

(the WY / UT form of Yang et al., "Gated Delta Networks", 2024). The terms inside a chunk are torch ops under
autograd, batched over every chunk; the scan over chunks (the products with S0, chunk after chunk) has a
hand-written backward (:class:`_ChunkScan`) and runs as a torch loop or as Triton kernels (gated_delta_triton.py;
:func:`scan_backend` picks). Computed in fp32 (fp64 for fp64 inputs, which the tests use to tell rounding from error);
:func:`recurrent_reference` is the token-by-token definition the tests compare against.

Legend: T = tree tokens, H = value heads, Hk = key heads (H / Hk value heads share one key head), dk / dv = key /
value head dims, K = conv kernel, C = conv channels.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


def tree_parents(depth: torch.Tensor) -> torch.Tensor:
    """Parent of every token of a DFS pre-order forest given each token's depth (-1 for roots, depth 0).

    In pre-order the parent of a token at depth d > 0 is the last token before it at depth d - 1 (every token in
    between lies in the parent's subtree, deeper than d - 1)."""
    depth = depth.reshape(-1).long()
    T = depth.numel()
    if T == 0:
        return depth.new_empty(0)
    idx = torch.arange(T, device=depth.device)
    keys = (depth * T + idx).sort().values  # tokens grouped by depth, in order inside a depth
    pos = torch.searchsorted(keys, (depth - 1) * T + idx) - 1  # last key below "depth d - 1, before i"
    cand = keys[pos.clamp(min=0)]
    found = (depth > 0) & (pos >= 0) & (torch.div(cand, T, rounding_mode="floor") == depth - 1)
    return torch.where(found, cand % T, torch.full_like(idx, -1))


@dataclass
class Level:
    """A batch of segments of one level, run together: ``tokens`` [B, L] their tree tokens (T = padding),
    ``segments`` [B] their ids, ``parents`` [B] the id of the segment each continues (-1: starts from a zero
    state; always in an earlier batch)."""

    tokens: torch.Tensor
    segments: torch.Tensor
    parents: torch.Tensor
    chunk: int  # the chunked rule's chunk for this batch: the plan's, or less for short segments (L a multiple)
    # where the initial states come from: (earlier batch, rows of this batch, rows of that batch's final states)
    sources: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class RecurrencePlan:
    """How to run a recurrence over a forest of ``num_tokens`` tokens: the levels of segments and, for the short
    convolution, every token's ``ancestors`` [T, K] (column a: the ancestor a levels up, itself first; T where a
    path is shorter). Build it once per micro-batch (:func:`plan_tree` / :func:`plan_chains`); every linear-
    attention layer of the model uses it."""

    num_tokens: int
    num_segments: int
    levels: list[Level]  # batches of segments, parents' batches first
    ancestors: torch.Tensor
    chunk: int
    rows: torch.Tensor | None = None  # every batch's tokens flattened, in batch order (where outputs go)


def plan_tree(depth: torch.Tensor, conv_kernel: int = 4, chunk: int = 64) -> RecurrencePlan:
    """The plan for a DFS pre-order forest whose tokens have depths ``depth`` [T] (a tree layout's position ids)."""
    return _plan(tree_parents(depth), conv_kernel, chunk)


def plan_chains(seq_len: int, batch: int, conv_kernel: int = 4, chunk: int = 64, device=None) -> RecurrencePlan:
    """The plan for ``batch`` independent sequences of ``seq_len`` tokens, tokens numbered ``b * seq_len + s``."""
    idx = torch.arange(batch * seq_len, device=device)
    parent = torch.where(idx % seq_len == 0, torch.full_like(idx, -1), idx - 1)
    return _plan(parent, conv_kernel, chunk)


def _plan(parent: torch.Tensor, conv_kernel: int, chunk: int) -> RecurrencePlan:
    if chunk < 1 or conv_kernel < 1:
        raise ValueError(f"chunk ({chunk}) and conv_kernel ({conv_kernel}) must be >= 1")
    device = parent.device
    T = parent.numel()
    idx = torch.arange(T, device=device)
    up = torch.cat([torch.where(parent < 0, torch.full_like(parent, T), parent), parent.new_tensor([T])])
    ancestors = [torch.cat([idx, idx.new_tensor([T])])]
    for _ in range(conv_kernel - 1):
        ancestors.append(up[ancestors[-1]])
    ancestors = torch.stack(ancestors, dim=1)[:T]
    if T == 0:
        return RecurrencePlan(0, 0, [], ancestors, chunk)

    children = torch.bincount(parent[parent >= 0], minlength=T)
    branch_before = torch.cat([children.new_zeros(1, dtype=torch.bool), children[:-1] >= 2])
    start = (parent < 0) | (parent != idx - 1) | branch_before
    seg_of = torch.cumsum(start.long(), 0) - 1
    starts = start.nonzero().flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([T])])
    seg_parent = torch.where(parent[starts] >= 0, seg_of[parent[starts].clamp(min=0)], torch.full_like(starts, -1))

    starts_l, lengths_l, parents_l = starts.tolist(), (ends - starts).tolist(), seg_parent.tolist()
    level_of: list[int] = []
    for p in parents_l:  # a parent segment precedes its children in pre-order
        level_of.append(0 if p < 0 else level_of[p] + 1)
    by_level: list[list[int]] = [[] for _ in range(max(level_of) + 1)]
    for s, lv in enumerate(level_of):
        by_level[lv].append(s)

    levels, where = [], [(0, 0)] * len(level_of)
    for segs in by_level:
        for batch in _similar_lengths(segs, lengths_l):
            longest = lengths_l[batch[0]]
            step = min(chunk, 1 << (longest - 1).bit_length())  # short segments: a smaller chunk, less padding
            width = -(-longest // step) * step
            tokens = torch.full((len(batch), width), T, dtype=torch.long)
            for row, s in enumerate(batch):
                tokens[row, : lengths_l[s]] = torch.arange(starts_l[s], starts_l[s] + lengths_l[s])
                where[s] = (len(levels), row)
            sources: dict[int, tuple[list[int], list[int]]] = {}
            for row, s in enumerate(batch):
                if parents_l[s] >= 0:
                    src, src_row = where[parents_l[s]]
                    sources.setdefault(src, ([], []))[0].append(row)
                    sources[src][1].append(src_row)
            levels.append(Level(tokens.to(device), torch.tensor(batch, device=device),
                                torch.tensor([parents_l[s] for s in batch], device=device), step,
                                [(src, torch.tensor(dst, device=device), torch.tensor(rows, device=device))
                                 for src, (dst, rows) in sorted(sources.items())]))
    return RecurrencePlan(T, len(level_of), levels, ancestors, chunk,
                          torch.cat([lv.tokens.reshape(-1) for lv in levels]))


def _similar_lengths(segs: list[int], lengths: list[int]) -> list[list[int]]:
    """``segs`` (one level) longest first, cut into batches whose segments are at least half as long as the batch's
    longest: padding to the longest at most doubles a batch's tokens, and there are at most log2(longest / shortest)
    + 1 batches."""
    batches: list[list[int]] = []
    for s in sorted(segs, key=lambda s: -lengths[s]):
        if batches and 2 * lengths[s] >= lengths[batches[-1][0]]:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches


# ------------------------------------------------------------------------------------------------ convolution
def tree_causal_conv(x: torch.Tensor, weight: torch.Tensor, plan: RecurrencePlan,
                     bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """Depthwise causal convolution along every token's ancestor path: x [T, C], weight [C, K] (HF's Conv1d weight
    [C, 1, K] squeezed: column K - 1 multiplies the token itself, column K - 1 - a its a-th ancestor) -> [T, C];
    ``silu``: followed by SiLU (Gated DeltaNet's q, k, v).

    The backward keeps only x and the weight (:class:`_TreeConv`) and computes the convolution again: autograd
    through the K gathered copies kept all K of them, and the SiLU its input, K + 1 times the memory of x."""
    K = weight.shape[1]
    if plan.ancestors.shape[1] < K:
        raise ValueError(f"the plan was built for a kernel of {plan.ancestors.shape[1]}, the weight has {K}")
    return _TreeConv.apply(x, weight, bias, plan.ancestors[:, :K], silu)


class _TreeConv(torch.autograd.Function):
    """pre[t] = sum_a x[anc[t, a]] * w[:, K - 1 - a] + bias (anc = T: a zero row), out = pre or silu(pre), with

        dpre = dout (* silu'(pre))      dx[j] = sum_{(t, a): anc[t, a] = j} dpre[t] * w[:, K - 1 - a]
        dw[:, K - 1 - a] = sum_t dpre[t] * x[anc[t, a]]                 dbias = sum_t dpre[t]
    """

    @staticmethod
    def forward(ctx, x, weight, bias, ancestors, silu):
        ctx.save_for_backward(x, weight, bias, ancestors)
        ctx.silu = silu
        pre = _conv(x, weight, bias, ancestors)
        return F.silu(pre) if silu else pre

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, ancestors = ctx.saved_tensors
        T, C = x.shape
        K = weight.shape[1]
        dpre = dout
        if ctx.silu:  # silu'(p) = sigmoid(p) (1 + p (1 - sigmoid(p))), in fp32
            p = _conv(x, weight, bias, ancestors).float()
            sig = torch.sigmoid(p)
            dpre = (dout.float() * sig * (1 + p * (1 - sig))).to(dout.dtype)
        padded = torch.cat([x, x.new_zeros(1, C)])
        dx = x.new_zeros(T + 1, C) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for a in range(K):
            rows = ancestors[:, a]
            if dx is not None:
                dx.index_add_(0, rows, dpre * weight[:, K - 1 - a])
            if dw is not None:
                dw[:, K - 1 - a] = (dpre * padded.index_select(0, rows)).sum(0)
        dbias = dpre.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return (None if dx is None else dx[:T]), dw, dbias, None, None


def _conv(x, weight, bias, ancestors):
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    K = weight.shape[1]
    out = padded.index_select(0, ancestors[:, 0]) * weight[:, K - 1]
    for a in range(1, K):
        out += padded.index_select(0, ancestors[:, a]) * weight[:, K - 1 - a]
    return out if bias is None else out + bias


# ------------------------------------------------------------------------------------------- the delta rule
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def chunked_gated_delta(q, k, v, g, beta, initial_state=None, chunk: int = 64, backend: str | None = None,
                        delta: bool = True):
    """The gated delta rule on [B, L, H, d] sequences in chunks (L a multiple of ``chunk``; q / k already normalised
    and q scaled; g, beta [B, L, H], or g [B, L, H, dk] for a decay per key channel (Kimi Delta Attention);
    ``initial_state`` [B, H, dk, dv] or None). Returns (o [B, L, H, dv], the final state [B, H, dk, dv]), in fp32
    (fp64 for fp64 inputs). ``backend`` runs the scan over chunks (see :func:`scan_backend`). ``delta=False``: the
    plain gated rule S_i = exp(g_i) S + beta_i k_i v_i^T (Mamba-2's state space duality: no correction by what the
    state already holds, so A = 0, U = diag(beta) V and W = 0 below: neither the triangular solves nor any product
    with W are computed, and the scan's Vn is U itself)."""
    B, L, H, dk = k.shape
    cd = _compute_dtype(v)
    dv = v.shape[-1]
    if L % chunk:
        raise ValueError(f"sequence length {L} is not a multiple of the chunk ({chunk})")
    n = L // chunk
    per_channel = g.dim() == 4

    def chunks(x):  # [B, L, H, ...] -> [B * H, n, chunk, ...]
        x = x.to(cd).transpose(1, 2)
        return x.reshape(B * H, n, chunk, *x.shape[3:]).contiguous()

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(2)  # [BH, n, C] (or [BH, n, C, dk]): the cumulative log decay inside each chunk
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta.unsqueeze(-1)
    if per_channel:  # Dec[t, s, c] = exp(G_tc - G_sc): every product of a row of one and a row of another, weighted
        dec = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~lower[..., None], float("-inf")).exp()
        attn = torch.einsum("...tc,...sc,...tsc->...ts", q, k, dec)
        G_exp, G_last = G.exp(), G[..., -1:, :]
        q_dec, k_dec = q * G_exp, k * (G_last - G).exp()
        chunk_decay = G_last.squeeze(-2).exp()  # [BH, n, dk]
    else:
        dec = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # [.., C, C], 0 above
        attn = q @ k.transpose(-1, -2) * dec
        G_exp = G.exp().unsqueeze(-1)
        q_dec, k_dec = q * G_exp, k * (G[..., -1:] - G).exp().unsqueeze(-1)
        chunk_decay = G[..., -1].exp()  # [BH, n]
    if delta:
        if per_channel:
            A = torch.einsum("...tc,...sc,...tsc->...ts", k_beta, k, dec).tril(-1)
        else:
            A = (k_beta @ k.transpose(-1, -2) * dec).tril(-1)
        system = torch.eye(chunk, dtype=q.dtype, device=q.device) + A
        U = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(system, k_beta * G_exp, upper=False, unitriangular=True)
    else:  # (no correction term: the chunk's writes are its values as they come)
        U, W = v * beta.unsqueeze(-1), None
    state = None if initial_state is None else initial_state.to(cd).reshape(B * H, dk, dv)
    name = scan_backend(q.device, cd, chunk, dk, backend)
    o, final = _ChunkScan.apply(U, W, q_dec, attn, k_dec, chunk_decay, state, name)
    return o.reshape(B, H, L, dv).transpose(1, 2), final.reshape(B, H, dk, dv)


# ------------------------------------------------------------------------------------------- scan over chunks
SCAN_BACKEND_ENV = "FORGE_GDN_BACKEND"
SCAN_BACKENDS = ("torch", "triton")


def scan_backend(device: torch.device, dtype: torch.dtype, chunk: int, dk: int, backend: str | None = None) -> str:
    """Who runs the scan over chunks: the ``backend`` argument, else ``FORGE_GDN_BACKEND``, else "torch". The Triton
    kernels are there on request: on an H200 (benchmarks/gated_delta.py, 4 x 8192 tokens, 8 heads of 128, bf16,
    forward + backward) the rule took 68 ms with them against 48 ms with the torch scan, so the automatic choice is
    torch on every device. Calls the Triton kernels do not take (fp64, chunks shorter than 16 tokens: one-chunk
    segments, key heads over 256) run on "torch" whatever was asked: both compute the same."""
    name = backend or os.environ.get(SCAN_BACKEND_ENV) or "torch"
    if name not in SCAN_BACKENDS:
        raise ValueError(f"unknown gated delta scan backend {name!r}; choose one of {SCAN_BACKENDS}")
    if name == "triton":
        kernels = _triton_scan()
        if kernels is None:
            raise RuntimeError(f"gated delta scan backend 'triton' is unavailable: {_triton_scan.why}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("gated delta scan backend 'triton' runs on CUDA tensors (or on CPU under "
                               "TRITON_INTERPRET=1, for tests)")
        if not kernels.supports(chunk, dk, dtype):
            return "torch"
    return name


@functools.cache
def _triton_scan():
    try:
        from forge_megatron.kernels import gated_delta_triton
    except Exception as exc:  # noqa: BLE001 - a missing or broken triton must not break the layer
        _triton_scan.why = f"{type(exc).__name__}: {exc}"
        return None
    return gated_delta_triton


def _scan_forward_torch(U, W, KD, decay, S0):
    """The Triton forward scan's definition (gated_delta_triton.py), a loop over chunks; W None: no correction
    term (the plain rule), Vn is U."""
    BH, n, _, dv = U.shape
    S = U.new_zeros(BH, KD.shape[-1], dv) if S0 is None else S0
    S_all, Vn = U.new_empty(BH, n, *S.shape[1:]), U if W is None else torch.empty_like(U)
    for i in range(n):
        S_all[:, i] = S
        if W is not None:
            Vn[:, i] = U[:, i] - W[:, i] @ S
        S = S * decay[:, i].reshape(BH, -1, 1) + KD[:, i].transpose(-1, -2) @ Vn[:, i]  # one decay, or one per row
    return S_all, Vn, S


def _scan_backward_torch(X, Y, W, KD, decay, dS):
    """The Triton backward scan's definition, a loop over chunks in reverse (W None: no correction term)."""
    BH, n, _, dv = X.shape
    dS = X.new_zeros(BH, KD.shape[-1], dv) if dS is None else dS
    dVn, dS_next = torch.empty_like(X), X.new_empty(BH, n, *dS.shape[1:])
    for i in reversed(range(n)):
        dS_next[:, i] = dS
        dVn[:, i] = X[:, i] + KD[:, i] @ dS
        dS = Y[:, i] + dS * decay[:, i].reshape(BH, -1, 1)
        if W is not None:
            dS = dS - W[:, i].transpose(-1, -2) @ dVn[:, i]
    return dVn, dS_next, dS


class _ChunkScan(torch.autograd.Function):
    """The chunks' outputs and the final state from the per-chunk terms (chunk i, state S_i before it):

        Vn_i = U_i - W_i S_i      O_i = Qd_i S_i + attn_i Vn_i      S_{i+1} = decay_i S_i + KD_i^T Vn_i

    (``decay`` [BH, n], or [BH, n, dk] scaling each row of the state: a decay per key channel; W None: no correction
    term, Vn = U: the plain gated rule, Mamba-2's)

    with a hand-written backward that keeps nothing per chunk between forward and backward: the states are
    recomputed by a second forward scan, then one reverse scan gives every chunk's dVn and dS_{i+1}, from which the
    remaining gradients are batched products over all chunks. (Autograd through the loop kept every chunk's state
    and Vn, and ran a dozen small kernels per chunk in the backward.)"""

    @staticmethod
    def forward(ctx, U, W, Qd, attn, KD, decay, S0, backend):
        scan_fwd = _triton_scan().scan_forward if backend == "triton" else _scan_forward_torch
        U, Qd, attn, KD, decay = (x.contiguous() for x in (U, Qd, attn, KD, decay))
        W, S0 = (None if x is None else x.contiguous() for x in (W, S0))
        S_all, Vn, final = scan_fwd(U, W, KD, decay, S0)
        O = torch.baddbmm(attn.flatten(0, 1) @ Vn.flatten(0, 1), Qd.flatten(0, 1), S_all.flatten(0, 1))
        ctx.save_for_backward(U, W, Qd, attn, KD, decay, S0)
        ctx.backend = backend
        return O.view_as(Vn), final

    @staticmethod
    def backward(ctx, dO, dfinal):
        U, W, Qd, attn, KD, decay, S0 = ctx.saved_tensors
        triton_scan = _triton_scan() if ctx.backend == "triton" else None
        scan_fwd = triton_scan.scan_forward if triton_scan else _scan_forward_torch
        scan_bwd = triton_scan.scan_backward if triton_scan else _scan_backward_torch
        S_all, Vn, _ = scan_fwd(U, W, KD, decay, S0)
        dO = torch.zeros_like(U) if dO is None else dO.contiguous()
        mT = lambda x: x.transpose(-1, -2)  # noqa: E731
        X, Y = mT(attn) @ dO, mT(Qd) @ dO
        dVn, dS_next, dS0 = scan_bwd(X, Y, W, KD, decay, None if dfinal is None else dfinal.contiguous())
        dU = dVn
        dW = None if W is None else -(dVn @ mT(S_all))
        dQd = dO @ mT(S_all)
        dattn = dO @ mT(Vn)
        dKD = Vn @ mT(dS_next)
        ddecay = (S_all * dS_next).sum(-1)  # per state row: a decay per key channel, or summed to the one
        if decay.dim() == 2:
            ddecay = ddecay.sum(-1)
        return dU, dW, dQd, dattn, dKD, ddecay, None if S0 is None else dS0, None


def _prepare(q, k, g, beta, heads: int, scale: float | None, l2norm: bool):
    """q, k [.., Hk, dk] -> normalised, scaled, repeated to ``heads``; g, beta in the compute dtype."""
    cd = _compute_dtype(q)
    q, k = q.to(cd), k.to(cd)
    if l2norm:  # as the FLA kernels and transformers compute it
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if q.shape[-2] != heads:
        if heads % q.shape[-2]:
            raise ValueError(f"{heads} value heads are not a multiple of {q.shape[-2]} key heads")
        rep = heads // q.shape[-2]
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k, g.to(cd), beta.to(cd)


def tree_gated_delta_rule(q, k, v, g, beta, plan: RecurrencePlan, scale: float | None = None,
                          l2norm: bool = True, backend: str | None = None, recompute: bool = True,
                          delta: bool = True) -> torch.Tensor:
    """The gated delta rule along every path of the forest ``plan`` describes: q, k [T, Hk, dk], v [T, H, dv],
    g (log decay, <= 0) [T, H] or [T, H, dk] (one per key channel: Kimi Delta Attention), beta [T, H] -> o [T, H, dv]
    in v's dtype (computed in fp32). ``backend``: who scans the chunks (:func:`scan_backend`; a decay per channel is
    best planned in chunks of 16: its terms inside a chunk are C x C x dk).

    ``recompute`` (default): keep only the inputs for the backward and compute the rest again there (a
    non-reentrant activation checkpoint around this function). The fp32 terms inside the chunks that autograd would
    keep otherwise come to about 1.8k floats per token and value head at dk = dv = 128, more than the rest of a
    decoder layer at long contexts (benchmarks/gated_delta.py); the price is this function's forward run twice.

    ``delta=False``: the plain gated rule without the delta correction (Mamba-2, :func:`chunked_gated_delta`)."""
    T, H, dv = v.shape
    if q.shape[0] != T or plan.num_tokens != T:
        raise ValueError(f"{q.shape[0]} query rows, {T} value rows, a plan for {plan.num_tokens} tokens")
    if recompute and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
        return torch.utils.checkpoint.checkpoint(_tree_rule, q, k, v, g, beta, plan, scale, l2norm, backend, delta,
                                                 use_reentrant=False)
    return _tree_rule(q, k, v, g, beta, plan, scale, l2norm, backend, delta)


def _tree_rule(q, k, v, g, beta, plan: RecurrencePlan, scale, l2norm, backend, delta=True) -> torch.Tensor:
    T, H, dv = v.shape
    q, k, g, beta = _prepare(q, k, g, beta, H, scale, l2norm)
    pad = lambda x: torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # noqa: E731  row T: padding
    q, k, vf, g, beta = pad(q), pad(k), pad(v.to(q.dtype)), pad(g), pad(beta)
    finals: list[torch.Tensor] = []
    out_vals = []
    dk = k.shape[-1]
    for level in plan.levels:
        rows = level.tokens  # [B, L]
        init = None
        for src, dst, src_rows in level.sources:  # parents' final states (zeros for roots)
            init = q.new_zeros(rows.shape[0], H, dk, dv) if init is None else init
            init = init.index_copy(0, dst, finals[src][src_rows])
        o, final = chunked_gated_delta(q[rows], k[rows], vf[rows], g[rows], beta[rows], init, level.chunk, backend,
                                       delta)
        finals.append(final)
        out_vals.append(o.reshape(-1, H, dv))
    out = vf.new_zeros(T + 1, H, dv).index_copy(0, plan.rows, torch.cat(out_vals))
    return out[:T].to(v.dtype)


def recurrent_reference(q, k, v, g, beta, parent: torch.Tensor, scale: float | None = None,
                        l2norm: bool = True, delta: bool = True) -> torch.Tensor:
    """Token-by-token definition over a forest (``parent`` [T], -1 for roots): the state of every token is kept,
    so this is for tests at small sizes (``delta=False``: the plain gated rule, Mamba-2's)."""
    T, H, dv = v.shape
    q, k, g, beta = _prepare(q, k, g, beta, H, scale, l2norm)
    v = v.to(q.dtype)
    states, out = [], []
    for i in range(T):
        p = int(parent[i])
        S = states[p] if p >= 0 else v.new_zeros(H, k.shape[-1], dv)
        S = S * g[i].exp().reshape(H, -1, 1)  # one decay per head, or one per key channel (a row of S)
        write = (v[i] - torch.einsum("hkv,hk->hv", S, k[i]) if delta else v[i]) * beta[i][:, None]
        S = S + k[i][:, :, None] * write[:, None, :]
        states.append(S)
        out.append(torch.einsum("hkv,hk->hv", S, q[i]))
    return torch.stack(out) if out else v.new_zeros(0, H, dv)


def gate_and_decay(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's per-head log decay g = -exp(A_log) * softplus(a + dt_bias) and write strength
    beta = sigmoid(b), in fp32 (fp64 for fp64 inputs)."""
    cd = _compute_dtype(a)
    g = -A_log.to(cd).exp() * F.softplus(a.to(cd) + dt_bias.to(cd))
    return g, b.to(cd).sigmoid()
