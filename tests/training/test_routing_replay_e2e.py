"""Rollout routing replay end to end: a MoE forge-engine recording routed experts, the gateway keeping them, the data
pool (a forge-pool process) and the Megatron trainer replaying them. CPU, fp32 on both sides, the same weights.

With the engine and the trainer computing the same network, the recorded experts must be the trainer's own routing
for (almost) every (token, layer) row: a low ``routing_mismatch`` proves that the engine's row t reaches the
trainer's tree token t through the gateway's segments, the pool, the batch wire and the tree packing (an
off-by-one anywhere would make most rows disagree). Replay then changes (almost) nothing about the loss.
"""

import numpy as np
import pytest

from forge_megatron.models.tiny import build_tiny_model
from tests.training.trainer_run import run_on_fresh_pool

MESSAGES = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "Name a colour."}],
]


def _rollouts(model_dir: str):
    """feed(client): two groups of two sessions each, through a MoE engine and the gateway, into the pool."""

    def feed(client):
        import openai

        from forge_megatron.rollout.launch import start_engine, start_gateway
        from tests.middleware.test_gateway import http

        engine = start_engine(model_dir, in_process=True, extra_args=["--enable-return-routed-experts"])
        gw = start_gateway(model_dir, [engine.url], in_process=True, sink=client,
                           extra_args=["--return-routed-experts"])
        try:
            for g, messages in enumerate(MESSAGES):
                _, group = http(gw.url + "/forge/groups", {"task_id": f"t{g}", "size": 2})
                for e in range(2):
                    _, s = http(gw.url + "/forge/sessions", {"group_id": group["group_id"]})
                    chat = openai.OpenAI(base_url=s["base_url"], api_key="x", max_retries=0, timeout=60)
                    first = chat.chat.completions.create(model="m", messages=messages, max_tokens=6, seed=10 * g + e)
                    follow = messages + [first.choices[0].message.model_dump(exclude_none=True),
                                         {"role": "user", "content": "And then?"}]
                    chat.chat.completions.create(model="m", messages=follow, max_tokens=6, seed=10 * g + e + 1)
                    http(f"{gw.url}/forge/sessions/{s['session_id']}/reward", {"reward": float(e)})
                    status, body = http(f"{gw.url}/forge/sessions/{s['session_id']}/end", {"status": "finished"})
                    assert status == 200 and body["sink"] == "accepted", body
        finally:
            gw.stop()
            engine.stop()

    return feed


# Gemma 4: its router on the layer, top_k_experts; ERNIE 4.5: a softmax router choosing with a bias (mcore/ernie.py);
# Llama 4: the top-1 of its router's logits (the engine records them from feed_forward.router), the experts fed
# inputs scaled by the router's sigmoid; Qwen3-VL-MoE: the decoder layers under model.language_model (Granite MoE's
# and LFM2-MoE's routers: tests/rollout/test_engine.py)
@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4_moe", "ernie4_5_moe", "llama4", "qwen3_vl_moe"])
def test_engine_routing_is_the_trainers_own(tmp_path, arch):
    model_dir = build_tiny_model(str(tmp_path / "moe"), arch=arch, seed=4, sampling_seed=0)
    steps = {}
    for name, extra in (("replay", ["--routing-replay"]), ("natural", [])):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, _rollouts(model_dir), iters=1, groups=2,
                                              extra=extra, model=[])
    replay, natural = steps["replay"][0], steps["natural"][0]
    assert replay["samples"] == 4 and replay["routing_replayed_rows"] > 100
    assert replay["routing_mismatch"] <= 0.02, replay  # the same network on both sides: the rows line up
    assert replay["rollout_logp_abs_diff"] <= 1e-4, replay  # and the engine's logprobs are the trainer's
    assert replay["routing_prefix_conflicts"] == 0.0  # a group's episodes recorded the same experts for the prompt
    assert replay["loss"] == pytest.approx(natural["loss"], rel=1e-3, abs=1e-4)
    assert np.isfinite(replay["grad_norm"]) and replay["grad_norm"] > 0
