"""The gateway's Anthropic Messages API (``/v1/messages``) with the official ``anthropic`` client.

The tiny model fine-tuned to answer two fixed chats with a tool call and then an answer (test_gateway's fixture)
is driven through Anthropic's content blocks; what the gateway records must be exactly what the OpenAI path records
for the same conversation (same prompt ids, one segment), and streaming must give the non-streaming message.
"""

import json

import anthropic
import pytest

from tests.middleware.test_gateway import (
    FINAL_ANSWER, TOOL_RESULT, TOOLS, USER, assert_records_like_the_chat_path, calls, end, http,
    new_session,
)

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


GREEDY = {"temperature": 0}  # recent anthropic clients take sampling parameters only through extra_body


def a_client(session):
    return anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="ignored", max_retries=0, timeout=60)


def _round_trip(c, **kw):
    """Tool call, then the answer after the tool result, through Anthropic blocks; returns both messages."""
    first = c.messages.create(model="tiny", max_tokens=64, messages=USER, tools=A_TOOLS, **kw, extra_body=GREEDY)
    [use] = [b for b in first.content if b.type == "tool_use"]
    follow = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": TOOL_RESULT}]}]
    second = c.messages.create(model="tiny", max_tokens=64, messages=follow, tools=A_TOOLS, **kw, extra_body=GREEDY)
    return first, second


def test_tool_round_trip_records_what_the_openai_path_records(stack):
    gw, _ = stack
    s = new_session(gw)
    assert s["anthropic_base_url"] == s["base_url"][: -len("/v1")]
    first, second = _round_trip(a_client(s))
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert second.content[0].text == FINAL_ANSWER
    a_calls = calls(gw, s)
    assert [c["segment_index"] for c in a_calls] == [0, 0]  # the tool result continued the segment
    assert end(gw, s)[0] == 200
    assert_records_like_the_chat_path(gw, s)


def test_streaming_gives_the_non_streaming_message(stack):
    gw, _ = stack
    s = new_session(gw)
    c = a_client(s)
    with c.messages.stream(model="tiny", max_tokens=64, messages=USER, tools=A_TOOLS, extra_body=GREEDY) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_message()
    [use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and use.input == {"city": "Paris"}
    assert events[0] == "message_start" and "content_block_start" in events and events[-1] == "message_stop"
    follow = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": TOOL_RESULT}]}]}]
    with c.messages.stream(model="tiny", max_tokens=64, messages=follow, tools=A_TOOLS, extra_body=GREEDY) as stream:
        texts = [e.text for e in stream if e.type == "text"]
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == FINAL_ANSWER and final.stop_reason == "end_turn"
    assert [c["segment_index"] for c in calls(gw, s)] == [0, 0]


def test_system_blocks_stop_sequences_and_max_tokens(stack):
    gw, _ = stack
    s = new_session(gw)
    c = a_client(s)
    _, second = _round_trip(c, stop_sequences=["sunny"])  # the scripted answer is "It is sunny."
    assert second.stop_reason == "stop_sequence" and second.stop_sequence == "sunny"
    assert second.content[0].text == FINAL_ANSWER[: FINAL_ANSWER.index("sunny")]
    r = c.messages.create(model="tiny", max_tokens=5, extra_body=GREEDY, tools=A_TOOLS, tool_choice={"type": "none"},
                          messages=USER + [{"role": "assistant", "content": [{"type": "text", "text": "Let me see."}]},
                                           {"role": "user", "content": "And now?"}],
                          system=[{"type": "text", "text": "You are terse."}])
    prompt = gw.gateway.renderer.tok.decode(calls(gw, s)[-1]["prompt_ids"])
    assert "You are terse." in prompt and "Let me see." in prompt and "And now?" in prompt
    assert r.content[0].type == "text"
    r = c.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "hi"}],
                          extra_body={**GREEDY, "ignore_eos": True})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 40


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens is required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "source must be {type: 'base64'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "invalid_request_error", "block type 'document' is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
     "must be 'user' or 'assistant'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "needs a non-empty tools array"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}, 400, "invalid_request_error",
     "input must be an object"),
])
def test_errors_use_anthropics_error_body(stack, body, status, kind, words):
    gw, _ = stack
    s = new_session(gw)
    code, reply = http(s["anthropic_base_url"] + "/v1/messages", body)
    assert code == status and reply["type"] == "error" and reply["error"]["type"] == kind, reply
    assert words in reply["error"]["message"]


def test_api_key_header_and_unknown_keys(stack):
    gw, _ = stack
    s = new_session(gw)
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    code, reply = http(gw.url + "/v1/messages", body, headers={"x-api-key": s["api_key"]})
    assert code == 200 and reply["type"] == "message" and reply["role"] == "assistant"
    code, reply = http(gw.url + "/v1/messages", body, headers={"x-api-key": "nope"})
    assert code == 401 and reply["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gw.url, api_key="nope", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert json.loads(json.dumps(calls(gw, s)))[0]["completion_ids"]


def test_count_tokens_is_the_prompt_the_call_sends(stack):
    gw, _ = stack
    s = new_session(gw)
    c = a_client(s)
    counted = c.messages.count_tokens(model="tiny", messages=USER, tools=A_TOOLS)
    first = c.messages.create(model="tiny", max_tokens=64, messages=USER, tools=A_TOOLS, extra_body=GREEDY)
    [call] = calls(gw, s)  # counting recorded nothing
    assert counted.input_tokens == len(call["prompt_ids"]) == first.usage.input_tokens
