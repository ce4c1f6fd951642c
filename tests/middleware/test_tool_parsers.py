"""Tool-call parsers of every model family (middleware/tool_parsers.py).

Each family's calls are written here by a small Jinja writer of our own that lays a call out the way that family's
chat template renders an assistant tool call (the format facts in the module docstring). Parsing the written text
must give back the calls, with arguments typed by the tools' schemas, and writing the parsed calls again must give
the same text: that is what lets the gateway continue a segment across turns."""

import json
import random

import jinja2
import pytest

from forge_megatron.middleware.tool_parsers import (
    CannotForceToolCall, get_parser, parser_names, schema_types, typed_value,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "level": {"enum": [1, 2, 3]}, "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}},
]

_VALUE = "{% if v is string %}{{ v }}{% else %}{{ v | tojson }}{% endif %}"
WRITERS = {  # family -> Jinja for a list of calls ({name, arguments: dict}) as its template writes them
    "hermes": '{% for c in calls %}{% if not loop.first %}\n{% endif %}<tool_call>\n{"name": "{{ c.name }}", '
              '"arguments": {{ c.arguments | tojson }}}\n</tool_call>{% endfor %}',
    "qwen3_coder": "{% for c in calls %}{% if not loop.first %}\n{% endif %}<tool_call>\n<function={{ c.name }}>\n"
                   "{% for k, v in c.arguments.items() %}<parameter={{ k }}>\n" + _VALUE + "\n</parameter>\n"
                   "{% endfor %}</function>\n</tool_call>{% endfor %}",
    "glm45": "{% for c in calls %}\n<tool_call>{{ c.name }}\n{% for k, v in c.arguments.items() %}<arg_key>{{ k }}"
             "</arg_key>\n<arg_value>" + _VALUE + "</arg_value>\n{% endfor %}</tool_call>{% endfor %}",
    "glm47": "{% for c in calls %}<tool_call>{{ c.name }}{% for k, v in c.arguments.items() %}<arg_key>{{ k }}"
             "</arg_key><arg_value>" + _VALUE + "</arg_value>{% endfor %}</tool_call>{% endfor %}",
    "minimax-m2": '<minimax:tool_call>\n{% for c in calls %}<invoke name="{{ c.name }}">\n'
                  '{% for k, v in c.arguments.items() %}<parameter name="{{ k }}">' + _VALUE + '</parameter>\n'
                  "{% endfor %}</invoke>\n{% endfor %}</minimax:tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|>{% for c in calls %}<|tool_call_begin|>{{ c.id }}"
               "<|tool_call_argument_begin|>{{ c.arguments | tojson }}<|tool_call_end|>{% endfor %}"
               "<|tool_calls_section_end|>",
    "deepseekv31": "<｜tool▁calls▁begin｜>{% for c in calls %}<｜tool▁call▁begin｜>{{ c.name }}<｜tool▁sep｜>"
                   "{{ c.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>",
    "deepseekv3": "<｜tool▁calls▁begin｜>{% for c in calls %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.name }}\n"
                  "```json\n{{ c.arguments | tojson }}\n```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>",
    "deepseekv32": "<｜DSML｜function_calls>\n{% for c in calls %}<｜DSML｜invoke name=\"{{ c.name }}\">\n"
                   "{% for k, v in c.arguments.items() %}<｜DSML｜parameter name=\"{{ k }}\" string=\""
                   "{{ 'true' if v is string else 'false' }}\">" + _VALUE + "</｜DSML｜parameter>\n{% endfor %}"
                   "</｜DSML｜invoke>\n{% endfor %}</｜DSML｜function_calls>",
}
# Gemma 4: keys bare, strings between <|"|> delimiters, everything else bare (JSON literals), nested objects and
# arrays in its own notation
WRITERS["gemma4"] = (
    "{% macro val(v) %}{% if v is string %}<|\"|>{{ v }}<|\"|>{% elif v is mapping %}{{ '{' }}"
    "{% for k, x in v.items() %}{% if not loop.first %},{% endif %}{{ k }}:{{ val(x) }}{% endfor %}{{ '}' }}"
    "{% elif v is sequence %}[{% for x in v %}{% if not loop.first %},{% endif %}{{ val(x) }}{% endfor %}]"
    "{% else %}{{ v | tojson }}{% endif %}{% endmacro %}"
    "{% for c in calls %}<|tool_call>call:{{ c.name }}{{ val(c.arguments) }}<tool_call|>{% endfor %}")
WRITERS["deepseekv4"] = WRITERS["deepseekv32"].replace("function_calls", "tool_calls")
# Hunyuan: a JSON list of the calls in one block
WRITERS["hunyuan"] = ("<tool_calls>[{% for c in calls %}{% if not loop.first %}, {% endif %}{\"name\": \"{{ c.name }}\", "
                      "\"arguments\": {{ c.arguments | tojson }}}{% endfor %}]</tool_calls>")
# MiniMax-M1: the calls' JSON objects one per line in one block
WRITERS["minimax-m1"] = ("<tool_calls>\n{% for c in calls %}{\"name\": \"{{ c.name }}\", \"arguments\": "
                         "{{ c.arguments | tojson }}}\n{% endfor %}</tool_calls>")
