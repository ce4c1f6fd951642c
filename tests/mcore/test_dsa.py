"""DeepSeek sparse attention's pieces (mcore/dsa.py) against plain PyTorch references.

The whole layer is compared with transformers (tests/convert/test_convert.py: logits and gradients of DeepSeek-V3.2
and GLM-5 layouts) and trees with samples alone (tests/mcore/test_tree_exact.py); here the masked-rows attention and
its hand-written backward, the top-k rule, and the configuration errors.
"""

import pytest
import torch

from forge_megatron.mcore import dsa


def _reference(q, k, v, index, valid, scale):
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    allowed[torch.arange(q.shape[0])[:, None].expand_as(index)[valid], index[valid]] = True
    s = torch.einsum("rnh,tnh->nrt", q, k) * scale
    p = s.masked_fill(~allowed[None], float("-inf")).softmax(-1)
    return torch.einsum("nrt,tnh->rnh", p, v)


@pytest.mark.parametrize("chunk_elements", [dsa.CHUNK_ELEMENTS, 1])
def test_selected_attention_and_its_backward_equal_autograd(monkeypatch, chunk_elements):
    """Forward and every gradient of the gathered-keys attention (probabilities recomputed from the saved log-sum-exp,
    key and value gradients scattered back, a key chosen by several rows accumulating) equal autograd through a dense
    masked softmax, in one chunk and in one row per chunk; invalid slots ignored; value heads narrower than query/key
    heads as in multi-latent attention."""
    monkeypatch.setattr(dsa, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    R, T, N, H, Hv, K = 7, 11, 3, 8, 5, 4
    q = torch.randn(R, N, H, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, N, H, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, N, Hv, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(R)])
    valid = torch.rand(R, K, generator=g) < 0.7
    valid[:, 0] = True  # every row has a key
    do = torch.randn(R, N, Hv, generator=g, dtype=torch.float64)

    out = dsa.selected_attention(q, k, v, index, valid, 0.3)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = _reference(q, k, v, index, valid, 0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    # fp32 inside the function: agreement to fp32 rounding
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert out.dtype == v.dtype and grads[1].dtype == k.dtype
    assert (grads[1] != 0).any(dim=(1, 2)).sum() > K  # keys chosen by different rows all got gradient


def test_topk_chooses_among_visible_keys_and_breaks_ties_toward_earlier_ones():
    scores = torch.tensor([[5.0, 1.0, 1.0, 1.0, 9.0, 1.0]])
    visible = torch.tensor([[True, True, True, True, False, True]])  # key 4 (the best score) is not visible
    index, valid = dsa.select_topk(scores, visible, 3)
    assert index.tolist() == [[0, 1, 2]] and valid.all()  # 5, then the first two of the tied 1s
    # fewer visible keys than topk: all of them, the other slots invalid
    index, valid = dsa.select_topk(scores, visible, 6)
    assert sorted(index[valid].tolist()) == [0, 1, 2, 3, 5] and valid.sum() == 5


def test_indexer_rope_layouts_keep_dot_products_of_the_rotated_pair():
    """Both RoPE layouts rotate q and k by the same angles: a query and key at one position keep their dot product,
    and at different positions it depends only on the distance (the indexer's scores are relative)."""
    g = torch.Generator().manual_seed(1)
    for interleaved in (False, True):
        idx = dsa.DSAIndexer(16, 8, heads=2, head_dim=12, rope_dim=8, inv_freq=torch.rand(4, generator=g),
                             interleaved=interleaved)
        q, k = torch.randn(1, 12, generator=g), torch.randn(1, 12, generator=g)

        def dot(pq, pk):
            return (idx._rope(q, torch.tensor([pq])) * idx._rope(k, torch.tensor([pk]))).sum()

        assert torch.allclose(dot(3, 3), (q * k).sum(), atol=1e-5)
        assert torch.allclose(dot(7, 2), dot(15, 10), atol=1e-5)
        assert not torch.allclose(dot(7, 2), dot(7, 3), atol=1e-3)
    assert not any(p.requires_grad for p in idx.parameters())  # frozen


def test_gpt_config_refuses_what_sparse_attention_cannot_be():
    from forge_megatron.mcore.model import GPTConfig

    mla = dict(num_attention_heads=4, num_query_groups=4, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
               v_head_dim=8)
    with pytest.raises(ValueError, match="query latent"):
        GPTConfig(**mla, dsa_index_heads=2)  # no q_lora_rank
    with pytest.raises(ValueError, match="rotated channels"):
        GPTConfig(**mla, q_lora_rank=16, dsa_index_heads=2, dsa_index_head_dim=2)
    with pytest.raises(ValueError, match="the first layer with its own indexer"):
        GPTConfig(**mla, q_lora_rank=16, dsa_index_heads=2, dsa_index_head_dim=8, dsa_shared_layers=(True, False))
    with pytest.raises(ValueError, match="without DeepSeek sparse attention"):
        GPTConfig(dsa_shared_layers=(False, True))
    cfg = GPTConfig(**mla, q_lora_rank=16, dsa_index_heads=2, dsa_index_head_dim=8, dsa_shared_layers=[0, 1])
    assert cfg.sparse_attention and cfg.dsa_shared_layers == (False, True)


def test_bridge_reads_indexer_types_as_transformers_derives_them():
    import transformers

    from forge_megatron.bridge.families import UnsupportedModelError, indexer_types

    for fields in ({"num_hidden_layers": 3}, {"num_hidden_layers": 4, "index_topk_pattern": "FSSF"},
                   {"num_hidden_layers": 5, "index_topk_freq": 2},
                   {"num_hidden_layers": 6, "index_topk_freq": 3, "index_skip_topk_offset": 1}):
        expected = transformers.GlmMoeDsaConfig(**fields).indexer_types
        assert indexer_types(fields) == expected, fields
        assert "shared" in expected or fields["num_hidden_layers"] == 3
    with pytest.raises(UnsupportedModelError, match="the first full"):
        indexer_types({"num_hidden_layers": 2, "indexer_types": ["shared", "full"]})


@pytest.mark.parametrize("chunk", [100, 1])
def test_indexer_loss_and_its_recomputed_backward_equal_autograd(chunk):
    """The indexer loss (mean over rows of KL(target || softmax of the indexer's scores at the selected keys)) and
    the parameter gradients its backward pass recomputes chunk by chunk equal autograd through an independent
    reference: the indexer's full score rows gathered at the selected keys, KL written out."""
    g = torch.Generator().manual_seed(2)
    T, D, L, K = 9, 16, 8, 4
    idx = dsa.DSAIndexer(D, L, heads=3, head_dim=8, rope_dim=4, inv_freq=torch.rand(2, generator=g),
                         interleaved=True, trainable=True)
    with torch.no_grad():
        for p in idx.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x, qr, positions = torch.randn(T, D, generator=g), torch.randn(T, L, generator=g), torch.arange(T)
    rows = torch.tensor([4, 5, 7, 8])
    index = torch.stack([torch.randperm(int(r) + 1, generator=g)[:K] for r in rows])
    valid = torch.ones(len(rows), K, dtype=torch.bool)
    valid[0, 3] = False
    target = torch.rand(len(rows), K, generator=g) * valid
    target = target / target.sum(-1, keepdim=True)
    params = list(idx.parameters())

    loss = dsa._IndexerKL.apply(idx, x, qr, positions, rows, index, valid, target, chunk, *params)
    grads = torch.autograd.grad(loss, params)
    scores = idx.scores(x[rows], qr[rows], positions[rows], idx.keys(x, positions)).gather(1, index)
    q = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
    ref = (target * (torch.log(target.clamp_min(1e-30)) - torch.log(q.clamp_min(1e-30)))).sum() / len(rows)
    ref_grads = torch.autograd.grad(ref, params)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5) and loss.item() > 0
    for (name, _), a, b in zip(idx.named_parameters(), grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (name, (a - b).abs().max())
        assert b.abs().sum() > 0, name  # every parameter (the keys' too) gets a gradient


def test_benchmark_prints_one_json_line():
    """benchmarks/dsa.py runs on CPU at small sizes: DSA's output equals a dense softmax over the selected keys, and
    the share of sparse rows is what topk implies."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "dsa.py"
    proc = subprocess.run([sys.executable, str(script), "--tokens", "96", "--topk", "32", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["max_abs_diff"] < 1e-5 and out["sparse_rows"] == pytest.approx(64 / 96)
    assert out["dense_ms"] > 0 and out["dsa_ms"] > 0 and out["indexer_ms"] > 0
