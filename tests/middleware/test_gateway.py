"""forge-gateway end to end: the official ``openai`` client -> gateway -> forge-engine(s) on the tiny model.

Real HTTP on loopback, real engines (in-process threads, or subprocesses where one is killed). The tool-call round
trip uses the tiny model fine-tuned in the fixture to answer two fixed chats (real weights and logprobs, known greedy
output). CPU only.
"""

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_megatron.middleware.gateway import ApiError, GatewayConfig, parse_chat_request
from forge_megatron.middleware.gateway_sessions import ChatRenderer
from forge_megatron.middleware.tool_parsers import CannotForceToolCall, get_parser
from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.rollout.launch import start_engine, start_engines, start_gateway

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_RESULT = "sunny, 22C"
FINAL_ANSWER = "It is sunny."


def scripted_chats():
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    after = USER + [call, {"role": "tool", "tool_call_id": "c1", "content": TOOL_RESULT}]
    return [(USER, TOOL_CALL_TEXT), (after, FINAL_ANSWER)]


def http(url, body=None, method="POST", headers=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def new_session(gw, size=1, headers=None):
    _, g = http(gw.url + "/forge/groups", {"task_id": "t", "size": size, "domain": "agent"}, headers=headers)
    status, s = http(gw.url + "/forge/sessions", {"group_id": g["group_id"], "metadata": {"k": 1}}, headers=headers)
    assert status == 200, s
    return s


def client(session):
    return openai.OpenAI(base_url=session["base_url"], api_key="ignored", max_retries=0, timeout=60)


def end(gw, s, status="finished"):
    return http(f"{gw.url}/forge/sessions/{s['session_id']}/end", {"status": status})


def calls(gw, s):
    return http(f"{gw.url}/forge/sessions/{s['session_id']}", method="GET")[1]["calls"]


def episode(gw, s):
    return next(e for e in gw.gateway.sink.episodes if e.episode_id == s["session_id"])


def assert_records_like_the_chat_path(gw, s):
    """Session ``s`` (ended) held the scripted tool round trip through another API: run the same conversation
    through /v1/chat/completions and check that both recorded the same prompt and completion ids, segment tokens
    included."""
    o = new_session(gw)
    oc = client(o)
    r1 = oc.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=64)
    msg = r1.choices[0].message.model_dump(exclude_none=True)
    oc.chat.completions.create(model="tiny", temperature=0, max_tokens=64, tools=TOOLS, messages=USER + [
        msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": TOOL_RESULT}])
    ours, chat = calls(gw, s), calls(gw, o)
    assert len(ours) == len(chat) == 2
    for a, b in zip(ours, chat):
        assert a["prompt_ids"] == b["prompt_ids"] and a["completion_ids"] == b["completion_ids"]
    assert end(gw, o)[0] == 200
    assert episode(gw, s).segments[0].tokens == episode(gw, o).segments[0].tokens


def busy_engine(engines, min_tokens=2, timeout_s=60):
    """The in-process engine handle serving a request that has sampled more than ``min_tokens`` tokens."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for h in engines:
            if any(len(r.output_ids) > min_tokens for r in list(h.engine.running.values())):
                return h
        time.sleep(0.002)
    pytest.fail("no engine started serving the call")


def abort_busy_call(engines, min_tokens=2, hold_s=0.05, resume=True):
    """What a weight update does to a call in flight: pause the engine serving it (once it has sampled more than
    ``min_tokens`` tokens) with mode=abort, then, unless ``resume`` is False, continue after ``hold_s``."""
    busy = busy_engine(engines, min_tokens)
    assert http(busy.url + "/pause_generation", {"mode": "abort"})[1]["success"]
    if resume:
        time.sleep(hold_s)
        http(busy.url + "/continue_generation", {})
    return busy


def stream_in_thread(session, **kw):
    """Consume a chat stream on a thread: (thread, event set once content arrived, out {text, finish, error})."""
    got_content, out = threading.Event(), {"text": ""}

    def consume():
        try:
            for ch in client(session).chat.completions.create(model="tiny", stream=True, **kw):
                if ch.choices and ch.choices[0].delta.content:
                    out["text"] += ch.choices[0].delta.content
                    got_content.set()
                if ch.choices and ch.choices[0].finish_reason:
                    out["finish"] = ch.choices[0].finish_reason
        except openai.APIError as exc:
            out["error"] = exc
        got_content.set()

    t = threading.Thread(target=consume)
    t.start()
    return t, got_content, out


def as_message(choice_message):
    return choice_message.model_dump(exclude_none=True)


def test_plain_chat_records_the_engines_tokens(stack, model_dir):
    gw, engines = stack
    s = new_session(gw)
    r = client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=12, temperature=1.0, seed=11)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    [call] = calls(gw, s)
    assert r.usage.prompt_tokens == len(call["prompt_ids"]) and r.usage.completion_tokens == len(call["completion_ids"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert call["prompt_ids"] == tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                                         add_generation_prompt=True, tokenize=True)["input_ids"]
    # the recorded logprobs are the model's: teacher-forced HF forward on the recorded ids
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = m(torch.tensor([call["prompt_ids"] + call["completion_ids"]])).logits[0]
    n_p = len(call["prompt_ids"])
    ref = torch.log_softmax(logits[n_p - 1:-1], -1)[torch.arange(len(call["completion_ids"])),
                                                     torch.tensor(call["completion_ids"])]
    assert call["logprobs"] == pytest.approx(ref.tolist(), abs=1e-4)
    # and the ids are exactly what the engine samples for that prompt and seed
    status, direct = http(call["engine_url"] + "/generate", {
        "input_ids": call["prompt_ids"], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "sampling_seed": 11}})
    assert status == 200 and direct["output_ids"] == call["completion_ids"]
    assert http(gw.url + "/v1/models", method="GET")[1]["data"][0]["id"] == gw.gateway.model_name
    r2 = client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=12, temperature=1.0, seed=11, logprobs=True, top_logprobs=3)
    content = r2.choices[0].logprobs.content
    assert [t.logprob for t in content] == calls(gw, s)[1]["logprobs"] == call["logprobs"]
    assert [t.token for t in content] == [tok.decode([i]) for i in call["completion_ids"]]
    # top_logprobs: the 3 most likely tokens of each position's distribution, as the teacher-forced forward has them
    logp = torch.log_softmax(logits[n_p - 1:-1], -1)
    for pos, t in enumerate(content):
        want = torch.topk(logp[pos], 3)
        assert [a.token for a in t.top_logprobs] == [tok.decode([i]) for i in want.indices.tolist()]
        assert [a.logprob for a in t.top_logprobs] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert t.top_logprobs[0].bytes == list(t.top_logprobs[0].token.encode())


def test_streamed_logprobs_join_to_the_answers(stack):
    """With logprobs, each streamed chunk carries the logprobs of the tokens sampled since the last one that did (the
    finish chunk the rest): joined, they are the non-streamed answer's, top alternatives and legacy offsets too."""
    gw, _ = stack
    c = client(new_session(gw))
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=1.0,
                seed=7, logprobs=True, top_logprobs=2)
    whole = c.chat.completions.create(**chat).choices[0]
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**chat, stream=True) if ch.choices]
    joined = [t.model_dump() for ch in chunks if ch.logprobs for t in ch.logprobs.content]
    assert joined == [t.model_dump() for t in whole.logprobs.content] and len(joined) > 2
    assert sum(1 for ch in chunks if ch.logprobs) > 1  # spread over the chunks, not all at the end
    text = dict(model="tiny", prompt="Q: What is 2 + 3?\nA:", max_tokens=10, temperature=1.0, seed=3, logprobs=2)
    whole = c.completions.create(**text).choices[0].logprobs
    pieces = [ch.choices[0].logprobs for ch in c.completions.create(**text, stream=True) if ch.choices]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in pieces if p for x in getattr(p, key)] == getattr(whole, key), key
    assert all(0 < len(alternatives) <= 2 for alternatives in whole.top_logprobs)


