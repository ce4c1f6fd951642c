"""--int4-qat end to end: the trainer, as a real process against a real forge-pool process, scores rollouts sampled
from an int4 release (Kimi-style: the routed experts packed by the compressed-tensors library) with that release's
weights. The rollouts' logprobs come from transformers on the library's dequantization of the release; with
--int4-qat the trainer's first-step logprobs of the same tokens match them (rollout_logp_abs_diff at float noise),
without it they are off by the int4 rounding. CPU, 0 GPUs (gloo)."""

import time
import uuid

import numpy as np
import torch

from forge_megatron.middleware.schema import Episode, Segment
from forge_megatron.models.tiny import build_tiny_model

from .trainer_run import run_on_fresh_pool


def _feed_from(policy, vocab=300, groups=2, group_size=4, prompt_len=10, completion_len=6):
    """A pool feed whose episodes' rollout logprobs are ``policy``'s (a transformers model) for their tokens."""
    rng = np.random.default_rng(7)

    def feed(client):
        for _ in range(groups):
            prompt = rng.integers(10, vocab, size=prompt_len).tolist()
            gid = client.register_group(f"task-{uuid.uuid4().hex[:6]}", group_size, "default")
            for e in range(group_size):
                tokens = prompt + rng.integers(10, vocab, size=completion_len).tolist()
                with torch.no_grad():
                    logp = torch.log_softmax(policy(torch.tensor([tokens])).logits[0].double(), -1)
                lps = [0.0] * prompt_len + [logp[t - 1, tokens[t]].item() for t in range(prompt_len, len(tokens))]
                seg = Segment(tokens=tokens, loss_mask=[0] * prompt_len + [1] * completion_len, rollout_logprobs=lps,
                              policy_versions=[-1] * prompt_len + [0] * completion_len)
                eid = f"{gid}-e{e}"
                client.episode_started(gid, eid)
                now = time.time()
                client.submit_episode(Episode(episode_id=eid, group_id=gid, task_id="t", segments=[seg],
                                              reward=float(e % 2), started_at=now - 1, ended_at=now))
    return feed


def test_int4_qat_trainer_scores_with_the_weights_the_engines_sample_from(tmp_path):
    from tests.weight_sync.test_int4 import _hf, _library_checkpoint, _library_dequantized

    model_dir = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", seed=8)
    release = _library_checkpoint(model_dir, str(tmp_path / "int4"))
    feed = _feed_from(_hf(_library_dequantized(release, str(tmp_path / "int4_fp32"))))
    diffs, outs, kl = {}, {}, {}
    # with a KL term its frozen reference is rounded as the policy is: the first step's KL is zero
    for name, extra in (("qat", ["--int4-qat", release, "--rl-kl-coef", "0.01"]), ("plain", [])):
        steps, stdouts, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=1, groups=2, model=[],
                                              extra=extra + ["--tree-token-budget", "64"])
        diffs[name], outs[name], kl[name] = steps[0]["rollout_logp_abs_diff"], stdouts[0], steps[0].get("kl")
    assert diffs["qat"] <= 1e-5, diffs
    assert diffs["plain"] > 5e-4, diffs  # the int4 rounding the engines sampled with (1.3e-3 here)
    assert kl["qat"] is not None and abs(kl["qat"]) <= 1e-9, kl
    # every expert's fc1 and fc2 (2 layers x 4 experts x 2), attention left as the release leaves it
    assert "--int4-qat: 16 weight(s) on rank 0 computed with their int4 rounding (group 16)" in outs["qat"]
