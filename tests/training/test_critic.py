"""PPO with a learned critic (--critic, training/critic.py): the value model's values of every trained token, GAE
advantages toward the segments' returns, the value loss and the critic's own optimizer step, checked against
transformers (the tiny reward model read at every position) on one rank, two pipeline stages, two tensor-parallel
ranks and two context-parallel ranks; warm-up steps leave the policy alone; a stopped and resumed run trains what an
uninterrupted one does; the critic's checkpoint exports as the sequence classifier it is. CPU, 0 GPUs (gloo)."""

import json
import os

import pytest
import torch

from forge_megatron.models.tiny import build_tiny_model, build_tiny_reward_model

from .trainer_run import episodes_feed as _feed
from .trainer_run import random_groups, run_on_fresh_pool


def _groups(n_groups: int, seed: int = 5):
    return random_groups(n_groups, seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("critic")
    return build_tiny_model(str(d / "policy")), build_tiny_reward_model(str(d / "critic"))


def _reference(policy: str, critic: str, episodes):
    """transformers' per completion token: the critic's value (its score head on the hidden state that predicts the
    token), the return (the episode's reward) and the policy's logprob; concatenated over the episodes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    lm = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(critic, dtype=torch.float32).eval()
    values, returns, logps = [], [], []
    with torch.no_grad():
        for prompt, completion, reward in episodes:
            ids = torch.tensor([prompt + completion])
            rows = slice(len(prompt) - 1, ids.shape[1] - 1)
            hidden = rm.model(input_ids=ids).last_hidden_state[0]
            values.append(rm.score(hidden)[rows, 0].double())
            returns.append(torch.full((len(completion),), reward, dtype=torch.float64))
            logp = torch.log_softmax(lm(ids).logits[0].double(), -1)[rows]
            logps.append(logp.gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return torch.cat(values), torch.cat(returns), torch.cat(logps)


def test_critic_values_advantages_and_losses_equal_transformers(models, tmp_path):
    """Step 1, GAE with gamma = lambda = 1, no whitening, recomputed old logprobs (ratio 1): the critic's values are
    transformers' (value_mean, explained_variance), the advantages are return - value (advantage_mean / std), the
    value loss is 0.5 mean (V - R)^2, the policy's CISPO loss is
    -(1/N) sum_t (R_t - V_t) logp_t (whitened, the default: the advantages' z-scores), on one rank, over two pipeline stages, two TP ranks with sequence parallelism
    and two CP ranks; the critic's and the policy's gradient norms agree between the layouts."""
    policy, critic = models
    (episodes,) = _groups(1)
    v, r, logp = _reference(policy, critic, episodes)
    a = r - v
    expect = {"critic/value_mean": v.mean().item(), "critic/return_mean": r.mean().item(),
              "critic/advantage_mean": a.mean().item(), "critic/advantage_std": a.std(unbiased=False).item(),
              "critic/explained_variance": 1.0 - a.var(unbiased=False).item() / r.var(unbiased=False).item(),
              "critic/vf_loss": 0.5 * (a ** 2).mean().item(),
              "loss": -(a * logp).mean().item()}
    flags = ["--critic-hf-checkpoint", critic, "--no-whiten-advantages", "--old-logprobs", "recompute"]
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("pp2", ["--pipeline-model-parallel-size", "2"], 2),
                               ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
                               ("cp2", ["--context-parallel-size", "2"], 2)):
        runs[name], stdouts, _ = run_on_fresh_pool(tmp_path, name, policy, _feed([episodes]), iters=1, groups=1,
                                                   extra=flags + extra, nproc=nproc)
        assert f"critic initialised from HF checkpoint {critic}" in stdouts[0]
        assert "| critic vf " in stdouts[0]
        (step,) = runs[name]
        for key, value in expect.items():
            assert step[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        assert step["critic/update_ok"] and step["update_ok"] and step["critic/warmup"] == 0.0
    for other in ("pp2", "tp2", "cp2"):
        for key in ("grad_norm", "critic/grad_norm"):
            assert runs["one"][0][key] == pytest.approx(runs[other][0][key], rel=1e-5), (other, key)
    # whitened (the default): the policy trains on (A - mean A) / std A
    (step,), _, _ = run_on_fresh_pool(tmp_path, "whitened", policy, _feed([episodes]), iters=1, groups=1,
                                      extra=flags[:2] + flags[3:])
    white = (a - a.mean()) / (a.std(unbiased=False) + 1e-8)
    assert step["loss"] == pytest.approx(-(white * logp).mean().item(), rel=1e-5, abs=1e-6)


def test_critic_learns_warms_up_resumes_and_exports(models, tmp_path):
    """Eight steps on the same group fed eight times, the first three the critic's alone (--critic-warmup-iters 3):
    the policy's loss stays put and its update is skipped while the critic's value loss falls; a run stopped after
    step 4 and resumed (the critic from <save>/critic) trains the same steps; the critic's checkpoint exports with
    forge-convert trainer-to-hf as a Qwen2ForSequenceClassification whose per-token scores are the values the
    resumed run's critic holds."""
    from transformers import AutoModelForSequenceClassification

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    policy, critic = models
    (episodes,) = _groups(1, seed=9)
    flags = ["--critic-hf-checkpoint", critic, "--critic-warmup-iters", "3", "--critic-lr", "3e-3"]
    runs = {}
    runs["one"], outs, _ = run_on_fresh_pool(tmp_path, "one", policy, _feed([episodes] * 8), iters=8, groups=1,
                                             extra=flags)
    assert "(warm-up)" in outs[0]
    runs["resumed"], outs, counts = run_on_fresh_pool(tmp_path, "resumed", policy, _feed([episodes] * 8), iters=8,
                                                      groups=1, extra=flags, exits=(4, None))
    assert counts == [4, 8] and f"critic resumed from {tmp_path / 'resumed' / 'ckpt' / 'critic'} at iteration 4" \
        in outs[1]
    one = runs["one"]
    assert [s["critic/warmup"] for s in one] == [1.0] * 3 + [0.0] * 5
    assert [s["update_ok"] for s in one] == [False] * 3 + [True] * 5
    # the policy did not move while warming up: its ratios to the recorded logprobs stay put until step 4 trains
    assert all(s["ratio_mean"] == pytest.approx(one[0]["ratio_mean"], rel=1e-6) for s in one[:4])
    assert one[4]["ratio_mean"] != pytest.approx(one[3]["ratio_mean"], rel=1e-4)
    assert one[-1]["critic/vf_loss"] < 0.5 * one[0]["critic/vf_loss"]
    assert one[-1]["critic/explained_variance"] > one[0]["critic/explained_variance"]
    for s in one:
        assert s["critic/advantage_std"] > 0
    for a, b in zip(one, runs["resumed"]):
        for key in ("loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/value_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key

    # the critic after 4 updates (saved at iteration 4) scored step 5's tokens: its export gives the same values
    out = str(tmp_path / "exported-critic")
    export_trainer_checkpoint(str(tmp_path / "resumed" / "ckpt" / "critic"), out, iteration=4)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    values = []
    with torch.no_grad():
        for prompt, completion, _ in episodes:
            hidden = hf.model(input_ids=torch.tensor([prompt + completion])).last_hidden_state[0]
            values.append(hf.score(hidden)[len(prompt) - 1:-1, 0])
    assert torch.cat(values).mean().item() == pytest.approx(one[4]["critic/value_mean"], rel=1e-4, abs=1e-5)


def test_rewards_of_single_calls_reach_the_critics_advantages(models, tmp_path):
    """Episodes whose agent rewarded single calls (Segment.call_rewards: +0.5 at a completion's second token in
    episodes 0 and 2, -0.25 at the last in episode 1): with gamma = lambda = 1 and no whitening each trained token's
    advantage is the rewards from it on (those calls' at or after it, then the outcome) minus the critic's value, so
    the step's return and advantage means equal those written out from transformers' values."""
    policy, critic = models
    (episodes,) = _groups(1, seed=17)
    calls = {0: (1, 0.5), 1: (-1, -0.25), 2: (1, 0.5)}  # episode -> (completion token, reward)
    feed = _feed([episodes], call_rewards={(0, e): [[len(episodes[e][0]) + k % len(episodes[e][1]), r]]
                                           for e, (k, r) in calls.items()})

    v, _, _ = _reference(policy, critic, episodes)
    returns = []
    for e, (_, completion, reward) in enumerate(episodes):
        k, r = calls.get(e, (0, 0.0))
        k %= len(completion)
        returns += [reward + (r if t <= k else 0.0) for t in range(len(completion))]
    r_t = torch.tensor(returns, dtype=torch.float64)
    (step,), _, _ = run_on_fresh_pool(tmp_path, "calls", policy, feed, iters=1, groups=1,
                                      extra=["--critic-hf-checkpoint", critic, "--no-whiten-advantages"])
    assert step["critic/return_mean"] == pytest.approx(r_t.mean().item(), rel=1e-5, abs=1e-6)
    assert step["critic/advantage_mean"] == pytest.approx((r_t - v).mean().item(), rel=1e-5, abs=1e-6)
    assert step["critic/advantage_std"] == pytest.approx((r_t - v).std(unbiased=False).item(), rel=1e-5, abs=1e-6)


def test_critics_that_cannot_value_the_policys_tokens_are_refused(models, tmp_path):
    """A critic checkpoint with another tokenizer (one token's id moved), a reward model of two labels, and a
    vision-language policy: each refused at start-up with the reason."""
    from forge_megatron.models.tiny import build_tiny_model as tiny

    from .trainer_run import refused_start, with_a_swapped_token

    policy, critic = models
    other = with_a_swapped_token(critic, str(tmp_path / "other_vocab"))
    out = refused_start(policy, tmp_path, ["--critic-hf-checkpoint", other])
    assert f"--critic-hf-checkpoint {other}: its tokenizer is not the policy's" in out
    assert "the critic values the policy's token ids" in out
    two = build_tiny_reward_model(str(tmp_path / "two_labels"), num_labels=2)
    assert "it has 2 labels; a value model has one" in refused_start(policy, tmp_path, ["--critic-hf-checkpoint", two])
    vl = tiny(str(tmp_path / "vl"), arch="qwen3_vl")
    assert "--critic: the policy is a vision-language model" in refused_start(vl, tmp_path, ["--critic"], model=[])


def test_critic_over_two_data_parallel_ranks_equals_one_rank(models, tmp_path):
    """Two groups on one rank and split over two data-parallel ranks: the batch-wide critic metrics (values, returns,
    whitening statistics, explained variance, value loss) and both gradient norms are the same (the whitening and the
    value loss's token mean span every DP rank's tokens)."""
    policy, critic = models
    groups = _groups(2, seed=13)
    flags = ["--critic-hf-checkpoint", critic, "--old-logprobs", "recompute"]
    runs = {}
    for name, nproc in (("one", 1), ("dp2", 2)):
        runs[name], _, _ = run_on_fresh_pool(tmp_path, name, policy, _feed(groups), iters=1, groups=2, extra=flags,
                                             nproc=nproc)
    (one,), (dp2,) = runs["one"], runs["dp2"]
    for key in ("critic/value_mean", "critic/return_mean", "critic/advantage_mean", "critic/advantage_std",
                "critic/explained_variance", "critic/vf_loss", "critic/grad_norm", "grad_norm"):
        assert dp2[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key


def test_a_lora_policy_trains_beside_a_whole_critic(models, tmp_path):
    """--lora-rank with --critic: the policy trains its adapters, the critic all of its weights (LoRA is the
    policy's). At step 1 the adapters are zero, so the LoRA run's policy loss and every critic metric equal a full
    run's; the adapters then move the policy (step 2's ratios differ from step 1's)."""
    policy, critic = models
    groups = _groups(2, seed=17)
    flags = ["--critic-hf-checkpoint", critic, "--old-logprobs", "recompute"]
    runs = {}
    for name, extra in (("full", []), ("lora", ["--lora-rank", "4", "--lora-alpha", "8"])):
        runs[name], _, _ = run_on_fresh_pool(tmp_path, name, policy, _feed(groups), iters=2, groups=1,
                                             extra=flags + extra)
    full, lora = runs["full"][0], runs["lora"][0]
    for key in ("loss", "critic/value_mean", "critic/vf_loss", "critic/grad_norm", "critic/explained_variance"):
        assert lora[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    assert lora["grad_norm"] != pytest.approx(full["grad_norm"], rel=1e-3)  # (the adapters' gradients alone)
    assert runs["lora"][1]["update_ok"] and runs["lora"][1]["critic/update_ok"]


def test_whitened_group_advantages_without_a_critic(models, tmp_path):
    """--whiten-advantages without --critic (REINFORCE++'s batch normalisation): the pool's group advantages of every
    trained token, whitened over the whole batch, train the policy: with recomputed pi_old (ratio 1) the CISPO loss is
    -(1/N) sum_t z_t logp_t with z the tokens' whitened advantages, from transformers' logprobs; the metrics give the
    raw advantages' token mean and std; two groups split over two DP ranks whiten alike (same statistics, same
    gradient norm)."""
    from forge_megatron.algo import EpisodeOutcome, RewardConfig, score_group

    policy, critic = models
    groups = _groups(2, seed=19)
    flags = ["--whiten-advantages", "--old-logprobs", "recompute"]
    raw, logps = [], []
    for episodes in groups:
        scores = score_group([EpisodeOutcome(outcome_reward=r, success=r > 0, duration_s=1.0)
                              for _, _, r in episodes], RewardConfig())
        _, _, logp = _reference(policy, critic, episodes)
        logps.append(logp)
        raw += [torch.full((len(c),), a[0], dtype=torch.float64)
                for (_, c, _), a in zip(episodes, scores.segment_advantages)]
    a, logp = torch.cat(raw), torch.cat(logps)
    z = (a - a.mean()) / (a.std(unbiased=False) + 1e-8)
    runs = {}
    for name, nproc in (("one", 1), ("dp2", 2)):
        (runs[name],), _, _ = run_on_fresh_pool(tmp_path, name, policy, _feed(groups), iters=1, groups=2,
                                                extra=flags, nproc=nproc)
    one = runs["one"]
    assert one["advantages/raw_mean"] == pytest.approx(a.mean().item(), abs=1e-6)
    assert one["advantages/raw_std"] == pytest.approx(a.std(unbiased=False).item(), rel=1e-6)
    assert one["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert one["loss"] == pytest.approx(-(z * logp).mean().item(), rel=1e-5, abs=1e-6)
    for key in ("advantages/raw_mean", "advantages/raw_std", "grad_norm"):
        assert runs["dp2"][key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
