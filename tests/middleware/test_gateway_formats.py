"""A reasoning model with XML tool calls through the gateway, end to end (OpenAI and Anthropic clients).

The tiny model gets a chat template of our own in the Qwen3 / Qwen3-Coder layout (``<think>`` blocks rendered from
``reasoning_content``, ``<tool_call><function=...><parameter=...>`` calls, ``enable_thinking`` and a variant whose
generation prompt opens the block) and is fine-tuned to answer six fixed chats; the gateway serves it with
``tool_parser="qwen3_coder"`` and ``reasoning_parser="qwen3"``. Checked: reasoning_content and schema-typed tool
arguments in answers and streams, the next turn (reasoning sent back) continuing the sampled segment, a turn without
it starting a new one, thinking blocks on /v1/messages, chat_template_kwargs from the request and the gateway,
and a Codex-style Responses conversation (a custom tool, reasoning sent back encrypted).
"""

import json

import anthropic
import pytest
from transformers import AutoTokenizer

from forge_megatron.models.tiny import build_tiny_model
from tests.middleware.served_tiny import fine_tuned_gateway, tool_follow_up
from tests.middleware.test_gateway import calls, client, end, http, new_session

calls_of = calls

TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n"
    "</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role in ['system', 'user'] %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
    "{%- for k, v in tc.function.arguments | items %}{{- '<parameter=' + k + '>\\n' }}"
    "{%- if v is string %}{{- v }}{%- else %}{{- v | tojson }}{%- endif %}{{- '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif think_in_prompt is defined and think_in_prompt %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
PLAN, CALL = "I should check the weather.", {"city": "Paris", "days": 3}
CALL_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
             "</parameter>\n</function>\n</tool_call>")
RESULT, PLAN2, ANSWER = "sunny, 22C", "Sunny.", "It is sunny."
HELLO = [{"role": "user", "content": "Say hello."}]
TWO = [{"role": "user", "content": "Weather in Paris and Rome?"}]
CALL_ROME = CALL_TEXT.replace("Paris", "Rome")
GREEDY = dict(temperature=0, max_tokens=256)
# a Codex-style free-form tool (Responses API custom tool): the model sees it as a function of one string
R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}
FIX = [{"role": "user", "content": "Fix the typo in a.txt."}]
PATCH = "*** Begin Patch\n*** Update File: a.txt\n-teh\n+the\n*** End Patch"
PLAN_FIX, PATCHED, FIXED = "Patch it.", "Done.", "Fixed the typo."


def scripted_chats():
    call = {"role": "assistant", "content": "", "reasoning_content": PLAN, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": CALL}}]}
    return [(USER, f"<think>\n{PLAN}\n</think>\n\n{CALL_TEXT}"),
            (USER + [call, {"role": "tool", "tool_call_id": "c1", "content": RESULT}],
             f"<think>\n{PLAN2}\n</think>\n\n{ANSWER}"),
            (HELLO, "Let me think.\n</think>\n\nHello.", {"think_in_prompt": True}),
            (TWO, f"<think>\nBoth.\n</think>\n\n{CALL_TEXT}\n{CALL_ROME}")] + patch_chats()


def patch_chats():
    """The custom tool's call and the answer after its output, under the tools the gateway renders for
    R_TOOLS + [APPLY_PATCH] (custom tool: its ``input`` parameter, as the XML format writes a string)."""
    from forge_megatron.middleware.responses_api import chat_tools, custom_arguments

    tools = chat_tools({"tools": R_TOOLS + [APPLY_PATCH]})[0]
    call = {"role": "assistant", "content": "", "reasoning_content": PLAN_FIX, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "apply_patch",
                                                      "arguments": json.loads(custom_arguments(PATCH))}}]}
    text = (f"<think>\n{PLAN_FIX}\n</think>\n\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n{PATCH}\n"
            "</parameter>\n</function>\n</tool_call>")
    return [(FIX, text, {"tools": tools}),
            (FIX + [call, {"role": "tool", "tool_call_id": "c1", "content": PATCHED}],
             f"<think>\nFixed.\n</think>\n\n{FIXED}", {"tools": tools})]


@pytest.fixture(scope="module")
def thinking_stack(tmp_path_factory):
    d = build_tiny_model(str(tmp_path_factory.mktemp("thinking")), seed=1)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    formats = {"tool_parser": "qwen3_coder", "reasoning_parser": "qwen3"}
    with fine_tuned_gateway(d, scripted_chats(), TOOLS, formats) as gw:
        yield gw