def test_tool_round_trip_is_one_segment(stack, model_dir):
    """Two calls, one segment: the second prompt is the template's rendering of the history (the first call's
    tokens as sampled, then the tool result), the segment holds both calls' tokens with the completions unmasked."""
    gw, _ = stack
    tok = AutoTokenizer.from_pretrained(model_dir)
    s = new_session(gw)
    c = client(s)
    msgs = list(USER)
    r1 = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, temperature=0, max_tokens=60)
    ch = r1.choices[0]
    assert ch.finish_reason == "tool_calls"
    [tc] = ch.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    msgs += [as_message(ch.message), {"role": "tool", "tool_call_id": tc.id, "content": TOOL_RESULT}]
    r2 = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, temperature=0, max_tokens=30)
    assert r2.choices[0].message.content == FINAL_ANSWER and r2.choices[0].finish_reason == "stop"
    http(f"{gw.url}/forge/sessions/{s['session_id']}/reward", {"reward": 1.0, "terms": {"format": 0.5}})
    assert end(gw, s)[0] == 200
    ep = episode(gw, s)
    [seg] = ep.segments
    rec = calls(gw, s)  # prompt and completion ids: positions of the segment (CallRecord)
    assert rec[1]["prompt_ids"][:len(rec[0]["prompt_ids"]) + len(rec[0]["completion_ids"])] == \
        rec[0]["prompt_ids"] + rec[0]["completion_ids"]
    assert seg.tokens == rec[1]["prompt_ids"] + rec[1]["completion_ids"]
    assert tok.decode(rec[0]["prompt_ids"]) == tok.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True,
                                                                       tokenize=False)
    assert tok.decode(rec[1]["prompt_ids"]) == tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True,
                                                                       tokenize=False)
    assert [len(r["completion_ids"]) for r in rec] == [r1.usage.completion_tokens, r2.usage.completion_tokens]
    n0p, n0c = len(rec[0]["prompt_ids"]), len(rec[0]["completion_ids"])
    assert seg.loss_mask == [0] * n0p + [1] * n0c + [0] * (len(rec[1]["prompt_ids"]) - n0p - n0c) + \
        [1] * len(rec[1]["completion_ids"])
    assert [v for v, m in zip(seg.policy_versions, seg.loss_mask) if not m] == [-1] * seg.loss_mask.count(0)
    assert ep.num_tool_calls == 1 and ep.num_malformed_tool_calls == 0 and ep.reward == 1.0
    assert ep.reward_terms == {"format": 0.5} and ep.domain == "agent" and ep.status == "finished"
    assert ep.ended_at >= ep.started_at > 0 and ep.metadata["k"] == 1


def test_tool_choice_required_then_auto_is_one_segment(stack, model_dir):
    """The forced <tool_call> opening is prompt (mask 0, version -1), the completion continues it, and the next
    turn's history (rendered by the chat template) equals the ids the engine saw, token for token."""
    gw, _ = stack
    tok = AutoTokenizer.from_pretrained(model_dir)
    forced_ids = tok.encode(get_parser("hermes").forced_prefix(), add_special_tokens=False)
    s = new_session(gw)
    c = client(s)
    r1 = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=0,
                                   max_tokens=60)
    [tc] = r1.choices[0].message.tool_calls
    assert r1.choices[0].finish_reason == "tool_calls"
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    msgs = USER + [as_message(r1.choices[0].message), {"role": "tool", "tool_call_id": tc.id, "content": TOOL_RESULT}]
    r2 = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, temperature=0, max_tokens=30)
    assert r2.choices[0].message.content == FINAL_ANSWER
    first, second = calls(gw, s)
    rendered = tok.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert first["prompt_ids"] == rendered + forced_ids  # the policy did not sample the opening
    assert first["completion_ids"][0] not in forced_ids and r1.usage.prompt_tokens == len(first["prompt_ids"])
    assert tok.decode(second["prompt_ids"]) == tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True,
                                                                       tokenize=False)
    assert end(gw, s)[0] == 200
    [seg] = episode(gw, s).segments
    n0p, n0c, n1p = len(first["prompt_ids"]), len(first["completion_ids"]), len(second["prompt_ids"])
    assert seg.tokens == second["prompt_ids"] + second["completion_ids"]
    assert seg.loss_mask == [0] * n0p + [1] * n0c + [0] * (n1p - n0p - n0c) + [1] * len(second["completion_ids"])
    assert seg.policy_versions[n0p - len(forced_ids):n0p] == [-1] * len(forced_ids)
    assert seg.rollout_logprobs[n0p - len(forced_ids):n0p] == [0.0] * len(forced_ids)
    assert seg.rollout_logprobs[n0p:n0p + n0c] == first["logprobs"]


def test_named_tool_choice_streams_like_non_streaming(stack, model_dir):
    gw, _ = stack
    tok = AutoTokenizer.from_pretrained(model_dir)
    s = new_session(gw)
    c = client(s)
    kw = dict(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [full] = c.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(c.chat.completions.create(stream=True, **kw))
    [streamed] = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert (streamed.function.name, streamed.function.arguments) == (full.function.name, full.function.arguments)
    assert full.function.name == "get_weather" and json.loads(full.function.arguments) == {"city": "Paris"}
    assert [call["num_tool_calls"] for call in calls(gw, s)] == [1, 1]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
    # a chat the model answers without calling: the named choice makes it attempt exactly one get_weather call
    # (the tiny model was never trained on it, so the attempt may be malformed JSON, which counts as a malformed call)
    hello = [{"role": "user", "content": "Hello"}]
    for choice in ("auto", kw["tool_choice"]):
        c.chat.completions.create(**{**kw, "messages": hello, "tool_choice": choice})
    unforced, forced_hello = calls(gw, s)[-2:]
    assert unforced["num_tool_calls"] + unforced["num_malformed_tool_calls"] == 0
    assert forced_hello["num_tool_calls"] + forced_hello["num_malformed_tool_calls"] == 1
    forced = tok.encode('<tool_call>\n{"name": "get_weather", "arguments":', add_special_tokens=False)
    assert [call["prompt_ids"][-len(forced):] == forced for call in calls(gw, s)] == [True, True, False, True]


def test_tool_choice_that_cannot_be_enforced_is_a_400(stack, model_dir):
    gw, _ = stack
    s = new_session(gw)
    named = {"type": "function", "function": {"name": "get_time"}}
    for body, says in [({"tools": TOOLS, "tool_choice": named}, "'get_time', which is not in tools ['get_weather']"),
                       ({"tool_choice": "required"}, "needs a non-empty tools array")]:
        status, err = chat_raw(gw, s["api_key"], json.dumps({"messages": USER, **body}).encode())
        assert status == 400 and err["error"]["param"] == "tool_choice" and says in err["error"]["message"]
    plain = start_gateway(model_dir, ["http://127.0.0.1:9"], in_process=True)
    plain.gateway.parser = get_parser("none")
    try:
        s = new_session(plain)
        status, err = chat_raw(plain, s["api_key"], json.dumps(
            {"messages": USER, "tools": TOOLS, "tool_choice": "required"}).encode())
        assert status == 400 and err["error"]["param"] == "tool_choice"
        assert "tool parser 'none' cannot force a tool call" in err["error"]["message"]
    finally:
        plain.stop()


def test_tool_choice_none_and_malformed_calls(stack):
    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none", temperature=0,
                                  max_tokens=60)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == TOOL_CALL_TEXT
    cut = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=6)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("<tool_call>")  # unclosed: malformed, kept as text
    end(gw, s)
    ep = episode(gw, s)
    assert ep.num_tool_calls == 0 and ep.num_malformed_tool_calls == 1


def test_call_rewards_by_the_id_of_the_answer(stack):
    """Every API's answer id names its call for a reward (``{"response": id}``): a chat completion, a streamed one
    (the id of its chunks), a legacy completion, a Responses API response and an Anthropic message; the session's
    record lists each call's response_id."""
    import anthropic

    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    msgs = [{"role": "user", "content": "q"}]
    ids = [c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3).id,
           list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, stream=True))[0].id,
           c.completions.create(model="tiny", prompt="q", max_tokens=3).id,
           c.responses.create(model="tiny", input="q", max_output_tokens=3).id,
           anthropic.Anthropic(base_url=s["anthropic_base_url"], api_key="x", max_retries=0, timeout=60).messages.create(
               model="tiny", max_tokens=3, messages=[{"role": "user", "content": "q"}]).id]
    assert [i.split("-")[0].split("_")[0] for i in ids] == ["chatcmpl", "chatcmpl", "cmpl", "resp", "msg"]
    assert [r["response_id"] for r in calls(gw, s)] == ids
    status, ok = http(f"{gw.url}/forge/sessions/{s['session_id']}/reward", {"call_rewards": [
        {"response": ids[k], "reward": float(k)} for k in (4, 1, 3)]})
    assert status == 200 and [(r["call"], r["reward"]) for r in ok["call_rewards"]] == [(1, 1.0), (3, 3.0), (4, 4.0)]
    assert end(gw, s)[0] == 200


