"""gpt-oss's harmony format: the parsers on written completions, then a tiny harmony model through the gateway.

Unit part: channels and recipients (in the channel part and in the role part of the header), preambles, several
messages, malformed and unknown calls kept as written, built-in tool recipients, text outside the format, no
reasoning parser, tool_choice "none", forced prefixes, and the streaming views: for every prefix of a completion the
reasoning and content given out extend the previous ones and end as the final answer's.

End to end: a tiny model with the harmony special tokens (``<|return|>`` and ``<|call|>`` both end a turn, from its
generation config), a harmony chat template of our own (tool calls rendered as gpt-oss's template does, with the
recipient in the role part; the reasoning of a turn that ends with a final answer dropped) and three fixed chats it is
fine-tuned to answer; the gateway serves it with ``tool_parser="gpt-oss"`` and ``reasoning_parser="gpt-oss"``.
"""

import json

import anthropic
import pytest

from forge_megatron.middleware import harmony
from forge_megatron.middleware.reasoning_parsers import get_reasoning_parser
from forge_megatron.middleware.tool_parsers import get_parser
from forge_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer
from tests.middleware.served_tiny import fine_tuned_gateway, tool_follow_up
from tests.middleware.test_gateway import calls, client, end, http, new_session

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALL_CHANNEL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}')
CALL_ROLE = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
             '<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}')
FINAL = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
PREAMBLE = ("<|channel|>analysis<|message|>Plan it.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking the weather first.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
            ' <|constrain|>json<|message|>{"city": "Rome"}')
TWO_THOUGHTS = ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
                "<|end|><|start|>assistant<|channel|>final<|message|>Done.")
COMPLETIONS = [CALL_CHANNEL, CALL_ROLE, FINAL, PREAMBLE, TWO_THOUGHTS, "plain text, no channels",
               "<|channel|>final<|message|>Hi<|end|>stray"]


def parse(text, tools=TOOLS, reasoning=True, tool_choice="auto"):
    r, t = get_reasoning_parser("gpt-oss"), get_parser("gpt-oss")
    if tool_choice == "none":
        t = t.without_calls()
    thought, rest = r.split(text, r.opens("")) if reasoning else (None, text)
    return thought, t.parse(rest, tools)


@pytest.mark.parametrize("text", [CALL_CHANNEL, CALL_ROLE])
def test_analysis_is_reasoning_and_a_message_to_functions_is_a_call(text):
    thought, p = parse(text)
    assert thought == "Need the weather." and p.content is None and p.num_malformed == 0
    [c] = p.tool_calls
    assert c["function"]["name"] == "get_weather" and json.loads(c["function"]["arguments"]) == {"city": "Paris",
                                                                                                 "days": 3}


def test_final_answer_preamble_and_several_analysis_messages():
    assert parse(FINAL)[0] == "Easy." and parse(FINAL)[1].content == "2 + 2 = 4."
    thought, p = parse(PREAMBLE)
    assert thought == "Plan it." and p.content == "Checking the weather first."
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"city": "Rome"}
    thought, p = parse(TWO_THOUGHTS)
    assert (thought, p.content, p.tool_calls) == ("First.\nSecond.", "Done.", [])
    many = "<|channel|>commentary<|message|>A<|end|><|start|>assistant<|channel|>final<|message|>B"
    assert parse(many)[1].content == "A\n\nB"


def test_text_outside_the_format_is_content_as_written():
    thought, p = parse("plain text, no channels")
    assert (thought, p.content, p.tool_calls) == (None, "plain text, no channels", [])
    assert parse("<|channel|>final<|message|>Hi<|end|>stray")[1].content == "Hi" + "stray"
    assert parse("")[1].content == ""


def test_bad_calls_are_malformed_and_kept_as_written():
    bad_json = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
    _, p = parse(bad_json)
    assert (p.tool_calls, p.num_malformed, p.content) == ([], 1, bad_json)
    unknown = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}'
    _, p = parse(unknown)
    assert (p.tool_calls, p.num_malformed, p.content) == ([], 1, unknown)
    _, p = parse(unknown, tools=None)  # no tools in the request: any function name is taken
    assert p.tool_calls[0]["function"]["name"] == "get_time" and p.num_malformed == 0
    browser = '<|channel|>analysis to=browser.search code<|message|>{"query": "paris"}'
    _, p = parse(browser, tools=None)  # a built-in tool's recipient is the call's name
    assert p.tool_calls[0]["function"]["name"] == "browser.search"


