"""RL algorithm layer: policy losses, advantages, composite rewards, domain mixing, off-policy control.

Pure torch and the standard library; imports neither Megatron nor the middleware. See docs/algorithms.md.
"""

from forge_megatron.algo.advantages import group_baselines, reward_to_go
from forge_megatron.algo.domains import DomainMixer, domain_means
from forge_megatron.algo.losses import LossConfig, policy_loss
from forge_megatron.algo.offpolicy import drop_stale, staleness, truncated_is_weights
from forge_megatron.algo.rewards import (
    PROCESS_TERMS,
    EpisodeOutcome,
    GroupScores,
    ProcessContext,
    RewardConfig,
    completion_time_bonus,
    language_mixing,
    load_reward_fn,
    measure_process_terms,
    register_process_term,
    score_group,
)

__all__ = [
    "LossConfig", "policy_loss", "EpisodeOutcome", "RewardConfig", "GroupScores", "score_group",
    "completion_time_bonus", "ProcessContext", "PROCESS_TERMS", "register_process_term", "measure_process_terms",
    "language_mixing", "load_reward_fn", "reward_to_go", "group_baselines", "DomainMixer", "domain_means",
    "truncated_is_weights", "staleness", "drop_stale",
]