def test_malformed_call_reward_lands_on_the_call_that_made_it(model_dir):
    """--malformed-call-reward -0.1: a call cut inside its tool call (malformed) gets -0.1 at its last token, added
    to what the agent set there; a well-formed call gets nothing; forge-node refuses it beside a non-zero
    episode-level malformed_tool_calls weight and zeroes that weight otherwise."""
    import subprocess
    import sys

    from forge_megatron.agents.middleware_node import build_parser as node_parser

    e = start_engine(model_dir, in_process=True)
    gw = start_gateway(model_dir, [e.url], in_process=True, config={"malformed_call_reward": -0.1})
    try:
        s = new_session(gw)
        c = client(s)
        c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=60)
        cut = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=6)
        assert cut.choices[0].message.content.startswith("<tool_call>")  # unclosed: malformed
        http(f"{gw.url}/forge/sessions/{s['session_id']}/reward", {"reward": 1.0, "call_rewards": [
            {"call": 1, "reward": 0.5}]})
        assert end(gw, s)[0] == 200
        rec = calls(gw, s)
        ep = episode(gw, s)
    finally:
        gw.stop()
        e.stop()
    assert [r["num_malformed_tool_calls"] for r in rec] == [0, 1] and ep.num_malformed_tool_calls == 1
    last = len(rec[1]["prompt_ids"]) + len(rec[1]["completion_ids"]) - 1
    assert ep.segments[rec[0]["segment_index"]].call_rewards is None  # (the well-formed call: nothing)
    assert ep.segments[rec[1]["segment_index"]].call_rewards == [[last, pytest.approx(0.4)]]
    args = node_parser().parse_args(["--model-path", model_dir, "--engines", "http://127.0.0.1:9",
                                     "--malformed-call-reward", "-0.1", "--reward-weights", "malformed_tool_calls=-0.2"])
    assert args.malformed_call_reward == -0.1
    out = subprocess.run([sys.executable, "-m", "forge_megatron.agents.middleware_node", "--model-path", model_dir,
                          "--engines", "http://127.0.0.1:9", "--malformed-call-reward", "-0.1", "--reward-weights",
                          "malformed_tool_calls=-0.2", "--pool-db", ":memory:"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "would penalise malformed tool calls twice" in out.stderr


def test_streaming_matches_non_streaming(stack):
    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me"}], max_tokens=20, seed=3)
    full = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == len(calls(gw, s)[-1]["completion_ids"])
    # streamed tool call: content is held back at the marker and the call arrives as a tool_calls delta
    chunks = list(c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=60,
                                            stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "<tool_call>" not in "".join(d.content or "" for d in deltas)
    [tc] = [t for d in deltas for t in (d.tool_calls or [])]
    assert tc.function.name == "get_weather"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_token_fidelity_without_retokenising(stack, model_dir):
    """Sampled ids that do not survive decode -> encode stay in the segment as sampled."""
    gw, _ = stack
    tok = AutoTokenizer.from_pretrained(model_dir)
    for seed in range(20):
        s = new_session(gw)
        c = client(s)
        msgs = [{"role": "user", "content": "Go"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=1.0, seed=seed)
        [call] = calls(gw, s)
        if tok.encode(tok.decode(call["completion_ids"]), add_special_tokens=False) != call["completion_ids"]:
            break
    else:
        pytest.fail("no completion whose re-tokenisation differs; the test would prove nothing")
    msgs += [as_message(r.choices[0].message), {"role": "user", "content": "again"}]
    c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, seed=1)
    first, second = calls(gw, s)
    assert first["segment_index"] == second["segment_index"] == 0
    assert second["prompt_ids"][:len(first["prompt_ids"]) + len(first["completion_ids"])] == \
        first["prompt_ids"] + first["completion_ids"]


def test_rewritten_history_starts_a_second_segment(stack):
    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    msgs = [{"role": "user", "content": "Step one"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, seed=1)
    msgs += [as_message(r.choices[0].message), {"role": "user", "content": "Step two"}]
    c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, seed=2)
    compressed = [{"role": "user", "content": "Summary: steps one and two done. Step three"}]
    c.chat.completions.create(model="tiny", messages=compressed, max_tokens=8, seed=3)
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 0, 1]
    end(gw, s)
    ep = episode(gw, s)
    assert len(ep.segments) == 2
    rec = calls(gw, s)
    assert ep.segments[1].tokens == rec[2]["prompt_ids"] + rec[2]["completion_ids"]
    assert ep.segments[1].loss_mask == [0] * len(rec[2]["prompt_ids"]) + [1] * len(rec[2]["completion_ids"])
    renderer = gw.gateway.renderer  # the rewritten history, rendered and tokenised from scratch
    assert rec[2]["prompt_ids"] == renderer.encode(renderer.render(compressed, None, add_generation_prompt=True))


def test_engine_killed_mid_episode_is_survived(tmp_path):
    d = build_tiny_model(str(tmp_path / "m"), seed=0)
    engines = start_engines(d, 2)
    gw = start_gateway(d, [e.url for e in engines], in_process=True)
    try:
        s = new_session(gw)
        c = client(s)
        msgs = [{"role": "user", "content": "Hi"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, seed=1)
        first = calls(gw, s)[0]["engine_url"]
        victim = next(e for e in engines if e.url == first)
        msgs += [as_message(r.choices[0].message), {"role": "user", "content": "More"}]
        out = {}
        call = threading.Thread(target=lambda: out.update(r=c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=1000, seed=2, extra_body={"ignore_eos": True})))
        call.start()
        busy = {e.url: e for e in gw.gateway.fleet.engines}[first]
        deadline = time.time() + 60
        while busy.inflight == 0 and time.time() < deadline:  # kill it only once it is serving the call
            time.sleep(0.005)
        time.sleep(0.05)
        victim.kill()
        call.join(120)
        r2 = out["r"]
        assert r2.usage.completion_tokens == 1000
        assert not victim.alive
        rec = calls(gw, s)
        assert rec[1]["engine_url"] != first and len(rec[1]["completion_ids"]) == r2.usage.completion_tokens
        assert rec[1]["segment_index"] == 0
        state = http(gw.url + "/forge/admin/state", method="GET")[1]
        assert {e["url"]: e["up"] for e in state["engines"]}[first] is False
        assert end(gw, s)[0] == 200
    finally:
        gw.stop()
        for e in engines:
            e.stop()


def test_pause_holds_calls_and_resume_sets_policy_version(stack):
    gw, _ = stack
    s = new_session(gw)
    assert http(gw.url + "/forge/admin/pause", {"drain_timeout_s": 1.0})[1] == {"paused": True, "inflight": 0}
    out = {}
    t = threading.Thread(target=lambda: out.update(r=client(s).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
        extra_body={"ignore_eos": True})))  # sampled: without ignore_eos the model may stop early
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and http(gw.url + "/forge/admin/state", method="GET")[1]["paused"] is True
    assert http(gw.url + "/forge/admin/resume", {"policy_version": 5})[1] == {"paused": False, "policy_version": 5,
                                                                             "policy_adapter": None}
    t.join(30)
    assert out["r"].usage.completion_tokens == 3
    assert calls(gw, s)[0]["policy_version"] == 5


def test_call_aborted_by_engine_pause_is_reissued(stack):
    """An engine paused with mode=abort (as a weight update does) aborts the call; the gateway goes on from the
    tokens it sampled (tests/middleware/test_gateway_resume.py has the rest)."""
    gw, engines = stack
    s = new_session(gw)
    served_before = sum(e.served for e in gw.gateway.fleet.engines)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=client(s).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "long"}], max_tokens=300, seed=4,
        extra_body={"ignore_eos": True})))
    t.start()
    abort_busy_call(engines, hold_s=0.1)
    t.join(60)
    assert out["r"].usage.completion_tokens == 300
    [call] = calls(gw, s)
    assert len(call["completion_ids"]) == 300 and len(call["logprobs"]) == 300 and call["resumed"] == 1
    assert sum(e.served for e in gw.gateway.fleet.engines) - served_before == 2  # the aborted part + the rest


