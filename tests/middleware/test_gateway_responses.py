"""The gateway's OpenAI Responses API (``/v1/responses``) with the official ``openai`` client.

The tiny model fine-tuned to answer a fixed chat with a tool call and then an answer (test_gateway's fixture) is
driven through Responses items: sending a response's output items back as input continues the segment, and what the
gateway records is exactly what the chat-completions path records for the same conversation; streaming gives the
non-streaming response;
a stored response continued by ``previous_response_id`` records the same, and stored responses are per session.
"""

import json

import openai
import pytest

from forge_megatron.middleware.responses_api import custom_arguments, custom_input, parse_responses_request

from tests.middleware.test_gateway import (
    FINAL_ANSWER, TOOL_RESULT, TOOLS, USER, assert_records_like_the_chat_path, calls, client, end, http,
    new_session,
)

R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def _items(response) -> list[dict]:
    """A response's output items as input items (what store: false clients send back)."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def _round_trip(c, **kw):
    first = c.responses.create(model="tiny", input=USER, tools=R_TOOLS, temperature=0, max_output_tokens=64, **kw)
    [fc] = [i for i in first.output if i.type == "function_call"]
    follow = USER + _items(first) + [{"type": "function_call_output", "call_id": fc.call_id, "output": TOOL_RESULT}]
    second = c.responses.create(model="tiny", input=follow, tools=R_TOOLS, temperature=0, max_output_tokens=64, **kw)
    return first, second


def test_tool_round_trip_records_what_the_chat_path_records(stack):
    gw, _ = stack
    s = new_session(gw)
    first, second = _round_trip(client(s))
    [fc] = [i for i in first.output if i.type == "function_call"]
    assert first.status == "completed" and fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert second.status == "completed" and [i.type for i in second.output] == ["message"]
    assert second.output_text == FINAL_ANSWER  # the client's own aggregation of output_text parts
    r_calls = calls(gw, s)
    assert [c["segment_index"] for c in r_calls] == [0, 0]  # the function_call_output continued the segment
    assert end(gw, s)[0] == 200
    assert_records_like_the_chat_path(gw, s)


def test_streaming_gives_the_non_streaming_response(stack):
    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    events = list(c.responses.create(model="tiny", input=USER, tools=R_TOOLS, temperature=0, max_output_tokens=64,
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = events[-1].response
    [fc] = [i for i in streamed.output if i.type == "function_call"]
    assert json.loads(fc.arguments) == {"city": "Paris"}
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == fc.arguments and done.item_id == fc.id
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == [i.type for i in streamed.output]  # every item announced, in order
    follow = USER + _items(streamed) + [{"type": "function_call_output", "call_id": fc.call_id,
                                         "output": [{"type": "input_text", "text": TOOL_RESULT}]}]
    events = list(c.responses.create(model="tiny", input=follow, tools=R_TOOLS, temperature=0, max_output_tokens=64,
                                     stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == FINAL_ANSWER
    [text_done] = [e for e in events if e.type == "response.output_text.done"]
    assert text_done.text == FINAL_ANSWER
    assert [c["segment_index"] for c in calls(gw, s)] == [0, 0]


def test_instructions_developer_messages_and_max_output_tokens(stack):
    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    c.responses.create(model="tiny", temperature=0, max_output_tokens=5, instructions="You are terse.",
                       input=[{"role": "developer", "content": "Answer in English."},
                              {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]}])
    prompt = gw.gateway.renderer.tok.decode(calls(gw, s)[-1]["prompt_ids"])
    assert prompt.index("You are terse.") < prompt.index("Answer in English.") < prompt.index("And now?")
    r = c.responses.create(model="tiny", input="hi", max_output_tokens=40, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 40
    events = list(c.responses.create(model="tiny", input="hi", max_output_tokens=7, stream=True,
                                     extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 7


@pytest.mark.parametrize("body, words", [
    ({"input": []}, "input must be a string or a non-empty array"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "image_url must be a data URL"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "part type 'input_file' is not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tool type 'web_search' is not supported"),
    ({"input": "x", "previous_response_id": "resp_1"}, "no stored response 'resp_1' in this session"),
    ({"input": "x", "background": True}, "background responses are not supported"),
    ({"input": "x", "conversation": "conv_1"}, "use previous_response_id"),
    ({"input": "x", "store": "yes"}, "store must be a boolean"),
    ({"input": "x", "include": "reasoning.encrypted_content"}, "include must be an array"),
    ({"input": "x", "tools": [{"type": "custom", "name": "f", "format": {"type": "grammar", "syntax": "ebnf",
                                                                        "definition": "x"}}]}, "syntax 'lark' or"),
    ({"input": "x", "tools": [{"type": "custom", "name": "f"}, {"type": "function", "name": "f"}]},
     "two tools are named 'f'"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f"}]}, "input[0].input must be a string"),
    ({"input": [{"type": "reasoning", "encrypted_content": "gAAAA-from-elsewhere"}]},
     "input[0].encrypted_content was not issued by this gateway"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item type 'item_reference' is not supported"),
    ({"input": "x", "tool_choice": "required"}, "needs a non-empty tools array"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "arguments must be a string"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs must be an integer in [0, 20]"),
])
def test_bad_requests_name_the_field(stack, body, words):
    gw, _ = stack
    s = new_session(gw)
    code, reply = http(s["base_url"] + "/responses", body)
    assert code == 400 and words in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    code, reply = http(s["base_url"].replace(s["api_key"], "nope") + "/responses", {"input": "x"})
    assert code == 401


def test_previous_response_id_records_what_the_chat_path_records(stack):
    """The follow-up sends only the tool output and the first response's id: the gateway rebuilds the conversation
    from what it stored, and the two calls are one segment, token for token the chat path's."""
    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    first = c.responses.create(model="tiny", input=USER, tools=R_TOOLS, temperature=0, max_output_tokens=64)
    [fc] = [i for i in first.output if i.type == "function_call"]
    assert first.store is True and first.previous_response_id is None
    second = c.responses.create(model="tiny", previous_response_id=first.id, tools=R_TOOLS, temperature=0,
                                max_output_tokens=64, stream=True,
                                input=[{"type": "function_call_output", "call_id": fc.call_id, "output": TOOL_RESULT}])
    final = list(second)[-1].response
    assert final.output_text == FINAL_ANSWER and final.previous_response_id == first.id
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert c.responses.retrieve(final.id).output_text == FINAL_ANSWER  # a streamed response is stored too
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 0]
    assert end(gw, s)[0] == 200
    assert_records_like_the_chat_path(gw, s)


