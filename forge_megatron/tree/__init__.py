"""Prefix-tree merging: build a DFS-ordered prefix forest from samples and pack samples into micro-batches.

No Megatron imports here: the layout is plain tensors (see docs/prefix_tree.md).
"""

from forge_megatron.tree.build import build_tree
from forge_megatron.tree.layout import TreeLayout
from forge_megatron.tree.pack import pack_micro_batches

__all__ = ["build_tree", "TreeLayout", "pack_micro_batches"]
