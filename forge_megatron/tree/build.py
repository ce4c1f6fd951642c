"""Build the prefix forest of a batch of samples: a token-level trie laid out in DFS pre-order.

Algorithm (both builders, so their outputs are byte-identical):
1. Insert every sample into a trie keyed by (parent node, token id); node ids are given in creation order, so a
   parent's id is below its children's and siblings are ordered by first appearance.
2. Subtree sizes by one reverse pass over node ids: size[parent] += size[node].
3. Pre-order index by one forward pass: a root starts after the previous roots' subtrees, a child after its
   parent and its earlier siblings' subtrees.  sub_end = pre + size, position_ids = depth.

The C++ builder (``forge_megatron._C_tree``, csrc/tree/tree_builder.cpp) runs the same steps with an
open-addressing hash table; this module's Python builder is the fallback and the reference.

Legend: T = unique tree tokens, S = samples, P = sample tokens of all samples.
"""

from __future__ import annotations

import numpy as np
import torch

from forge_megatron.tree.layout import TreeLayout
from forge_megatron.utils import env

BACKENDS = ("auto", "cpp", "python")


def build_tree(samples, backend: str = "auto") -> TreeLayout:
    """Merge ``samples`` (1-D integer sequences: list[int], np.ndarray or torch.Tensor) into a TreeLayout.

    ``backend``: "auto" (C++ if built, else Python), "cpp" or "python".
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown tree builder backend {backend!r}; choose one of {BACKENDS}")
    flat_P, offsets_S1 = flatten_samples(samples)
    use_cpp = backend == "cpp" or (backend == "auto" and env.has_tree_ext())
    if use_cpp:
        env.require("tree_ext", "build_tree(backend='cpp')")
        from forge_megatron import _C_tree

        tokens_T, position_ids_T, sub_end_T, sample_nodes_P = _C_tree.build(flat_P, offsets_S1)
    else:
        tokens_T, position_ids_T, sub_end_T, sample_nodes_P = build_python(flat_P, offsets_S1)
    return TreeLayout(
        tokens=torch.from_numpy(tokens_T),
        position_ids=torch.from_numpy(position_ids_T),
        sub_end=torch.from_numpy(sub_end_T),
        sample_offsets=torch.from_numpy(offsets_S1),
        sample_nodes=torch.from_numpy(sample_nodes_P),
    )


def flatten_samples(samples) -> tuple[np.ndarray, np.ndarray]:
    """Validate samples and concatenate them: (int64 tokens [P], int64 offsets [S+1])."""
    if len(samples) == 0:
        raise ValueError("build_tree needs at least one sample, got an empty list")
    arrays = [_as_token_array(s, i) for i, s in enumerate(samples)]
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets_S1 = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets_S1[1:])
    return np.concatenate(arrays), offsets_S1


def _as_token_array(sample, index: int) -> np.ndarray:
    if isinstance(sample, torch.Tensor):
        if sample.is_floating_point() or sample.is_complex() or sample.dtype == torch.bool:
            raise TypeError(f"sample {index} has dtype {sample.dtype}; token ids must be integers")
        arr = sample.detach().cpu().numpy()
    else:
        arr = np.asarray(sample)
    if arr.ndim != 1:
        raise ValueError(f"sample {index} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"sample {index} is empty; every sample needs at least one token")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"sample {index} has dtype {arr.dtype}; token ids must be integers")
    arr = arr.astype(np.int64, copy=False)
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        pos = int(negative[0])
        raise ValueError(f"sample {index} has a negative token id {int(arr[pos])} at position {pos}")
    return arr


def build_python(flat_P: np.ndarray, offsets_S1: np.ndarray):
    """The reference builder: (tokens int64 [T], position_ids int64 [T], sub_end int32 [T], sample_nodes int64 [P])."""
    parent, token, depth, trie_node_P = _insert_all(flat_P.tolist(), offsets_S1.tolist())
    size = _subtree_sizes(parent)
    pre = _preorder(parent, size)
    pre_T = np.asarray(pre, dtype=np.int64)
    T = len(parent)
    tokens_T = np.empty(T, dtype=np.int64)
    tokens_T[pre_T] = token
    position_ids_T = np.empty(T, dtype=np.int64)
    position_ids_T[pre_T] = depth
    sub_end_T = np.empty(T, dtype=np.int32)
    sub_end_T[pre_T] = pre_T + np.asarray(size, dtype=np.int64)
    sample_nodes_P = pre_T[np.asarray(trie_node_P, dtype=np.int64)]
    return tokens_T, position_ids_T, sub_end_T, sample_nodes_P


def _insert_all(flat: list[int], offsets: list[int]):
    """Insert every sample into the trie; nodes numbered in creation order (parent -1 marks a root)."""
    children: dict[tuple[int, int], int] = {}
    parent: list[int] = []
    token: list[int] = []
    depth: list[int] = []
    trie_node_P: list[int] = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        node = -1
        for pos in range(start, end):
            key = (node, flat[pos])
            child = children.get(key)
            if child is None:
                child = len(parent)
                children[key] = child
                parent.append(node)
                token.append(flat[pos])
                depth.append(pos - start)
            trie_node_P.append(child)
            node = child
    return parent, token, depth, trie_node_P


def _subtree_sizes(parent: list[int]) -> list[int]:
    size = [1] * len(parent)
    for node in range(len(parent) - 1, -1, -1):
        if parent[node] >= 0:
            size[parent[node]] += size[node]
    return size


def _preorder(parent: list[int], size: list[int]) -> list[int]:
    """DFS pre-order index of every node; siblings in creation order (= first appearance)."""
    pre = [0] * len(parent)
    next_free = [0] * len(parent)  # where the next child of each node starts
    next_root = 0
    for node, p in enumerate(parent):
        if p < 0:
            pre[node] = next_root
            next_root += size[node]
        else:
            pre[node] = next_free[p]
            next_free[p] += size[node]
        next_free[node] = pre[node] + 1
    return pre
