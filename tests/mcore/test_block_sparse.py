"""MiniMax-M3's block-sparse attention (mcore/block_sparse.py) in isolation: the benchmark's independent masked
reference, the chunked path against the unchunked one with gradients, and the configuration it refuses. Its
equality with transformers is tests/convert/test_convert.py's, its tree exactness tests/mcore/test_tree_exact.py's,
its parallel layouts tests/training/test_trainer_moe.py's."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from forge_megatron.mcore import block_sparse
from forge_megatron.mcore.model import GPTConfig


def _module(block=2, topk=3, local=1, heads=2, head_dim=8, index_dim=8, hidden=16):
    config = types.SimpleNamespace(attention_dropout=0.0, softmax_scale=None, kv_channels=head_dim, hidden_size=hidden,
                                   num_attention_heads=2 * heads,
                                   num_query_groups=heads, tensor_model_parallel_size=1, sequence_parallel=False,
                                   params_dtype=torch.float32)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 4, 2).float() / 4))
    torch.manual_seed(0)
    module = block_sparse.BlockSparseAttention(config, layer_number=1, index_heads=heads, index_head_dim=index_dim,
                                               block_size=block, topk_blocks=topk, local_blocks=local,
                                               inv_freq=inv_freq)
    with torch.no_grad():
        for p in module.indexer.parameters():
            p.normal_(0.0, 0.5)
    return module


def test_benchmark_prints_one_json_line():
    """benchmarks/block_sparse.py runs on CPU at small sizes: both ways of attending (masked, gathered) equal a dense
    softmax masked to the kept blocks (built there from the indexer's scores without chunks or trees), and the share
    of queries that drop blocks is what topk x block implies."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "block_sparse.py"
    proc = subprocess.run([sys.executable, str(script), "--tokens", "96", "--block", "4", "--topk", "4",
                           "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["max_abs_diff"] < 1e-5 and out["sparse_rows"] == pytest.approx(80 / 96)
    assert out["dense_ms"] > 0 and out["masked_ms"] > 0 and out["gathered_ms"] > 0 and out["indexer_ms"] > 0


def test_chunks_and_a_forest_give_the_same_output_and_gradients(monkeypatch):
    """Two samples packed as a forest (the second sharing the first's 5-token prefix): the masked attention in one
    chunk, in one query per chunk, and the kept blocks' keys gathered (by each query's path of ancestors) in one
    chunk and per query all give the same outputs and gradients of q, k and v; and the blocks matter: keeping every
    block changes the output."""
    module = _module()
    T, N, H = 30, 4, 8
    # sample A: positions 0..19; sample B: A's first 5 tokens then 10 of its own (positions 5..14)
    positions = torch.cat([torch.arange(20), torch.arange(5, 15)])
    sub_end = torch.cat([torch.full((5,), 30), torch.full((15,), 20), torch.full((10,), 30)]).int()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, n, H, generator=gen) for n in (N, 2, 2))
    x = torch.randn(T, 16, generator=gen)
    do = torch.randn(T, N, H, generator=gen)

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = module._attend(*leaves, x, sub_end, positions, None)
        torch.autograd.backward(out, do)
        return out.detach(), [t.grad for t in leaves]

    monkeypatch.setattr(block_sparse, "GATHER_KEYS", False)  # every key before the chunk, masked
    whole, whole_grads = run()
    for chunk, gather in ((1, False), (1 << 25, True), (1, True)):  # kept blocks' keys gathered by depth
        monkeypatch.setattr(block_sparse, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(block_sparse, "GATHER_KEYS", gather)
        other, other_grads = run()
        assert torch.allclose(whole, other, atol=1e-6), (chunk, gather)
        for a, b in zip(whole_grads, other_grads):
            assert torch.allclose(a, b, atol=1e-6), (chunk, gather)
    monkeypatch.setattr(module, "topk_blocks", 100)  # every block kept: dense tree attention
    dense, _ = run()
    assert (dense - whole).abs().max() > 1e-3


def test_the_layer_input_is_required():
    module = _module()
    q = torch.randn(6, 1, 4, 8)
    with pytest.raises(ValueError, match="needs the layer's input.*recompute whole layers"):
        module(q, torch.randn(6, 1, 2, 8), torch.randn(6, 1, 2, 8))


@pytest.mark.parametrize("change,message", [
    ({"block_index_heads": 4}, "block_index_heads \\(4\\) must equal num_query_groups \\(2\\)"),
    ({"block_local": 3}, "block_local \\(3\\) in \\[0, block_topk\\]"),
    ({"block_index_head_dim": 4}, "hold the 8 rotated channels"),
    ({"block_sparse_layers": (True,)}, "one entry per layer \\(2\\)"),
])
def test_config_refuses_what_the_layers_cannot_compute(change, message):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=100, kv_channels=16, rotary_percent=0.5, block_sparse_layers=(False, True),
                block_index_heads=2, block_index_head_dim=16, block_size=2, block_topk=2, block_local=1)
    GPTConfig(**base)
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**base, **change})
