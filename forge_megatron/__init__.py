"""forge_megatron: agent reinforcement learning on Megatron-Core.

Layers (lower never imports higher):
  utils <- tree, kernels, algo <- mcore <- training
  bridge <- weight_sync, convert
  middleware, rollout stand apart from Megatron.
"""

__version__ = "0.1.0"
