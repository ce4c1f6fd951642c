"""Segment tree attention == the dense reference, forward and backward, fp32 (CPU; one GPU case marked gpu).

Forests come from forge_megatron.tree.build_tree (see tests/tree/forests.py for the shapes); the comparison rule
is tree_cases.check_against_reference (errors against the fp64 reference on o, dq, dk, dv: at most twice the error
of the reference run in the inputs' dtype, + 1e-5 relative to the output's size; tree_cases.error_budget).
"""

import itertools
import random

import pytest
import torch
from tree_cases import check_against_reference, check_sinks_and_window, check_suffix_queries

from forge_megatron.kernels.tree_attention import segment
from forge_megatron.kernels.tree_attention.segment import Forest, tree_attention_segment
from forge_megatron.tree import build_tree
from tests.tree.forests import all_kinds, random_batch

KINDS = all_kinds()
KINDS["long_chain"] = [list(range(segment.QUERY_BLOCK + 90))]
KINDS["long_completions"] = [list(range(40)) + [100 + g] * (segment.QUERY_BLOCK + 3 * g) for g in range(3)]
KINDS["many_roots"] = [[r] + [r % 3] * (r % 7) for r in range(40)]


def sub_end_of(samples) -> torch.Tensor:
    return build_tree(samples).sub_end


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_matches_reference_on_forests(kind):
    check_against_reference(tree_attention_segment, sub_end_of(KINDS[kind]), N=4, K=2, H=16, dtype=torch.float32)


@pytest.mark.parametrize("N, K, H", [(4, 4, 16), (4, 1, 16), (6, 2, 64), (2, 1, 128)])
def test_gqa_and_head_dims(N, K, H):
    check_against_reference(tree_attention_segment, sub_end_of(KINDS["random"]), N, K, H, torch.float32, seed=N + H)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["grpo", "wide_fan", "agentic"])
def test_low_precision_tolerance_rule(kind, dtype):
    """16-bit inputs: error <= 2 x (error of the reference run in 16 bits) + 1e-5 (relative), on o, dq, dk, dv."""
    check_against_reference(tree_attention_segment, sub_end_of(KINDS[kind]), N=4, K=2, H=64, dtype=dtype)


def test_softmax_scale():
    sub_end = sub_end_of(KINDS["grpo"])
    check_against_reference(tree_attention_segment, sub_end, N=4, K=2, H=16, dtype=torch.float32, scale=0.37)


@pytest.mark.parametrize("kind", ["grpo", "agentic", "long_chain", "many_roots", "random"])
def test_suffix_queries(kind):
    """q holds only the last tokens of the keys' tree (context parallelism's all-gather mode): the chain holding
    the first query is cut there, earlier chains are keys only."""
    check_suffix_queries(tree_attention_segment, sub_end_of(KINDS[kind]), N=4, K=2, H=16)


@pytest.mark.parametrize("H,Hv", [(24, 16), (16, 24)])
def test_value_heads_of_another_size(monkeypatch, H, Hv):
    """Multi-latent attention's value heads (narrower, or wider, than query/key heads): whole forests, long chains
    in query blocks and suffix queries, forward and backward."""
    check_against_reference(tree_attention_segment, sub_end_of(KINDS["random"]), N=4, K=2, H=H, Hv=Hv,
                            dtype=torch.float32)
    check_suffix_queries(tree_attention_segment, sub_end_of(KINDS["agentic"]), N=2, K=1, H=H, Hv=Hv)
    monkeypatch.setattr(segment, "QUERY_BLOCK", 8)
    check_against_reference(tree_attention_segment, sub_end_of(KINDS["agentic"]), N=2, K=1, H=H, Hv=Hv,
                            dtype=torch.float32)


@pytest.mark.parametrize("window,with_sinks", [(3, True), (3, False), (None, True), (1, True), (1000, False)])
def test_sinks_and_sliding_window(monkeypatch, window, with_sinks):
    """gpt-oss attention: per-head sink logits in the softmax and a sliding window by depth (each sample's window),
    against the reference and the reference against a one-query-at-a-time oracle; long chains in query blocks too."""
    check_sinks_and_window(tree_attention_segment, sub_end_of(KINDS["random"]), N=4, K=2, H=16, window=window,
                           with_sinks=with_sinks)
    monkeypatch.setattr(segment, "QUERY_BLOCK", 4)
    check_sinks_and_window(tree_attention_segment, sub_end_of(KINDS["agentic"][:3]), N=2, K=1, H=8, Hv=12,
                           window=window, with_sinks=with_sinks)


@pytest.mark.parametrize("window,with_sinks", [(None, False), (3, True)])
def test_soft_capped_scores(monkeypatch, window, with_sinks):
    """Gemma 2's soft-capped scores (explicit softmax) against the reference and the oracle, forward and backward;
    long chains in query blocks too."""
    check_sinks_and_window(tree_attention_segment, sub_end_of(KINDS["random"]), N=4, K=2, H=16, window=window,
                           with_sinks=with_sinks, softcap=2.0)
    monkeypatch.setattr(segment, "QUERY_BLOCK", 4)
    check_sinks_and_window(tree_attention_segment, sub_end_of(KINDS["agentic"][:3]), N=2, K=1, H=8, window=window,
                           with_sinks=with_sinks, softcap=2.0)