def test_streaming_call_aborted_before_any_content_is_reissued(stack):
    """tool_choice 'required' holds every character back (the forced text starts with <tool_call>), so an abort
    reaches the gateway before the client saw content: the call is re-issued and the stream ends normally."""
    gw, engines = stack
    s = new_session(gw)
    served_before = sum(e.served for e in gw.gateway.fleet.engines)
    out = {}
    t = threading.Thread(target=lambda: out.update(chunks=list(client(s).chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))))
    t.start()
    abort_busy_call(engines, hold_s=0.1)
    t.join(60)
    chunks = out["chunks"]
    assert chunks[-1].usage.completion_tokens == 300
    [call] = calls(gw, s)
    assert len(call["completion_ids"]) == 300 and call["num_tool_calls"] == 1
    [tc] = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    assert sum(e.served for e in gw.gateway.fleet.engines) - served_before == 2  # the aborted stream + the re-issue


def test_weight_update_cycle_records_new_policy_version(tmp_path, model_dir):
    """pause gateway -> engine loads new weights (weight_version 1) -> resume: later calls carry version 1 and
    logprobs of the new weights."""
    new_dir = build_tiny_model(str(tmp_path / "v1"), seed=9)
    e = start_engine(model_dir, in_process=True)
    gw = start_gateway(model_dir, [e.url], in_process=True)
    try:
        s = new_session(gw)
        c = client(s)
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=3)
        http(gw.url + "/forge/admin/pause", {"drain_timeout_s": 5})
        assert http(e.url + "/update_weights_from_disk", {"model_path": new_dir, "weight_version": "1"})[1]["success"]
        http(gw.url + "/forge/admin/resume", {"policy_version": 1})
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "b"}], max_tokens=3)
        first, second = calls(gw, s)
        assert first["policy_version"] == 0 and second["policy_version"] == 1
        m = AutoModelForCausalLM.from_pretrained(new_dir).eval()
        ids = second["prompt_ids"] + second["completion_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(m(torch.tensor([ids])).logits[0, len(second["prompt_ids"]) - 1:-1], -1)
        ref = logp[torch.arange(3), torch.tensor(second["completion_ids"])]
        assert second["logprobs"] == pytest.approx(ref.tolist(), abs=1e-4)
    finally:
        gw.stop()
        e.stop()


def test_bounded_pause_wait_gives_503(model_dir):
    e = start_engine(model_dir, in_process=True)
    gw = start_gateway(model_dir, [e.url], in_process=True)
    gw.gateway.config.pause_wait_s = 0.2
    try:
        s = new_session(gw)
        http(gw.url + "/forge/admin/pause", {})
        with pytest.raises(openai.APIStatusError) as err:
            client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "paused"
    finally:
        gw.stop()
        e.stop()


# --- bad input ------------------------------------------------------------------------------------------------
def chat_raw(gw, key, raw):
    return http(gw.url + "/v1/chat/completions", raw=raw, headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "9"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    # sampling controls the gateway does not serve (they would sample off the policy, or constrain it)
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -1}, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "min_p": 0.1}, "min_p"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_schema_errors_name_the_field(stack, body, param):
    gw, _ = stack
    s = new_session(gw)
    status, err = chat_raw(gw, s["api_key"], json.dumps(body).encode())
    assert status == 400 and err["error"]["param"] == param and param.split(".")[0] in err["error"]["message"]


def test_neutral_values_of_unserved_sampling_controls_pass(stack):
    """What SDKs and frameworks send by default (penalties 0, no logit bias, a text response format) is served:
    only values that would change the sampled distribution are refused."""
    gw, _ = stack
    out = client(new_session(gw)).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, presence_penalty=0,
        frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"}, extra_body={"repetition_penalty": 1.0})
    assert out.usage.completion_tokens >= 1


def test_bad_requests(stack):
    gw, _ = stack
    s = new_session(gw)
    status, err = chat_raw(gw, s["api_key"], b"{not json")
    assert status == 400 and err["error"]["code"] == "invalid_json"
    status, err = chat_raw(gw, "forge-nope", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode())
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="forge-wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as e:
        client(s).chat.completions.create(model="tiny", messages=long, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    status, err = chat_raw(gw, s["api_key"], b'{"messages": "' + b"x" * (9 << 20) + b'"}')
    assert status == 413 and err["error"]["code"] == "body_too_large"
    assert http(gw.url + "/forge/sessions", {"group_id": "nope"})[0] == 404
    assert http(gw.url + "/forge/groups", {"task_id": "t", "size": 0})[1]["error"]["param"] == "size"
    assert end(gw, s)[1]["error"]["param"] == "status"  # no calls: cannot be 'finished'
    assert end(gw, s, "bogus")[1]["error"]["param"] == "status"
    assert end(gw, s, "aborted")[0] == 200
    with pytest.raises(openai.NotFoundError) as e:
        client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.body["code"] == "session_ended"
    assert end(gw, s)[0] == 404


def test_no_engine_gives_503(model_dir):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    gw = start_gateway(model_dir, [dead], in_process=True)
    try:
        s = new_session(gw)
        with pytest.raises(openai.InternalServerError) as e:
            client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_unavailable"
        with pytest.raises(openai.InternalServerError) as e:
            client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                              stream=True)
        assert e.value.status_code == 503
    finally:
        gw.stop()


def test_ended_sessions_are_forgotten_beyond_the_bound(model_dir):
    gw = start_gateway(model_dir, ["http://127.0.0.1:9"], in_process=True)
    gw.gateway.config.keep_ended_sessions = 1
    try:
        a, b = new_session(gw), new_session(gw)
        assert end(gw, a, "aborted")[0] == 200 and end(gw, b, "failed")[0] == 200
        assert http(f"{gw.url}/forge/sessions/{a['session_id']}", method="GET")[0] == 404  # forgotten
        assert http(f"{gw.url}/forge/sessions/{b['session_id']}", method="GET")[1]["status"] == "failed"
        assert [e.status for e in gw.gateway.sink.episodes] == ["aborted", "failed"]
        assert set(gw.gateway.by_key) == {b["api_key"]}
    finally:
        gw.stop()
    with pytest.raises(ValueError, match="keep_ended_sessions must be >= 1"):
        GatewayConfig(model_path=model_dir, engine_urls=["http://x"], keep_ended_sessions=0)
    with pytest.raises(ValueError, match="image_threads must be >= 1"):
        GatewayConfig(model_path=model_dir, engine_urls=["http://x"], image_threads=0)


def test_ended_sessions_are_forgotten_beyond_the_memory_budget(stack, model_dir):
    """--keep-ended-mib: the ended sessions' recorded tokens (typed arrays: 21 bytes a token; the call records point
    into them) are counted; beyond the budget the oldest are forgotten, the newest always kept."""
    _, engines = stack
    gw = start_gateway(model_dir, [engines[0].url], in_process=True)
    g = gw.gateway
    try:
        sessions = [new_session(gw) for _ in range(3)]
        for s in sessions:
            client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}],
                                              max_tokens=4, extra_body={"ignore_eos": True})
        sizes = [g.sessions[s["session_id"]].recorded_bytes() for s in sessions]
        one = g.sessions[sessions[0]["session_id"]]
        assert sizes[0] == 21 * len(one.segments[0].tokens)  # int32 id, int8 mask, f64 logprob, i64 version
        g.config.keep_ended_mib = (sizes[1] + sizes[2] + 1) / 2**20  # the last two fit, not three
        for s in sessions:
            assert end(gw, s)[0] == 200
        assert g.stats["forgotten_sessions"] == 1 and g.ended_bytes == sizes[1] + sizes[2]
        kept = [http(f"{gw.url}/forge/sessions/{s['session_id']}", method="GET")[0] for s in sessions]
        assert kept == [404, 200, 200]
        state = http(gw.url + "/forge/admin/state", method="GET")[1]
        assert state["ended_sessions_mib"] == round(g.ended_bytes / 2**20, 3) and state["forgotten_sessions"] == 1
        g.config.keep_ended_mib = 0.0  # nothing but the newest
        extra = new_session(gw)
        assert end(gw, extra, "aborted")[0] == 200
        assert list(g.ended_ids) == [extra["session_id"]] and g.ended_bytes == 0  # no call: nothing recorded
        assert set(g.sessions) == {extra["session_id"]}
    finally:
        gw.stop()
    with pytest.raises(ValueError, match="keep_ended_mib must be >= 0"):
        GatewayConfig(model_path=model_dir, engine_urls=["http://x"], keep_ended_mib=-1)


