"""Tree attention over a DFS-ordered prefix forest: key j is visible to query i iff j <= i < sub_end[j].

Backends: ``reference`` (dense mask, the spec), ``segment`` (exact, cost ~ sum of depths, CPU and GPU),
``triton`` and ``cuda`` (GPU kernels, imported lazily). :func:`tree_attention` dispatches between them.
"""

from forge_megatron.kernels.tree_attention.dispatch import available_backends, tree_attention
from forge_megatron.kernels.tree_attention.reference import tree_attention_reference, tree_mask
from forge_megatron.kernels.tree_attention.segment import tree_attention_segment

__all__ = ["tree_attention", "available_backends", "tree_attention_reference", "tree_attention_segment", "tree_mask"]