WRITERS["seed_oss"] = WRITERS["qwen3_coder"].replace("tool_call>", "seed:tool_call>")
# LongCat-Flash-Chat: Hermes' JSON calls under its own tags; later LongCat releases: GLM-4.5's layout under them
# (longcat_xml: the same parser, told apart by the block's body)
WRITERS["longcat"] = WRITERS["hermes"].replace("tool_call>", "longcat_tool_call>")
WRITERS["longcat_xml"] = WRITERS["glm45"].replace("tool_call>", "longcat_tool_call>") \
    .replace("arg_key>", "longcat_arg_key>").replace("arg_value>", "longcat_arg_value>")
# Cohere (Command A / R7B): a JSON list of the calls, one per line, numbered by the template's running count
WRITERS["cohere"] = ("<|START_ACTION|>[\n{% for c in calls %}    {\"tool_call_id\": \"{{ first + loop.index0 }}\", "
                     "\"tool_name\": \"{{ c.name }}\", \"parameters\": {{ c.arguments | tojson }}}"
                     "{% if not loop.last %},{% endif %}\n{% endfor %}]<|END_ACTION|>")
XML = ("qwen3_coder", "glm45", "glm47", "minimax-m2", "seed_oss", "longcat_xml")
PARSER = {"longcat_xml": "longcat"}  # writer -> the parser that reads it, where the names differ
_env = jinja2.Environment()
_env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)


def write(family: str, calls: list[dict], first: int = 0) -> str:
    """``calls`` as ``family`` writes them; ``first``: calls earlier in the conversation (Cohere numbers them)."""
    return _env.from_string(WRITERS[family]).render(calls=calls, first=first)


def parsed_calls(parsed) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"]), "id": c["id"]}
            for c in parsed.tool_calls]


def random_arguments(rng: random.Random) -> dict:
    pool = {
        "city": lambda: rng.choice(["Paris", "São Paulo", "New\nYork", "x <y> & z", "123", "true", "  spaced  "]),
        "days": lambda: rng.randint(-5, 400), "metric": lambda: rng.random() < 0.5,
        "ratio": lambda: rng.choice([0.25, 3, -1.5e-3]), "tags": lambda: rng.sample(["a", "b", "c d"], 2),
        "where": lambda: {"lat": 1.5, "names": ["x"]}, "note": lambda: rng.choice([None, "hi", "null-ish"]),
        "level": lambda: rng.choice([1, 2, 3]), "zip": lambda: rng.choice(["01234", "75001"]),
    }
    keys = rng.sample(sorted(pool), rng.randint(1, len(pool)))
    return {k: pool[k]() for k in keys}


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_parse_inverts_the_family_format_and_writes_back_the_same_text(family):
    rng = random.Random(family)
    p = get_parser(PARSER.get(family, family))
    for trial in range(25):
        calls = [{"name": "get_weather", "arguments": random_arguments(rng), "id": f"functions.get_weather:{i}"}
                 for i in range(rng.randint(1, 3))]
        text = write(family, calls)
        lead = rng.choice(["", "Let me check.", "Sure, calling it now:\n"])
        got = p.parse(lead + text, TOOLS)
        assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == \
            [(c["name"], c["arguments"]) for c in calls], (trial, text)
        assert got.num_malformed == 0 and got.content == (lead.strip() or None)
        # the parsed calls, written again (as the template renders them next turn), are the sampled text
        assert write(family, parsed_calls(got)) == text
        if family == "kimi_k2":
            assert [c["id"] for c in got.tool_calls] == [c["id"] for c in calls]  # the model's own ids are kept
        else:
            assert all(c["id"].startswith("call_") for c in got.tool_calls)


def test_calls_to_tools_the_request_does_not_have_are_malformed():
    p = get_parser("hermes")
    text = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    got = p.parse(text, TOOLS)
    assert got.tool_calls == [] and got.num_malformed == 1 and got.content == text
    assert p.parse(text).tool_calls[0]["function"]["name"] == "launch_rockets"  # no tools given: any name


def test_every_registered_name_parses_or_is_none():
    assert {"hermes", "qwen", "qwen25", "qwen3_coder", "glm", "glm45", "glm47", "minimax-m2", "kimi_k2",
            "deepseekv3", "deepseekv31", "gemma4", "longcat", "none"} <= set(parser_names())
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; available: .*qwen3_coder"):
        get_parser("nope")


@pytest.mark.parametrize("family", XML)
def test_xml_arguments_are_typed_by_the_schema(family):
    p = get_parser(PARSER.get(family, family))
    text = write(family, [{"name": "get_weather", "arguments": {
        "city": "123", "zip": "01234", "days": 3, "metric": False, "ratio": 2.5, "tags": ["a"], "where": {"k": 1},
        "note": None, "level": 2}}, {"name": "search", "arguments": {"query": "true", "limit": None}}])
    got = p.parse(text, TOOLS)
    assert got.num_malformed == 0
    [weather, search] = parsed_calls(got)
    assert weather["arguments"] == {"city": "123", "zip": "01234", "days": 3, "metric": False, "ratio": 2.5,
                                    "tags": ["a"], "where": {"k": 1}, "note": None, "level": 2}
    assert search["arguments"] == {"query": "true", "limit": None}
    # without tools (no schema) values are read as JSON where they parse: "123" would become 123
    assert json.loads(p.parse(text).tool_calls[0]["function"]["arguments"])["city"] == 123