def test_a_refused_episode_is_a_409_and_its_session_is_kept_like_any_ended_one(model_dir):
    """The sink's refusal (SchemaError) answers 409 episode_rejected; the session is ended and counts towards
    keep_ended_sessions, so refused sessions do not pile up in memory."""
    from forge_megatron.middleware.gateway import ListSink
    from forge_megatron.middleware.schema import SchemaError

    class RefusesAborted(ListSink):
        def submit_episode(self, episode):
            if episode.status == "aborted":
                raise SchemaError("aborted episodes are not kept here")
            return super().submit_episode(episode)

    gw = start_gateway(model_dir, ["http://127.0.0.1:9"], in_process=True, sink=RefusesAborted())
    gw.gateway.config.keep_ended_sessions = 1
    try:
        a, b = new_session(gw), new_session(gw)
        status, err = end(gw, a, "aborted")
        assert status == 409 and err["error"]["code"] == "episode_rejected"
        assert "aborted episodes are not kept here" in err["error"]["message"]
        assert http(f"{gw.url}/forge/sessions/{a['session_id']}", method="GET")[1]["status"] == "aborted"
        assert end(gw, a, "failed")[1]["error"]["code"] == "session_ended"  # ended for good
        assert end(gw, b, "failed")[0] == 200
        assert http(f"{gw.url}/forge/sessions/{a['session_id']}", method="GET")[0] == 404  # forgotten in turn
        assert set(gw.gateway.sessions) == {b["session_id"]} and set(gw.gateway.by_key) == {b["api_key"]}
        assert [e.status for e in gw.gateway.sink.episodes] == ["failed"]
    finally:
        gw.stop()


def test_admin_token_and_loopback_rule(model_dir):
    with pytest.raises(ValueError, match="admin_token is required when host '0.0.0.0'"):
        GatewayConfig(model_path=model_dir, engine_urls=["http://x"], host="0.0.0.0")
    with pytest.raises(ValueError, match="engine_urls is empty"):
        GatewayConfig(model_path=model_dir, engine_urls=[])
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        GatewayConfig(model_path=model_dir, engine_urls=["http://x"], tool_parser="nope")
    for bad in (0.0, -1.0, 2.5):
        with pytest.raises(ValueError, match="policy_temperature must be in \\(0, 2\\]"):
            GatewayConfig(model_path=model_dir, engine_urls=["http://x"], policy_temperature=bad)
    gw = start_gateway(model_dir, ["http://127.0.0.1:9"], in_process=True)
    gw.gateway.config.admin_token = "sekret"
    try:
        status, err = http(gw.url + "/forge/groups", {"task_id": "t", "size": 1})
        assert status == 401 and err["error"]["code"] == "invalid_admin_token"
        assert http(gw.url + "/forge/admin/state", method="GET", headers={"X-Forge-Admin-Token": "sekret"})[0] == 200
        new_session(gw, headers={"Authorization": "Bearer sekret"})
    finally:
        gw.stop()


# --- parser and rendering units -------------------------------------------------------------------------------
def test_hermes_parser():
    p = get_parser("hermes")
    good = p.parse('ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert good.content == "ok" and json.loads(good.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    bad = p.parse('<tool_call>{"name": 3}</tool_call> and <tool_call>{"name": "g"')
    assert bad.tool_calls == [] and bad.num_malformed == 2 and "<tool_call>" in bad.content
    assert get_parser("none").parse("<tool_call>{}</tool_call>").tool_calls == []


def test_hermes_forced_prefix_is_how_the_template_opens_a_tool_call(model_dir):
    """The forced text must be the start of the template's assistant tool call, or the next turn would not extend
    the recorded ids."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    (_, _), (after, _) = scripted_chats()
    head = tok.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    turn = tok.apply_chat_template(after[:2], tools=TOOLS, tokenize=False)[len(head):]
    p = get_parser("qwen")
    assert turn.startswith(p.forced_prefix()) and turn.startswith(p.forced_prefix("get_weather"))
    assert p.forced_prefix("get_weather") == '<tool_call>\n{"name": "get_weather", "arguments":'
    with pytest.raises(CannotForceToolCall, match="tool parser 'none' cannot force a tool call"):
        get_parser("none").forced_prefix()


def test_parse_chat_request_defaults():
    req = parse_chat_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}]}, 7)
    assert req.messages == [{"role": "system", "content": "a"}]
    assert req.sampling == {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 7}
    with pytest.raises(ApiError, match="messages"):
        parse_chat_request({"messages": "hi"}, 7)


def test_renderer_splices_sampled_ids_when_turn_ends_without_eot(model_dir):
    """Cut by max_tokens: the template's end-of-turn marker becomes a prompt token after the sampled ids."""
    r = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    from forge_megatron.middleware.gateway_sessions import _Turn
    msgs = [{"role": "user", "content": "Hi"}]
    text, ids, cont = r.prompt_ids(None, msgs, None)
    sampled = r.encode("Hel") + r.encode("lo")  # not what encode("Hello") gives
    prev = _Turn(msgs, None, text, ids, sampled, {"role": "assistant", "content": "Hello"})
    nxt = msgs + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    _, ids2, cont2 = r.prompt_ids(prev, nxt, None)
    assert not cont and cont2
    assert ids2 == ids + sampled + r.encode("<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    _, _, cont3 = r.prompt_ids(prev, nxt, TOOLS)  # tools changed -> new segment
    assert not cont3
    # the turn a session keeps for its next call reads its ids from the segment (no lists of its own): same answer
    from forge_megatron.middleware.gateway_sessions import CallRecord, Session
    sess = Session(group_id="g", task_id="t", domain="d")
    sess.record(prev, False, CallRecord(prompt_ids=ids, completion_ids=sampled, logprobs=[-0.5] * len(sampled),
                                        policy_version=3, finish_reason="length", engine_url="-", segment_index=-1,
                                        started_at=0.0, ended_at=0.0))
    kept = sess.last_turn
    assert kept.prompt_ids is None and kept.completion_ids is None and kept.segment is sess.segments[0]
    assert kept.ids() == ids + sampled and kept.completion() == sampled
    assert r.prompt_ids(kept, nxt, None) == r.prompt_ids(prev, nxt, None)
    raw = dataclasses.replace(kept, messages=[])  # a /v1/completions turn: ids, or text, continue it
    more = ids + sampled + [5, 6]
    assert r.raw_prompt_ids(raw, None, more) == (r.tok.decode(more, skip_special_tokens=False), more, True)
    assert r.raw_prompt_ids(raw, r.tok.decode(more, skip_special_tokens=False), None)[1:] == (more, True)
    seg = sess.segments[0].to_segment()
    assert seg.tokens == ids + sampled and seg.loss_mask == [0] * len(ids) + [1] * len(sampled)
    assert seg.rollout_logprobs == [0.0] * len(ids) + [-0.5] * len(sampled)
    assert seg.policy_versions == [-1] * len(ids) + [3] * len(sampled)


def test_episodes_reach_the_data_pool(tmp_path, model_dir):
    """The real DataPool (SQLite) as the gateway's sink: a group of two sessions becomes a trainable batch."""
    from forge_megatron.middleware.pool import DataPool, PoolConfig

    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), generation_batch_groups=1))
    e = start_engine(model_dir, in_process=True)
    gw = start_gateway(model_dir, [e.url], in_process=True, sink=pool)
    try:
        _, g = http(gw.url + "/forge/groups", {"task_id": "t", "size": 2})
        for reward in (1.0, 0.0):
            status, s = http(gw.url + "/forge/sessions", {"group_id": g["group_id"]})
            client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=5)
            http(f"{gw.url}/forge/sessions/{s['session_id']}/reward", {"reward": reward})
            assert end(gw, s)[1]["sink"] == "accepted"
        assert pool.group_status(g["group_id"])["finished"] == 2
        scraped = scrape(gw.url)  # forge-node's /metrics carries the pool's state too
        assert scraped['forge_pool_groups{state="finished"}'] == 1 and scraped["forge_pool_queue_depth"] == 1
        assert scraped["forge_gateway_calls_total"] == 2 and scraped["forge_pool_filtered_groups"] == 0
        batch = pool.next_batch(1, timeout_s=10)
        recorded = {sid: sess.segments[0].tokens.tolist() for sid, sess in gw.gateway.sessions.items()}
        assert {smp.episode_id: smp.tokens.tolist() for smp in batch.samples} == recorded
        status, err = http(gw.url + "/forge/sessions", {"group_id": g["group_id"]})
        assert status == 409 and err["error"]["code"] == "group_closed"  # the pool closed the completed group
    finally:
        gw.stop()
        e.stop()
        pool.close()