def follow_up(first_message: dict) -> list[dict]:
    return tool_follow_up(USER, first_message, RESULT)


def test_reasoning_and_typed_tool_call_then_the_answer_in_one_segment(thinking_stack):
    gw = thinking_stack
    s = new_session(gw)
    c = client(s)
    r1 = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, **GREEDY)
    m1 = r1.choices[0].message.model_dump(exclude_none=True)
    assert m1["reasoning_content"] == PLAN and "content" not in m1 and r1.choices[0].finish_reason == "tool_calls"
    [tc] = m1["tool_calls"]
    assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == CALL  # days: int
    r2 = c.chat.completions.create(model="tiny", messages=follow_up(m1), tools=TOOLS, **GREEDY)
    m2 = r2.choices[0].message.model_dump(exclude_none=True)
    assert (m2["reasoning_content"], m2["content"]) == (PLAN2, ANSWER)
    recorded = calls(gw, s)
    assert [x["segment_index"] for x in recorded] == [0, 0]  # the reasoning sent back re-renders the sampled tokens
    assert recorded[1]["prompt_ids"][:len(recorded[0]["prompt_ids"]) + len(recorded[0]["completion_ids"])] == \
        recorded[0]["prompt_ids"] + recorded[0]["completion_ids"]
    tok = gw.gateway.renderer.tok
    assert tok.decode(recorded[0]["completion_ids"]).startswith(f"<think>\n{PLAN}\n</think>\n\n<tool_call>")
    assert end(gw, s)[0] == 200
    assert gw.gateway.sink.episodes[-1].num_malformed_tool_calls == 0


def test_responses_api_reasoning_items_continue_the_segment(thinking_stack):
    """/v1/responses: the reasoning block comes back as a reasoning item (content reasoning_text) before the
    function_call item; sent back as input, both rebuild the assistant turn the model sampled (one segment), streamed
    too, where reasoning_text deltas come first."""
    gw = thinking_stack
    s = new_session(gw)
    c = client(s)
    r_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    first = c.responses.create(model="tiny", input=USER, tools=r_tools, temperature=0, max_output_tokens=256)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == PLAN and json.loads(first.output[1].arguments) == CALL
    follow = USER + [i.model_dump(exclude_none=True) for i in first.output] + [
        {"type": "function_call_output", "call_id": first.output[1].call_id, "output": RESULT}]
    events = list(c.responses.create(model="tiny", input=follow, tools=r_tools, temperature=0, max_output_tokens=256,
                                     stream=True))
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == PLAN2
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 0]
    assert end(gw, s)[0] == 200