@pytest.mark.parametrize("chunk,window", [(2, None), (5, 3)])
def test_chunked_attention(monkeypatch, chunk, window):
    """Llama 4's chunked attention against the reference and the oracle, forward and backward; long chains in query
    blocks too (chunk starts inside blocks)."""
    check_sinks_and_window(tree_attention_segment, sub_end_of(KINDS["random"]), N=4, K=2, H=16, window=window,
                           with_sinks=False, chunk=chunk)
    monkeypatch.setattr(segment, "QUERY_BLOCK", 4)
    check_sinks_and_window(tree_attention_segment, sub_end_of(KINDS["agentic"][:3]), N=2, K=1, H=8, window=window,
                           with_sinks=True, chunk=chunk)


def test_reference_suffix_queries():
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    check_suffix_queries(tree_attention_reference, sub_end_of(KINDS["agentic"]), N=4, K=1, H=16)


def test_suffix_queries_long_chain_blocks(monkeypatch):
    monkeypatch.setattr(segment, "QUERY_BLOCK", 3)
    check_suffix_queries(tree_attention_segment, sub_end_of(KINDS["agentic"]), N=2, K=1, H=16, seed=3)


def test_long_chain_blocks_on_random_forests(monkeypatch):
    """Tiny query blocks send most chains down the long-chain path (blocks over prefixes of gathered keys)."""
    monkeypatch.setattr(segment, "QUERY_BLOCK", 3)
    rng = random.Random(5)
    for seed in range(6):
        samples = random_batch(rng, rng.randint(2, 12), 25, rng.choice([2, 4]))
        check_against_reference(tree_attention_segment, sub_end_of(samples), 4, 2, 16, torch.float32, seed=seed)


def test_forest_metadata_matches_layout():
    layout = build_tree(KINDS["random"])
    forest = Forest(layout.sub_end)
    assert torch.equal(forest.depth_T, layout.position_ids)
    for start, end in zip(forest.start_C.tolist(), forest.end_C.tolist()):
        keys = forest.path_keys(start, end)
        assert keys[-(end - start):].tolist() == list(range(start, end))
        visible_from_last = torch.nonzero(
            (torch.arange(layout.unique_tokens) <= end - 1) & (layout.sub_end > end - 1)
        ).flatten()
        assert torch.equal(keys, visible_from_last), "a chain's keys are exactly what its last token sees"


