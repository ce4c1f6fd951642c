"""Attention kernels for tree-packed training; see :mod:`forge_megatron.kernels.tree_attention`."""

from forge_megatron.kernels.tree_attention import available_backends, tree_attention

__all__ = ["tree_attention", "available_backends"]