def test_responses_text_logprobs_are_the_answer_tokens(thinking_stack):
    """include message.output_text.logprobs (with top_logprobs): the output_text part carries the logprobs of the
    tokens that wrote its text, as recorded, not those of the reasoning block or the end-of-turn token; streamed, the
    output_text deltas carry them in order and the done event all of them."""
    gw = thinking_stack
    c = client(new_session(gw))
    r_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    first = c.responses.create(model="tiny", input=USER, tools=r_tools, temperature=0, max_output_tokens=256)
    follow = USER + [i.model_dump(exclude_none=True) for i in first.output] + [
        {"type": "function_call_output", "call_id": first.output[1].call_id, "output": RESULT}]
    ask = dict(model="tiny", input=follow, tools=r_tools, temperature=0, max_output_tokens=256,
               include=["message.output_text.logprobs"], top_logprobs=2)
    s = new_session(gw)
    second = client(s).responses.create(**ask)
    assert [i.type for i in second.output] == ["reasoning", "message"]
    part = second.output[1].content[0]
    assert part.text == ANSWER and "".join(t.token for t in part.logprobs) == ANSWER
    [rec] = calls(gw, s)
    ids, n = rec["completion_ids"], len(part.logprobs)
    tok = gw.gateway.renderer.tok
    assert ids[-1] in gw.gateway.renderer.eot_ids  # the answer's tokens are the ones before the end of the turn
    assert [t.token for t in part.logprobs] == [tok.decode([i]) for i in ids[-1 - n:-1]]
    assert [t.logprob for t in part.logprobs] == rec["logprobs"][-1 - n:-1]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in part.logprobs)
    events = list(client(new_session(gw)).responses.create(**ask, stream=True))
    streamed = [t.model_dump() for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    [text_done] = [e for e in events if e.type == "response.output_text.done"]
    assert streamed == [t.model_dump() for t in text_done.logprobs] == [t.model_dump() for t in part.logprobs]
    assert events[-1].response.output[1].content[0].logprobs == part.logprobs
    plain = client(new_session(gw)).responses.create(**{k: v for k, v in ask.items()
                                                       if k not in ("include", "top_logprobs")})
    assert plain.output[1].content[0].logprobs == []


def test_custom_tool_and_encrypted_reasoning_continue_the_segment(thinking_stack):
    """As Codex CLI drives the Responses API (store false, include reasoning.encrypted_content, a free-form custom
    tool: apply_patch), with reasoning items sent back as clients of OpenAI's hosted models send them (id, summary
    and encrypted_content; no text). The call comes out as a custom_tool_call whose input is the patch text, streamed
    with custom_tool_call_input events; the sealed reasoning restores the sampled turn, so the follow-up continues
    the segment; a tampered seal is a 400."""
    gw = thinking_stack
    s = new_session(gw)
    c = client(s)
    kw = dict(model="tiny", tools=R_TOOLS + [APPLY_PATCH], temperature=0, max_output_tokens=256, store=False,
              include=["reasoning.encrypted_content"])
    first = c.responses.create(input=FIX, **kw)
    assert [i.type for i in first.output] == ["reasoning", "custom_tool_call"]
    reasoning, patch = first.output
    assert reasoning.content[0].text == PLAN_FIX and reasoning.encrypted_content
    assert (patch.name, patch.input) == ("apply_patch", PATCH)
    events = list(c.responses.create(input=FIX, stream=True, **kw))
    streamed = events[-1].response
    assert [i.type for i in streamed.output] == ["reasoning", "custom_tool_call"] and streamed.output[1].input == PATCH
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == PATCH == "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    [sealed] = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert sealed.encrypted_content  # the completed item carries it (the added one cannot)
    codex_reasoning = {"type": "reasoning", "id": reasoning.id, "summary": [],
                       "encrypted_content": reasoning.encrypted_content}  # no content: the text is in the seal
    follow = FIX + [codex_reasoning, patch.model_dump(exclude_none=True),
                    {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": PATCHED}]
    second = c.responses.create(input=follow, **kw)
    assert [i.type for i in second.output] == ["reasoning", "message"] and second.output_text == FIXED
    # the streamed call repeats the first one's prompt (a new segment); the follow-up continues the streamed call's
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 1, 1]
    sealed_text = reasoning.encrypted_content
    tampered = dict(codex_reasoning, encrypted_content=sealed_text[:-1] + ("1" if sealed_text[-1] == "0" else "0"))
    status, err = http(s["base_url"] + "/responses", {**{k: v for k, v in kw.items() if k != "model"},
                                                      "input": FIX + [tampered] + follow[2:]})
    assert status == 400 and err["error"]["param"] == "input[1].encrypted_content", err
    assert end(gw, s)[0] == 200
    assert gw.gateway.sink.episodes[-1].num_malformed_tool_calls == 0


def test_a_turn_sent_back_without_its_reasoning_starts_a_new_segment(thinking_stack):
    gw = thinking_stack
    s = new_session(gw)
    c = client(s)
    m1 = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, **GREEDY).choices[0].message
    m1 = m1.model_dump(exclude_none=True)
    m1.pop("reasoning_content")
    c.chat.completions.create(model="tiny", messages=follow_up(m1), tools=TOOLS, **GREEDY)
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 1]


def test_streams_give_reasoning_content_deltas_then_content_and_tool_calls(thinking_stack):
    gw = thinking_stack
    c = client(new_session(gw))
    seen = {"reasoning": "", "content": "", "tool_calls": [], "order": []}
    for ch in c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True, **GREEDY):
        if not ch.choices:
            continue
        delta = ch.choices[0].delta.model_dump(exclude_none=True)
        for key, field in (("reasoning", "reasoning_content"), ("content", "content")):
            if delta.get(field):
                seen[key] += delta[field]
                seen["order"].append(key)
        seen["tool_calls"] += delta.get("tool_calls", [])
    assert seen["reasoning"] == PLAN and seen["content"] == "" and seen["order"][0] == "reasoning"
    assert len(seen["order"]) > 1  # streamed in pieces, not one chunk at the end
    [tc] = seen["tool_calls"]
    assert json.loads(tc["function"]["arguments"]) == CALL


