"""Triton tree attention vs the dense reference, forward and backward (CPU: TRITON_INTERPRET=1, set in conftest).

GPUs needed: 0 for the unmarked tests (interpreter), 1 for the `gpu` ones.
"""

import pytest
import torch
import triton.language as tl
from tree_cases import (
    check_against_reference,
    check_sinks_and_window,
    check_suffix_queries,
    error_budget,
    forest_cases,
    low_precision_attention,
    random_qkv,
    sub_end_from_samples,
)

from forge_megatron.kernels.tree_attention import triton_kernel
from forge_megatron.kernels.tree_attention.triton_kernel import tree_attention_triton

CASES = forest_cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_gqa_fp32(case):
    check_against_reference(tree_attention_triton, CASES[case], N=4, K=2, H=32, dtype=torch.float32)


@pytest.mark.parametrize("N,K,H", [(2, 1, 16), (2, 2, 64), (3, 1, 24)])
def test_head_dims_and_group_sizes(N, K, H):
    check_against_reference(tree_attention_triton, CASES["grpo"], N=N, K=K, H=H, dtype=torch.float32)


@pytest.mark.parametrize("H,Hv", [(24, 16), (16, 24), (48, 32)])
def test_value_heads_of_another_size(H, Hv):
    """Multi-latent attention: value heads narrower (DeepSeek: 192 / 128) or wider than query/key heads, GQA,
    forward and backward, whole trees and suffix queries."""
    check_against_reference(tree_attention_triton, CASES["random_trie"], N=4, K=2, H=H, Hv=Hv, dtype=torch.float32)
    check_suffix_queries(tree_attention_triton, CASES["grpo"], N=2, K=1, H=H, Hv=Hv)


def test_heads_of_512():
    """Gemma 4's global layers: query, key and value heads of 512 (GQA), forward and backward, whole tree and suffix
    queries; on a GPU such heads take 32 x 32 tiles (gpu_launch_config), here the interpreter's 32 x 32."""
    check_against_reference(tree_attention_triton, CASES["many_roots"], N=2, K=1, H=512, dtype=torch.float32)
    check_suffix_queries(tree_attention_triton, CASES["grpo"], N=2, K=1, H=512)
    assert triton_kernel.gpu_launch_config(512, tl.bfloat16)["BLOCK_M"] == 32
    assert triton_kernel.gpu_launch_config(256, tl.bfloat16)["BLOCK_M"] == 64


@pytest.mark.parametrize("case,window,with_sinks", [("random_trie", 3, True), ("grpo", 5, False),
                                                    ("many_roots", None, True), ("long_chain", 40, True)])
def test_sinks_and_sliding_window(case, window, with_sinks):
    """gpt-oss attention (sinks start the online softmax, windows mask by depth) against the reference, the sinks'
    gradient included, and the reference against the one-query-at-a-time oracle."""
    check_sinks_and_window(tree_attention_triton, CASES[case], N=4, K=2, H=16, window=window, with_sinks=with_sinks)


@pytest.mark.parametrize("case,window", [("random_trie", None), ("grpo", 5), ("long_chain", None)])
def test_soft_capped_scores(case, window):
    """Gemma 2's attention soft-capping (scores c * tanh(s / c)) against the reference and the oracle, forward and
    backward (dS times the cap's derivative in both backward kernels), full tiles (no window) and windowed ones."""
    check_sinks_and_window(tree_attention_triton, CASES[case], N=4, K=2, H=16, window=window, with_sinks=False,
                           softcap=2.0)


@pytest.mark.parametrize("case,chunk,window", [("random_trie", 2, None), ("grpo", 5, None), ("long_chain", 33, None),
                                               ("long_chain", 7, 20)])
def test_chunked_attention(case, chunk, window):
    """Llama 4's chunked attention (a query sees the keys of its own chunk of depths) against the reference and the
    oracle, forward and backward; chunk 33 over the 160-token chain under 32 x 32 tiles: chunk starts inside tiles
    and tiles skipped above them; with a window ANDed."""
    check_sinks_and_window(tree_attention_triton, CASES[case], N=4, K=2, H=16, window=window, with_sinks=False,
                           chunk=chunk)


def test_chunks_skip_tiles_above_their_queries():
    """A 160-token chain under 32 x 32 tiles with chunks of 64: the forward's schedule computes only the tiles
    whose keys reach the chunk start of their shallowest query: query blocks of depths 0-31, 32-63 | 64-95, 96-127 |
    128-159 see key blocks 0 | 0, 1 | 2 | 2, 3 | 4, 7 of the 15 causal tiles, none of them unmasked."""
    from forge_megatron.kernels.tree_attention import schedule

    sub_end = sub_end_from_samples([list(range(160))])
    plan = schedule.build_schedule(sub_end, 160, 32, 32, chunk=64)
    causal = schedule.build_schedule(sub_end, 160, 32, 32)
    assert (plan.full_tiles, plan.partial_tiles) == (0, 7)
    assert causal.full_tiles + causal.partial_tiles == 15