def test_without_the_reasoning_parser_or_with_tool_choice_none_the_messages_stay_as_written():
    thought, p = parse(CALL_CHANNEL, reasoning=False)
    assert thought is None and p.content == "<|channel|>analysis<|message|>Need the weather.<|end|>"
    assert len(p.tool_calls) == 1
    thought, p = parse(CALL_CHANNEL, tool_choice="none")
    assert thought == "Need the weather." and p.tool_calls == [] and p.num_malformed == 0
    assert p.content == CALL_CHANNEL[CALL_CHANNEL.index("<|start|>"):]


def test_forced_prefixes_parse_as_calls():
    t = get_parser("gpt-oss")
    _, p = parse(t.forced_prefix("get_weather") + '{"city": "Oslo"}')
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, p = parse(t.forced_prefix() + 'get_weather <|constrain|>json<|message|>{"city": "Oslo"}')
    assert p.tool_calls[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("text", COMPLETIONS)
@pytest.mark.parametrize("reasoning", [True, False])
def test_stream_views_only_grow_and_end_as_the_answer(text, reasoning):
    r, t = get_reasoning_parser("gpt-oss"), get_parser("gpt-oss")
    last_thought, last_content = "", ""
    for n in range(len(text) + 1):
        thought, rest = r.split(text[:n], False, final=False) if reasoning else (None, text[:n])
        shown = t.streamable(rest)
        assert shown.startswith(last_content) and (thought or "").startswith(last_thought), (n, shown, thought)
        assert "<|message|>" not in shown or not reasoning  # no header ever, with the reasoning parser
        last_thought, last_content = thought or "", shown
    thought, p = parse(text, reasoning=reasoning)
    assert (thought or "") == last_thought
    assert (p.content or "").startswith(last_content.strip() if p.tool_calls else last_content)
    if not p.tool_calls:
        assert p.content == last_content  # nothing held back at the end of a completion without calls


def test_split_messages_reads_headers():
    [a, b] = harmony.split_messages(CALL_ROLE)
    assert (a.channel, a.recipient, a.body, a.closed) == ("analysis", None, "Need the weather.", True)
    assert (b.channel, b.recipient, b.closed) == ("commentary", "functions.get_weather", False)
    [a, b] = harmony.split_messages(CALL_CHANNEL)
    assert (b.channel, b.recipient) == ("commentary", "functions.get_weather")
    [m] = harmony.split_messages("<|channel|>fin")
    assert not m.header_done  # still arriving: a stream holds it back


# ---------------------------------------------------------------------------------------------- end to end
SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = (
    "{%- set ns = namespace(tool='') %}"
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools\\nnamespace functions {\\n' }}"
    "{%- for t in tools %}"
    "{{- 'type ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson) + ') => any;\\n' }}"
    "{%- endfor %}{{- '} // namespace functions<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif %}"
    "{%- for tc in m.tool_calls %}{%- set ns.tool = tc.function.name %}"
    "{{- '<|start|>assistant to=functions.' + tc.function.name + '<|channel|>commentary json<|message|>' }}"
    "{{- tc.function.arguments | tojson }}{{- '<|call|>' }}{%- endfor %}"
    "{%- elif m.role == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start|>functions.' + ns.tool + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
USER = [{"role": "user", "content": "Weather in Paris?"}]
HELLO = [{"role": "user", "content": "Say hello."}]
PLAN, CALL, RESULT, PLAN2, ANSWER = "Need the weather.", {"city": "Paris", "days": 3}, "sunny", "Sunny.", "It is sunny."
GREEDY = dict(temperature=0, max_tokens=200)


def scripted_chats():
    call = {"role": "assistant", "content": None, "thinking": PLAN, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": CALL}}]}
    return [(USER, CALL_ROLE + "<|call|>"),
            (USER + [call, {"role": "tool", "tool_call_id": "c1", "content": RESULT}],
             f"<|channel|>analysis<|message|>{PLAN2}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"),
            (HELLO, "<|channel|>final<|message|>Hello.")]


@pytest.fixture(scope="module")
def harmony_stack(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("harmony"))
    tok = build_tiny_tokenizer()
    tok.add_tokens(SPECIALS, special_tokens=True)
    tok.eos_token = "<|return|>"
    tok.chat_template = TEMPLATE
    ends = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    build_tiny_model(d, seed=2, with_tokenizer=False, vocab_size=len(tok), eos_token_id=ends)
    tok.save_pretrained(d)
    formats = {"tool_parser": "gpt-oss", "reasoning_parser": "gpt-oss"}
    with fine_tuned_gateway(d, scripted_chats(), TOOLS, formats) as gw:
        yield gw


def follow_up(first: dict) -> list[dict]:
    return tool_follow_up(USER, first, RESULT)


def test_harmony_tool_loop_is_one_segment_and_a_final_answer_ends_it(harmony_stack):
    gw = harmony_stack
    assert {gw.gateway.renderer.tok.convert_ids_to_tokens(i) for i in gw.gateway.renderer.eot_ids} == \
        {"<|return|>", "<|call|>"}  # from generation_config.json
    s = new_session(gw)
    c = client(s)
    r1 = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, **GREEDY)
    m1 = r1.choices[0].message.model_dump(exclude_none=True)
    assert m1["reasoning_content"] == PLAN and "content" not in m1 and r1.choices[0].finish_reason == "tool_calls"
    assert json.loads(m1["tool_calls"][0]["function"]["arguments"]) == CALL
    r2 = c.chat.completions.create(model="tiny", messages=follow_up(m1), tools=TOOLS, **GREEDY)
    m2 = r2.choices[0].message.model_dump(exclude_none=True)
    assert (m2["reasoning_content"], m2["content"], r2.choices[0].finish_reason) == (PLAN2, ANSWER, "stop")
    tok = gw.gateway.renderer.tok
    recorded = calls(gw, s)
    assert tok.convert_ids_to_tokens(recorded[0]["completion_ids"][-1]) == "<|call|>"
    assert tok.convert_ids_to_tokens(recorded[1]["completion_ids"][-1]) == "<|return|>"
    assert [x["segment_index"] for x in recorded] == [0, 0]  # <|call|> ended the turn; the reasoning came back
    assert recorded[1]["prompt_ids"][:len(recorded[0]["prompt_ids"]) + len(recorded[0]["completion_ids"])] == \
        recorded[0]["prompt_ids"] + recorded[0]["completion_ids"]
    # the template drops a final answer's reasoning: the next turn is a new segment (what the model then sees)
    third = follow_up(m1) + [m2, {"role": "user", "content": "Say hello."}]
    c.chat.completions.create(model="tiny", messages=third, tools=TOOLS, max_tokens=8, temperature=0)
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 0, 1]
    assert end(gw, s)[0] == 200
    assert gw.gateway.sink.episodes[-1].num_malformed_tool_calls == 0


def test_reasoning_content_renders_as_thinking_so_a_turn_sent_back_without_it_is_a_new_segment(harmony_stack):
    gw = harmony_stack
    s = new_session(gw)
    c = client(s)
    m1 = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, **GREEDY).choices[0].message
    m1 = m1.model_dump(exclude_none=True)
    assert f"<|channel|>analysis<|message|>{PLAN}<|end|>" in gw.gateway.renderer.render(follow_up(m1), TOOLS, True)
    m1.pop("reasoning_content")
    c.chat.completions.create(model="tiny", messages=follow_up(m1), tools=TOOLS, max_tokens=8, temperature=0)
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 1]