def test_call_rewards_reach_the_trainer_batch_as_per_call_advantages(tmp_path, model_dir):
    """Per-call rewards (POST /forge/sessions/{id}/reward {call_rewards}): episode A makes three calls, the first two
    in one segment, the third after a rewritten context in a second; the agent rewards call 0 (0.5) and the latest
    call (-0.25, by index -1) besides the outcome 1; episode B one call, outcome 0. Bad items are refused by name and
    set nothing. The pool's steps are call 0, segment 0's end, call 2, segment 1's end (the outcome), so the trainer's
    samples carry, token by token, the advantage of the return from their call on (group baseline on the first
    returns), each call's reward at its last sampled token for a critic, and the return from the segment's end; the
    batch's wire form and the episode's JSON keep them."""
    import numpy as np

    from forge_megatron.middleware.pool import DataPool, PoolConfig
    from forge_megatron.middleware.schema import Episode
    from forge_megatron.middleware.wire import batch_from_wire, batch_to_wire

    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), generation_batch_groups=1))
    e = start_engine(model_dir, in_process=True)
    gw = start_gateway(model_dir, [e.url], in_process=True, sink=pool)
    try:
        _, g = http(gw.url + "/forge/groups", {"task_id": "t", "size": 2})
        _, a = http(gw.url + "/forge/sessions", {"group_id": g["group_id"]})
        c = client(a)
        msgs = [{"role": "user", "content": "Step one"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
        msgs += [as_message(r.choices[0].message), {"role": "user", "content": "Step two"}]
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Summary"}], max_tokens=5,
                                  temperature=0)
        url = f"{gw.url}/forge/sessions/{a['session_id']}/reward"
        for bad, message in (([{"call": 3, "reward": 1.0}], "call_rewards[0].call must be the index of one of the "
                                                            "session's 3 calls"),
                             ([{"call": 0, "reward": 1.0}, {"call": True, "reward": 1.0}], "call_rewards[1].call"),
                             ([{"call": 0, "reward": "x"}], "call_rewards[0].reward must be a finite number"),
                             ([{"call": 0}], "call_rewards[0] must be an object with the keys call (or response"),
                             ([{"call": 0, "response": "x", "reward": 1.0}], "call_rewards[0] must be an object"),
                             ([{"response": "chatcmpl-0", "reward": 1.0}], "call_rewards[0].response 'chatcmpl-0' is "
                                                                           "the id of none of the session's 3 calls"),
                             ([{"call": 0, "token": 99, "reward": 1.0}], "call_rewards[0].token must index one of "
                                                                          "call 0's"),
                             ({"call": 0, "reward": 1.0}, "call_rewards must be a list")):
            status, err = http(url, {"reward": 1.0, "call_rewards": bad})
            assert status == 400 and err["error"]["param"] == "call_rewards" and message in err["error"]["message"]
        summary = http(f"{gw.url}/forge/sessions/{a['session_id']}", method="GET")[1]
        assert summary["call_rewards"] == [] and summary["reward"] is None  # (nothing set by a refused request)
        status, ok = http(url, {"reward": 1.0, "call_rewards": [{"call": 0, "reward": 0.5}, {"call": -1, "reward": -0.25}]})
        rec = calls(gw, a)
        n0, n2 = len(rec[0]["completion_ids"]), len(rec[2]["completion_ids"])
        assert status == 200 and ok["call_rewards"] == [{"call": 0, "token": n0 - 1, "reward": 0.5},
                                                        {"call": 2, "token": n2 - 1, "reward": -0.25}]
        ep = gw.gateway.sessions[a["session_id"]].to_episode()
        assert end(gw, a)[1]["sink"] == "accepted"
        _, b = http(gw.url + "/forge/sessions", {"group_id": g["group_id"]})
        client(b).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=5)
        http(f"{gw.url}/forge/sessions/{b['session_id']}/reward", {"reward": 0.0})
        assert end(gw, b)[1]["sink"] == "accepted"
        batch = pool.next_batch(1, timeout_s=10)
    finally:
        gw.stop()
        e.stop()
        pool.close()
    assert [x["segment_index"] for x in rec] == [0, 0, 1]
    p0 = len(rec[0]["prompt_ids"]) + len(rec[0]["completion_ids"]) - 1  # call 0's last sampled token in segment 0
    p2 = len(rec[2]["prompt_ids"]) + len(rec[2]["completion_ids"]) - 1
    assert [s.call_rewards for s in ep.segments] == [[[p0, 0.5]], [[p2, -0.25]]]
    assert Episode.from_dict(json.loads(json.dumps(ep.to_dict()))).segments[0].call_rewards == [[p0, 0.5]]
    seg0, seg1 = [s for s in batch.samples if s.episode_id == a["session_id"]]
    (only_b,) = [s for s in batch.samples if s.episode_id == b["session_id"]]
    # A's composite reward R (the outcome, the calls' 0.25 and whatever process terms the pool weighs) is the sum of
    # its steps: 0.5 (call 0), 0 (segment 0's end), -0.25 (call 2), R - 0.25 (segment 1's end); gamma 1
    r_a, r_b = seg0.reward, only_b.reward
    assert r_a == pytest.approx(1.25 - 0.1 * ep.num_malformed_tool_calls)  # (the default malformed-call weight)
    g_a = [r_a, r_a - 0.5, r_a - 0.5, r_a - 0.25]
    base, scale = (r_a + r_b) / 2, abs(r_a - r_b) / 2 + 1e-6  # GRPO on the first returns, population std
    adv = [(x - base) / scale for x in g_a]
    assert only_b.call_rewards is None
    assert only_b.advantages[only_b.loss_mask == 1] == pytest.approx(np.full(int(only_b.loss_mask.sum()),
                                                                            (r_b - base) / scale), rel=1e-5)
    assert seg0.call_rewards == [[p0, 0.5]] and seg1.call_rewards == [[p2, -0.25]]
    trained = np.flatnonzero(seg0.loss_mask)
    want = np.where(trained <= p0, adv[0], adv[1])
    assert seg0.advantages[trained] == pytest.approx(want, rel=1e-5) and (seg0.advantages[seg0.loss_mask == 0] == 0).all()
    assert seg1.advantages[seg1.loss_mask == 1] == pytest.approx(np.full(int(seg1.loss_mask.sum()), adv[2]), rel=1e-5)
    assert (seg0.segment_return, seg1.segment_return) == (pytest.approx(r_a - 0.5), pytest.approx(r_a - 0.25))
    wired = batch_from_wire(*batch_to_wire(batch))
    assert [s.call_rewards for s in wired.samples] == [s.call_rewards for s in batch.samples]
    assert [s.segment_return for s in wired.samples] == [s.segment_return for s in batch.samples]