def test_soft_capped_scores_with_suffix_queries():
    """The all-gather CP mode's suffix queries under a soft cap, with a window: forward and gradients against the
    reference given the same suffix, whose rows are those of the whole tree's."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    sub_end = CASES["grpo"]
    T = sub_end.shape[0]
    q, k, v = random_qkv(T, 4, 2, 16, torch.float32, "cpu", 3)
    q, a = q * 3.0, T // 3
    do = torch.randn((T - a, 4, 16), generator=torch.Generator().manual_seed(4))
    results = []
    for f in (tree_attention_triton, tree_attention_reference):
        leaves = [x.detach().requires_grad_() for x in (q[a:], k, v)]
        o = f(*leaves, sub_end, softmax_scale=0.3, window=6, softcap=2.0)
        results.append((o, *torch.autograd.grad(o, leaves, do)))
    for got, want in zip(*results):
        assert (got - want).abs().max() < 2e-5
    whole = tree_attention_reference(q, k, v, sub_end, softmax_scale=0.3, window=6, softcap=2.0)
    assert (whole[a:] - results[1][0]).abs().max() < 1e-5


@pytest.mark.parametrize("window", [5, 34, 200])
def test_window_skips_tiles_far_above_their_queries(window):
    """A 160-token chain (an agent episode) under the interpreter's 32 x 32 tiles: with a window of W levels the
    kernels skip the key tiles that every query of a tile sees W or more levels above it, and still equal the
    reference, forward and backward (W = 34 is the boundary: query 96 and key 63 are 33 levels apart, so the tile of
    keys 32-63 must be computed for queries 96-127); fewer tiles are computed than without a window, as many when the
    window spans the chain."""
    sub_end = sub_end_from_samples([list(range(160))])
    live, without = triton_kernel.window_live_tiles(sub_end, window, 32, 32)
    assert without == 15 and live == {5: 9, 34: 12, 200: 15}[window]
    check_sinks_and_window(tree_attention_triton, sub_end, N=2, K=1, H=16, window=window, with_sinks=True)


def test_sinks_and_window_with_suffix_queries_and_narrow_values():
    """The all-gather CP mode's suffix queries with sinks and a window (depths from the clamped sub_end)."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    sub_end = CASES["grpo"]
    T = sub_end.shape[0]
    q, k, v = random_qkv(T, 4, 2, 16, torch.float32, Hv=8)
    sinks = torch.randn(4)
    for a, b in ((10, T), (5, 30)):
        cut = torch.clamp(sub_end[:b], max=b)
        want = tree_attention_reference(q, k, v, sub_end, sinks=sinks, window=4)[a:b]
        got = tree_attention_triton(q[a:b], k[:b], v[:b], cut, sinks=sinks, window=4)
        assert (got - want).abs().max().item() <= 2e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    check_against_reference(tree_attention_triton, CASES["random_trie"], N=2, K=1, H=32, dtype=dtype)


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (32, 64), (64, 32)])
def test_other_block_shapes(monkeypatch, block_m, block_n):
    """The GPU block size (64) and unequal query/key blocks give the same result (interpreter, fp32 math)."""
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_H=32, BLOCK_HV=32, COMPUTE=tl.float32, DOT_PRECISION="ieee")
    monkeypatch.setattr(triton_kernel, "_launch_config", lambda q, T, v_head_dim=None: cfg)
    check_against_reference(tree_attention_triton, CASES["many_roots"], N=4, K=2, H=32, dtype=torch.float32)


def test_each_kernel_its_own_tiles(monkeypatch):
    """The forward, dQ and dK/dV kernels each take their tiles from the config (as on a GPU, where dK/dV has narrow
    query tiles): three different shapes, whole tree, suffix queries and bidirectional blocks."""
    tiles = {"fwd": (32, 16, 4, 2), "dq": (16, 32, 4, 2), "dkdv": (16, 32, 4, 1)}  # dK/dV's key-major tiles not square
    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_H=16, BLOCK_HV=16, COMPUTE=tl.float32, DOT_PRECISION="ieee",
               num_warps=4, tiles=tiles)
    monkeypatch.setattr(triton_kernel, "_launch_config", lambda q, T, v_head_dim=None: cfg)
    check_against_reference(tree_attention_triton, CASES["random_trie"], N=4, K=2, H=16, dtype=torch.float32)
    check_suffix_queries(tree_attention_triton, CASES["grpo"], N=2, K=1, H=16, seed=3)
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], N=2, K=1, H=16, q_start=20)


def test_gpu_tiles_by_head_size_and_from_the_environment(monkeypatch):
    monkeypatch.delenv(triton_kernel.TILES_ENV, raising=False)
    cfg = triton_kernel.gpu_launch_config(128, tl.bfloat16)
    assert cfg["tiles"] == {"fwd": (64, 64, 4, 3), "dq": (128, 32, 4, 3), "dkdv": (32, 64, 4, 3)}
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]) == (64, 64, 4)
    assert triton_kernel.gpu_launch_config(512, tl.bfloat16)["tiles"]["fwd"][:2] == (32, 32)
    assert triton_kernel.gpu_launch_config(192, tl.bfloat16, 128)["tiles"]["fwd"][:2] == (64, 64)
    assert max(t[0] for t in triton_kernel.gpu_launch_config(64, tl.float32)["tiles"].values()) == 32
    monkeypatch.setenv(triton_kernel.TILES_ENV, "dkdv=64x128x8x2, fwd=64x64x4x1")
    tiles = triton_kernel.gpu_launch_config(128, tl.bfloat16)["tiles"]
    assert tiles == {"fwd": (64, 64, 4, 1), "dq": (128, 32, 4, 3), "dkdv": (64, 128, 8, 2)}
    constexprs, options = triton_kernel._kernel_launch(triton_kernel.gpu_launch_config(128, tl.bfloat16), "dkdv")
    assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], options) == (64, 128, dict(num_warps=8, num_stages=2))
    assert "tiles" not in constexprs and "num_warps" not in constexprs
    for bad, message in (("bwd=64x64x4x2", "KERNEL one of fwd, dq, dkdv"), ("fwd=64x64x4", "is not KERNEL="),
                         ("fwd=48x64x4x2", "powers of two in \\[16, 256\\]"), ("dq=64x64x3x2", "warps 1-16"),
                         ("dq=64x64x4x9", "stages 1-8")):
        monkeypatch.setenv(triton_kernel.TILES_ENV, bad)
        with pytest.raises(ValueError, match=message):
            triton_kernel.gpu_launch_config(128, tl.bfloat16)