@pytest.mark.parametrize("family", XML)
def test_xml_value_that_fits_no_type_is_passed_on_and_counted(family):
    text = write(family, [{"name": "get_weather", "arguments": {"days": "three", "city": "Rome"}}])
    got = get_parser(PARSER.get(family, family)).parse(text, TOOLS)
    assert parsed_calls(got)[0]["arguments"] == {"days": "three", "city": "Rome"}
    assert got.num_malformed == 1


def test_typed_value_rules():
    assert typed_value("5", {"type": "integer"}) == (5, True)
    assert typed_value("5.0", {"type": "integer"}) == ("5.0", False)
    assert typed_value("5", {"type": "number"}) == (5, True)
    assert typed_value("true", {"type": "integer"}) == ("true", False)  # a bool is not an integer
    assert typed_value("true", {"type": "boolean"}) == (True, True)
    assert typed_value("null", {"type": ["integer", "null"]}) == (None, True)
    assert typed_value("null", {"type": "string"}) == ("null", True)
    assert typed_value("[1]", {"type": "array"}) == ([1], True)
    assert typed_value("2", {"enum": [1, 2]}) == (2, True)
    assert typed_value("b", {"enum": ["a", "b"]}) == ("b", True)
    assert typed_value("x", {"oneOf": [{"type": "integer"}, {"type": "string"}]}) == ("x", True)
    assert typed_value("{", None) == ("{", True)
    assert schema_types({"properties": {}}) == {"object"} and schema_types({"description": "d"}) is None


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_malformed_and_unclosed_blocks_stay_in_content(family):
    p = get_parser(PARSER.get(family, family))
    good = write(family, [{"name": "search", "arguments": {"query": "q"}, "id": "functions.search:0"}])
    start, end = p.start_marker, p.end_marker
    broken = {"hermes": f'{start}{{"name": 3}}{end}', "kimi_k2": f"{start}<|tool_call_begin|>bad id"
              "<|tool_call_argument_begin|>{}<|tool_call_end|>" + end}.get(family, f"{start}garbage{end}")
    got = p.parse(f"a {broken} b {good}", TOOLS)
    assert [c["function"]["name"] for c in got.tool_calls] == ["search"] and got.num_malformed == 1
    assert broken in got.content
    cut = good[:len(good) - len(end) - 1]  # cut by max_tokens before the closing marker
    got = p.parse("hi " + cut, TOOLS)
    assert got.tool_calls == [] and got.num_malformed == 1 and got.content == "hi " + cut
    assert p.parse("no calls here", TOOLS).content == "no calls here"


@pytest.mark.parametrize("family", sorted(set(WRITERS) - {"longcat_xml"}))  # (LongCat forces its JSON form)
def test_forced_prefix_starts_the_written_call_and_parses_with_the_completion(family):
    p = get_parser(family)
    call = {"name": "search", "arguments": {"query": "weather"}, "id": "functions.search:2"}
    text = write(family, [call], first=2).lstrip("\n")  # (the call after two others: prior_calls=2)
    for name in (None, "search"):
        prefix = p.forced_prefix(name, prior_calls=2)
        assert text.startswith(prefix), (prefix, text)
        got = p.parse(prefix + text[len(prefix):], TOOLS)
        assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == [("search", {"query": "weather"})]
    with pytest.raises(CannotForceToolCall):
        get_parser("none").forced_prefix()


# ------------------------------------------------------------------------------------- Llama 3.1-3.3 (llama3)
LLAMA3 = '{"name": "{{ c.name }}", "parameters": {{ c.arguments | tojson }}}'  # how its template writes a call


def test_llama3_json_calls_round_trip_and_tagged_ones():
    p, rng = get_parser("llama3"), random.Random("llama3")
    for trial in range(25):
        calls = [{"name": rng.choice(["get_weather", "search"]), "arguments": random_arguments(rng)}
                 for _ in range(rng.randint(1, 3))]
        text = "; ".join(_env.from_string(LLAMA3).render(c=c) for c in calls)
        lead = rng.choice(["", "<|python_tag|>", "Checking.<|python_tag|>"])
        got = p.parse(lead + text, TOOLS)
        assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == \
            [(c["name"], c["arguments"]) for c in calls], (trial, text)
        assert got.num_malformed == 0 and got.content == ("Checking." if lead.startswith("C") else None)
        assert _env.from_string(LLAMA3).render(c=parsed_calls(got)[0]) == text.split("; ")[0]
    arguments_key = p.parse('{"name": "search", "arguments": {"query": "q"}}', TOOLS)
    assert parsed_calls(arguments_key)[0]["arguments"] == {"query": "q"}


