"""Calls that an engine aborts for a weight update go on from the tokens they had sampled (partial rollout).

Real forge-engines (in-process) and gateways on loopback, the official ``openai`` client, a real weight update from
disk between the two parts. What is checked against HF: each kept token's logprob and routed experts are those of
the weights that sampled it, the rest those of the new weights, and the per-token policy versions say which.
"""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge_megatron.middleware.gateway import ABORT_RETRIES, Gateway, GatewayConfig, _Call, continuation_seed
from forge_megatron.middleware.gateway_sessions import _Turn
from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.rollout.launch import start_engine, start_gateway
from forge_megatron.rollout.sglang_client import GenerateResult
from tests.middleware.test_gateway import (
    abort_busy_call, busy_engine, calls, client, end, episode, http, new_session, stream_in_thread,
)
from tests.rollout.test_engine import _routers_topk

LONG = [{"role": "user", "content": "long"}]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    return (build_tiny_model(str(d / "v0"), arch="qwen3_moe", seed=0),
            build_tiny_model(str(d / "v1"), arch="qwen3_moe", seed=5))


@pytest.fixture(scope="module")
def plain_stack(moe_dirs):
    e = start_engine(moe_dirs[0], in_process=True)
    gw = start_gateway(moe_dirs[0], [e.url], in_process=True)
    yield gw, e
    gw.stop()
    e.stop()


def call_in_thread(s, **kw):
    out = {}

    def run():
        try:
            out["r"] = client(s).chat.completions.create(model="tiny", messages=LONG, **kw)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def teacher_forced(model_dir, ids):
    """Per-position log-softmax [len(ids) - 1, vocab] and routed experts [len(ids) - 1, layers, topk] of HF."""
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return logp, _routers_topk(m, ids[:-1]).to(torch.int32)


def test_call_spanning_a_weight_update_keeps_each_tokens_version_logprob_and_experts(moe_dirs):
    """The weight-sync sequence (gateway pause, engine pause abort, update from disk, continue, resume) in the middle
    of a 160-token call: the call completes once, its first k tokens carry version 0 with the old model's logprobs
    and routing, the rest version 1 with the new model's, and nothing sampled is thrown away."""
    v0, v1 = moe_dirs
    e = start_engine(v0, in_process=True, extra_args=["--enable-return-routed-experts"])
    gw = start_gateway(v0, [e.url], in_process=True, extra_args=["--return-routed-experts"])
    try:
        s = new_session(gw)
        t, out = call_in_thread(s, max_tokens=160, seed=3, extra_body={"ignore_eos": True})
        busy_engine([e], min_tokens=5)
        assert http(gw.url + "/forge/admin/pause", {})[0] == 200
        assert http(e.url + "/pause_generation", {"mode": "abort"})[1]["success"]
        assert http(e.url + "/update_weights_from_disk", {"model_path": v1, "weight_version": "1"})[1]["success"]
        http(e.url + "/continue_generation", {})
        http(gw.url + "/forge/admin/resume", {"policy_version": 1})
        t.join(60)
        assert "error" not in out, out
        assert out["r"].usage.completion_tokens == 160
        [call] = calls(gw, s)
        stats = http(gw.url + "/forge/admin/state", method="GET")[1]
        assert end(gw, s)[0] == 200
        [seg] = episode(gw, s).segments
        # the continuation was sampled with a seed of its own (not a replay of the first part's random stream):
        # asking the updated engine for it directly with that seed gives exactly the resumed tokens
        k = call["policy_versions"].count(0)
        seed = continuation_seed(3, 1)
        assert seed != 3 and 0 <= seed < 1 << 63 and seed == continuation_seed(3, 1) != continuation_seed(3, 2)
        status, direct = http(e.url + "/generate", {
            "input_ids": call["prompt_ids"] + call["completion_ids"][:k], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 160 - k, "temperature": 1.0, "top_p": 1.0, "sampling_seed": seed,
                                "ignore_eos": True}})
        assert status == 200 and direct["output_ids"] == call["completion_ids"][k:]
    finally:
        gw.stop()
        e.stop()
    versions = call["policy_versions"]
    assert 5 < k < 160 and versions == [0] * k + [1] * (160 - k)
    assert call["resumed"] == 1 and call["policy_version"] == 1
    assert stats["aborts"] == 1 and stats["resumed_tokens"] == k and stats["discarded_tokens"] == 0
    prompt, completion = call["prompt_ids"], call["completion_ids"]
    ids, P = prompt + completion, len(prompt)
    assert seg.tokens == ids and seg.policy_versions == [-1] * P + versions
    pos = torch.arange(P - 1, len(ids) - 1)
    lp_old, routed_old = teacher_forced(v0, ids)
    lp_new, routed_new = teacher_forced(v1, ids)
    want = torch.cat([lp_old[pos[:k], completion[:k]], lp_new[pos[k:], completion[k:]]])
    assert call["logprobs"] == pytest.approx(want.tolist(), abs=1e-4)
    # the other weights' logprobs differ: the check above tells the two parts apart
    assert (lp_new[pos[:k], completion[:k]] - want[:k]).abs().max() > 1e-2
    # routing rows: a position belongs to the part that sampled the token after it (row P + k - 1 is the new part's)
    got = torch.from_numpy(seg.routed_experts.astype("int32"))
    assert (got[-1] == -1).all()
    cut = P + k - 1
    assert torch.equal(got[:cut].sort(-1).values, routed_old[:cut].sort(-1).values)
    assert torch.equal(got[cut:-1].sort(-1).values, routed_new[cut:].sort(-1).values)
    assert not torch.equal(routed_old[:cut].sort(-1).values, routed_new[:cut].sort(-1).values)