@pytest.mark.parametrize("case", ["long_chain", "grpo", "many_roots", "random_trie"])
def test_suffix_queries(case):
    """q holds only the last tokens of the keys' tree (CP all-gather mode): query tiles start at an unaligned
    position, the dK/dV loop starts at the first query block that can see each key block."""
    check_suffix_queries(tree_attention_triton, CASES[case], N=4, K=2, H=16)


@pytest.mark.parametrize("block_m,block_n", [(32, 64), (64, 32)])
def test_suffix_queries_unequal_blocks(monkeypatch, block_m, block_n):

    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_H=16, BLOCK_HV=16, COMPUTE=tl.float32, DOT_PRECISION="ieee")
    monkeypatch.setattr(triton_kernel, "_launch_config", lambda q, T, v_head_dim=None: cfg)
    check_suffix_queries(tree_attention_triton, CASES["grpo"], N=2, K=1, H=16, seed=4)


def test_softmax_scale():
    check_against_reference(tree_attention_triton, CASES["many_roots"], N=2, K=1, H=16, dtype=torch.float32,
                            scale=0.05)


def _tile_kinds(sub_end: torch.Tensor, block: int) -> set[str]:
    """Classify every causal tile by the DESIGN rule (with the Python sub_end, independent of the kernel)."""
    T = sub_end.shape[0]
    kinds = set()
    for q_lo in range(0, T, block):
        q_hi = min(q_lo + block, T)
        for k_lo in range(0, q_hi, block):
            se = sub_end[k_lo:k_lo + block]
            if se.max() <= q_lo:
                kinds.add("empty")
            elif k_lo + block - 1 <= q_lo and se.min() >= q_hi:
                kinds.add("full")
            else:
                kinds.add("partial")
    return kinds


def test_cases_cover_every_tile_kind():
    block = triton_kernel._launch_config(torch.empty(1, 1, 32), 1)["BLOCK_N"]
    kinds = set().union(*(_tile_kinds(se, block) for se in CASES.values()))
    assert kinds == {"empty", "full", "partial"}


@pytest.mark.parametrize("with_key_end", [False, True])
def test_torch_compile_traces_fwd_and_bwd(with_key_end):
    sub_end = CASES["grpo"]
    q, k, v = (x.requires_grad_() for x in random_qkv(sub_end.shape[0], 2, 1, 16, torch.float32))
    extra = dict(key_end_T=_key_end(sub_end, _random_blocks(sub_end, 2))) if with_key_end else {}
    from torch._dynamo.utils import counters

    # the real torch.compile, with TorchDynamo on (a CPU process that applied forge's Megatron patches defers
    # torch.compile and turns TorchDynamo off: that would run this eagerly and prove nothing)
    compile_ = getattr(torch.compile, "_forge_original", torch.compile)
    traced = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = compile_(tree_attention_triton, backend="aot_eager", fullgraph=True)
        o = compiled(q, k, v, sub_end, **extra)
        o.sum().backward()
    assert counters["stats"]["unique_graphs"] > traced  # TorchDynamo traced it (fullgraph: in one graph)
    o_eager = tree_attention_triton(q, k, v, sub_end, **extra)
    assert torch.allclose(o, o_eager)
    assert q.grad is not None and k.grad.abs().sum() > 0


