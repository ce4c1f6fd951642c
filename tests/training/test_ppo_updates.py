"""Several optimizer steps per RL batch (--ppo-mini-batches, --ppo-epochs) and the critic's value clip (--value-clip).

One iteration of M mini-batches x E epochs must train exactly what M x E one-group iterations do when those see the
same pi_old: the logprobs of the weights from before the first update (--old-logprobs recompute; the one-group runs
get them as their rollout logprobs, written out from transformers). Over two data-parallel ranks each update equals
one rank's. The critic's clipped value loss starts unclipped (its first update's values are V_old) and binds later.
CPU, 0 GPUs (gloo)."""

import numpy as np
import pytest
import torch

from forge_megatron.models.tiny import build_tiny_model, build_tiny_reward_model

from .trainer_run import episodes_feed as _feed
from .trainer_run import random_groups as _groups
from .trainer_run import refused_start, run_on_fresh_pool


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppo_updates")
    return build_tiny_model(str(d / "policy")), build_tiny_reward_model(str(d / "critic"))


def _logprobs(policy: str, groups):
    """transformers' logprobs of every completion token under the checkpoint's weights (the weights before any
    update): ``[group][episode] -> list``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for episodes in groups:
            out.append([])
            for prompt, completion, _ in episodes:
                ids = torch.tensor([prompt + completion])
                logp = torch.log_softmax(lm(ids).logits[0].double(), -1)[len(prompt) - 1:-1]
                out[-1].append(logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist())
    return out


CONSTANT_LR = ["--lr-decay-style", "constant"]  # (one iteration of 4 updates vs 4 iterations: the same rate)


def test_mini_batches_and_epochs_train_like_one_group_iterations(models, tmp_path):
    """Two groups, --ppo-mini-batches 2 --ppo-epochs 2, --old-logprobs recompute: four updates, each on one group, in
    the order the metrics list (ppo/per_update); the first pass takes the mini-batches as drawn, the second reshuffled.
    Four one-group iterations fed in that order with the checkpoint's logprobs as their rollout logprobs (pi_old, as
    the recomputation gave) see the same losses, ratios, clip fractions and gradient norms update by update: each
    update trained on the weights the one before left. The step's loss and ratio are the token-weighted means over
    the updates, its gradient norm their mean; the first update's ratio is 1, the later ones' not."""
    policy, _ = models
    groups = _groups(2, seed=21)
    (step,), stdouts, _ = run_on_fresh_pool(
        tmp_path, "ppo", policy, _feed(groups), iters=1, groups=2,
        extra=[*CONSTANT_LR, "--ppo-mini-batches", "2", "--ppo-epochs", "2", "--old-logprobs", "recompute"])
    assert "4 optimizer steps per batch (--ppo-mini-batches 2 x --ppo-epochs 2), pi_old from a forward pass" \
        in stdouts[0]
    assert "| updates 4 |" in stdouts[0]
    per = step["ppo/per_update"]
    assert step["ppo/updates"] == 4 and step["update_ok"] and len(per) == 4
    index = {g: i for i, g in enumerate(sorted(step["group_indices"]))}  # pool index -> position in ``groups``
    order = [index[g] for u in per for g in u["groups"]]
    assert sorted(order[:2]) == [0, 1] and sorted(order[2:]) == [0, 1]
    assert per[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert all(abs(u["ratio_mean"] - 1.0) > 1e-5 for u in per[1:])
    weights = np.array([u["num_tokens"] for u in per])
    for key in ("loss", "ratio_mean", "clip_frac_high"):
        assert step[key] == pytest.approx(float(np.average([u[key] for u in per], weights=weights)), rel=1e-6)
    assert step["grad_norm"] == pytest.approx(float(np.mean([u["grad_norm"] for u in per])), rel=1e-6)
    assert step["num_tokens"] == pytest.approx(weights[:2].sum())  # (the batch's, not the four updates')

    logprobs = _logprobs(policy, groups)
    seq, _, _ = run_on_fresh_pool(tmp_path, "seq", policy, _feed([groups[g] for g in order],
                                                                 [logprobs[g] for g in order]),
                                  iters=4, groups=1, extra=CONSTANT_LR)
    first = seq[0]["group_indices"][0]
    assert [s["group_indices"] for s in seq] == [[first + i] for i in range(4)]  # (fed order = trained order)
    for u, s in zip(per, seq):
        for key in ("loss", "pg_loss", "ratio_mean", "clip_frac_low", "clip_frac_high", "grad_norm", "num_tokens"):
            assert u[key] == pytest.approx(s[key], rel=2e-5, abs=1e-7), (key, u, s)


def test_mini_batches_in_parallel_layouts_equal_one_rank(models, tmp_path):
    """Four groups in two mini-batches of two epochs: over two DP ranks (each trains one group of every mini-batch),
    two pipeline stages and two context-parallel ranks every update's gradient norm equals one rank's (each update's
    normaliser spans both DP ranks' tokens), and its loss too where every rank logs the whole update's (PP, CP); a
    batch too small to give every DP rank a group of every mini-batch is refused at start-up."""
    policy, _ = models
    groups = _groups(4, seed=22)
    flags = ["--ppo-mini-batches", "2", "--ppo-epochs", "2", "--old-logprobs", "recompute"]
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("dp2", [], 2), ("pp2", ["--pipeline-model-parallel-size", "2"], 2),
                               ("cp2", ["--context-parallel-size", "2"], 2)):
        (runs[name],), _, _ = run_on_fresh_pool(tmp_path, name, policy, _feed(groups), iters=1, groups=4,
                                                extra=flags + extra, nproc=nproc)
    one = runs["one"]["ppo/per_update"]
    assert len(one) == 4 and all(len(u["groups"]) == 2 for u in one)
    for name in ("dp2", "pp2", "cp2"):
        other = runs[name]["ppo/per_update"]
        assert [u["groups"] for u in one] == [u["groups"] for u in other], name
        # (under DP the logged loss is rank 0's share of the update: compared by the reduced gradient norm only)
        for key in ("grad_norm",) if name == "dp2" else ("grad_norm", "loss", "ratio_mean"):
            assert [u[key] for u in other] == pytest.approx([u[key] for u in one], rel=1e-5, abs=1e-7), (name, key)
    assert runs["dp2"]["dp_load_imbalance"] >= 1.0
    out = refused_start(policy, tmp_path, ["--ppo-mini-batches", "2", "--train-batch-groups", "3"], nproc=2)
    assert "--ppo-mini-batches 2 with 2 data-parallel ranks needs at least 4 groups per batch" in out


def test_critic_value_clip_binds_after_the_first_update(models, tmp_path):
    """--critic --value-clip with two mini-batches x two epochs, the first iteration the critic's warm-up: the critic
    updates four times per iteration, the policy's loss is measured once per mini-batch while it waits (no update),
    then it updates four times too. The critic's first update's values are the ones its targets came from (nothing
    clipped: the value loss equals an unclipped run's); with a small clip and a fast critic later updates clip some
    tokens and their losses part from the unclipped run's. The critic's LR schedule advanced once per iteration."""
    policy, critic = models
    groups = _groups(4, seed=23)
    flags = ["--critic-hf-checkpoint", critic, "--critic-lr", "5e-3", "--value-clip", "1e-3", "--ppo-mini-batches",
             "2", "--ppo-epochs", "2", "--critic-warmup-iters", "1", "--lr-decay-style", "linear", "--min-lr", "0"]
    (warm, step), stdouts, _ = run_on_fresh_pool(tmp_path, "clip", policy, _feed(groups), iters=2, groups=2,
                                                 extra=flags)
    assert warm["critic/warmup"] == 1.0 and not warm["update_ok"] and warm["ppo/updates"] == 0
    assert [("loss" in u, "critic/vf_loss" in u) for u in warm["ppo/per_update"]] == \
        [(True, True)] * 2 + [(False, True)] * 2
    assert step["critic/warmup"] == 0.0 and step["update_ok"] and step["ppo/updates"] == 4
    assert warm["critic/update_ok"] and step["critic/update_ok"]
    assert warm["critic/lr"] == pytest.approx(5e-3 / 2) and step["critic/lr"] == pytest.approx(0.0, abs=1e-12)
    per = warm["ppo/per_update"] + step["ppo/per_update"]
    assert warm["critic/vf_clip_frac"] > 0 and step["critic/vf_clip_frac"] > 0
    (plain_warm, plain_step), _, _ = run_on_fresh_pool(
        tmp_path, "plain", policy, _feed(groups), iters=2, groups=2,
        extra=[f for f in flags if f not in ("--value-clip", "1e-3")])
    assert "critic/vf_clip_frac" not in plain_warm
    plain = plain_warm["ppo/per_update"] + plain_step["ppo/per_update"]
    assert per[0]["critic/vf_loss"] == pytest.approx(plain[0]["critic/vf_loss"], rel=1e-6)
    assert any(a["critic/vf_loss"] != pytest.approx(b["critic/vf_loss"], rel=1e-4) for a, b in zip(per[1:], plain[1:]))
    weights = np.array([u["num_tokens"] for u in step["ppo/per_update"]])
    assert step["critic/vf_loss"] == pytest.approx(
        float(np.average([u["critic/vf_loss"] for u in step["ppo/per_update"]], weights=weights)), rel=1e-6)


def test_stop_and_resume_trains_the_same_updates(models, tmp_path):
    """Three iterations of two mini-batches x two epochs stopped after the first and resumed: the same mini-batches
    in the same order (drawn from --seed and the groups' indices), the same losses and gradient norms. With a KL to
    the reference (the checkpoint's weights), taken before the updates, the first update's KL is 0 and later ones'
    not."""
    policy, _ = models
    groups = _groups(6, seed=24)
    flags = ["--ppo-mini-batches", "2", "--ppo-epochs", "2", "--rl-kl-coef", "0.1"]
    runs = {}
    for name, exits in (("one", (None,)), ("resumed", (1, None))):
        runs[name], _, counts = run_on_fresh_pool(tmp_path, name, policy, _feed(groups), iters=3, groups=2,
                                                  extra=flags, exits=exits)
    assert counts == [1, 3]
    kls = [u["kl"] for u in runs["one"][0]["ppo/per_update"]]
    assert kls[0] == pytest.approx(0.0, abs=1e-7) and all(k > 1e-6 for k in kls[1:])
    for a, b in zip(runs["one"], runs["resumed"]):
        assert [u["groups"] for u in a["ppo/per_update"]] == [u["groups"] for u in b["ppo/per_update"]]
        for ua, ub in zip(a["ppo/per_update"], b["ppo/per_update"]):
            for key in ("loss", "grad_norm", "kl"):
                assert ua[key] == pytest.approx(ub[key], rel=1e-5, abs=1e-7), key


def test_target_kl_stops_a_batchs_updates_early(models, tmp_path):
    """--ppo-target-kl: with pi_old recomputed the first update measures ppo_kl 0 and steps; the second measures the
    first's move, above a tiny target, so it and the rest are not taken (one update, marked stopped in the per-update
    log); a target far above the moves lets all four run. Without several updates per batch the flag is refused."""
    policy, _ = models
    groups = _groups(2, seed=25)
    flags = ["--ppo-mini-batches", "2", "--ppo-epochs", "2", "--old-logprobs", "recompute"]
    (tight,), _, _ = run_on_fresh_pool(tmp_path, "tight", policy, _feed(groups), iters=1, groups=2,
                                       extra=flags + ["--ppo-target-kl", "1e-12"])
    per = tight["ppo/per_update"]
    assert tight["ppo/updates"] == 1 and tight["ppo/early_stop"] == 1.0 and len(per) == 2
    assert per[0]["ppo_kl"] == pytest.approx(0.0, abs=1e-9) and per[0]["update_ok"] and "stopped" not in per[0]
    assert per[1]["ppo_kl"] > 1e-12 and per[1]["stopped"] and "update_ok" not in per[1]
    (loose,), _, _ = run_on_fresh_pool(tmp_path, "loose", policy, _feed(groups), iters=1, groups=2,
                                       extra=flags + ["--ppo-target-kl", "10"])
    assert loose["ppo/updates"] == 4 and loose["ppo/early_stop"] == 0.0
    assert [u["ppo_kl"] for u in loose["ppo/per_update"]][:2] == pytest.approx([u["ppo_kl"] for u in per])
    out = refused_start(policy, tmp_path, ["--ppo-target-kl", "0.01"])
    assert "--ppo-target-kl 0.01: stops the later updates of a batch" in out
