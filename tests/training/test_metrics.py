"""Trainer metrics: per-episode rewards by domain, staleness, the JSONL/tensorboard writer. CPU, 0 GPUs."""

import argparse
import importlib.util
import json

import numpy as np
import pytest

from forge_megatron.middleware.batch import TrainSample
from forge_megatron.training.metrics import MetricsWriter, reward_metrics, staleness_metrics


def _sample(episode, domain, reward, versions, mask):
    n = len(versions)
    return TrainSample(tokens=np.arange(n, dtype=np.int32), loss_mask=np.array(mask, dtype=np.uint8),
                       rollout_logprobs=np.zeros(n, np.float32), policy_versions=np.array(versions, np.int32),
                       advantages=np.zeros(n, np.float32), sample_weight=1.0, group_index=0, episode_id=episode,
                       domain=domain, reward=reward)


def test_rewards_count_each_episode_once_per_domain():
    samples = [_sample("a", "math", 1.0, [0, 1], [0, 1]), _sample("a", "math", 1.0, [0, 1], [0, 1]),  # 2 segments
               _sample("b", "math", -0.1, [0, 1], [0, 1]), _sample("c", "qa", 0.5, [0, 2], [0, 1])]
    m = reward_metrics(samples)
    assert m["episodes"] == 3
    assert m["reward_mean"] == pytest.approx((1.0 - 0.1 + 0.5) / 3) and m["success_rate"] == pytest.approx(2 / 3)
    assert m["math/success_rate"] == 0.5 and m["qa/reward_mean"] == 0.5


def test_staleness_uses_trained_tokens_only():
    samples = [_sample("a", "d", 1.0, [-1, 3, 5], [0, 1, 1]), _sample("b", "d", 1.0, [-1, 6], [0, 1])]
    assert staleness_metrics(samples, policy_version=6) == {"staleness_mean": pytest.approx(4 / 3), "staleness_max": 3.0}


def test_writer_jsonl_and_tensorboard(tmp_path):
    args = argparse.Namespace(metrics_jsonl=str(tmp_path / "m.jsonl"), tensorboard_dir=None, wandb_project=None,
                              wandb_exp_name="")
    w = MetricsWriter(args)
    w.write(1, {"loss": 0.5, "group_indices": [3, 4], "note": "dropped"})
    w.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 1, "loss": 0.5, "group_indices": [3, 4]}
    args.metrics_jsonl, args.tensorboard_dir = None, str(tmp_path / "tb")
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(RuntimeError, match="pip install tensorboard"):
            MetricsWriter(args)
    else:
        w = MetricsWriter(args)
        w.write(1, {"loss": 0.5})
        w.close()
        assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_micro_batch_metrics_combine_like_one_micro_batch():
    """Loss shares add up, token means are weighted by their tokens (per domain by the domain's), maxima are maxima."""
    from forge_megatron.training.metrics import combine_micro_batch_metrics

    a = {"loss": 0.25, "pg_loss": 0.3, "entropy": 0.5, "num_tokens": 30.0, "ratio_mean": 1.0, "ratio_max": 1.5,
         "math/num_tokens": 10.0, "math/ratio": 2.0}
    b = {"loss": 0.5, "pg_loss": 0.4, "entropy": 0.25, "num_tokens": 10.0, "ratio_mean": 3.0, "ratio_max": 1.2,
         "math/num_tokens": 30.0, "math/ratio": 1.0, "qa/num_tokens": 5.0, "qa/ratio": 4.0}
    out = combine_micro_batch_metrics([a, b])
    assert out["loss"] == 0.75 and out["pg_loss"] == pytest.approx(0.7) and out["entropy"] == 0.75
    assert out["num_tokens"] == 40.0 and out["ratio_mean"] == pytest.approx((30 * 1 + 10 * 3) / 40)
    assert out["ratio_max"] == 1.5
    assert out["math/ratio"] == pytest.approx((10 * 2 + 30 * 1) / 40) and out["math/num_tokens"] == 40.0
    assert out["qa/ratio"] == 4.0 and out["qa/num_tokens"] == 5.0  # only in one micro-batch
    assert combine_micro_batch_metrics([a]) == a


def test_update_metrics_combine_like_one_update_over_the_batch():
    """Several updates per step (--ppo-mini-batches x --ppo-epochs): each update's loss terms are means over its own
    tokens, so the step's are their token-weighted means (a domain absent from an update counts 0 there), token means
    likewise, token counts the batch's (its first pass over the mini-batches), maxima the maximum, the mismatch terms
    the first update's (absent if it had none). One update comes back as it is."""
    from forge_megatron.training.metrics import combine_update_metrics

    u1 = {"loss": 0.2, "num_tokens": 30.0, "ratio_mean": 1.0, "ratio_max": 1.0, "rollout_kl": 0.01,
          "onpolicy/rollout_kl": 0.02, "math/pg_loss": 0.1, "math/num_tokens": 30.0, "math/ratio": 1.0}
    u2 = {"loss": 0.6, "num_tokens": 10.0, "ratio_mean": 1.4, "ratio_max": 2.0, "rollout_kl": 0.5,
          "qa/pg_loss": 0.3, "qa/num_tokens": 10.0}
    out = combine_update_metrics([u1, u2, u1, u2], first_pass=2)
    assert out["loss"] == pytest.approx((30 * 0.2 + 10 * 0.6) / 40)
    assert out["math/pg_loss"] == pytest.approx(30 * 0.1 / 40) and out["qa/pg_loss"] == pytest.approx(10 * 0.3 / 40)
    assert out["ratio_mean"] == pytest.approx((30 * 1.0 + 10 * 1.4) / 40) and out["ratio_max"] == 2.0
    assert out["num_tokens"] == 40.0 and out["math/num_tokens"] == 30.0 and out["qa/num_tokens"] == 10.0
    assert out["rollout_kl"] == 0.01 and out["onpolicy/rollout_kl"] == 0.02
    assert "onpolicy/rollout_kl" not in combine_update_metrics([u2, u1])
    assert combine_update_metrics([u1]) == u1 and combine_update_metrics([]) == {}


def test_progress_line_shows_a_held_out_evaluation_when_one_arrived():
    from forge_megatron.training.trainer import progress_line

    m = {"iteration": 3, "reward_mean": 0.5, "success_rate": 0.5, "loss": -0.1, "clip_frac_high": 0.0,
         "total_tokens": 100, "unique_tokens": 40, "wait_s": 0.1, "forward_backward_s": 0.2, "sync_s": 0.0,
         "policy_version": 3}
    assert "eval" not in progress_line(m)
    line = progress_line({**m, "eval/pass@1": 0.8125, "eval/policy_version": 2.0})
    assert line.endswith("| v3 | eval pass@1 0.81 (v2)")
    assert "images" not in progress_line(m) and "(unique 40, 2 images)" in progress_line({**m, "images": 2})