def test_rewards_of_tokens_inside_a_call(stack):
    """A reward at a token inside a call (``"token": k``, the end of a step a process reward model scored) lands at
    that token of the segment, beside the whole call's reward at its last token; a second post for the same token
    replaces it; an index past the completion is a 400 naming the item."""
    gw, _ = stack
    s = new_session(gw)
    client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Steps"}], max_tokens=6,
                                      extra_body={"ignore_eos": True})
    (rec,) = calls(gw, s)
    p, n = len(rec["prompt_ids"]), len(rec["completion_ids"])
    url = f"{gw.url}/forge/sessions/{s['session_id']}/reward"
    status, err = http(url, {"call_rewards": [{"call": 0, "token": -n - 1, "reward": 1.0}]})
    assert status == 400 and f"call_rewards[0].token must index one of call 0's {n} completion tokens" in \
        err["error"]["message"]
    assert http(url, {"call_rewards": [{"call": 0, "token": 1, "reward": 0.1}]})[0] == 200
    status, ok = http(url, {"reward": 1.0, "call_rewards": [{"call": 0, "token": 1, "reward": 0.3},
                                                            {"call": 0, "reward": 0.2}]})
    assert status == 200 and ok["call_rewards"] == [{"call": 0, "token": 1, "reward": 0.3},
                                                    {"call": 0, "token": n - 1, "reward": 0.2}]
    assert end(gw, s)[0] == 200
    (seg,) = episode(gw, s).segments
    assert seg.call_rewards == [[p + 1, 0.3], [p + n - 1, 0.2]]


def test_routed_experts_reach_the_trainer_batch(tmp_path):
    """Rollout routing replay, gateway to batch: a MoE engine returns each call's routed experts, the gateway keeps
    them per segment (first call to process a position wins; the last token has none), and the data pool hands
    them to the trainer next to the tokens, equal (as sets per token) to the routers' choice in a teacher-forced HF
    forward of each sample. A rewritten context starts a second segment with its own routing. The episode's JSON
    form round-trips them."""
    from forge_megatron.middleware.pool import DataPool, PoolConfig
    from forge_megatron.middleware.schema import Episode
    from tests.rollout.test_engine import _routers_topk

    moe = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", sampling_seed=0)
    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), generation_batch_groups=1))
    e = start_engine(moe, in_process=True, extra_args=["--enable-return-routed-experts"])
    gw = start_gateway(moe, [e.url], in_process=True, sink=pool, extra_args=["--return-routed-experts"])
    try:
        s = new_session(gw)
        c = client(s)
        msgs = [{"role": "user", "content": "Step one"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=1)
        msgs += [as_message(r.choices[0].message), {"role": "user", "content": "Step two"}]
        for _ in c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=2, stream=True):
            pass  # streamed: the engine sends the routing with its last chunk
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Summary. Three"}], max_tokens=6,
                                  seed=3)
        http(f"{gw.url}/forge/sessions/{s['session_id']}/reward", {"reward": 1.0})
        assert end(gw, s)[1]["sink"] == "accepted"
        batch = pool.next_batch(1, timeout_s=10)
        ep = gw.gateway.sessions[s["session_id"]].to_episode()
    finally:
        gw.stop()
        e.stop()
        pool.close()
    model = AutoModelForCausalLM.from_pretrained(moe).eval()
    layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert len(batch.samples) == 2  # two segments
    for smp in batch.samples:
        assert smp.routed_experts.dtype == "int8"  # 4 experts: one byte per id
        routed = torch.from_numpy(smp.routed_experts.astype("int32"))
        assert routed.shape == (len(smp.tokens), layers, top_k)
        assert (routed[-1] == -1).all() and (routed[:-1] >= 0).all()
        want = _routers_topk(model, smp.tokens[:-1].tolist()).to(torch.int32)
        assert torch.equal(routed[:-1].sort(-1).values, want.sort(-1).values)
    back = Episode.from_dict(json.loads(json.dumps(ep.to_dict())))
    assert all((a.routed_experts == b.routed_experts).all() for a, b in zip(back.segments, ep.segments))


def test_segment_routing_keeps_the_first_call_that_processed_a_position():
    """A later call's routing of an earlier position (recomputed, e.g. under new weights after a cache miss) does not
    replace what the call that sampled from it saw; new positions are appended; the last token has none."""
    import numpy as np

    from forge_megatron.middleware.gateway_sessions import SegmentBuilder

    b = SegmentBuilder()
    b.add_prompt([1, 2, 3])
    b.add_completion([4, 5], [-0.1, -0.2], 0)
    first = np.arange(8, dtype=np.int16).reshape(4, 2, 1)  # positions 0..3 (token 5 was not fed)
    b.add_routing(first)
    b.add_prompt([6])
    b.add_completion([7], [-0.3], 1)
    b.add_routing(np.full((6, 2, 1), 9, np.int16))  # positions 0..5, the first four recomputed differently
    routed = b.to_segment().routed_experts
    assert routed.shape == (7, 2, 1) and routed.dtype == np.int16
    np.testing.assert_array_equal(routed[:4], first)
    assert (routed[4:6] == 9).all() and (routed[6] == -1).all()
    plain = SegmentBuilder()
    plain.add_prompt([1])
    assert plain.to_segment().routed_experts is None  # nothing recorded: no routing at all