def test_opcheck_fake_and_autograd_registration():
    sub_end = sub_end_from_samples([[1, 2, 3], [1, 2, 4, 5], [6]])
    q, k, v = (x.requires_grad_() for x in random_qkv(sub_end.shape[0], 2, 1, 16, torch.float32))
    torch.library.opcheck(triton_kernel.tree_attention_triton_op, (q, k, v, sub_end, 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    # bidirectional blocks [0, 2) (ending at the branch after token 1) and [3, 5), with sinks and a window
    key_end = torch.tensor([2, 2, 3, 5, 5, 6], dtype=torch.int32)
    sinks = torch.randn(2).requires_grad_()
    torch.library.opcheck(triton_kernel.tree_attention_triton_op, (q, k, v, sub_end, 0.25, sinks, 2, key_end),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(7, 4, 16), torch.empty(7, 2, 16), torch.empty(7, 2, 16)
        o, lse = triton_kernel.tree_attention_triton_op(q, k, v, torch.empty(7, dtype=torch.int32), 0.25)
    assert o.shape == (7, 4, 16) and lse.shape == (4, 7) and lse.dtype == torch.float32
    with FakeTensorMode():
        q, k, v = torch.empty(7, 4, 16), torch.empty(7, 2, 16), torch.empty(7, 2, 8)
        o, _ = triton_kernel.tree_attention_triton_op(q, k, v, torch.empty(7, dtype=torch.int32), 0.25)
    assert o.shape == (7, 4, 8)  # the values' head size


def test_unsupported_sizes_raise():
    q = torch.zeros(3, 1, 1024)
    with pytest.raises(ValueError, match="head_dim 1024 is not supported by the Triton tree attention kernel"):
        tree_attention_triton(q, q, q, torch.full((3,), 3, dtype=torch.int32))
    huge = torch.empty(2**31 // 64 + 1, 1, 64, device="meta")
    with pytest.raises(ValueError, match="int32 offsets"):
        triton_kernel._launch_config(huge, huge.shape[0])


def test_empty_input():
    q, k, v = random_qkv(0, 2, 1, 16, torch.float32)
    assert tree_attention_triton(q, k, v, torch.empty(0, dtype=torch.int32)).shape == (0, 2, 16)


@pytest.mark.parametrize("change,message", [
    (dict(sub_end=torch.zeros(5, dtype=torch.int64)), "sub_end must be int32, got torch.int64"),
    (dict(sub_end=torch.zeros(4, dtype=torch.int32)), "sub_end must have shape [5], got (4,)"),
    (dict(k=torch.zeros(5, 3, 16), v=torch.zeros(5, 3, 16)), "query heads (4) must be a multiple of key/value heads (3)"),
    (dict(q=torch.zeros(5, 4, 16, dtype=torch.int32)), "q has dtype torch.int32; supported"),
    (dict(v=torch.zeros(5, 2, 16, dtype=torch.float16)), "q, k, v must share a dtype"),
    (dict(q=torch.zeros(5, 64)), "q must be 3-D [T, heads, head_dim], got shape (5, 64)"),
    (dict(q=torch.zeros(6, 4, 16)), "k/v need q's head_dim and at least as many tokens"),
    (dict(scale=-1.0), "softmax_scale must be positive and finite, got -1.0"),
])
def test_bad_input_errors(change, message):
    args = dict(q=torch.zeros(5, 4, 16), k=torch.zeros(5, 2, 16), v=torch.zeros(5, 2, 16),
                sub_end=torch.full((5,), 5, dtype=torch.int32), scale=None)
    args.update(change)
    with pytest.raises(ValueError) as err:
        tree_attention_triton(args["q"], args["k"], args["v"], args["sub_end"], softmax_scale=args["scale"])
    assert message in str(err.value)


# ---- bidirectional blocks (key_end: Gemma 3's images, ops.py) ----------------------------------------------------


def _block_tree() -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(sub_end, blocks [start, end) in DFS positions) of a GRPO-like tree with images: a 45-token prompt (tokens
    0-44; token 44 branches into 4 completions) and completions 45-59, 60-66 (branching at 66 into 67-76 and 77-84)
    and 85-105. Blocks: a 1-token one, one crossing the 16- and 32-token tile boundaries, one ending exactly at each
    branch point, leaf blocks (one running to a sample's end, next to a block that starts the sibling completion),
    one crossing tile boundary 96."""
    prompt = list(range(1000, 1045))
    samples = [prompt + [10_000] + list(range(100, 114)),
               prompt + [10_001] + list(range(200, 206)) + [1] + list(range(300, 309)),
               prompt + [10_001] + list(range(200, 206)) + [2] + list(range(400, 407)),
               prompt + [10_003] + list(range(500, 520))]
    sub_end = sub_end_from_samples(samples)
    assert sub_end.shape[0] == 106 and int(sub_end[44]) == 106 and int(sub_end[66]) == 85
    return sub_end, [(1, 2), (3, 40), (41, 45), (47, 58), (62, 67), (68, 72), (77, 85), (85, 88), (90, 105)]


def _chains_tree() -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Two 100- and 96-token chains, one block in each: [5, 96) makes the 32 x 32 tiles of queries 32-63 or 64-95
    against keys 64-95 full (keys past the queries, the last one key_end - 1); [101, 191) leaves keys 160-191 one
    short of full for queries 128-159 (key 191 is past their key_end)."""
    sub_end = sub_end_from_samples([list(range(100)), list(range(1000, 1096))])
    return sub_end, [(5, 96), (101, 191)]


def _random_blocks(sub_end: torch.Tensor, seed: int) -> list[tuple[int, int]]:
    """Random blocks of 1-12 tokens, each cut where its chain ends (the token before the cut may branch)."""
    g = torch.Generator().manual_seed(seed)
    T, se = sub_end.shape[0], sub_end.tolist()
    blocks, i = [], 0
    while i < T:
        i += int(torch.randint(0, 6, (), generator=g))
        end = min(T, i + int(torch.randint(1, 13, (), generator=g)))
        j = i
        while j + 1 < end and se[j] > j + 1 and se[j + 1] == se[j]:  # j + 1 is j's only child
            j += 1
        if i < T:
            blocks.append((i, j + 1))
        i = j + 2  # leave a gap: a block after a branch point's last token would continue its run
    return blocks


def _key_end(sub_end: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    from forge_megatron.kernels.tree_attention import ops

    mark = torch.zeros(sub_end.shape[0], dtype=torch.bool)
    for a, b in blocks:
        mark[a:b] = True
    key_end = ops.block_key_end(mark, sub_end)
    ops.check_key_end(key_end, sub_end)
    # the runs are the blocks given (adjacent blocks stay apart when the second does not continue the first's chain)
    for a, b in blocks:
        assert key_end[a:b].tolist() == [b] * (b - a), (a, b, key_end[a:b].tolist())
    return key_end


BLOCK_CASES = {"prefix_and_leaves": _block_tree(), "chains_full_tiles": _chains_tree(),
               "random_trie": (CASES["random_trie"], _random_blocks(CASES["random_trie"], 0)),
               "many_roots": (CASES["many_roots"], _random_blocks(CASES["many_roots"], 1))}


def _check_key_end(sub_end, blocks, N=4, K=2, H=16, dtype=torch.float32, window=None, with_sinks=False, q_start=0,
                   seed=0, Hv=None, device="cpu"):
    """Triton with key_end (q: tokens [q_start, T)) against the fp32 reference with the same key_end, forward and
    backward (dq, dk, dv and the sinks' gradient), by the FlashAttention rule (tree_cases.error_budget: error
    against fp64 <= 2 x the error of the same math run in ``dtype``, tree_cases.low_precision_attention, + 1e-5
    relative to the output's magnitude). Also checks that the blocks change the
    output (the test is not causal)."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    key_end = (blocks if isinstance(blocks, torch.Tensor) else _key_end(sub_end, blocks)).to(device)
    sub_end = sub_end.to(device)
    q, k, v = random_qkv(sub_end.shape[0], N, K, H, dtype, device=device, seed=seed, Hv=Hv)
    q = q[q_start:]
    sinks = torch.randn(N, generator=torch.Generator().manual_seed(seed + 2)).to(device) if with_sinks else None
    do = torch.randn((*q.shape[:2], v.shape[2]), generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)

    def run(f, q, k, v, sinks, do, key_end):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)] + \
            ([sinks.detach().requires_grad_()] if sinks is not None else [])
        o = f(*leaves[:3], sub_end, softmax_scale=0.3, sinks=leaves[3] if sinks is not None else None, window=window,
              key_end_T=key_end)
        return (o, *torch.autograd.grad(o, leaves, do))

    got = run(tree_attention_triton, q, k, v, sinks, do, key_end)
    exact = run(tree_attention_reference, q.double(), k.double(), v.double(),
                sinks.double() if sinks is not None else None, do.double(), key_end)
    lowp = run(low_precision_attention, q, k, v, sinks, do, key_end)
    for name, g, e, lp in zip(("o", "dq", "dk", "dv", "dsinks"), got, exact, lowp):
        assert g.shape == e.shape, name
        err = (g.double() - e).abs().max().item()
        budget = error_budget(lp, e)
        assert err <= budget, f"{name}: error {err:.3g} > {budget:.3g} ({dtype}, window {window}, q_start {q_start})"
    causal = tree_attention_reference(q.float(), k.float(), v.float(), sub_end, softmax_scale=0.3, sinks=sinks,
                                      window=window)
    assert (causal - exact[0]).abs().max().item() > 1e-2, "the blocks do not change these queries' attention"


def test_low_precision_math_is_the_reference_in_fp64():
    """The error budget's low-precision math (tree_cases.low_precision_attention: the reference's explicit path)
    computes what the reference's SDPA path does: in fp64 they agree to round-off with suffix queries, a window and
    bidirectional blocks."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    sub_end, blocks = BLOCK_CASES["prefix_and_leaves"]
    q, k, v = random_qkv(sub_end.shape[0], 4, 2, 16, torch.float64, Hv=8)
    # (with sinks the reference always takes its explicit path: nothing to compare there)
    for extra in (dict(), dict(window=3), dict(key_end_T=_key_end(sub_end, blocks), window=5)):
        for q_start in (0, 9):
            got = low_precision_attention(q[q_start:], k, v, sub_end, 0.3, **extra)
            want = tree_attention_reference(q[q_start:], k, v, sub_end, 0.3, **extra)
            assert (got - want).abs().max().item() < 1e-12


def _key_end_tile_kinds(sub_end, key_end, block_m, block_n) -> set[str]:
    """Kinds of the tiles the forward visits under the DESIGN rules (module docstring), in plain Python; a tile
    whose keys start at or past its queries' end is 'ahead'."""
    T = sub_end.shape[0]
    kinds = set()
    for q_lo in range(0, T, block_m):
        q_hi = min(q_lo + block_m, T)
        kemin, kemax = int(key_end[q_lo:q_hi].min()), int(key_end[q_lo:q_hi].max())
        for k_lo in range(0, kemax, block_n):
            se = sub_end[k_lo:k_lo + block_n]
            ahead = "_ahead" if k_lo >= q_hi else ""
            if int(se.max()) <= q_lo:
                kinds.add("empty" + ahead)
            elif k_lo + block_n <= kemin and int(se.min()) >= q_hi:
                kinds.add("full" + ahead)
            else:
                kinds.add("partial" + ahead)
    return kinds


def test_key_end_cases_cover_every_tile_kind():
    """The block cases reach every kind of tile under the interpreter's 32 x 32 and the 16 x 16 tiles below: full
    and partial ones whose keys lie past their queries (the forward's loop runs past q_hi), and empty ones."""
    kinds = set()
    for sub_end, blocks in BLOCK_CASES.values():
        key_end = _key_end(sub_end, blocks)
        kinds |= _key_end_tile_kinds(sub_end, key_end, 32, 32) | _key_end_tile_kinds(sub_end, key_end, 16, 16)
    assert {"empty", "full", "partial", "full_ahead", "partial_ahead"} <= kinds
    chains, blocks = BLOCK_CASES["chains_full_tiles"]
    assert "full_ahead" in _key_end_tile_kinds(chains, _key_end(chains, blocks), 32, 32)


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_bidirectional_blocks_match_reference(case):
    """Bidirectional blocks (key_end) in shared prefixes and leaves, ending at branch points, of one token, across
    tile boundaries and making full tiles of keys past their queries: forward and backward, GQA, fp32."""
    _check_key_end(*BLOCK_CASES[case])


def test_key_end_that_is_not_blocks():
    """ops.check_key_end admits any key_end whose tokens i .. key_end[i] - 1 form a chain, not only blocks: token 0
    sees its whole 100-token chain while the rest stay causal (the dK/dV loop skips the query blocks between it and
    a key tile, whose key_end all stop short of the tile), token 101 sees 101-149."""
    sub_end, _ = BLOCK_CASES["chains_full_tiles"]
    key_end = torch.arange(1, sub_end.shape[0] + 1, dtype=torch.int32)
    key_end[0], key_end[101] = 100, 150
    _check_key_end(sub_end, key_end, N=2, K=1)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16)])
def test_bidirectional_blocks_small_tiles(monkeypatch, block_m, block_n):
    """Blocks crossing many query- and key-tile boundaries (the dK/dV loop starts at the query block of the first
    token whose block reaches the key tile), equal and unequal tiles, whole tree and suffix queries."""

    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_H=16, BLOCK_HV=16, COMPUTE=tl.float32, DOT_PRECISION="ieee")
    monkeypatch.setattr(triton_kernel, "_launch_config", lambda q, T, v_head_dim=None: cfg)
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], N=2, K=1)
    _check_key_end(*BLOCK_CASES["chains_full_tiles"], N=2, K=1, q_start=37)