def test_llama3_answers_that_are_not_calls():
    p = get_parser("llama3")
    for text in ("The answer is 4.", '{"answer": 4}', '{"name": "search"}', "{not json"):
        got = p.parse(text, TOOLS)  # JSON answers and lookalikes are content, not malformed calls
        assert (got.content, got.tool_calls, got.num_malformed) == (text, [], 0), text
    for text in ('<|python_tag|>{"answer": 4}', '{"name": "launch", "parameters": {}}',
                 '{"name": "search", "parameters": {"query": "q"}} trailing words'):
        got = p.parse(text, TOOLS)  # after the tag, to an unknown tool, or with text after the call: malformed
        assert (got.content, got.tool_calls, got.num_malformed) == (text, [], int("launch" in text or "<|" in text))
    assert p.parse('{"name": "launch", "parameters": {}}').tool_calls[0]["function"]["name"] == "launch"


def test_llama3_streams_hold_back_what_may_be_a_call():
    p = get_parser("llama3")
    assert p.streamable("The answer") == "The answer" and p.streamable("  {\"na") == "" and p.streamable("") == ""
    assert p.streamable("Checking.<|python_tag|>{") == "Checking." and p.start_marker == "<|python_tag|>"
    call = '{"name": "search", "parameters": {"query": "weather"}}'
    for name in (None, "search"):
        prefix = p.forced_prefix(name)
        assert call.startswith(prefix)
        assert parsed_calls(p.parse(prefix + call[len(prefix):], TOOLS))[0]["arguments"] == {"query": "weather"}


# ------------------------------------------------------------------------------------------------ Mistral
MISTRAL_V7 = '[TOOL_CALLS][{% for c in calls %}{% if not loop.first %}, {% endif %}{"name": "{{ c.name }}", ' \
             '"arguments": {{ c.arguments | tojson }}, "id": "{{ c.id }}"}{% endfor %}]'
MISTRAL_V11 = '{% for c in calls %}[TOOL_CALLS]{{ c.name }}[ARGS]{{ c.arguments | tojson }}{% endfor %}'


@pytest.mark.parametrize("writer", [MISTRAL_V7, MISTRAL_V11], ids=["json-array", "v11"])
def test_mistral_calls_round_trip_with_template_acceptable_ids(writer):
    p, rng = get_parser("mistral"), random.Random("mistral")
    for trial in range(20):
        calls = [{"name": rng.choice(["get_weather", "search"]), "arguments": random_arguments(rng),
                  "id": f"a{trial:02d}b{i}xyz9"[:9]} for i in range(rng.randint(1, 3))]
        text = _env.from_string(writer).render(calls=calls)
        lead = rng.choice(["", "On it."])
        got = p.parse(lead + text, TOOLS)
        assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == \
            [(c["name"], c["arguments"]) for c in calls], (trial, text)
        assert got.num_malformed == 0 and got.content == (lead or None)
        if writer == MISTRAL_V7:  # the model's ids are kept, and render back to the same text
            assert [c["id"] for c in got.tool_calls] == [c["id"] for c in calls]
            assert _env.from_string(writer).render(calls=parsed_calls(got)) == text
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got.tool_calls)  # Mistral templates demand it


def test_mistral_malformed_calls_and_forcing():
    p = get_parser("mistral")
    for bad in ('[TOOL_CALLS][{"name": "search", "arguments": {"query": ', '[TOOL_CALLS]search{"query": "q"}',
                '[TOOL_CALLS][{"name": "launch", "arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]'):
        got = p.parse("x " + bad, TOOLS)
        assert (got.tool_calls, got.num_malformed, got.content) == ([], 1, "x " + bad), bad
    got = p.parse('[TOOL_CALLS]search[CALL_ID]q1w2e3r4t[ARGS]{"query": "q"}', TOOLS)
    assert got.tool_calls[0]["id"] == "q1w2e3r4t"
    assert p.parse("plain answer", TOOLS).content == "plain answer" and p.start_marker == "[TOOL_CALLS]"
    assert p.forced_prefix() == "[TOOL_CALLS]"
    with pytest.raises(CannotForceToolCall, match="use tool_choice 'required'"):
        p.forced_prefix("search")  # no template read (learn_template): the named call's form is unknown


def _mistral_chat_template(call_writer: str) -> str:
    """A Mistral-style chat template whose assistant tool calls are written by ``call_writer`` (over ``calls``)."""
    return ("{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
            "{% elif m.role == 'assistant' %}{% set calls = m.tool_calls | map(attribute='function') | list %}"
            "{% set ids = m.tool_calls | map(attribute='id') | list %}" + call_writer + "</s>"
            "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}")


MISTRAL_V11_IDS = '{% for c in calls %}[TOOL_CALLS]{{ c.name }}[CALL_ID]{{ ids[loop.index0] }}[ARGS]' \
                  '{{ c.arguments | tojson }}{% endfor %}'


@pytest.mark.parametrize("writer", [MISTRAL_V7.replace('{{ c.id }}', '{{ ids[loop.index0] }}'), MISTRAL_V11,
                                    MISTRAL_V11_IDS], ids=["json-array", "v11", "v11-call-ids"])
