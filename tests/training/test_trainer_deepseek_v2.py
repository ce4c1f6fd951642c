"""The trainer on DeepSeek-V2's layout (the 236B models'), as a real process against a real forge-pool process:
multi-latent attention with a query latent under YaRN, a dense first layer, then a softmax router over every expert,
group-limited greedy (the best of 2 groups of 4 by its best expert, forge's router), whose top-k probabilities are
kept as they are and scaled, logits in fp32, beside two shared experts' width. One rank, TP = 2 with sequence
parallelism and EP = 2 train the same two steps, routing replayed. (V2-Lite's greedy routing is Megatron's
pre-softmax top-k: tests/convert.) CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_layouts


def test_deepseek_v2_trains_the_same_under_tensor_and_expert_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "deepseek_v2"), arch="deepseek_v2", seed=2, q_lora_rank=32,
                                 n_routed_experts=8, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                 routed_scaling_factor=16.0)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(2, 8, 2))  # noqa
    runs = ["tp2sp", "ep2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0 and all(s["routing_replayed_rows"] > 0 for s in steps["one"])
    assert_same_as_one_rank(steps, runs, REPLAY_KEYS)