def test_each_tool_call_is_streamed_when_its_block_closes_with_the_ids_the_turn_keeps(thinking_stack):
    gw = thinking_stack
    s = new_session(gw)
    c = client(s)
    chunks = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in c.chat.completions.create(
        model="tiny", messages=TWO, tools=TOOLS, stream=True, **GREEDY) if ch.choices]
    with_calls = [i for i, d in enumerate(chunks) if d.get("tool_calls")]
    assert len(with_calls) == 2  # a delta per call
    calls = [d["tool_calls"][0] for d in (chunks[i] for i in with_calls)]
    assert [tc["index"] for tc in calls] == [0, 1]
    assert [json.loads(tc["function"]["arguments"])["city"] for tc in calls] == ["Paris", "Rome"]
    # what the stream sees after each sampled token: the first call is final as soon as its block closes, long
    # before the completion ends
    from types import SimpleNamespace

    from forge_megatron.middleware.gateway import parse_chat_request

    req = parse_chat_request({"messages": TWO, "tools": TOOLS}, 64)
    ids = calls_of(gw, s)[0]["completion_ids"]
    seen, closed = [], 0
    for n in range(1, len(ids) + 1):
        closed, got = gw.gateway.stream_calls(SimpleNamespace(forced_text="", reasoning_open=False), req,
                                              SimpleNamespace(output_ids=ids[:n], finish_reason=None), closed)
        if got is not None:
            seen.append((n, [json.loads(tc["function"]["arguments"])["city"] for tc in got]))
    assert [cities for _, cities in seen] == [["Paris"], ["Paris", "Rome"]]
    assert seen[0][0] < seen[1][0] - 10  # Paris's call was out while Rome's was still being sampled
    # the turn is recorded with the streamed ids: sending the calls back with them continues the segment
    message = {"role": "assistant", "content": None, "reasoning_content": "Both.",
               "tool_calls": [{k: tc[k] for k in ("id", "type", "function")} for tc in calls]}
    follow = TWO + [message] + [{"role": "tool", "tool_call_id": tc["id"], "content": RESULT} for tc in calls]
    c.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=4, temperature=0)
    assert [x["segment_index"] for x in calls_of(gw, s)] == [0, 0]
    assert gw.gateway.sessions[s["session_id"]].calls[0].num_tool_calls == 2


def test_separate_reasoning_false_gives_the_raw_text(thinking_stack):
    gw = thinking_stack
    c = client(new_session(gw))
    r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, extra_body={"separate_reasoning": False},
                                  **GREEDY)
    m = r.choices[0].message.model_dump(exclude_none=True)
    assert "reasoning_content" not in m and m["content"] == f"<think>\n{PLAN}\n</think>"
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == CALL


def test_a_prompt_that_opens_the_block_and_template_kwargs(thinking_stack):
    gw = thinking_stack
    s = new_session(gw)
    c = client(s)
    opened = {"chat_template_kwargs": {"think_in_prompt": True}}
    m = c.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, extra_body=opened,
                                  **GREEDY).choices[0].message
    assert (m.model_dump()["reasoning_content"], m.content) == ("Let me think.", "Hello.")
    tok = gw.gateway.renderer.tok
    assert tok.decode(calls(gw, s)[0]["prompt_ids"]).endswith("<|im_start|>assistant\n<think>\n")
    with pytest.raises(Exception, match="opens a reasoning block"):  # a forced tool call cannot start in it
        c.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, tool_choice="required",
                                  extra_body=opened, **GREEDY)
    gw.gateway.config.chat_template_kwargs = {"think_in_prompt": True}  # the gateway's default ...
    try:
        m = c.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, **GREEDY).choices[0].message
        assert m.content == "Hello."
        c.chat.completions.create(model="tiny", messages=HELLO, extra_body={  # ... and a request overriding it
            "chat_template_kwargs": {"think_in_prompt": False, "enable_thinking": False}}, max_tokens=4)
        assert tok.decode(calls(gw, s)[-1]["prompt_ids"]).endswith("assistant\n<think>\n\n</think>\n\n")
    finally:
        gw.gateway.config.chat_template_kwargs = {}
    status, err = http(s["base_url"] + "/chat/completions", {"messages": HELLO, "chat_template_kwargs": [1]},
                       headers={"Authorization": "Bearer " + s["api_key"]})
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs"