@pytest.mark.parametrize("window,with_sinks", [(3, True), (20, False), (None, True)])
def test_bidirectional_blocks_with_window_and_sinks(window, with_sinks):
    """Gemma 3's local layers: a sliding window ANDed onto the blocks (3: smaller than most blocks, whose later
    tokens still see the block's keys after them), and attention sinks (their gradient included)."""
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], window=window, with_sinks=with_sinks)


@pytest.mark.parametrize("q_start,window", [(20, None), (50, 6), (95, None)])
def test_bidirectional_blocks_suffix_queries(q_start, window):
    """q holds only the last tokens (from inside a block, tile-unaligned; 95: the last 11, in the block [90, 105)
    and after it): key_end still covers all T tokens and the queries use its last Tq entries; the keys before
    q_start get dK/dV."""
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], q_start=q_start, window=window, with_sinks=window is not None)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_bidirectional_blocks_low_precision(dtype):
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], dtype=dtype, with_sinks=True)
    _check_key_end(*BLOCK_CASES["chains_full_tiles"], N=2, K=1, dtype=dtype, Hv=8)


def test_bad_key_end_raises():
    sub_end, blocks = BLOCK_CASES["prefix_and_leaves"]
    key_end = _key_end(sub_end, blocks)
    q, k, v = random_qkv(sub_end.shape[0], 2, 1, 16, torch.float32)
    across = key_end.clone()
    across[43:45] = 47  # tokens 43-46: past the branch at token 44
    below = key_end.clone()
    below[10] = 10
    for bad, message in ((key_end.long(), "key_end must be int32"), (key_end[:-1], "key_end must be int32 of shape"),
                         (across, "spans a branch"), (below, "i < key_end\\[i\\] <= sub_end\\[i\\]")):
        with pytest.raises(ValueError, match=message):
            tree_attention_triton(q, k, v, sub_end, key_end_T=bad)


