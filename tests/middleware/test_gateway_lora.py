"""The gateway in front of engines serving the policy as a LoRA adapter (the trainer's --weight-sync-lora adapter):
``/forge/admin/resume {policy_version, lora_name}`` makes every call from then on name the adapter (SGLang's
``lora_path``) and record its version; a call sent before, to the checkpoint's weights, keeps version 0 though it ends
after the switch (nothing pauses it); a bad ``lora_name`` is a 400. Real engine with a PEFT adapter, real gateway."""

import threading
import time

import pytest

from forge_megatron.rollout.launch import start_engine, start_gateway
from tests.middleware.test_gateway import calls, client, http, new_session
from tests.rollout.peft_adapters import write_peft_adapter

NAME = "forge-0a1b-v3"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("gateway_lora")
    model = build_tiny_model(str(root / "model"), seed=5)
    engine = start_engine(model, in_process=True, extra_args=["--enable-lora"])
    adapter = write_peft_adapter(model, str(root / "adapter"), b_std=0.5)
    assert http(engine.url + "/load_lora_adapter", {"lora_name": NAME, "lora_path": adapter})[0] == 200
    gateway = start_gateway(model, [engine.url], in_process=True)
    yield engine, gateway
    gateway.stop()
    engine.stop()


def _chat(gw, content):
    s = new_session(gw)
    client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    (call,) = calls(gw, s)
    return call


def _engine_greedy(engine, prompt_ids, n, lora_path=None):
    status, out = http(engine.url + "/generate", {
        "input_ids": prompt_ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        **({"lora_path": lora_path} if lora_path else {})})
    assert status == 200, out
    return out["output_ids"]


def test_calls_name_the_policy_adapter_once_told_and_keep_the_version_they_were_sent_at(served):
    engine, gw = served
    assert http(engine.url + "/pause_generation", {"mode": "in_place"})[0] == 200  # hold the first call
    held = {}
    first = threading.Thread(target=lambda: held.update(call=_chat(gw, "what is 2+2?")))
    first.start()
    deadline = time.monotonic() + 30
    while not engine.engine.admitted and time.monotonic() < deadline:
        time.sleep(0.01)
    status, answer = http(gw.url + "/forge/admin/resume", {"policy_version": 3, "lora_name": NAME})
    assert status == 200 and answer == {"paused": False, "policy_version": 3, "policy_adapter": NAME}
    assert http(engine.url + "/continue_generation", {})[0] == 200
    first.join(60)
    call = held["call"]  # sent to the checkpoint's weights: version 0, the base model's tokens
    assert call["policy_version"] == 0 and set(call["policy_versions"]) == {0}
    assert call["completion_ids"] == _engine_greedy(engine, call["prompt_ids"], 8)
    call = _chat(gw, "what is 2+2?")  # named the adapter: its version, its tokens
    assert call["policy_version"] == 3 and set(call["policy_versions"]) == {3}
    assert call["completion_ids"] == _engine_greedy(engine, call["prompt_ids"], 8, NAME)
    assert call["completion_ids"] != _engine_greedy(engine, call["prompt_ids"], 8)
    state = http(gw.url + "/forge/admin/state", method="GET")[1]
    assert state["policy_adapter"] == NAME and state["aborts"] == 0


@pytest.mark.parametrize("lora_name", ["", 5, "x" * 300])
def test_a_bad_lora_name_is_a_400(served, lora_name):
    _, gw = served
    status, body = http(gw.url + "/forge/admin/resume", {"policy_version": 4, "lora_name": lora_name})
    assert status == 400 and "lora_name must be the name of the LoRA adapter" in body["error"]["message"]


def test_a_call_on_an_engine_without_the_adapter_goes_to_one_that_has_it(served, tmp_path):
    """An engine that lacks the named adapter (restarted, or it failed the last load) answers SGLang's "not loaded";
    the call goes on another engine, which has it (the engine is not marked down: the next sync loads it there)."""
    engine, gw = served
    bare = start_engine(engine.engine.model_path, in_process=True, extra_args=["--enable-lora"])
    both = start_gateway(engine.engine.model_path, [bare.url, engine.url], in_process=True)
    try:
        assert http(both.url + "/forge/admin/resume", {"policy_version": 3, "lora_name": NAME})[0] == 200
        recorded = [_chat(both, f"question {i}") for i in range(4)]
        assert {c["engine_url"] for c in recorded} == {engine.url} and {c["policy_version"] for c in recorded} == {3}
        state = http(both.url + "/forge/admin/state", method="GET")[1]
        assert all(e["up"] for e in state["engines"])
        assert [e["failures"] for e in state["engines"] if e["url"] == bare.url] == [0]
    finally:
        both.stop()
        bare.stop()