def test_mistral_named_forcing_reads_the_call_form_off_the_template(writer):
    """The gateway hands the parser its chat template (learn_template); the forced text for a named call is then how
    that template starts a call to the function, up to the model's own part (its id, where the template has ids
    the model writes, or the arguments), and the forced text plus the rest of the call parses as the call."""
    p = get_parser("mistral")
    template = _env.from_string(_mistral_chat_template(writer))
    p.learn_template(lambda messages, tools: template.render(messages=messages, tools=tools))
    call = {"name": "search", "arguments": {"query": "weather"}, "id": "k3j4h5g6f"}
    written = _env.from_string(writer.replace("ids[loop.index0]", "c.id")).render(calls=[call])
    prefix = p.forced_prefix("search")
    assert written.startswith(prefix) and prefix.startswith("[TOOL_CALLS]") and "search" in prefix, (prefix, written)
    assert "k3j4h5g6f" not in prefix and '"query"' not in prefix  # the model writes its id and arguments
    [got] = parsed_calls(p.parse(prefix + written[len(prefix):], TOOLS))
    assert (got["name"], got["arguments"]) == ("search", {"query": "weather"})
    refusing = get_parser("mistral")
    refusing.learn_template(lambda messages, tools: 1 / 0)  # a template that refuses the probe
    with pytest.raises(CannotForceToolCall):
        refusing.forced_prefix("search")


# ------------------------------------------------------------------------------------ pythonic (Llama 3.2+)
def _pythonic(calls):
    return "[" + ", ".join(f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items()) + ")"
                           for c in calls) + "]"


def test_pythonic_calls_round_trip_and_nothing_is_evaluated():
    p, rng = get_parser("pythonic"), random.Random("pythonic")
    for trial in range(25):
        calls = [{"name": rng.choice(["get_weather", "search"]), "arguments": random_arguments(rng)}
                 for _ in range(rng.randint(1, 3))]
        text = _pythonic(calls)
        for wrapped in (text, f"<|python_start|>{text}<|python_end|>", f"\n {text}\n"):
            got = p.parse(wrapped, TOOLS)
            assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == \
                [(c["name"], c["arguments"]) for c in calls], (trial, wrapped)
            assert got.num_malformed == 0 and got.content is None
    for text in ("The answer is [4].", "[1, 2]", "[not python", "Sure: [search(query='x')]"):
        got = p.parse(text, TOOLS)  # not a call list as the whole answer: content
        assert (got.content, got.tool_calls, got.num_malformed) == (text, [], 0), text
    for text in ("[search(__import__('os').system('true'))]", "[search(query=open('x').read())]",
                 "[launch(now=True)]", "[search(query={1, 2})]", "[x.search(query='q')]"):
        got = p.parse(text, TOOLS)  # calls that do not read as literal calls to known tools: malformed
        assert (got.content, got.tool_calls, got.num_malformed) == (text, [], 1), text


def test_pythonic_streams_hold_back_a_possible_call_list_and_force_it():
    p = get_parser("pythonic")
    assert p.streamable("Hello") == "Hello" and p.streamable(" [sea") == "" and p.streamable("<|pyth") == ""
    assert p.forced_prefix() == "[" and p.forced_prefix("search") == "[search("
    got = p.parse(p.forced_prefix("search") + "query='weather')]", TOOLS)
    assert parsed_calls(got)[0]["arguments"] == {"query": "weather"}



def test_lfm2_blocks_of_pythonic_or_json_calls():
    """LFM2's ``<|tool_call_start|>[...]<|tool_call_end|>`` blocks: a pythonic list of calls (nothing evaluated) or
    JSON ones, text outside the blocks content; a block that does not read, or calls an unknown tool, stays content
    and counts as malformed; forcing opens a block (and the call when named)."""
    p, rng = get_parser("lfm2"), random.Random("lfm2")
    for trial in range(20):
        calls = [{"name": rng.choice(["get_weather", "search"]), "arguments": random_arguments(rng)}
                 for _ in range(rng.randint(1, 3))]
        lead = rng.choice(["", "Let me check.\n"])
        as_json = json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
        for body in (_pythonic(calls), as_json):
            got = p.parse(f"{lead}<|tool_call_start|>{body}<|tool_call_end|>", TOOLS)
            assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == \
                [(c["name"], c["arguments"]) for c in calls], (trial, body)
            assert got.num_malformed == 0 and got.content == (lead.strip() or None)
    one = p.parse('<|tool_call_start|>{"name": "search", "arguments": {"query": "q"}}<|tool_call_end|>', TOOLS)
    assert parsed_calls(one)[0]["arguments"] == {"query": "q"}
    for bad in ("<|tool_call_start|>[search(query=open('x').read())]<|tool_call_end|>",
                "<|tool_call_start|>[launch(now=True)]<|tool_call_end|>",
                "<|tool_call_start|>not a call<|tool_call_end|>"):
        got = p.parse("x " + bad, TOOLS)
        assert (got.tool_calls, got.num_malformed, got.content) == ([], 1, "x " + bad), bad
    assert p.parse("plain [answer]", TOOLS).content == "plain [answer]"
    for name in (None, "search"):
        prefix = p.forced_prefix(name)
        rest = "search(query='weather')]<|tool_call_end|>" if name is None else "query='weather')]<|tool_call_end|>"
        assert prefix.startswith("<|tool_call_start|>[")
        assert parsed_calls(p.parse(prefix + rest, TOOLS))[0]["arguments"] == {"query": "weather"}