def test_cuda_backend_refuses_key_end():
    """The CUDA kernel shares the ops' registration but has no blocks: its impls and public function refuse key_end
    by name (before needing the extension, so this runs without a GPU)."""
    from forge_megatron.kernels.tree_attention import cuda

    sub_end, blocks = BLOCK_CASES["prefix_and_leaves"]
    key_end = _key_end(sub_end, blocks)
    q, k, v = random_qkv(sub_end.shape[0], 2, 1, 32, torch.float32)
    message = "the CUDA kernel has no bidirectional blocks \\(key_end\\); use the triton or segment backend"
    with pytest.raises(ValueError, match=message):
        cuda._forward(q, k, v, sub_end, 0.25, None, 0, key_end)
    with pytest.raises(ValueError, match=message):
        cuda._backward(q, q, k, v, q, torch.zeros(2, q.shape[0]), sub_end, 0.25, 0, key_end)
    with pytest.raises(ValueError, match=message):
        cuda.tree_attention_cuda(q, k, v, sub_end, key_end_T=key_end)


def _gpu_forest(n_samples: int, prompt: int, completion: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shared = list(range(prompt))
    return sub_end_from_samples([shared + [10_000 + i] + torch.randint(0, 4, (completion,), generator=g).tolist()
                                 for i in range(n_samples)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_matches_reference(dtype, H):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for name, se in {**CASES, "gpu_grpo": _gpu_forest(8, 700, 300, 0)}.items():
        check_against_reference(tree_attention_triton, se, N=8, K=2, H=H, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_bidirectional_blocks(dtype):
    """Gemma 3's image blocks (key_end) compiled for the GPU (64-wide tiles): every block case, whole tree, suffix
    queries and a window smaller than a block, against the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for case in sorted(BLOCK_CASES):
        _check_key_end(*BLOCK_CASES[case], N=8, K=2, H=128, dtype=dtype, device="cuda")
    _check_key_end(*BLOCK_CASES["chains_full_tiles"], N=8, K=2, H=64, dtype=dtype, q_start=37, device="cuda")
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], N=8, K=2, H=64, dtype=dtype, window=3, with_sinks=True,
                   device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras,H", [({"softcap": 2.0}, 256), ({"chunk": 64}, 128),
                                      ({"chunk": 100, "window": 40}, 128)])
def test_gpu_soft_caps_and_chunks(dtype, extras, H):
    """Gemma 2's soft-capped scores (its heads of 256, queries scaled so the cap bends) and Llama 4's chunks (with a
    window ANDed) compiled for the GPU, against the reference by the FlashAttention tolerance rule."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for se in (CASES["grpo"], _gpu_forest(8, 700, 300, 0)):
        check_against_reference(tree_attention_triton, se, N=8, K=2, H=H, dtype=dtype, device="cuda", extras=extras,
                                q_scale=3.0 if "softcap" in extras else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_heads_of_512(dtype):
    """Gemma 4's global heads of 512 compiled for the GPU (32 x 32 tiles), whole trees and suffix queries."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for se in (CASES["grpo"], _gpu_forest(4, 300, 200, 0)):
        check_against_reference(tree_attention_triton, se, N=4, K=1, H=512, dtype=dtype, device="cuda")
    check_suffix_queries(tree_attention_triton, CASES["random_trie"], N=4, K=1, H=512, device="cuda", atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_suffix_queries(H):
    """Suffix queries compiled for the GPU (64-wide tiles, ieee fp32 dots) against rows of the full reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for se in (CASES["grpo"], _gpu_forest(8, 700, 300, 0)):
        check_suffix_queries(tree_attention_triton, se, N=8, K=2, H=H, device="cuda", atol=1e-4)


SM90_CASES = [("bf16", "128", None, False, False, 0, 0), ("fp32", "64", None, False, False, 0, 0),
              ("bf16", "192x128", None, False, False, 0, 0), ("bf16", "64", 128, False, False, 0, 0),
              ("bf16", "128", None, True, False, 0, 0), ("bf16", "512", None, False, False, 0, 0),
              ("bf16", "128", None, False, True, 0, 0), ("bf16", "256", None, False, False, 50.0, 0),
              ("bf16", "128", None, False, False, 0, 8192)]


def _sm90_argv(dtype, head_dim, window, key_end, split, softcap, chunk) -> list[str]:
    return ["--dtypes", dtype, "--head-dims", head_dim, "--resources",
            *(["--sinks-window", str(window)] if window else []), *(["--key-end"] if key_end else []),
            *(["--dkdv-split"] if split else []), *(["--softcap", str(softcap)] if softcap else []),
            *(["--chunk", str(chunk)] if chunk else [])]


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    """{run name: its output lines}: every sm_90 compilation of this file (the parametrized cases, the pipelining
    stages, the split heads) in one triton_aot.py process, as a GPU-less machine compiles them (without
    TRITON_INTERPRET); a run that failed has its error and traceback as its lines."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    runs = {f"case{i}": {"argv": _sm90_argv(*case)} for i, case in enumerate(SM90_CASES)}
    # test_kernel_loads_are_pipelined: heads of 128's default tiles with one pipeline stage less (case 0: as they are)
    fewer = ",".join(f"{k}={m}x{n}x{w}x{s - 1}" for k, (m, n, w, s) in _sm90_tiles_128().items())
    runs["fewer_stages"] = {"argv": ["--dtypes", "bf16", "--head-dims", "128"], "env": {triton_kernel.TILES_ENV: fewer}}
    # test_split_head_kernels_compile_for_sm90_and_need_less: 192-channel heads split (case 2: padded, the default)
    runs["split"] = {"argv": ["--dtypes", "bf16", "--head-dims", "192x128"], "env": {triton_kernel.SPLIT_HEAD_ENV: "1"}}
    batch = tmp_path_factory.mktemp("sm90") / "runs.json"
    batch.write_text(json.dumps(runs))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", triton_kernel.TILES_ENV, triton_kernel.SPLIT_HEAD_ENV,
                        triton_kernel.DKDV_SPLIT_ENV)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_aot.py")), "--batch", str(batch)],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {name: [] for name in runs}
    for line in proc.stdout.splitlines():
        name, _, rest = line.partition(" ")
        out[name].append(rest)
    return out


def _sm90_tiles_128() -> dict[str, tuple[int, int, int, int]]:
    """The default GPU tiles (BLOCK_M, BLOCK_N, warps, stages) of bf16 heads of 128, by kernel (as the sm90 fixture
    compiles them: without FORGE_TREE_ATTN_TRITON_TILES)."""
    return triton_kernel._default_tiles(128, tl.bfloat16)


def _compiled(sm90, name) -> list[str]:
    """A run's lines, or its error as a failure."""
    lines = sm90[name]
    assert lines and lines[0] != "! ERROR", "\n".join(lines)
    return lines


@pytest.mark.parametrize("case", range(len(SM90_CASES)),
                         ids=["-".join(str(x) for x in case) for case in SM90_CASES])
def test_kernels_compile_for_sm90_without_gpu(sm90, case):
    """The GPU code path (native low-precision tl.dot, ieee fp32 dots) lowers to a cubin: TTIR -> PTX -> ptxas;
    with key_end: the bidirectional blocks' variants (HAS_KEY_END, full tiles included: no window); with split, dK/dV
    per query head (fp32 atomics, FORGE_TREE_ATTN_DKDV_SPLIT); with softcap: Gemma 2's soft-capped scores (its heads
    of 256; its sliding layers' dQ kernel, a window on heads of 256, spills 32-48 bytes, as it does uncapped); with
    chunk: Llama 4's chunked attention (heads of 128, chunks of 8192). Each kernel's
    shared memory fits an H100 / H200 SM (227 KiB a block): Gemma 4's heads of 512 need their 32 x 32 tiles for
    that, 64 x 64 ones would take over 260 KiB in the backward; bf16 kernels spill no registers."""
    import re

    dtype, head_dim = SM90_CASES[case][:2]
    lines = _compiled(sm90, f"case{case}")
    names = {line.split()[2] for line in lines}
    assert names == {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"}
    shared = [int(re.search(r"shared=(\d+)", line).group(1)) for line in lines]
    assert max(shared) <= 227 * 1024, lines
    stacks = [re.search(r" regs=\d+ stack=(\d+)$", line) for line in lines]
    assert all(stacks), lines
    if dtype == "bf16":  # untimed default tiles were chosen so that ptxas spills no registers; heads of 128 take the
        # fastest measured on an H200, whose small spills (to L1-cached local memory) did not slow them
        allowed = 256 if head_dim == "128" else 0
        assert all(int(m.group(1)) <= allowed for m in stacks), lines


def test_kernel_loads_are_pipelined(sm90):
    """The loads inside each kernel's loops are software-pipelined (cp.async into multi-buffered shared memory): its
    shared memory grows with the pipeline stages. A data-dependent branch around the loads inside the loop (as the
    kernels once tested each tile for emptiness) stops that, and then the stages change nothing."""
    import re

    shared = {run: {line.split()[2]: int(re.search(r"shared=(\d+)", line).group(1)) for line in _compiled(sm90, run)}
              for run in ("case0", "fewer_stages")}
    assert SM90_CASES[0][:2] == ("bf16", "128") and not any(SM90_CASES[0][2:])  # case 0: the default tiles
    # one more stage: one more buffer of each tile loaded in the loop (bf16, 128-wide heads): K and V of BLOCK_N rows
    # in the forward and dQ, Q and dO of BLOCK_M rows in dK / dV
    tiles = _sm90_tiles_128()
    assert min(stages for _, _, _, stages in tiles.values()) >= 2
    for kernel, rows in (("_fwd_kernel", tiles["fwd"][1]), ("_bwd_dq_kernel", tiles["dq"][1]),
                         ("_bwd_dkdv_kernel", tiles["dkdv"][0])):
        assert shared["case0"][kernel] - shared["fewer_stages"][kernel] >= 2 * rows * 128 * 2, (kernel, shared)


def test_forests_as_deep_as_a_long_prompt():
    """tree_cases builds sub_end without recursion: a GRPO group whose 1,500-token prompt is a chain that deep (the
    GPU tests' forests overflowed Python's recursion limit on the first H200 runs)."""
    se = _gpu_forest(2, 1500, 5, 0).tolist()
    assert len(se) == 1500 + 2 * 6 and se[:1500] == [1512] * 1500
    assert se[1500:1506] == [1506] * 6 and se[1506:] == [1512] * 6  # each completion's chain ends with its sample


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_error_budget_catches_a_slightly_wrong_kernel(dtype, rel):
    """The tolerance rule is not vacuous: attention with its softmax scale off by ``rel`` fails it."""
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    def wrong(q, k, v, sub_end, softmax_scale=None):
        return tree_attention_reference(q, k, v, sub_end, softmax_scale=q.shape[-1] ** -0.5 * (1 + rel))

    check_against_reference(tree_attention_reference, CASES["grpo"], N=2, K=1, H=16, dtype=dtype)
    with pytest.raises(AssertionError, match="exceeds"):
        check_against_reference(wrong, CASES["grpo"], N=2, K=1, H=16, dtype=dtype)


def test_dkdv_split_over_query_heads(monkeypatch):
    """FORGE_TREE_ATTN_DKDV_SPLIT=1: dK / dV from one program per query head, the group's heads added into fp32 with
    atomics: the same gradients (GQA groups of 2 and 4; whole tree, suffix queries, bidirectional blocks with a
    window and sinks); without GQA it is the plain kernel. Bad values of the variable are refused."""
    monkeypatch.setenv(triton_kernel.DKDV_SPLIT_ENV, "1")
    assert triton_kernel.dkdv_split()
    check_against_reference(tree_attention_triton, CASES["grpo"], N=4, K=2, H=16, dtype=torch.float32)
    check_against_reference(tree_attention_triton, CASES["many_roots"], N=4, K=1, H=16, dtype=torch.float32, seed=2)
    check_suffix_queries(tree_attention_triton, CASES["random_trie"], N=4, K=2, H=16, seed=3)
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], N=4, K=2, H=16, window=3, with_sinks=True)
    monkeypatch.setenv(triton_kernel.DKDV_SPLIT_ENV, "yes")
    with pytest.raises(ValueError, match="FORGE_TREE_ATTN_DKDV_SPLIT must be 0 or 1"):
        triton_kernel.dkdv_split()
    monkeypatch.delenv(triton_kernel.DKDV_SPLIT_ENV)
    assert not triton_kernel.dkdv_split()


def test_grid_caps_blocks_at_cuda_limit():
    assert triton_kernel._grid(16, 65535) == (16, 65535)
    with pytest.raises(ValueError, match="exceed the CUDA grid's 65535"):
        triton_kernel._grid(16, 65536)


def test_split_heads_match_the_reference(monkeypatch):
    """FORGE_TREE_ATTN_SPLIT_HEAD=1: heads whose size is not a power of two run as two tiles (48 = 32 + 16, 96 =
    64 + 32, multi-latent attention's 192 = 128 + 64 with values of 128) instead of one padded tile: the same
    outputs and gradients, whole trees, suffix queries, bidirectional blocks with a window and sinks, and with
    dK/dV split over query heads too. Powers of two stay whole; bad values of the variable are refused."""
    monkeypatch.setenv(triton_kernel.SPLIT_HEAD_ENV, "1")
    assert triton_kernel.head_blocks(192) == dict(BLOCK_H=128, BLOCK_H2=64, SPLIT_H=True)
    assert triton_kernel.head_blocks(80) == dict(BLOCK_H=64, BLOCK_H2=16, SPLIT_H=True)
    assert triton_kernel.head_blocks(128) == dict(BLOCK_H=128, BLOCK_H2=16, SPLIT_H=False)
    assert triton_kernel.head_blocks(192, split=False)["BLOCK_H"] == 256
    check_against_reference(tree_attention_triton, CASES["grpo"], N=4, K=2, H=48, dtype=torch.float32)
    check_against_reference(tree_attention_triton, CASES["random_trie"], N=2, K=2, H=96, dtype=torch.float32, seed=1)
    check_against_reference(tree_attention_triton, CASES["many_roots"], N=2, K=2, H=192, dtype=torch.float32, seed=2,
                            Hv=128)
    check_suffix_queries(tree_attention_triton, CASES["random_trie"], N=4, K=2, H=48, seed=3)
    _check_key_end(*BLOCK_CASES["prefix_and_leaves"], N=4, K=2, H=48, window=3, with_sinks=True)
    monkeypatch.setenv(triton_kernel.DKDV_SPLIT_ENV, "1")
    check_against_reference(tree_attention_triton, CASES["grpo"], N=4, K=2, H=48, dtype=torch.float32, seed=4)
    monkeypatch.setenv(triton_kernel.SPLIT_HEAD_ENV, "2")
    with pytest.raises(ValueError, match="FORGE_TREE_ATTN_SPLIT_HEAD must be 0 or 1"):
        triton_kernel.head_split()


def test_split_head_kernels_compile_for_sm90_and_need_less(sm90):
    """Multi-latent attention's 192-channel heads split 128 + 64 compile for sm_90 (bf16, as the JIT specialises)
    and need less shared memory than the same kernels padded to 256 channels, each of the three."""
    import re

    assert SM90_CASES[2][:2] == ("bf16", "192x128") and not any(SM90_CASES[2][2:])  # case 2: padded to 256
    shared = {run: {line.split()[2]: int(re.search(r"shared=(\d+)", line).group(1)) for line in _compiled(sm90, run)}
              for run in ("case2", "split")}
    assert set(shared["split"]) == {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"}
    assert all(shared["split"][k] < shared["case2"][k] for k in shared["split"]), shared