def test_bad_sub_end():
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="i < sub_end\\[i\\] <= T = 4"):
        tree_attention_segment(q, q, q, torch.tensor([4, 1, 4, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="i < sub_end\\[i\\] <= T = 4"):
        tree_attention_segment(q, q, q, torch.tensor([5, 2, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"the subtree of token 2, \[2, 4\), is not nested in the subtree of its parent 0"):
        tree_attention_segment(q, q, q, torch.tensor([3, 2, 4, 4], dtype=torch.int32))  # [0, 3) and [2, 4) cross
    with pytest.raises(ValueError, match="sub_end must have shape \\[4\\]"):
        tree_attention_segment(q, q, q, torch.tensor([4, 4], dtype=torch.int32))


def test_forest_accepts_exactly_the_nested_layouts():
    """Every int array with i < sub_end[i] <= T, T <= 6: accepted iff no two subtrees partly overlap."""
    accepted = []
    for T in range(1, 7):
        for sub_end in itertools.product(*[range(i + 1, T + 1) for i in range(T)]):
            nested = not any(a < b < sub_end[a] < sub_end[b] for a in range(T) for b in range(T))
            try:
                Forest(torch.tensor(sub_end))
                ok = True
            except ValueError:
                ok = False
            assert ok == nested, sub_end
            accepted.append(ok)
    assert sum(accepted) == 1 + 2 + 5 + 14 + 42 + 132, "ordered forests of T nodes: Catalan numbers"


@pytest.mark.gpu
def test_matches_reference_on_gpu():
    for kind in ("grpo", "long_chain", "binary_trie"):
        for dtype in (torch.float32, torch.bfloat16):
            check_against_reference(tree_attention_segment, sub_end_of(KINDS[kind]), 4, 2, 64, dtype, "cuda")


# --- bidirectional blocks (key_end: Gemma 3's images) ------------------------------------------------------------

IMG = 1000  # the block tokens of these samples: a run of IMG + k tokens is one image (keys differ per image)


def _image_samples(rng: random.Random, n: int, long_image: int = 0) -> list[list[int]]:
    """Samples of text and images (runs of IMG-range tokens, each image's k-th token IMG + 50 * image + k, as the
    vision tree keys images), images shared between samples, in prompts and after branch points."""
    images = [[IMG + 50 * m + k for k in range(length)] for m, length in enumerate((1, 3, 6, 9, long_image or 4))]
    prompt = [1, 2] + images[3] + [3]
    out = []
    for s in range(n):
        sample = list(prompt)
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                sample += rng.choice(images)  # an image right after a shared image or a branch point
            sample += [rng.randrange(4, 7) for _ in range(rng.randint(1, 4))]
        out.append(sample)
    return out


def _blocks(samples):
    """The tree of the samples and its key_end: each maximal run of image tokens along a sample is one block."""
    from forge_megatron.kernels.tree_attention.ops import block_key_end

    layout = build_tree(samples)
    return layout, block_key_end(layout.tokens >= IMG, layout.sub_end)


def _sample_mask(sample) -> torch.Tensor:
    """transformers' Gemma 3 mask of one sample: causal OR (query and key in the same run of image tokens)."""
    is_image = torch.tensor(sample) >= IMG
    start = is_image & ~torch.cat([torch.tensor([False]), is_image[:-1]])
    group = torch.where(is_image, torch.cumsum(start.long(), 0), -1)
    L = len(sample)
    causal = torch.arange(L)[None, :] <= torch.arange(L)[:, None]
    return causal | ((group[:, None] == group[None, :]) & (group[:, None] >= 0))


@pytest.mark.parametrize("seed", range(4))
def test_blocks_on_the_tree_are_each_samples_own_mask(seed):
    """The reference's mask on a tree with bidirectional blocks, restricted to each sample's path, is the sample's
    own causal-or-image-block mask (what transformers' Gemma 3 gives one sample)."""
    from forge_megatron.kernels.tree_attention.reference import tree_mask

    samples = _image_samples(random.Random(seed), 6)
    layout, key_end = _blocks(samples)
    mask = tree_mask(layout.sub_end, window=None, key_end_T=key_end)
    offsets = [0] + list(itertools.accumulate(len(s) for s in samples))
    for s, sample in enumerate(samples):
        path = layout.sample_nodes[offsets[s]:offsets[s + 1]]
        own = _sample_mask(sample)
        assert torch.equal(mask[path][:, path], own), (s, sample)


@pytest.mark.parametrize("seed, window", [(0, 0), (1, 0), (2, 5), (3, 2)])
def test_bidirectional_blocks_match_reference(monkeypatch, seed, window):
    monkeypatch.setattr(segment, "QUERY_BLOCK", 8)  # long chains in query blocks, blocks across them
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    samples = _image_samples(random.Random(seed), 8, long_image=12)
    layout, key_end = _blocks(samples)
    assert int((key_end - torch.arange(key_end.numel())).max()) > 1  # blocks are there
    sub_end = layout.sub_end
    T = sub_end.numel()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, n, 16, generator=g) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=g) if window else None
    do = torch.randn(T, 4, 16, generator=g)
    outs = []
    for fn in (tree_attention_segment, tree_attention_reference):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([sinks.clone().requires_grad_()] if window else [])
        o = fn(*leaves[:3], sub_end, sinks=leaves[3] if window else None, window=window, key_end_T=key_end)
        outs.append((o, *torch.autograd.grad(o, leaves, do)))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), *outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)
    causal = tree_attention_reference(q, k, v, sub_end, window=window, sinks=sinks)
    assert (causal - outs[1][0]).abs().max() > 1e-3  # the blocks change the result


def test_bidirectional_blocks_with_suffix_queries():
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    samples = _image_samples(random.Random(5), 6)
    layout, key_end = _blocks(samples)
    sub_end = layout.sub_end
    T = sub_end.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, n, 8, generator=g) for n in (2, 1, 1))
    for start in (1, T // 3, T // 2, T - 1):
        got = tree_attention_segment(q[start:], k, v, sub_end, key_end_T=key_end)
        want = tree_attention_reference(q, k, v, sub_end, key_end_T=key_end)[start:]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_bad_key_end_is_refused():
    samples = [[1, 2, IMG, IMG + 1, 3], [1, 2, IMG, IMG + 1, 4], [1, 5]]
    layout, key_end = _blocks(samples)
    T = key_end.numel()
    q = k = v = torch.randn(T, 1, 8)
    tree_attention_segment(q, k, v, layout.sub_end, key_end_T=key_end)
    with pytest.raises(ValueError, match="int32"):
        tree_attention_segment(q, k, v, layout.sub_end, key_end_T=key_end.long())
    spanning = torch.arange(1, T + 1, dtype=torch.int32)
    spanning[1] = 5  # token 1's block would run over the branch after token 1... 4
    with pytest.raises(ValueError, match="branch|subtree"):
        tree_attention_segment(q, k, v, layout.sub_end, key_end_T=spanning)
    with pytest.raises(ValueError, match="key_end"):
        tree_attention_segment(q, k, v, layout.sub_end, key_end_T=torch.zeros(T, dtype=torch.int32))
