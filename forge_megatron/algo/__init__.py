"""RL algorithm layer: policy losses, advantages, composite rewards, domain mixing, off-policy control.

Pure torch and the standard library; imports neither Megatron nor the middleware. See docs/algorithms.md.
"""

import importlib

# Names to the submodule that defines them, imported on first use: the rewards and advantages are plain Python, so
# the data pool and the gateway (which score groups) start without importing torch (losses and offpolicy need it).
_WHERE = {
    "group_baselines": "advantages", "reward_to_go": "advantages",
    "DomainMixer": "domains", "domain_means": "domains",
    "LossConfig": "losses", "policy_loss": "losses",
    "drop_stale": "offpolicy", "staleness": "offpolicy", "truncated_is_weights": "offpolicy",
    **{name: "rewards" for name in (
        "PROCESS_TERMS", "EpisodeOutcome", "GroupScores", "ProcessContext", "RewardConfig", "completion_time_bonus",
        "language_mixing", "load_reward_fn", "measure_process_terms", "register_process_term", "score_group")},
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_WHERE})


__all__ = list(_WHERE)