def test_stream_goes_on_through_aborts(plain_stack):
    """Content reached the client, then the engine aborted: the stream continues without a break and what the
    client read is the recorded completion's text."""
    gw, e = plain_stack
    s = new_session(gw)
    t, got_content, out = stream_in_thread(
        s, messages=LONG, max_tokens=400, seed=4, tool_choice="none", extra_body={"ignore_eos": True},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert got_content.wait(60)
    abort_busy_call([e])
    t.join(60)
    assert "error" not in out, out
    [call] = calls(gw, s)
    assert out["finish"] == "length" and call["resumed"] == 1 and len(call["completion_ids"]) == 400
    tok = gw.gateway.renderer.tok
    assert out["text"] == tok.decode(call["completion_ids"], skip_special_tokens=False)


def test_aborts_that_make_progress_do_not_count_against_the_retry_limit(plain_stack):
    gw, e = plain_stack
    s = new_session(gw)
    t, out = call_in_thread(s, max_tokens=600, seed=5, extra_body={"ignore_eos": True})
    for _ in range(ABORT_RETRIES + 1):
        abort_busy_call([e], hold_s=0.02)  # once the current part has sampled something
    t.join(60)
    assert "error" not in out, out
    [call] = calls(gw, s)
    assert call["resumed"] == ABORT_RETRIES + 1 and len(call["completion_ids"]) == 600
    assert call["policy_versions"] == [0] * 600


def test_without_resume_aborted_calls_start_over(plain_stack, moe_dirs):
    """--no-resume-aborted: the aborted part is thrown away (counted), the call is re-issued from its prompt; a
    stream that had sent content ends with an OpenAI-style error event instead."""
    _, e = plain_stack
    gw = start_gateway(moe_dirs[0], [e.url], in_process=True, extra_args=["--no-resume-aborted"])
    try:
        s = new_session(gw)
        t, out = call_in_thread(s, max_tokens=300, seed=4, extra_body={"ignore_eos": True})
        abort_busy_call([e], min_tokens=5)
        t.join(60)
        assert out["r"].usage.completion_tokens == 300
        [call] = calls(gw, s)
        assert call["resumed"] == 0 and len(call["completion_ids"]) == 300
        assert http(gw.url + "/forge/admin/state", method="GET")[1]["discarded_tokens"] > 5

        s = new_session(gw)
        t, got_content, out = stream_in_thread(s, messages=LONG, max_tokens=1000, seed=4,
                                               extra_body={"ignore_eos": True})
        assert got_content.wait(60)
        abort_busy_call([e], resume=False)
        t.join(60)
        http(e.url + "/continue_generation", {})
        err = out["error"]
        assert err.body["code"] == "aborted" and err.body["type"] == "service_unavailable"
        assert "aborted the call (weights update) after" in err.message and "characters were streamed" in err.message
        assert calls(gw, s) == []  # nothing recorded for a call the client did not get
    finally:
        gw.stop()


# --- joining parts (no engine involved: the parts are built here) --------------------------------------------------
@pytest.fixture(scope="module")
def joiner(moe_dirs):
    return Gateway(GatewayConfig(model_path=moe_dirs[0], engine_urls=["http://127.0.0.1:9"]))


def part(ids, version, finish=None, first=0.0):
    return GenerateResult(output_ids=list(ids), logprobs=[first - i for i in range(len(ids))],
                          finish_reason=finish or {"type": "abort"}, prompt_tokens=3,
                          completion_tokens=len(ids), weight_version=str(version), text="")


def new_call(stop=None, max_new_tokens=100, ignore_eos=False):
    sampling = {"max_new_tokens": max_new_tokens, **({"stop": stop} if stop else {}),
                **({"ignore_eos": True} if ignore_eos else {})}
    return _Call(turn=_Turn(messages=[], tools=None, prompt_text="", prompt_ids=[5, 6, 7], completion_ids=[],
                            assistant_message={}), continues=False, sampling=sampling, forced_text="", started=0.0)


def test_a_stop_string_split_by_an_abort_ends_the_completion_where_it_completes(joiner):
    """The engine checks stop strings in each request's own output: "STOP" sampled as "ST" | "OP" is found by the
    gateway, the completion cut after the token that completes it (as the engine keeps it), versions cut along."""
    tok = joiner.renderer.tok
    a, b = tok.encode("one ST", add_special_tokens=False), tok.encode("OP two three", add_special_tokens=False)
    assert tok.decode(a) + tok.decode(b) == "one STOP two three"
    call = new_call(stop=["STOP"])
    call.done.append((part(a, 0), 0))
    ids, sampling = joiner.next_request(call)
    assert ids == [5, 6, 7] + a and sampling["max_new_tokens"] == 100 - len(a)
    result = joiner.complete(call, part(b, 1, {"type": "length"}, first=-50.0))
    n = len(result.output_ids)
    assert len(a) < n < len(a) + len(b)
    assert "STOP" in tok.decode(result.output_ids) and "STOP" not in tok.decode(result.output_ids[:-1])
    assert result.finish_reason == {"type": "stop", "matched": "STOP"}
    assert call.versions == [0] * len(a) + [1] * (n - len(a))
    assert result.logprobs == part(a, 0).logprobs + part(b, 1, first=-50.0).logprobs[:n - len(a)]
    assert joiner.renderer.completion_text(result.output_ids, result.finish_reason) == "one "
    # no stop string across the cut: nothing is cut
    call = new_call(stop=["never"])
    call.done.append((part(a, 0), 0))
    result = joiner.complete(call, part(b, 1, {"type": "length"}))
    assert result.output_ids == a + b and result.finish_reason == {"type": "length"}


def test_kept_parts_that_use_the_budget_or_end_the_turn_complete_the_call(joiner):
    tok = joiner.renderer.tok
    a = tok.encode("abc", add_special_tokens=False)
    call = new_call(max_new_tokens=len(a))
    call.done.append((part(a, 2), 2))
    ids, sampling = joiner.next_request(call)
    assert joiner.kept_is_whole(call, sampling)
    result = joiner.complete(call, None)
    assert result.output_ids == a and result.finish_reason == {"type": "length", "length": len(a)}
    assert call.versions == [2] * len(a)
    eot = tok.eos_token_id
    for ignore_eos, whole in ((False, True), (True, False)):
        call = new_call(ignore_eos=ignore_eos)
        call.done.append((part(a + [eot], 2), 2))
        assert joiner.kept_is_whole(call, joiner.next_request(call)[1]) is whole
    result = joiner.complete(new_call_with([a + [eot]]), None)
    assert result.finish_reason == {"type": "stop", "matched": eot}


def new_call_with(parts):
    call = new_call()
    for p in parts:
        call.done.append((part(p, 0), 0))
    return call


def test_routing_rows_of_joined_parts_and_parts_without_routing(moe_dirs):
    """Three parts over a 3-token prompt: row p comes from the part that sampled token p + 1 (part i answered rows
    [0, n_i + k_i - 1) for its n_i input ids); an aborted part whose engine sent no routing is dropped (counted),
    not kept without it."""
    import numpy as np

    gw = Gateway(GatewayConfig(model_path=moe_dirs[0], engine_urls=["http://127.0.0.1:9"],
                               return_routed_experts=True))
    layers, top_k = gw.routing_shape

    def routed(n_rows, tag):  # every id of part `tag` is tag (a valid expert id), so rows tell their part
        return np.full(n_rows * layers * top_k, tag, dtype=np.int32)

    call = new_call()
    sizes = [2, 3, 4]
    n = 3
    for i, k in enumerate(sizes[:-1]):
        p = part(range(10 * i, 10 * i + k), i)
        p.routed_experts = routed(n + k - 1, i)
        assert gw.keep_aborted(call, n, p)
        n += k
    last = part(range(20, 24), 2, {"type": "length"})
    last.routed_experts = routed(n + sizes[-1] - 1, 2)
    result = gw.complete(call, last)
    rows = gw.routed_experts_of(3, result)
    assert rows.shape == (3 + sum(sizes) - 1, layers, top_k)
    assert [int(r[0, 0]) for r in rows] == [0] * 4 + [1] * 3 + [2] * 4  # cuts at n_i - 1: rows 4 and 7
    assert call.versions == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    dropped = new_call()
    assert not gw.keep_aborted(dropped, 3, part([1, 2], 0)) and dropped.done == []
    assert gw.stats["discarded_tokens"] == 2 and gw.stats["resumed_tokens"] == 5
