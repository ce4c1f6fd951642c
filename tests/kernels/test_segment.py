"""Segment tree attention == the dense reference, forward and backward, fp32 (CPU; one GPU case marked gpu).

Forests come from forge_megatron.tree.build_tree (see tests/tree/forests.py for the shapes); the comparison rule
is tree_cases.check_against_reference (fp32: max abs error <= 1e-5 on o, dq, dk, dv; 16-bit: at most twice the
error of the reference run in 16 bits, + 1e-5).
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
    """16-bit inputs: error <= 2 x (error of the reference run in 16 bits) + 1e-5, on o, dq, dk, dv."""
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
