"""RL algorithm layer: policy losses, advantages, composite rewards, domain mixing, off-policy control.

Pure torch; imports neither Megatron nor the middleware.
"""

from forge_megatron.algo.losses import LossConfig, policy_loss

__all__ = ["LossConfig", "policy_loss"]