def test_stored_responses_chain_delete_and_stay_in_their_session(stack):
    gw, _ = stack
    s, other = new_session(gw), new_session(gw)
    c = client(s)
    tok = gw.gateway.renderer.tok
    first = c.responses.create(model="tiny", input="Say A.", instructions="Be brief.", max_output_tokens=3)
    second = c.responses.create(model="tiny", input="Say B.", previous_response_id=first.id, max_output_tokens=3)
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        c.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=3)
    # a response continuing the deleted one keeps its history: the third prompt holds all of it, in order
    third = c.responses.create(model="tiny", input="Say C.", previous_response_id=second.id, max_output_tokens=3,
                               store=False)
    prompt = tok.decode(calls(gw, s)[-1]["prompt_ids"])
    assert prompt.index("Say A.") < prompt.index("Say B.") < prompt.index("Say C.")
    assert "Be brief." not in prompt  # instructions are not carried over (as in the API)
    assert third.store is False and third.previous_response_id == second.id
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(third.id)  # store: false
    with pytest.raises(openai.NotFoundError):
        client(other).responses.retrieve(second.id)  # another session's
    code, reply = http(s["base_url"] + "/responses", {"input": "x", "previous_response_id": third.id})
    assert code == 400 and reply["error"]["code"] == "previous_response_not_found", reply
    sess = gw.gateway.sessions[s["session_id"]]
    assert list(sess.responses) == [second.id]
    assert end(gw, s)[0] == 200
    code, _ = http(s["base_url"] + f"/responses/{second.id}", method="GET")
    assert code == 404 and sess.responses == {}  # the session has ended: its stored responses are dropped


def test_custom_tools_are_function_tools_with_one_string_input():
    """A custom (free-form) tool is shown to the model as a function taking one string, its grammar described; a
    custom_tool_call item sent back becomes the call's arguments exactly as the tool parsers spell them."""
    grammar = "start: /[a-z]+/"
    req = parse_responses_request({"input": [
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch\n\u00e9"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "done"}]}],
        "tools": [{"type": "custom", "name": "apply_patch", "description": "Patch files.",
                   "format": {"type": "grammar", "syntax": "lark", "definition": grammar}},
                  {"type": "function", "name": "ls"}], "tool_choice": {"type": "custom", "name": "apply_patch"}}, 64)
    fn = req.chat.tools[0]["function"]
    assert fn["name"] == "apply_patch" and fn["description"] == "Patch files."
    assert fn["parameters"]["required"] == ["input"] and grammar in fn["parameters"]["properties"]["input"][
        "description"]
    assert req.custom == {"apply_patch"} and req.chat.tool_choice == {"type": "function",
                                                                       "function": {"name": "apply_patch"}}
    [call] = req.chat.messages[1]["tool_calls"]
    assert call["function"]["arguments"] == '{"input": "*** Begin Patch\\n\u00e9"}'  # json.dumps, no ascii escapes
    assert req.chat.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "done"}
    for text in ("", "a\nb", "{\"x\": 1}", "\u00e9\"q"):
        assert custom_input(custom_arguments(text)) == text
    # arguments that are not exactly {input: string} come back as the model wrote them
    assert custom_input('{"input": "a", "more": 1}') == '{"input": "a", "more": 1}'
    assert custom_input("not json") == "not json" and custom_input('{"input": 3}') == '{"input": 3}'


def test_reasoning_effort_is_the_template_variable_on_both_apis():
    """reasoning_effort (chat) and reasoning.effort (Responses) become the chat template variable reasoning_effort,
    as SGLang and vLLM pass it (gpt-oss's template writes it into its system message); chat_template_kwargs win."""
    from forge_megatron.middleware.gateway import ApiError, parse_chat_request

    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat_request({"messages": msgs, "reasoning_effort": "high"}, 8).template_kwargs == {
        "reasoning_effort": "high"}
    both = parse_chat_request({"messages": msgs, "reasoning_effort": "high",
                               "chat_template_kwargs": {"reasoning_effort": "low", "x": 1}}, 8)
    assert both.template_kwargs == {"reasoning_effort": "low", "x": 1}
    assert parse_chat_request({"messages": msgs}, 8).template_kwargs == {}
    r = parse_responses_request({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}, 8)
    assert r.chat.template_kwargs == {"reasoning_effort": "low"}
    with pytest.raises(ApiError, match="reasoning_effort must be one of") as e:
        parse_chat_request({"messages": msgs, "reasoning_effort": "max"}, 8)
    assert e.value.param == "reasoning_effort"
    with pytest.raises(ApiError, match="reasoning.effort must be one of") as e:
        parse_responses_request({"input": "hi", "reasoning": {"effort": "max"}}, 8)
    assert e.value.param == "reasoning.effort"
