"""benchmarks/tree_attention.py runs on CPU (tiny sizes, segment/reference vs per-sample SDPA) and prints one JSON line.

GPUs needed: 0.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tree_attention.py"


@pytest.mark.parametrize("workload,extra", [("grpo", []), ("agentic", []), ("grpo", ["--v-head-dim", "16"])])
def test_benchmark_prints_one_json_line(workload, extra):
    """Both workloads, and value heads narrower than the query/key heads (multi-latent attention's shape)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--workload", workload, "--repeat", "1",
                           *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out["backends"]) >= {"segment", "reference", "sdpa_per_sample"}
    assert out["backends"]["reference"]["max_abs_diff_vs_segment"] < 1e-5
    # Merging shares prefixes: the tree attends strictly fewer pairs than the unmerged samples.
    assert out["tree_pairs"] < out["per_sample_pairs"] and out["tree_tokens"] < out["per_sample_tokens"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0 for r in out["backends"].values())
    blocks = -(-out["tree_tokens"] // 64)
    assert sum(out["tiles_64"].values()) == blocks * (blocks + 1) // 2  # every causal tile classified once
    assert out["HV"] == (16 if extra else out["H"])


def test_attended_pair_flops_count_value_heads_apart():
    """2 (H + HV) flops per pair and head forward, 2 (4 H + 3 HV) forward and backward: 4 H and 14 H when equal."""
    bench = _load_benchmark()
    same, mla = bench._rates(10**6, 2, 128, 1.0, 1.0), bench._rates(10**6, 2, 192, 1.0, 1.0, HV=128)
    assert (same["fwd_tflops"], same["fwd_bwd_tflops"]) == (4 * 2 * 128 / 1e3, 14 * 2 * 128 / 1e3)
    assert (mla["fwd_tflops"], mla["fwd_bwd_tflops"]) == (2 * 2 * 320 / 1e3, 2 * 2 * (4 * 192 + 3 * 128) / 1e3)


def test_sweep_candidates_start_with_the_defaults():
    """Each head size's candidate tiles start with the kernels' defaults (the sweep's default_ms reads them), and
    every candidate is a valid FORGE_TREE_ATTN_TRITON_TILES value."""
    import triton.language as tl

    from forge_megatron.kernels.tree_attention import triton_kernel as tk

    bench = _load_benchmark()
    for widest in (16, 64, 128, 256, 512):
        defaults, candidates = tk._default_tiles(widest, tl.bfloat16), bench.sweep_candidates(widest)
        assert set(candidates) == set(tk.KERNELS)
        for kernel, tried in candidates.items():
            assert tried[0] == "x".join(map(str, defaults[kernel])), (widest, kernel)
            assert len(set(tried)) == len(tried)
            for tiles in tried:
                assert tk.tiles_from_env(f"{kernel}={tiles.removesuffix('+split')}")[kernel]


def test_tile_sweep_times_each_kernel_under_each_candidate(monkeypatch):
    """--sweep under the interpreter (tiny sizes; on a GPU it times compiled kernels): every candidate of every kernel
    gets a time or its error, the best per kernel makes the FORGE_TREE_ATTN_TRITON_TILES value, and the variable is
    left as it was."""
    from forge_megatron.kernels.tree_attention import triton_kernel

    bench = _load_benchmark()
    monkeypatch.setattr(bench, "sweep_candidates", lambda widest: {
        "fwd": ["32x32x4x1", "16x32x4x1"], "dq": ["32x16x4x1"], "dkdv": ["16x16x4x1", "16x16x4x1+split", "48x16x4x1"]})
    monkeypatch.setenv(triton_kernel.TILES_ENV, "fwd=16x16x4x1")
    monkeypatch.delenv(triton_kernel.DKDV_SPLIT_ENV, raising=False)
    out = bench.sweep(bench.parse_args(["--device", "cpu", "--sweep", "--repeat", "1", "--prompt", "20",
                                        "--completion", "10", "--samples", "2"]))
    assert set(out["ms"]["fwd"]) == {"32x32x4x1", "16x32x4x1"}
    assert set(out["ms"]["dkdv"]) == {"16x16x4x1", "16x16x4x1+split", "48x16x4x1"}
    assert all(isinstance(ms, float) and ms > 0 for kernel in ("fwd", "dq") for ms in out["ms"][kernel].values())
    assert isinstance(out["ms"]["dkdv"]["16x16x4x1+split"], float)  # the split variant ran
    assert "powers of two" in out["ms"]["dkdv"]["48x16x4x1"]  # a candidate that cannot run is reported, not fatal
    best = out["best"]["dkdv"]
    assert best in ("16x16x4x1", "16x16x4x1+split") and "dkdv=16x16x4x1" in out["best_env"]
    assert out["best_split"] == int(best.endswith("+split"))
    assert out["default_ms"]["fwd"] == out["ms"]["fwd"]["32x32x4x1"]
    assert os.environ[triton_kernel.TILES_ENV] == "fwd=16x16x4x1"
    assert triton_kernel.DKDV_SPLIT_ENV not in os.environ  # both variables left as they were


def _load_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tree_attention_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("api", ["is_causal", "window_size"])
def test_torch_varlen_baseline_adapts_to_the_torch_release(monkeypatch, api):
    """torch's varlen FlashAttention (CUDA only) changed its causal argument between releases and gained GQA later:
    the baseline's adapter is checked against stand-ins of both signatures that compute per-sample causal attention
    on CPU (and, for the older one, refuse fewer key/value heads than query heads, as it does)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import varlen

    def per_sample(q, k, v, cu):
        outs = []
        for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
            x = [t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)

    calls = []
    if api == "is_causal":
        def stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
            assert is_causal and key.shape[1] == query.shape[1] and torch.equal(cu_seq_q, cu_seq_k)
            calls.append(max_q)
            return per_sample(query, key, value, cu_seq_q)
    else:
        def stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
            assert window_size == (-1, 0) and enable_gqa
            calls.append(max_q)
            return per_sample(query, key, value, cu_seq_q)

    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    attend = _load_benchmark().torch_varlen_attention()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, n, 16, generator=g) for n in (4, 2, 2))
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    torch.testing.assert_close(attend(q, k, v, cu, 18), per_sample(q, k, v, cu))
    assert calls == [18]
