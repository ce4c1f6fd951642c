"""Checkpoint conversion between HF safetensors and Megatron-Core (``forge-convert``)."""
