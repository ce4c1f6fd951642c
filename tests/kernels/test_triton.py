"""Triton tree attention vs the dense reference, forward and backward (CPU: TRITON_INTERPRET=1, set in conftest).

GPUs needed: 0 for the unmarked tests (interpreter), 1 for the `gpu` ones.
"""

import pytest
import torch
from tree_cases import (
    check_against_reference,
    check_sinks_and_window,
    check_suffix_queries,
    forest_cases,
    random_qkv,
    sub_end_from_samples,
)

from forge_megatron.kernels.tree_attention import triton_kernel
from forge_megatron.kernels.tree_attention.triton_kernel import key_block_bounds, tree_attention_triton

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


@pytest.mark.parametrize("case,window,with_sinks", [("random_trie", 3, True), ("grpo", 5, False),
                                                    ("many_roots", None, True), ("long_chain", 40, True)])
def test_sinks_and_sliding_window(case, window, with_sinks):
    """gpt-oss attention (sinks start the online softmax, windows mask by depth) against the reference, the sinks'
    gradient included, and the reference against the one-query-at-a-time oracle."""
    check_sinks_and_window(tree_attention_triton, CASES[case], N=4, K=2, H=16, window=window, with_sinks=with_sinks)


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
    import triton.language as tl

    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_H=32, BLOCK_HV=32, COMPUTE=tl.float32, DOT_PRECISION="ieee")
    monkeypatch.setattr(triton_kernel, "_launch_config", lambda q, T, v_head_dim=None: cfg)
    check_against_reference(tree_attention_triton, CASES["many_roots"], N=4, K=2, H=32, dtype=torch.float32)


@pytest.mark.parametrize("case", ["long_chain", "grpo", "many_roots", "random_trie"])
def test_suffix_queries(case):
    """q holds only the last tokens of the keys' tree (CP all-gather mode): query tiles start at an unaligned
    position, the dK/dV loop starts at the first query block that can see each key block."""
    check_suffix_queries(tree_attention_triton, CASES[case], N=4, K=2, H=16)


@pytest.mark.parametrize("block_m,block_n", [(32, 64), (64, 32)])
def test_suffix_queries_unequal_blocks(monkeypatch, block_m, block_n):
    import triton.language as tl

    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_H=16, BLOCK_HV=16, COMPUTE=tl.float32, DOT_PRECISION="ieee")
    monkeypatch.setattr(triton_kernel, "_launch_config", lambda q, T, v_head_dim=None: cfg)
    check_suffix_queries(tree_attention_triton, CASES["grpo"], N=2, K=1, H=16, seed=4)


def test_softmax_scale():
    check_against_reference(tree_attention_triton, CASES["many_roots"], N=2, K=1, H=16, dtype=torch.float32,
                            scale=0.05)


def test_block_bounds_match_torch():
    sub_end = CASES["many_roots"]
    kmin, kmax = key_block_bounds(sub_end, 32)
    padded = torch.nn.functional.pad(sub_end, (0, -sub_end.shape[0] % 32), value=-1).view(-1, 32)
    assert torch.equal(kmax, padded.amax(1).int())
    assert torch.equal(kmin, torch.where(padded < 0, torch.iinfo(torch.int32).max, padded).amin(1).int())


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


def test_torch_compile_traces_fwd_and_bwd():
    sub_end = CASES["grpo"]
    q, k, v = (x.requires_grad_() for x in random_qkv(sub_end.shape[0], 2, 1, 16, torch.float32))
    from torch._dynamo.utils import counters

    # the real torch.compile, with TorchDynamo on (a CPU process that applied forge's Megatron patches defers
    # torch.compile and turns TorchDynamo off: that would run this eagerly and prove nothing)
    compile_ = getattr(torch.compile, "_forge_original", torch.compile)
    traced = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = compile_(tree_attention_triton, backend="aot_eager", fullgraph=True)
        o = compiled(q, k, v, sub_end)
        o.sum().backward()
    assert counters["stats"]["unique_graphs"] > traced  # TorchDynamo traced it (fullgraph: in one graph)
    o_eager = tree_attention_triton(q, k, v, sub_end)
    assert torch.allclose(o, o_eager)
    assert q.grad is not None and k.grad.abs().sum() > 0


def test_opcheck_fake_and_autograd_registration():
    sub_end = sub_end_from_samples([[1, 2, 3], [1, 2, 4, 5], [6]])
    q, k, v = (x.requires_grad_() for x in random_qkv(sub_end.shape[0], 2, 1, 16, torch.float32))
    torch.library.opcheck(triton_kernel.tree_attention_triton_op, (q, k, v, sub_end, 0.25),
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
    q = torch.zeros(3, 1, 512)
    with pytest.raises(ValueError, match="head_dim 512 is not supported by the Triton tree attention kernel"):
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
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_suffix_queries(H):
    """Suffix queries compiled for the GPU (64-wide tiles, ieee fp32 dots) against rows of the full reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for se in (CASES["grpo"], _gpu_forest(8, 700, 300, 0)):
        check_suffix_queries(tree_attention_triton, se, N=8, K=2, H=H, device="cuda", atol=1e-4)


@pytest.mark.parametrize("dtype,head_dim,window", [("bf16", "128", None), ("fp32", "64", None),
                                                   ("bf16", "192x128", None), ("bf16", "64", 128)])
def test_kernels_compile_for_sm90_without_gpu(dtype, head_dim, window):
    """The GPU code path (native low-precision tl.dot, ieee fp32 dots) lowers to a cubin: TTIR -> PTX -> ptxas."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("triton_aot.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    extra = ["--sinks-window", str(window)] if window else []
    proc = subprocess.run([sys.executable, str(script), "--dtypes", dtype, "--head-dims", head_dim, *extra],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {line.split()[2] for line in proc.stdout.splitlines()}
    assert names == {"_key_block_bounds_kernel", "_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"}