A_TOOLS = [{"name": "get_weather", "description": TOOLS[0]["function"]["description"],
            "input_schema": TOOLS[0]["function"]["parameters"]}]


def test_anthropic_thinking_blocks_round_trip_and_stream(thinking_stack):
    gw = thinking_stack
    s = new_session(gw)
    c = anthropic.Anthropic(base_url=s["anthropic_base_url"], api_key="ignored", max_retries=0, timeout=60)
    first = c.messages.create(model="tiny", max_tokens=256, messages=USER, tools=A_TOOLS,
                              extra_body={"temperature": 0})
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    assert first.content[0].thinking == PLAN and first.content[1].input == CALL
    follow = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id,
                                                   "content": RESULT}]}]
    second = c.messages.create(model="tiny", max_tokens=256, messages=follow, tools=A_TOOLS,
                               extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in second.content] == \
        [("thinking", PLAN2), ("text", ANSWER)]
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 0]  # thinking blocks sent back continue the segment

    events = []
    with c.messages.stream(model="tiny", max_tokens=256, messages=follow, tools=A_TOOLS,
                           extra_body={"temperature": 0}) as st:
        for ev in st:
            if ev.type == "content_block_delta":
                events.append(ev.delta.type)
        final = st.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in second.content]
    assert events[0] == "thinking_delta" and "signature_delta" in events and events[-1] == "text_delta"
    first_stream = c.messages.create(model="tiny", max_tokens=256, messages=USER, tools=A_TOOLS, stream=True,
                                     extra_body={"temperature": 0})
    kinds = [ev.content_block.type for ev in first_stream if ev.type == "content_block_start"]
    assert kinds == ["thinking", "tool_use"]
    with c.messages.stream(model="tiny", max_tokens=256, messages=TWO, tools=A_TOOLS,
                           extra_body={"temperature": 0}) as st:  # two calls, each block as its call closes
        starts = [(ev.index, ev.content_block.type) for ev in st if ev.type == "content_block_start"]
        final = st.get_final_message()
    assert starts == [(0, "thinking"), (1, "tool_use"), (2, "tool_use")]
    assert [b.input["city"] for b in final.content[1:]] == ["Paris", "Rome"]


def test_a_template_that_refuses_the_messages_is_a_400_naming_its_reason(thinking_stack):
    """Chat templates raise on histories they cannot render (Mistral: tool call ids of 9 characters; gpt-oss: content
    and thinking on one tool-call turn; Llama 3.1: one call per turn): a 400 with the template's own message on both
    APIs (count_tokens too), and the session goes on serving."""
    gw = thinking_stack
    tok = gw.gateway.renderer.tok
    saved = tok.chat_template
    tok.chat_template = ("{%- for m in messages %}{%- if m.tool_calls %}"
                         "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
                         "{%- endif %}{{- m.content }}{%- endfor %}")
    try:
        s = new_session(gw)
        history = USER + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
        status, err = http(s["base_url"] + "/chat/completions", {"messages": history, "max_tokens": 4},
                           headers={"Authorization": "Bearer " + s["api_key"]})
        assert status == 400 and err["error"]["code"] == "chat_template_error", err
        assert "alphanumeric strings with length 9" in err["error"]["message"] and err["error"]["param"] == "messages"
        a = anthropic.Anthropic(base_url=s["anthropic_base_url"], api_key="ignored", max_retries=0, timeout=60)
        follow = USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                            "input": {}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                                       "content": RESULT}]}]
        for call in (lambda: a.messages.count_tokens(model="tiny", messages=follow, tools=A_TOOLS),
                     lambda: a.messages.create(model="tiny", max_tokens=4, messages=follow, tools=A_TOOLS)):
            with pytest.raises(anthropic.BadRequestError, match="length 9"):
                call()
        status, ok = http(s["base_url"] + "/chat/completions", {"messages": USER, "max_tokens": 2},
                          headers={"Authorization": "Bearer " + s["api_key"]})
        assert status == 200, ok
    finally:
        tok.chat_template = saved
