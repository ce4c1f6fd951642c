"""Prefix-forest builders: Python == C++ byte for byte, layout invariants against a brute-force oracle. CPU only."""

import random

import numpy as np
import pytest
import torch

from forge_megatron.kernels.tree_attention.reference import tree_mask
from forge_megatron.tree import TreeLayout, build_tree
from forge_megatron.tree.layout import _FIELDS
from tests.tree.forests import all_kinds, random_batch

KINDS = all_kinds()


def node_paths(layout: TreeLayout, samples) -> dict[int, tuple]:
    """Tree node -> its root-to-node token path, read off the samples (asserting every occurrence agrees)."""
    paths: dict[int, tuple] = {}
    for s, sample in enumerate(samples):
        nodes = layout.sample_nodes[layout.sample_slice(s)].tolist()
        assert len(nodes) == len(sample)
        for t, node in enumerate(nodes):
            assert paths.setdefault(node, tuple(sample[: t + 1])) == tuple(sample[: t + 1])
    return paths


def check_invariants(layout: TreeLayout, samples) -> None:
    T = layout.unique_tokens
    paths = node_paths(layout, samples)
    assert sorted(paths) == list(range(T)), "every tree token belongs to some sample"
    assert len(set(paths.values())) == T, "no two tree tokens share a root path (the trie is minimal)"
    assert layout.total_tokens == sum(len(s) for s in samples)
    for i, path in paths.items():
        assert layout.tokens[i] == path[-1]
        assert layout.position_ids[i] == len(path) - 1
    oracle = torch.tensor([[paths[i][: len(paths[j])] == paths[j] for j in range(T)] for i in range(T)])
    assert torch.equal(tree_mask(layout.sub_end), oracle), "j visible to i iff path(j) is a prefix of path(i)"
    first_seen: dict[int, int] = {}
    for s, sample in enumerate(samples):
        for node in layout.sample_nodes[layout.sample_slice(s)].tolist():
            first_seen.setdefault(node, len(first_seen))
    siblings: dict[tuple, list[int]] = {}
    for i in range(T):
        siblings.setdefault(paths[i][:-1], []).append(i)
    for group in siblings.values():  # DFS index order of siblings == order of first appearance
        assert [first_seen[i] for i in group] == sorted(first_seen[i] for i in group)


def assert_identical(a: TreeLayout, b: TreeLayout) -> None:
    for field in _FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x, y), field


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_layout_invariants(kind, backend):
    check_invariants(build_tree(KINDS[kind], backend=backend), KINDS[kind])


def test_builders_identical_on_random_forests():
    rng = random.Random(1)
    for _ in range(60):
        samples = random_batch(rng, rng.randint(1, 30), rng.randint(1, 40), rng.choice([2, 5, 1000]))
        py = build_tree(samples, backend="python")
        assert_identical(py, build_tree(samples, backend="cpp"))
        check_invariants(py, samples)


def test_hand_worked_example():
    # trie: 1 -> 2 -> {3 -> 7, 4};  5.   DFS: 1 2 3 7 4 5
    layout = build_tree([[1, 2, 3], [1, 2, 4], [5], [1, 2, 3, 7]])
    assert layout.tokens.tolist() == [1, 2, 3, 7, 4, 5]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 2, 0]
    assert layout.sub_end.tolist() == [5, 5, 4, 4, 5, 6]
    assert layout.sample_offsets.tolist() == [0, 3, 6, 7, 11]
    assert layout.sample_nodes.tolist() == [0, 1, 2, 0, 1, 4, 5, 0, 1, 2, 3]
    assert (layout.num_samples, layout.total_tokens, layout.unique_tokens) == (4, 11, 6)
    assert layout.tokens.dtype == layout.position_ids.dtype == layout.sample_nodes.dtype == torch.int64
    assert layout.sub_end.dtype == torch.int32


def test_input_types_agree():
    samples = KINDS["random"]
    as_list = build_tree(samples)
    assert_identical(as_list, build_tree([np.asarray(s, dtype=np.int32) for s in samples]))
    assert_identical(as_list, build_tree([torch.tensor(s) for s in samples]))


def test_gather_and_next_token_index():
    samples = KINDS["random"]
    layout = build_tree(samples)
    assert layout.gather(layout.tokens).tolist() == [t for s in samples for t in s]
    assert layout.gather(layout.tokens.numpy()).tolist() == [t for s in samples for t in s]
    pred, targets, offsets = layout.next_token_index()
    assert offsets.tolist() == np.cumsum([0] + [len(s) - 1 for s in samples]).tolist()
    for s, sample in enumerate(samples):
        nodes = layout.sample_nodes[layout.sample_slice(s)]
        rows = slice(int(offsets[s]), int(offsets[s + 1]))
        assert torch.equal(pred[rows], nodes[:-1])
        assert targets[rows].tolist() == sample[1:]
    x_T = torch.randn(layout.unique_tokens, 3, requires_grad=True)
    layout.gather(x_T).sum().backward()
    uses = torch.bincount(layout.sample_nodes, minlength=layout.unique_tokens).float()
    assert torch.equal(x_T.grad, uses[:, None].expand(-1, 3)), "shared tokens collect one gradient per sample"


@pytest.mark.parametrize(
    "samples, error, message",
    [
        ([], ValueError, "at least one sample"),
        ([[1, 2], []], ValueError, "sample 1 is empty"),
        ([[1, 2], [3, -4]], ValueError, "sample 1 has a negative token id -4 at position 1"),
        ([[1.0, 2.0]], TypeError, "sample 0 has dtype float64"),
        ([torch.tensor([1.0])], TypeError, "sample 0 has dtype torch.float32"),
        ([np.ones((2, 2), dtype=np.int64)], ValueError, r"sample 0 must be 1-D, got shape \(2, 2\)"),
    ],
)
def test_bad_samples(samples, error, message):
    with pytest.raises(error, match=message):
        build_tree(samples)


def test_bad_backend_and_cpp_input_checks():
    with pytest.raises(ValueError, match="unknown tree builder backend 'rust'"):
        build_tree([[1]], backend="rust")
    from forge_megatron import _C_tree

    tokens = np.array([1, 2, 3], dtype=np.int64)
    with pytest.raises(ValueError, match="offsets\\[0\\] must be 0"):
        _C_tree.build(tokens, np.array([1, 3], dtype=np.int64))
    with pytest.raises(ValueError, match="sample 1 is empty"):
        _C_tree.build(tokens, np.array([0, 3, 3], dtype=np.int64))
    with pytest.raises(ValueError, match="offsets\\[-1\\] = 2 but there are 3 tokens"):
        _C_tree.build(tokens, np.array([0, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="negative token id -1"):
        _C_tree.build(np.array([1, -1], dtype=np.int64), np.array([0, 2], dtype=np.int64))


def test_layout_to_and_sample_slice_bounds():
    layout = build_tree(KINDS["grpo"])
    moved = layout.to("cpu")
    assert_identical(layout, moved)
    with pytest.raises(IndexError, match="sample index 8 out of range for a layout of 8 samples"):
        layout.sample_slice(8)
    with pytest.raises(ValueError, match=f"leading dimension of {layout.unique_tokens} tree tokens"):
        layout.gather(torch.zeros(layout.unique_tokens + 1))