def test_gateway_cli_subprocess_writes_episodes_jsonl(tmp_path, stack, model_dir):
    """forge-gateway as its console entry point (a subprocess) with the JSONL sink, in front of a running engine."""
    from forge_megatron.middleware.gateway import build_parser
    from forge_megatron.rollout.launch import ProcessServer

    assert "--engines" in build_parser().format_help()
    _, engines = stack
    out = tmp_path / "episodes.jsonl"
    gw = ProcessServer("forge_megatron.middleware.gateway", ["--model-path", model_dir, "--engines", engines[0].url,
                                                              "--episodes-jsonl", str(out)])
    try:
        s = new_session(gw)
        client(s).chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=60)
        # the routes of the other APIs find the gateway too (python -m runs the module as __main__, a second copy)
        counted = urllib.request.Request(s["anthropic_base_url"] + "/v1/messages/count_tokens", method="POST",
                                         data=json.dumps({"model": "tiny", "messages": USER}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(counted, timeout=30) as r:
            assert json.loads(r.read())["input_tokens"] > 0
        assert end(gw, s)[0] == 200
    finally:
        gw.stop()
    [line] = out.read_text().splitlines()
    ep = json.loads(line)
    assert ep["episode_id"] == s["session_id"] and ep["num_tool_calls"] == 1 and len(ep["segments"]) == 1


def test_cli_reports_bad_configuration(model_dir):
    from forge_megatron.middleware.gateway import main

    with pytest.raises(SystemExit, match="forge-gateway: admin_token is required"):
        main(["--model-path", model_dir, "--engines", "http://127.0.0.1:9", "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="forge-gateway: return_routed_experts: .* is not a MoE model"):
        main(["--model-path", model_dir, "--engines", "http://127.0.0.1:9", "--return-routed-experts"])


def test_calls_cut_at_max_tokens_are_counted_and_can_be_penalised(stack):
    """A call that ends at max_tokens counts in Episode.num_truncated_calls; the pool's scoring turns it into the
    ``truncated_calls`` process term, which ``--reward-weights truncated_calls=W`` weighs (0 by default)."""
    from forge_megatron.algo.rewards import RewardConfig, score_group
    from forge_megatron.middleware.batch import episode_outcome

    gw, _ = stack
    s = new_session(gw)
    for max_tokens in (2, 64):  # the first is cut (finish_reason length); the second may end by itself
        r = client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=max_tokens, temperature=0.0)
        if max_tokens == 2:
            assert r.choices[0].finish_reason == "length"
    finishes = [c["finish_reason"] for c in calls(gw, s)]
    end(gw, s)
    ep = episode(gw, s)
    assert ep.num_truncated_calls == finishes.count("length") >= 1
    outcome = episode_outcome(ep)
    assert outcome.process_terms["truncated_calls"] == ep.num_truncated_calls
    weighted = score_group([outcome], RewardConfig(process_weights={"truncated_calls": -0.5}, singleton_group="raw"))
    assert weighted.terms[0]["truncated_calls"] == -0.5 * ep.num_truncated_calls
    assert "truncated_calls" in score_group([outcome], RewardConfig(singleton_group="raw")).terms[0]  # weight 0


def test_idle_sessions_are_reaped_as_timed_out(model_dir, stack):
    """session_idle_timeout_s: a session whose agent went silent is ended as timed_out and its episode reaches the
    sink (so its group completes); a session that keeps calling is left alone; the silent agent's next call gets a
    404 naming the end."""
    from forge_megatron.middleware.gateway import Gateway, GatewayConfig, serve
    from forge_megatron.rollout.launch import ThreadServer

    _, engines = stack
    gw = Gateway(GatewayConfig(model_path=model_dir, engine_urls=[engines[0].url], port=0,
                               session_idle_timeout_s=1.5))  # a loaded 2-core machine: calls of ~1 s
    server = ThreadServer(lambda ready: serve(gw, ready))
    server.gateway = gw
    try:
        silent, busy = new_session(server), new_session(server)
        ask = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=2, temperature=0.0)
        client(silent).chat.completions.create(**ask)
        deadline = time.monotonic() + 3.5  # past the timeout and a reaper round (timeout / 4)
        while time.monotonic() < deadline:  # the busy agent calls every ~0.2 s, well inside the timeout
            client(busy).chat.completions.create(**ask)
            time.sleep(0.2)
        reaped = {e.episode_id: e for e in gw.sink.episodes}
        assert silent["session_id"] in reaped and reaped[silent["session_id"]].status == "timed_out"
        assert len(reaped[silent["session_id"]].segments) == 1  # its call was kept
        assert busy["session_id"] not in reaped and gw.stats["reaped_sessions"] == 1
        with pytest.raises(openai.NotFoundError, match="has ended"):
            client(silent).chat.completions.create(**ask)
        assert end(server, busy)[0] == 200
    finally:
        server.stop()
    with pytest.raises(ValueError, match="session_idle_timeout_s must be > 0"):
        GatewayConfig(model_path=model_dir, engine_urls=["http://x"], session_idle_timeout_s=0)


def scrape(url: str) -> dict[str, float]:
    """GET /metrics, parsed: ``{"name{labels}": value}``; every sample has HELP and TYPE lines before it."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            assert key.split("{")[0] in typed, key
            out[key] = float(value)
    return out


def test_prometheus_metrics_match_the_admin_state(stack):
    gw, engines = stack
    s = new_session(gw)
    client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    _, state = http(gw.url + "/forge/admin/state", method="GET")
    scraped = scrape(gw.url)
    for key in ("calls", "prompt_tokens", "completion_tokens", "aborts", "tempered_calls", "reaped_sessions"):
        assert scraped[f"forge_gateway_{key}_total"] == state[key]
    assert state["calls"] >= 1 and state["completion_tokens"] >= 1
    assert scraped["forge_gateway_open_sessions"] == state["sessions_open"] >= 1
    assert scraped["forge_gateway_paused"] == 0 and scraped["forge_gateway_policy_version"] == state["policy_version"]
    for e in engines:
        assert scraped[f'forge_engine_up{{engine="{e.url}"}}'] == 1
    assert not any(k.startswith("forge_pool_") for k in scraped)  # a ListSink has no pool state
    for placement, n in state["group_affinity"].items():
        assert scraped[f'forge_engine_group_placements_total{{placement="{placement}"}}'] == n
    end(gw, s)


def test_checkpoint_code_runs_only_when_trusted(tmp_path):
    """A checkpoint whose config class ships as its own Python file (Kimi-K2's kind): without --trust-remote-code
    the gateway refuses with a message that names the flag; with it, the config loads from the directory."""
    import json
    import shutil

    from forge_megatron.middleware.gateway import Gateway, GatewayConfig
    from forge_megatron.models.tiny import build_tiny_tokenizer, tiny_config

    d = tmp_path / "remote_model"
    build_tiny_tokenizer(str(d))
    config = {**tiny_config("qwen2").to_dict(), "model_type": "forge_remote", "max_position_embeddings": 777,
              "auto_map": {"AutoConfig": "configuration_forge_remote.ForgeRemoteConfig"}}
    (d / "config.json").write_text(json.dumps(config))
    (d / "configuration_forge_remote.py").write_text(
        "from transformers import PretrainedConfig\n\n\n"
        "class ForgeRemoteConfig(PretrainedConfig):\n    model_type = 'forge_remote'\n")
    with pytest.raises(ValueError, match="ships its own tokenizer or config code .* start with --trust-remote-code"):
        Gateway(GatewayConfig(model_path=str(d), engine_urls=["http://127.0.0.1:9"]))
    gw = Gateway(GatewayConfig(model_path=str(d), engine_urls=["http://127.0.0.1:9"], trust_remote_code=True))
    assert gw.context_length == 777
    shutil.rmtree(d)


def test_a_mistral_gateway_forces_named_calls_as_its_template_writes_them(tmp_path):
    """Served with --tool-parser mistral, the gateway shows the parser its chat template: a named tool_choice is then
    enforced with the template's own opening of that call (here v11's NAME[ARGS])."""
    from transformers import AutoTokenizer

    from forge_megatron.middleware.gateway import Gateway, GatewayConfig
    from forge_megatron.models.tiny import build_tiny_tokenizer, tiny_config
    from tests.middleware.test_tool_parsers import MISTRAL_V11, _mistral_chat_template

    d = tmp_path / "mistral_like"
    build_tiny_tokenizer(str(d))
    (d / "config.json").write_text(json.dumps(tiny_config("qwen2").to_dict()))
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = _mistral_chat_template(MISTRAL_V11) + "{% if add_generation_prompt %}{% endif %}"
    tok.save_pretrained(d)
    gw = Gateway(GatewayConfig(model_path=str(d), engine_urls=["http://127.0.0.1:9"], tool_parser="mistral"))
    req = parse_chat_request({"messages": USER, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 8)
    assert gw.forced_text(req) == "[TOOL_CALLS]get_weather[ARGS]"


def test_a_groups_sessions_open_on_one_engine(stack):
    """The sessions of a group (the G rollouts of one task, one shared prompt) open on the engine the first one used
    (one prefill of the prompt, then SGLang's prefix cache); /forge/admin/state counts the placements."""
    gw, _ = stack
    before = http(gw.url + "/forge/admin/state", method="GET")[1]["group_affinity"]
    engine_of = {}
    for task in ("t1", "t2"):
        _, g = http(gw.url + "/forge/groups", {"task_id": task, "size": 3})
        for _ in range(3):
            _, s = http(gw.url + "/forge/sessions", {"group_id": g["group_id"]})
            client(s).chat.completions.create(model="tiny", messages=USER, max_tokens=2)
            engine_of.setdefault(task, set()).update(c["engine_url"] for c in calls(gw, s))
            assert end(gw, s)[0] == 200
    assert all(len(urls) == 1 for urls in engine_of.values())  # each group on one engine (other groups: the
    # least-loaded engine, tests/rollout/test_fleet.py)
    after = http(gw.url + "/forge/admin/state", method="GET")[1]["group_affinity"]
    assert after["followed"] - before["followed"] == 4 and after["spilled"] == before["spilled"]


def test_the_gateway_remembers_the_newest_groups_only(stack, monkeypatch):
    """A long run registers groups without end: the gateway keeps the newest MAX_GROUPS (their sessions open), and
    a session of a group older than that gets the unknown-group 404."""
    from forge_megatron.middleware import gateway as gateway_module

    gw, _ = stack
    monkeypatch.setattr(gateway_module, "MAX_GROUPS", 2)
    ids = [http(gw.url + "/forge/groups", {"task_id": f"old{i}", "size": 1})[1]["group_id"] for i in range(3)]
    assert len(gw.gateway.groups) == 2 and ids[0] not in gw.gateway.groups
    status, body = http(gw.url + "/forge/sessions", {"group_id": ids[0]})
    assert status == 404 and body["error"]["code"] == "group_not_found"
    assert http(gw.url + "/forge/sessions", {"group_id": ids[2]})[0] == 200


def test_urls_handed_to_agents_name_a_reachable_host():
    """Bound to every interface, the gateway hands out this machine's host name (http://0.0.0.0:port reaches only
    this machine); a loopback or named host as bound; IPv6 literals bracketed; forge-node takes --public-url."""
    import socket

    from forge_megatron.agents.middleware_node import build_parser as node_parser
    from forge_megatron.middleware.gateway import advertised_url

    assert advertised_url("0.0.0.0", 8000) == f"http://{socket.gethostname()}:8000"
    assert advertised_url("127.0.0.1", 5) == "http://127.0.0.1:5" and advertised_url("::1", 5) == "http://[::1]:5"
    args = node_parser().parse_args(["--model-path", "m", "--engines", "e", "--public-url", "http://gw.example:80"])
    assert args.public_url == "http://gw.example:80"