def test_dsml_string_attribute_types_the_value():
    p = get_parser("deepseekv32")
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="zip" string="true">01234</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    assert parsed_calls(p.parse(text, TOOLS))[0]["arguments"] == {"zip": "01234", "days": 3}
    bad = text.replace('string="false">3<', 'string="false">three<')
    got = p.parse(bad, TOOLS)
    assert (got.tool_calls, got.num_malformed, got.content) == ([], 1, bad)


def test_gemma4_notation_nesting_delimited_text_and_malformed_calls():
    """Gemma 4's own argument notation: delimited strings may hold the notation's punctuation, nested objects and
    arrays read their bare tokens as JSON literals, a bare top-level value is typed by the schema; a call whose
    notation is broken stays in content, counted."""
    p = get_parser("gemma4")
    text = ('<|tool_call>call:get_weather{city:<|"|>a, {b}: [c]<|"|>,days: 3 ,zip:01234,'
            'where:{lat:1.5,names:[<|"|>x,y<|"|>,true,null],deep:{k:v}},tags:[]}<tool_call|>')
    got = p.parse(text, TOOLS)
    assert got.num_malformed == 0 and got.content is None
    assert json.loads(got.tool_calls[0]["function"]["arguments"]) == {
        "city": "a, {b}: [c]", "days": 3, "zip": "01234",  # (a bare value for a string parameter keeps its text)
        "where": {"lat": 1.5, "names": ["x,y", True, None], "deep": {"k": "v"}}, "tags": []}
    assert p.parse('<|tool_call>call:get_weather{days:many}<tool_call|>', TOOLS).num_malformed == 1  # not an integer
    for broken in ('call:get_weather{city:<|"|>open}', "call:get_weather{city}", "call:{}", "get_weather{}",
                   'call:get_weather{city:<|"|>x<|"|> days:1}', "call:get_weather{a:1}}", "call:get_weather{a:[1,2}"):
        got = p.parse(f"<|tool_call>{broken}<tool_call|>", TOOLS)
        assert got.tool_calls == [] and got.num_malformed == 1, broken
    assert p.forced_prefix("search") == "<|tool_call>call:search{"


# ------------------------------------------------------------------------------------------------ Granite 3.x
GRANITE = '<|tool_call|>{{ calls | tojson }}'  # its template: the calls' functions as one JSON array


def test_granite_calls_round_trip_malformed_ones_stay_content_and_forcing():
    p, rng = get_parser("granite"), random.Random("granite")
    for trial in range(20):
        calls = [{"name": rng.choice(["get_weather", "search"]), "arguments": random_arguments(rng)}
                 for _ in range(rng.randint(1, 3))]
        text = _env.from_string(GRANITE).render(calls=calls)
        lead = rng.choice(["", "Let me look.\n"])
        got = p.parse(lead + text, TOOLS)
        assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == \
            [(c["name"], c["arguments"]) for c in calls], (trial, text)
        assert got.num_malformed == 0 and got.content == (lead.strip() or None)
        again = [{"name": c["name"], "arguments": c["arguments"]} for c in parsed_calls(got)]
        assert _env.from_string(GRANITE).render(calls=again) == text
    as_string = p.parse('<|tool_call|>[{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}]', TOOLS)
    assert parsed_calls(as_string)[0]["arguments"] == {"query": "q"}  # (OpenAI-style string arguments)
    for bad in ('<|tool_call|>[{"name": "search", "arguments": {"query": ', '<|tool_call|>{"name": "search"}',
                '<|tool_call|>[{"name": "launch", "arguments": {}}]', '<|tool_call|>[] and more',
                '<|tool_call|>[{"name": "search", "arguments": {}}] trailing'):
        got = p.parse("x " + bad, TOOLS)
        assert (got.tool_calls, got.num_malformed, got.content) == ([], 1, "x " + bad), bad
    assert p.parse("plain answer", TOOLS).content == "plain answer"
    call = _env.from_string(GRANITE).render(calls=[{"name": "search", "arguments": {"query": "weather"}}])
    for name in (None, "search"):
        prefix = p.forced_prefix(name)
        assert call.startswith(prefix), (prefix, call)
        assert parsed_calls(p.parse(prefix + call[len(prefix):], TOOLS))[0]["arguments"] == {"query": "weather"}


# ---------------------------------------------------------------------------------- Cohere (Command A, R7B)
COHERE_CALL = '{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}'