def test_harmony_streams_reasoning_and_content_without_headers(harmony_stack):
    gw = harmony_stack
    c = client(new_session(gw))
    first = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, **GREEDY).choices[0].message
    for messages, want in ((USER, None), (follow_up(first.model_dump(exclude_none=True)), ANSWER)):
        got = {"reasoning_content": "", "content": "", "tool_calls": [], "pieces": 0}
        for ch in c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, stream=True, **GREEDY):
            if not ch.choices:
                continue
            delta = ch.choices[0].delta.model_dump(exclude_none=True)
            for key in ("reasoning_content", "content"):
                got[key] += delta.get(key) or ""
                got["pieces"] += bool(delta.get(key))
            got["tool_calls"] += delta.get("tool_calls", [])
        assert got["reasoning_content"] == (PLAN if want is None else PLAN2)
        assert got["content"] == (want or "") and "<|" not in got["content"] and got["pieces"] > 2
        assert bool(got["tool_calls"]) == (want is None)


def test_harmony_forced_call_and_anthropic_blocks(harmony_stack):
    gw = harmony_stack
    s = new_session(gw)
    c = client(s)
    named = {"type": "function", "function": {"name": "get_weather"}}
    c.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, tool_choice=named, max_tokens=8)
    tok = gw.gateway.renderer.tok
    assert tok.decode(calls(gw, s)[-1]["prompt_ids"]).endswith(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    a = anthropic.Anthropic(base_url=s["anthropic_base_url"], api_key="ignored", max_retries=0, timeout=60)
    a_tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    msg = a.messages.create(model="tiny", max_tokens=200, messages=USER, tools=a_tools, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.content[1].input == CALL
    status, err = http(s["base_url"] + "/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "none",
                                                            "temperature": 0, "max_tokens": 200},
                       headers={"Authorization": "Bearer " + s["api_key"]})
    assert status == 200 and "tool_calls" not in err["choices"][0]["message"]  # "none": the call stays text
    assert "to=functions.get_weather" in err["choices"][0]["message"]["content"]