def test_cohere_actions_single_objects_and_the_answer_text():
    """Cohere's ``<|START_ACTION|>`` list (or a lone call object) with free whitespace; an answer is the text inside
    ``<|START_RESPONSE|>`` ... ``<|END_RESPONSE|>`` (a generation prompt may have opened it), a trailing
    ``<|END_OF_TURN_TOKEN|>`` is nothing, and text outside the blocks stays content."""
    p = get_parser("cohere")
    one = f"<|START_ACTION|>[\n    {COHERE_CALL}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>"
    got = p.parse(one, TOOLS)
    assert parsed_calls(got)[0]["name"] == "get_weather" and parsed_calls(got)[0]["arguments"] == {"city": "Paris"}
    assert (got.content, got.num_malformed) == (None, 0) and got.tool_calls[0]["id"].startswith("call_")
    two = ('<|START_ACTION|>[{"tool_call_id":"0","tool_name":"search","parameters":{"query":"a"}},\n\n'
           '  {"tool_call_id": "1", "tool_name": "get_weather", "parameters": {"days": 3}}  ]<|END_ACTION|>')
    assert [(c["name"], c["arguments"]) for c in parsed_calls(p.parse(two, TOOLS))] == \
        [("search", {"query": "a"}), ("get_weather", {"days": 3})]
    lone = p.parse(f"<|START_ACTION|>\n{COHERE_CALL}\n<|END_ACTION|>", TOOLS)
    assert [c["name"] for c in parsed_calls(lone)] == ["get_weather"] and lone.num_malformed == 0
    as_string = p.parse('<|START_ACTION|>[{"tool_name": "search", "parameters": "{\\"query\\": \\"q\\"}"}]'
                        '<|END_ACTION|>', TOOLS)
    assert parsed_calls(as_string)[0]["arguments"] == {"query": "q"}  # (arguments as their JSON string)
    for text, content in [("<|START_RESPONSE|>It is sunny.\n\nBye.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
                           "It is sunny.\n\nBye."),
                          ("It is sunny.<|END_RESPONSE|>", "It is sunny."),  # the prompt opened the answer
                          ("<|START_RESPONSE|>cut by max_tokens", "cut by max_tokens"),
                          ("Note: <|START_RESPONSE|>hi<|END_RESPONSE|>", "Note: hi"),
                          ("plain", "plain")]:
        got = p.parse(text, TOOLS)
        assert (got.content, got.tool_calls, got.num_malformed) == (content, [], 0), text
    got = p.parse("Checking. " + one, TOOLS)
    assert got.content == "Checking." and len(got.tool_calls) == 1
    # tool_choice "none": no calls read, the answer's markers still dropped
    none = p.without_calls()
    assert none.parse(one, TOOLS).tool_calls == [] and none.parse(one, TOOLS).content == one[:-len(p.end_of_turn)]
    assert none.parse("<|START_RESPONSE|>ok<|END_RESPONSE|>").content == "ok" and not none.streams_calls


def test_cohere_malformed_actions_stay_content_and_count():
    p = get_parser("cohere")
    for bad in ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "search", "parameters": {"query": }]'
                "<|END_ACTION|>",  # not JSON
                '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "launch", "parameters": {}}]<|END_ACTION|>',
                '<|START_ACTION|>[{"tool_call_id": "0", "parameters": {"query": "q"}}]<|END_ACTION|>',  # no name
                '<|START_ACTION|>[{"tool_call_id": "0", "name": "search", "arguments": {}}]<|END_ACTION|>',
                '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "search", "parameters": [1]}]<|END_ACTION|>',
                "<|START_ACTION|>[]<|END_ACTION|>", '<|START_ACTION|>["search"]<|END_ACTION|>',
                f"<|START_ACTION|>[\n    {COHERE_CALL}\n"):  # cut by max_tokens before the block closed
        got = p.parse("x " + bad, TOOLS)
        assert (got.tool_calls, got.num_malformed, got.content) == ([], 1, "x " + bad), bad
    launch = '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "launch", "parameters": {}}]<|END_ACTION|>'
    assert p.parse(launch).tool_calls[0]["function"]["name"] == "launch"  # no tools given: any name
    # one bad block among good ones: the good calls are read, the bad block stays in the content
    got = p.parse(f"<|START_ACTION|>[{COHERE_CALL}]<|END_ACTION|>\n{launch}", TOOLS)
    assert [c["name"] for c in parsed_calls(got)] == ["get_weather"] and got.num_malformed == 1
    assert got.content == launch


def test_cohere_thinking_then_an_action_or_an_answer_with_the_reasoning_parser():
    """``--reasoning-parser cohere`` takes the plan; the tool parser reads the calls or the answer after it."""
    from forge_megatron.middleware.reasoning_parsers import get_reasoning_parser

    r, p = get_reasoning_parser("cohere"), get_parser("cohere")
    action = (f"<|START_THINKING|>I will look up Paris.<|END_THINKING|><|START_ACTION|>[\n    {COHERE_CALL}\n]"
              "<|END_ACTION|><|END_OF_TURN_TOKEN|>")
    reasoning, rest = r.split(action, r.opens("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"))
    got = p.parse(rest, TOOLS)
    assert reasoning == "I will look up Paris." and got.content is None and len(got.tool_calls) == 1
    answer = "<|START_THINKING|>Easy.<|END_THINKING|><|START_RESPONSE|>4<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
    reasoning, rest = r.split(answer, False)
    assert (reasoning, p.parse(rest, TOOLS).content) == ("Easy.", "4")
    # a reasoning template whose generation prompt opens the block
    prompt = "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>"
    assert r.opens(prompt) and r.split("Easy.<|END_THINKING|><|START_RESPONSE|>4", True) == \
        ("Easy.", "<|START_RESPONSE|>4")
    # without the reasoning parser the plan stays in the content, as written
    got = p.parse(action, TOOLS)
    assert got.content == "<|START_THINKING|>I will look up Paris.<|END_THINKING|>" and len(got.tool_calls) == 1


COHERE_STREAMS = [
    "<|START_RESPONSE|>The <weather> is <|sunny|>.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
    "<|START_THINKING|>plan<|END_THINKING|><|START_RESPONSE|>Hi!<|END_RESPONSE|>",
    f"<|START_THINKING|>plan<|END_THINKING|><|START_ACTION|>[\n    {COHERE_CALL}\n]<|END_ACTION|>",
    f"Let me check.\n<|START_ACTION|>[{COHERE_CALL}]<|END_ACTION|><|END_OF_TURN_TOKEN|>",
    "Answer opened by the prompt<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
]


@pytest.mark.parametrize("text", COHERE_STREAMS)
@pytest.mark.parametrize("reasoning", [True, False])
def test_cohere_streams_give_the_answer_text_and_stop_at_an_action(text, reasoning):
    """Cut a completion at every character: what a stream may show (the parser's streamable text, held back at the
    action marker as the gateway holds it) only grows, never holds a response marker, and ends as the final
    content; calls are sent from parse once their block closes."""
    from forge_megatron.middleware.reasoning_parsers import get_reasoning_parser

    r, p = get_reasoning_parser("cohere"), get_parser("cohere")
    marker = p.start_marker

    def held(shown):  # the gateway's hold at the tool-call marker (and a partial one at the end)
        at = shown.find(marker)
        shown = shown if at < 0 else shown[:at]
        return shown[:len(shown) - max((k for k in range(1, len(marker)) if shown.endswith(marker[:k])), default=0)]

    last = ""
    for n in range(len(text) + 1):
        rest = r.split(text[:n], False, final=False).content if reasoning else text[:n]
        shown = held(p.streamable(rest))
        assert shown.startswith(last), (n, shown, last)
        assert not any(m in shown for m in (*p.response_markers, p.end_of_turn, "<|START_RE", "<|END_RE")), (n, shown)
        last = shown
    final = p.parse(r.split(text, False).content if reasoning else text, TOOLS)
    if final.tool_calls:
        assert (final.content or "") == last.strip() and [c["name"] for c in parsed_calls(final)] == ["get_weather"]
    else:
        assert final.content == last  # nothing held back at the end of an answer


def test_cohere_forced_calls_number_like_the_template():
    p = get_parser("cohere")
    assert p.forced_prefix() == "<|START_ACTION|>"
    prefix = p.forced_prefix("search", prior_calls=3)
    assert prefix == '<|START_ACTION|>[\n    {"tool_call_id": "3", "tool_name": "search", "parameters":'
    got = p.parse(prefix + ' {"query": "weather"}}\n]<|END_ACTION|>', TOOLS)
    assert parsed_calls(got)[0]["arguments"] == {"query": "weather"} and got.num_malformed == 0


def test_cohere_plans_are_rendered_back_before_their_actions():
    """A Command A turn's plan (``<|START_THINKING|>``, the reasoning parser's reasoning_content) is written back by
    its template from ``tool_plan`` before the action: the gateway hands the template the reasoning under that name
    too, beside tool calls only, so the next turn's prompt holds the plan the model wrote (and its recorded segment
    continues instead of restarting)."""
    import jinja2

    from forge_megatron.middleware.gateway_sessions import _template_messages

    call = {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "I will look it up.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
                {"role": "assistant", "content": "Sunny.", "reasoning_content": "Done."}]
    out = _template_messages(messages)
    assert out[1]["tool_plan"] == "I will look it up." and out[1]["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris"}
    assert "tool_plan" not in out[3] and out[3]["thinking"] == "Done."  # (no action: no plan field)
    assert "tool_plan" not in messages[1]  # the caller's messages are left as they are
    template = jinja2.Template("{% for m in messages %}{% if m.tool_calls %}<|START_THINKING|>{{ m.tool_plan }}"
                               "<|END_THINKING|><|START_ACTION|>{% for c in m.tool_calls %}{{ c.function.name }}"
                               "{% endfor %}<|END_ACTION|>{% endif %}{% endfor %}")
    assert template.render(messages=out) == \
        "<|START_THINKING|>I will look it up.<|END_THINKING|><|START_ACTION|>get_weather<|END_ACTION|>"


def test_minimax_m1_reads_objects_across_lines_and_a_bad_one_spoils_its_block():
    """MiniMax-M1's block holds JSON objects one per line as its template writes them; pretty-printed ones (an object
    over several lines) read the same; one line that is no call leaves the whole block in the content, counted."""
    p = get_parser("minimax-m1")
    pretty = '<tool_calls>\n{\n  "name": "search",\n  "arguments": {"query": "q"}\n}\n{"name": "get_weather", ' \
             '"arguments": {"city": "Paris"}}</tool_calls>'
    got = p.parse("<think>x</think>\n" + pretty, TOOLS)
    assert [(c["name"], c["arguments"]) for c in parsed_calls(got)] == \
        [("search", {"query": "q"}), ("get_weather", {"city": "Paris"})]
    assert got.content == "<think>x</think>" and got.num_malformed == 0
    bad = '<tool_calls>\n{"name": "search", "arguments": {"query": "q"}}\nsearch(query="q")\n</tool_calls>'
    got = p.parse(bad, TOOLS)
    assert got.tool_calls == [] and got.num_malformed == 1 and got.content == bad
