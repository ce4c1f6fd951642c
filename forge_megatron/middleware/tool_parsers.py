"""Tool-call parsers: completion text -> (content, OpenAI tool calls), one per model family's chat format.

Black-box agents speak the OpenAI schema, models speak their chat format. A parser turns the text a model generated
into ``content`` plus ``tool_calls`` [{id, type: "function", function: {name, arguments: <JSON string>}}], and counts
malformed calls (a process-reward signal: ``Episode.num_malformed_tool_calls``). The names are SGLang's
``--tool-call-parser`` names, so an engine and the gateway in front of it are configured alike:

  name (aliases)             model families            a call as the model writes it
  hermes (qwen, qwen25)      Hermes-2-Pro, Qwen2.5/3   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
  qwen3_coder                Qwen3-Coder, Qwen3.5      <tool_call>\\n<function=f>\\n<parameter=a>\\nV\\n</parameter>\\n
                                                       </function>\\n</tool_call>
  glm45 (glm)                GLM-4.5, GLM-4.6          <tool_call>f\\n<arg_key>a</arg_key>\\n<arg_value>V</arg_value>\\n
                                                       </tool_call>
  glm47                      GLM-4.7, GLM-5            the same without the newlines
  minimax-m2 (minimax_m2)    MiniMax-M2                <minimax:tool_call>\\n<invoke name="f">\\n<parameter name="a">V
                                                       </parameter>\\n</invoke>\\n</minimax:tool_call>
  minimax-m1 (minimax_m1)    MiniMax-M1, Text-01       <tool_calls>\n{"name": "f", "arguments": {...}}\n{"name": ...}\n
                                                       </tool_calls>  (one JSON object per line; vLLM: minimax)
  kimi_k2                    Kimi-K2                   <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                                                       <|tool_call_argument_begin|>{...}<|tool_call_end|>
                                                       <|tool_calls_section_end|>
  deepseekv31                DeepSeek-V3.1             <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}
                                                       <｜tool▁call▁end｜><｜tool▁calls▁end｜>
  deepseekv3                 DeepSeek-V3 (0324), R1    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
                                                       \\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  deepseekv32 (deepseekv4)   DeepSeek-V3.2 (V4)        <｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter
                                                       name="a" string="true">V</｜DSML｜parameter>\n</｜DSML｜invoke>\n
                                                       </｜DSML｜function_calls>  (V4: tool_calls)
  hunyuan                    Hunyuan (A13B, dense)     <tool_calls>[{"name": "f", "arguments": {...}}, ...]</tool_calls>
  longcat                    LongCat-Flash             <longcat_tool_call>\n{"name": "f", "arguments": {...}}\n
                                                       </longcat_tool_call>  (or, later releases, glm45's layout
                                                       with <longcat_arg_key> / <longcat_arg_value> tags)
  llama3                     Llama 3.1-3.3             {"name": "f", "parameters": {...}}  (the whole answer; ; between
                                                       calls; optionally after <|python_tag|>)
  pythonic                   Llama 3.2 / 3.3 / 4       [get_weather(city="Paris", days=3), search(query="x")]
  mistral                    Mistral-Small 3, Devstral [TOOL_CALLS][{"name": "f", "arguments": {...}}]  (up to v7
                             Magistral                 tokenizers) or [TOOL_CALLS]f[ARGS]{...}  (v11)
  gpt-oss (gpt_oss)          gpt-oss (harmony)         <|start|>assistant<|channel|>commentary to=functions.f
                                                       <|constrain|>json<|message|>{...}<|call|>  (harmony.py)
  gemma4                     Gemma 4                   <|tool_call>call:f{a:<|"|>text<|"|>,n:3,o:{k:true},l:[1]}
                                                       <tool_call|>
                                                       (keys bare, strings between <|"|> delimiters, other values
                                                       bare: numbers, true / false / null; nested objects, arrays)
  granite                    Granite 3.x               <|tool_call|>[{"name": "f", "arguments": {...}}, ...]  (the rest
                                                       of the completion; Granite 4.0: hermes)
  cohere                     Command A, Command A      <|START_ACTION|>[\\n    {"tool_call_id": "0", "tool_name": "f",
                             Reasoning, Command R7B    "parameters": {...}},\\n    ...\\n]<|END_ACTION|>  (an answer:
                                                       <|START_RESPONSE|>text<|END_RESPONSE|>, its content the text)
  none                       -                         no tool calls (tool_choice "none" uses it too)

Register others with :func:`register_parser`.

*Blocks and content.* Every format opens a call (or a section of calls) with a marker and closes it with another.
Text outside the blocks is ``content`` (stripped, or None, when there are calls). A block that does not parse (bad
JSON, no function name, an argument tag left open) or calls a function the request has no tool for is malformed:
counted, and its text stays in ``content`` so the agent sees what the model wrote; so does a block opened and never
closed (cut by max_tokens). ``start_marker`` is
where a stream must stop emitting content.

*Typed arguments.* The XML formats (qwen3_coder, glm45/47, minimax-m2) write every argument as text; the value is
read against the tool's JSON schema (``parameters.properties[name]``: ``type``, a list of types, ``anyOf`` /
``oneOf``, ``enum``): a string parameter keeps the text as written (one newline on each side dropped for
qwen3_coder, whose template puts them there); integer, number, boolean, null, object and array parameters take the
text as JSON when it is one of the allowed types. A value that fits none of them is passed on as the text and the
call counts as malformed (the tool will likely refuse it; the episode's process reward can see it). Parameters the
schema does not name are read as JSON when they parse, else kept as text.

*Tool call ids.* Kimi-K2 writes its own ids (``functions.f:0``, the index counting calls across the conversation)
and its template renders them back, so those ids are kept; the other formats have no id in the text and get a
fresh ``call_...`` one (so do Cohere's calls: their ``tool_call_id`` is the template's running count of calls, which
it writes again itself).

*Forcing a call* (``tool_choice`` "required" or a named function) needs no constrained decoding: the gateway appends
:meth:`ToolParser.forced_prefix` to the prompt ids and parses prefix + completion. The prefix is what the family's
chat template writes at the start of an assistant tool call (and, for a named function, up to where the arguments
begin), so the forced text + completion is the text the template renders for that call on the next turn. For
Hermes/Qwen the named prefix stops before the template's space after ``"arguments":``: byte-level BPE merges that
space with the next character (`` {"``), so a prompt ending in a lone space token is one the model never saw in
training (a tiny model continued it with garbage); the model writes `` {`` itself.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

from forge_megatron.middleware import harmony


@dataclass
class ParsedCompletion:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    num_malformed: int = 0


class CannotForceToolCall(ValueError):
    """The parser has no text that commits a model to a tool call."""


class _Malformed(Exception):
    """A call block that does not parse (internal to the parsers)."""


class _UnknownTool(_Malformed):
    """A well-formed call to a function the request has no tool for."""


def _call(name: str, args: dict, call_id: str | None = None) -> dict:
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolParser:
    """Base: no tool calls; ``start_marker`` is where streaming must stop emitting content (None: never)."""

    name = "none"
    start_marker: str | None = None
    # parse() of a completion so far gives the finished completion's first calls (closed blocks do not change):
    # streams send each call as soon as its block closes
    streams_calls = False

    def parse(self, text: str, tools: list | None = None) -> ParsedCompletion:
        """Split ``text`` into content and tool calls; ``tools`` (the request's OpenAI tools) type XML arguments."""
        return ParsedCompletion(content=text)

    def streamable(self, text: str) -> str:
        """The content a stream may give out so far (before holding back at ``start_marker`` and stop strings)."""
        return text

    def without_calls(self) -> ToolParser:
        """The parser for tool_choice "none": no tool calls read."""
        return ToolParser()

    def learn_template(self, render) -> None:
        """Called once by the gateway with ``render(messages, tools) -> text`` (the served chat template, no
        generation prompt), for formats whose written form depends on the template; the default needs nothing."""

    def forced_prefix(self, function_name: str | None = None, prior_calls: int = 0) -> str:
        """Text that, appended to the prompt, commits the model to a tool call (to ``function_name`` when given);
        ``prior_calls``: tool calls earlier in the conversation (formats whose call ids count them)."""
        raise CannotForceToolCall(f"tool parser {self.name!r} cannot force a tool call; use tool_choice 'auto' or "
                                  "'none', or serve with a parser that can (e.g. --tool-parser hermes)")


class BlockToolParser(ToolParser):
    """Formats whose calls sit in ``start_marker`` ... ``end_marker`` blocks; subclasses read one block's body
    (:meth:`calls_in`: the calls it holds, or raise _Malformed)."""

    end_marker: str = ""
    streams_calls = True

    def parse(self, text: str, tools: list | None = None) -> ParsedCompletion:
        schemas = _schemas(tools)
        calls, kept, malformed, pos = [], [], 0, 0
        start, end = self.start_marker, self.end_marker
        while True:
            at = text.find(start, pos)
            if at < 0:
                break
            close = text.find(end, at + len(start))
            if close < 0:  # opened but never closed (e.g. cut by max_tokens)
                break
            kept.append(text[pos:at])
            block_end = close + len(end)
            try:
                found, bad = self.calls_in(text[at + len(start):close], schemas)
                if not found:
                    raise _Malformed("no call in the block")
                if schemas and any(c["function"]["name"] not in schemas for c in found):
                    raise _Malformed("a call to a function the request has no tool for")
                calls += found
                malformed += bad
            except _Malformed:
                malformed += 1
                kept.append(text[at:block_end])
            pos = block_end
        rest = text[pos:]
        if start in rest:
            malformed += 1
        kept.append(rest)
        content = "".join(kept)
        if calls:
            content = content.strip() or None
        return ParsedCompletion(content=content, tool_calls=calls, num_malformed=malformed)

    def calls_in(self, body: str, schemas: dict) -> tuple[list[dict], int]:
        """(calls, how many of them have arguments that do not fit their schema) of one block's body."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------ JSON formats
def _json_call(body: str) -> dict:
    """{"name": str, "arguments" | "parameters": object or its JSON string} -> one call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise _Malformed(str(exc)) from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _Malformed("no function name")
    return _call(obj["name"], _json_args(obj.get("arguments", obj.get("parameters", {}))))


def _json_args(args) -> dict:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise _Malformed(str(exc)) from exc
    if not isinstance(args, dict):
        raise _Malformed("arguments are not an object")
    return args


class HermesToolParser(BlockToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def calls_in(self, body, schemas):
        return [_json_call(body)], 0

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker + "\n"
        return f'{self.start_marker}\n{{"name": {json.dumps(function_name, ensure_ascii=False)}, "arguments":'


class HunyuanToolParser(BlockToolParser):
    """Hunyuan: one ``<tool_calls>`` block holding a JSON list of ``{"name", "arguments"}`` calls."""

    name = "hunyuan"
    start_marker = "<tool_calls>"
    end_marker = "</tool_calls>"

    def calls_in(self, body, schemas):
        try:
            items = json.loads(body)
        except json.JSONDecodeError as exc:
            raise _Malformed(str(exc)) from exc
        if not isinstance(items, list) or not items:
            raise _Malformed("not a list of calls")
        return [_json_call(json.dumps(item)) for item in items], 0

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker
        return f'{self.start_marker}[{{"name": {json.dumps(function_name, ensure_ascii=False)}, "arguments":'


class MinimaxM1ToolParser(BlockToolParser):
    """MiniMax-M1 / Text-01: one ``<tool_calls>`` block holding ``{"name", "arguments"}`` objects one after another
    (one per line as the template writes them; any whitespace between them is read)."""

    name = "minimax-m1"
    start_marker = "<tool_calls>"
    end_marker = "</tool_calls>"

    def calls_in(self, body, schemas):
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            while pos < len(body) and body[pos].isspace():
                pos += 1
            if pos == len(body):
                return calls, 0
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                raise _Malformed(str(exc)) from exc
            calls.append(_json_call(json.dumps(obj)))

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker + "\n"
        return f'{self.start_marker}\n{{"name": {json.dumps(function_name, ensure_ascii=False)}, "arguments":'


class GraniteToolParser(ToolParser):
    """Granite 3.x: after ``<|tool_call|>`` one JSON array of ``{"name", "arguments"}`` calls (the arguments an object
    or its JSON string), the rest of the completion; text before the marker is content. (Granite 4.0 writes Hermes'
    ``<tool_call>`` blocks: ``--tool-parser hermes``.)"""

    name = "granite"
    start_marker = "<|tool_call|>"

    def parse(self, text, tools=None):
        at = text.find(self.start_marker)
        if at < 0:
            return ParsedCompletion(content=text)
        schemas = _schemas(tools)
        body = text[at + len(self.start_marker):].strip()
        try:
            try:
                items, end = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError as exc:
                raise _Malformed(str(exc)) from exc
            if body[end:].strip() or not isinstance(items, list) or not items:
                raise _Malformed("not one JSON array of calls")
            calls = [_json_call(json.dumps(item, ensure_ascii=False)) for item in items]
            if schemas and any(c["function"]["name"] not in schemas for c in calls):
                raise _Malformed("a call to a function the request has no tool for")
        except _Malformed:
            return ParsedCompletion(content=text, num_malformed=1)
        return ParsedCompletion(content=text[:at].strip() or None, tool_calls=calls)

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker + "["
        return f'{self.start_marker}[{{"name": {json.dumps(function_name, ensure_ascii=False)}, "arguments":'


class CohereToolParser(BlockToolParser):
    """Cohere Command A, Command A Reasoning, Command R7B: ``<|START_ACTION|>`` then a JSON list of calls
    ``{"tool_call_id": "0", "tool_name": "f", "parameters": {...}}`` (or one such object), then ``<|END_ACTION|>``;
    a block that does not parse, is empty, or holds a call without a ``tool_name`` or with parameters that are not
    an object is malformed, as in the other block formats. ``tool_call_id`` is the template's running count of calls
    in the conversation (the calls get fresh ids; the template numbers them again itself).

    An answer is ``<|START_RESPONSE|>text<|END_RESPONSE|>`` (a template without tools opens it in the generation
    prompt): those markers are neither reasoning nor a call, so this parser drops them from ``content`` (its text is
    the answer's, as the template writes it back), and an ``<|END_OF_TURN_TOKEN|>`` ending the completion is nothing.
    The plan or reasoning ``<|START_THINKING|>...<|END_THINKING|>`` that opens a turn is the reasoning parser's
    (``--reasoning-parser cohere``, which leaves the rest to this one); without it, it stays in ``content`` as
    written. Forcing writes ``<|START_ACTION|>``, or for a named function the template's opening of that call up to
    ``"parameters":`` (numbered as the template numbers it: ``prior_calls``; no space after the colon, as Hermes'
    prefix)."""

    name = "cohere"
    start_marker = "<|START_ACTION|>"
    end_marker = "<|END_ACTION|>"
    response_markers = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
    end_of_turn = "<|END_OF_TURN_TOKEN|>"

    def __init__(self, calls: bool = True):
        self.calls = self.streams_calls = calls

    def parse(self, text, tools=None):
        head = text.rstrip()
        if head.endswith(self.end_of_turn):
            text = head[:-len(self.end_of_turn)]
        parsed = super().parse(text, tools) if self.calls else ParsedCompletion(content=text)
        if parsed.content is not None:
            parsed.content = self.answer_text(parsed.content)
            if parsed.tool_calls:
                parsed.content = parsed.content.strip() or None
        return parsed

    def calls_in(self, body, schemas):
        try:
            items = json.loads(body)
        except json.JSONDecodeError as exc:
            raise _Malformed(str(exc)) from exc
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list) or not items:
            raise _Malformed("not a list of calls")
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("tool_name"), str) or not item["tool_name"]:
                raise _Malformed("a call without a tool_name")
            calls.append(_call(item["tool_name"], _json_args(item.get("parameters", {}))))
        return calls, 0

    def answer_text(self, text: str) -> str:
        """``text`` without the answer's ``<|START_RESPONSE|>`` / ``<|END_RESPONSE|>`` markers."""
        for marker in self.response_markers:
            text = text.replace(marker, "")
        return text

    def streamable(self, text):
        text = text.split(self.end_of_turn, 1)[0]
        held = max((k for m in (*self.response_markers, self.end_of_turn) for k in range(1, len(m))
                    if text.endswith(m[:k])), default=0)  # a marker may be arriving
        return self.answer_text(text[:len(text) - held])

    def without_calls(self):
        return CohereToolParser(calls=False)

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker
        return (f'{self.start_marker}[\n    {{"tool_call_id": "{prior_calls}", "tool_name": '
                f'{json.dumps(function_name, ensure_ascii=False)}, "parameters":')


class KimiK2ToolParser(BlockToolParser):
    """A section of ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``
    calls; the id ``functions.NAME:IDX`` is the model's own (the template renders it back)."""

    name = "kimi_k2"
    start_marker = "<|tool_calls_section_begin|>"
    end_marker = "<|tool_calls_section_end|>"
    _CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)"
                       r"<\|tool_call_end\|>", re.DOTALL)
    _ID = re.compile(r"^(?:functions\.)?(?P<name>[^:\s]+):(?P<index>\d+)$")

    def calls_in(self, body, schemas):
        calls = []
        for m in self._CALL.finditer(body):
            ident = self._ID.match(m.group("id"))
            if ident is None:
                raise _Malformed(f"tool call id {m.group('id')!r}")
            calls.append(_call(ident.group("name"), _json_args(m.group("args").strip()), call_id=m.group("id")))
        if not calls or self._CALL.sub("", body).strip():
            raise _Malformed("text between the calls of a section")
        return calls, 0

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker
        return (f"{self.start_marker}<|tool_call_begin|>functions.{function_name}:{prior_calls}"
                "<|tool_call_argument_begin|>")


class DeepSeekV31ToolParser(BlockToolParser):
    """A section of ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`` calls."""

    name = "deepseekv31"
    start_marker = "<｜tool▁calls▁begin｜>"
    end_marker = "<｜tool▁calls▁end｜>"
    call_open, sep, call_close = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

    def calls_in(self, body, schemas):
        pattern = re.compile(re.escape(self.call_open) + r"(.*?)" + re.escape(self.call_close), re.DOTALL)
        calls = [self.one_call(m.group(1)) for m in pattern.finditer(body)]
        if not calls or pattern.sub("", body).strip():
            raise _Malformed("text between the calls of a section")
        return calls, 0

    def one_call(self, inner: str) -> dict:
        name, sep, args = inner.partition(self.sep)
        if not sep or not name.strip():
            raise _Malformed("no function name")
        return _call(name.strip(), _json_args(args.strip()))

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker
        return f"{self.start_marker}{self.call_open}{function_name}{self.sep}"


class DeepSeekV3ToolParser(DeepSeekV31ToolParser):
    """DeepSeek-V3 (0324) / R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{json}\\n```<｜tool▁call▁end｜>``."""

    name = "deepseekv3"
    _INNER = re.compile(r"^\s*function\s*<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*)\n```\s*$", re.DOTALL)

    def one_call(self, inner):
        m = self._INNER.match(inner)
        if m is None or not m.group("name").strip():
            raise _Malformed("not function<sep>NAME and a ```json block")
        return _call(m.group("name").strip(), _json_args(m.group("args").strip()))

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker
        return f"{self.start_marker}{self.call_open}function{self.sep}{function_name}\n```json\n"


# ------------------------------------------------------------------------------------------------- XML formats
def _schemas(tools: list | None) -> dict:
    """{function name: {parameter: JSON schema}} of OpenAI tools."""
    out = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            props = params.get("properties")
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None),
               "object": dict, "array": list}


def schema_types(schema) -> set[str] | None:
    """JSON types a parameter schema allows (``type``, type lists, anyOf/oneOf/allOf, enum); None: unknown."""
    if not isinstance(schema, dict):
        return None
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(k for k in kind if isinstance(k, str))
    for value in schema.get("enum") or []:
        types.add(next(k for k, py in _JSON_TYPES.items()
                       if isinstance(value, py) and not (k in ("integer", "number") and isinstance(value, bool))))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            types |= schema_types(sub) or set()
    if not types and ("properties" in schema):
        types.add("object")
    return types or None


def typed_value(text: str, schema) -> tuple[object, bool]:
    """(value, fits) of an argument written as ``text`` for a parameter with JSON ``schema`` (module docstring)."""
    types = schema_types(schema)
    if types is None:
        try:
            return json.loads(text), True
        except json.JSONDecodeError:
            return text, True
    if types - {"string"}:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = _NOT_JSON
        if value is not _NOT_JSON:
            for kind in types - {"string"}:
                py = _JSON_TYPES.get(kind)
                if py is not None and isinstance(value, py) and not (isinstance(value, bool) and kind != "boolean"):
                    return value, True
    return text, "string" in types


_NOT_JSON = object()


class _XmlToolParser(BlockToolParser):
    """Formats that write one (name, {parameter: text}) per call; subclasses split a block into those."""

    strip_newlines = False  # drop one newline at each end of a value (the template writes them)

    def calls_in(self, body, schemas):
        calls, bad = [], 0
        for name, raw_args in self.split_calls(body):
            if not name:
                raise _Malformed("no function name")
            args, props, fits_all = {}, schemas.get(name, {}), True
            for key, raw in raw_args:
                if self.strip_newlines:
                    raw = raw[1:] if raw.startswith("\n") else raw
                    raw = raw[:-1] if raw.endswith("\n") else raw
                args[key], fits = typed_value(raw, props.get(key))
                fits_all &= fits
            calls.append(_call(name, args))
            bad += not fits_all
        return calls, bad

    def split_calls(self, body: str) -> list[tuple[str, list[tuple[str, str]]]]:
        raise NotImplementedError


def _pairs(body: str, pattern: re.Pattern, junk_ok: str = r"\s*") -> list[tuple[str, ...]]:
    """(key, the other groups...) of every match of ``pattern`` in ``body``; anything else but whitespace is
    malformed."""
    pairs = [(m.group(1).strip(), *m.groups()[1:]) for m in pattern.finditer(body)]
    if not re.fullmatch(junk_ok, pattern.sub("", body)):
        raise _Malformed("text outside the argument tags")
    return pairs


class Qwen3CoderToolParser(_XmlToolParser):
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``."""

    name = "qwen3_coder"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    strip_newlines = True
    _FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)

    def split_calls(self, body):
        found = [(m.group(1).strip(), _pairs(m.group(2), self._PARAM)) for m in self._FUNCTION.finditer(body)]
        if not found or self._FUNCTION.sub("", body).strip():
            raise _Malformed("not <function=NAME>...</function>")
        return found

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker + "\n"
        return f"{self.start_marker}\n<function={function_name}>\n"


class SeedOssToolParser(Qwen3CoderToolParser):
    """Seed-OSS: Qwen3-Coder's calls in ``<seed:tool_call>`` ... ``</seed:tool_call>`` blocks."""

    name = "seed_oss"
    start_marker = "<seed:tool_call>"
    end_marker = "</seed:tool_call>"


class Glm45ToolParser(_XmlToolParser):
    """``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>`` (GLM-4.7: no
    newlines)."""

    name = "glm45"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    name_end = "\n"
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def split_calls(self, body):
        cut = body.find("<arg_key>")
        head, args = (body, "") if cut < 0 else (body[:cut], body[cut:])
        return [(head.strip(), _pairs(args, self._ARG))]

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker
        return f"{self.start_marker}{function_name}{self.name_end}"


class Glm47ToolParser(Glm45ToolParser):
    name = "glm47"
    name_end = ""


class LongcatToolParser(_XmlToolParser):
    """LongCat-Flash: ``<longcat_tool_call>`` blocks holding a JSON call ``{"name": "f", "arguments": {...}}``
    (LongCat-Flash-Chat / -Thinking), or ``NAME\n<longcat_arg_key>KEY</longcat_arg_key>\n<longcat_arg_value>VALUE
    </longcat_arg_value>\n...`` (later LongCat releases: GLM-4.5's layout under LongCat's tags), told apart by the
    body's first character. A forced call is opened in the JSON form."""

    name = "longcat"
    start_marker = "<longcat_tool_call>"
    end_marker = "</longcat_tool_call>"
    _ARG = re.compile(r"<longcat_arg_key>(.*?)</longcat_arg_key>\s*<longcat_arg_value>(.*?)</longcat_arg_value>",
                      re.DOTALL)

    def calls_in(self, body, schemas):
        if body.lstrip().startswith("{"):
            return [_json_call(body)], 0
        return super().calls_in(body, schemas)

    def split_calls(self, body):
        cut = body.find("<longcat_arg_key>")
        head, args = (body, "") if cut < 0 else (body[:cut], body[cut:])
        return [(head.strip(), _pairs(args, self._ARG))]

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker + "\n"
        return f'{self.start_marker}\n{{"name": {json.dumps(function_name, ensure_ascii=False)}, "arguments":'


class MinimaxM2ToolParser(_XmlToolParser):
    """``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n...</invoke>\\n
    </minimax:tool_call>`` (several invokes per block allowed)."""

    name = "minimax-m2"
    start_marker = "<minimax:tool_call>"
    end_marker = "</minimax:tool_call>"
    _INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.DOTALL)
    _PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)

    def split_calls(self, body):
        found = [(m.group(1).strip(), _pairs(m.group(2), self._PARAM)) for m in self._INVOKE.finditer(body)]
        if not found or self._INVOKE.sub("", body).strip():
            raise _Malformed('not <invoke name="NAME">...</invoke>')
        return found

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker + "\n"
        return f'{self.start_marker}\n<invoke name="{function_name}">\n'


# ---------------------------------------------------------------------------------------------- Llama 3.1-3.3
class Llama3ToolParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calling: the whole answer is ``{"name": "f", "parameters": {...}}`` (several joined
    by ``;``), optionally after ``<|python_tag|>``; text before a ``<|python_tag|>`` is content. An answer that
    starts with ``{`` but is not such calls is content (a JSON answer), one after ``<|python_tag|>`` is malformed."""

    name = "llama3"
    tag = start_marker = "<|python_tag|>"  # streams hold back at it (and at a partial one)

    def parse(self, text, tools=None):
        schemas = _schemas(tools)
        at = text.find(self.tag)
        lead, body = (text[:at], text[at + len(self.tag):]) if at >= 0 else ("", text)
        if at < 0 and not body.lstrip().startswith("{"):
            return ParsedCompletion(content=text)
        try:
            calls = self.calls_in(body, schemas)
        except _Malformed as exc:  # after the tag, or a call to an unknown tool: a malformed call
            return ParsedCompletion(content=text, num_malformed=int(at >= 0 or isinstance(exc, _UnknownTool)))
        return ParsedCompletion(content=lead.strip() or None, tool_calls=calls)

    @staticmethod
    def calls_in(body: str, schemas: dict) -> list[dict]:
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            while pos < len(body) and body[pos] in " \t\n\r;":
                pos += 1
            if pos == len(body):
                break
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                raise _Malformed(str(exc)) from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"] or \
                    not ({"parameters", "arguments"} & set(obj)) or set(obj) - {"name", "parameters", "arguments"}:
                raise _Malformed("not {name, parameters}")
            if schemas and obj["name"] not in schemas:
                raise _UnknownTool("a call to a function the request has no tool for")
            calls.append(_call(obj["name"], _json_args(obj.get("parameters", obj.get("arguments")))))
        if not calls:
            raise _Malformed("no call")
        return calls

    def streamable(self, text):
        head = text.lstrip()
        if not head or head.startswith("{"):
            return ""  # may be a call: held until the answer is whole
        at = text.find(self.tag)
        return text if at < 0 else text[:at]

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(function_name, ensure_ascii=False)}, "parameters":'


class PythonicToolParser(ToolParser):
    """Llama 3.2 / 3.3 / 4 "pythonic" calls: the whole answer is a Python list of calls with literal keyword
    arguments, ``[get_weather(city="Paris", days=3), search(query="x")]`` (Llama 4 may wrap it in
    ``<|python_start|>`` ... ``<|python_end|>``). Read with Python's parser and ``ast.literal_eval`` (nothing is
    evaluated); an answer that is not such a list is content, one whose calls do not read is malformed."""

    name = "pythonic"
    _WRAP = ("<|python_start|>", "<|python_end|>")

    def parse(self, text, tools=None):
        body = text.strip()
        if body.startswith(self._WRAP[0]):
            body = body[len(self._WRAP[0]):].removesuffix(self._WRAP[1]).strip()
        tree = _call_list(body)
        if tree is None:
            return ParsedCompletion(content=text)
        try:
            calls = _pythonic_calls(tree, _schemas(tools))
        except _Malformed:
            return ParsedCompletion(content=text, num_malformed=1)
        return ParsedCompletion(content=None, tool_calls=calls)

    def streamable(self, text):
        head = text.lstrip()
        return "" if not head or head.startswith(("[", "<|python_start|>"[:len(head)])) else text

    def forced_prefix(self, function_name=None, prior_calls=0):
        return "[" if function_name is None else f"[{function_name}("


def _call_list(body: str) -> ast.List | None:
    """``body`` read as a Python list of calls (the pythonic format), or None where it is not one."""
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None  # e.g. a bracketed answer that is not Python
    if not isinstance(tree, ast.List) or not tree.elts or not all(isinstance(e, ast.Call) for e in tree.elts):
        return None
    return tree


def _pythonic_calls(tree: ast.List, schemas: dict) -> list[dict]:
    """The calls of a pythonic list (:func:`_call_list`): NAME(key=literal, ...) each, nothing evaluated; _Malformed
    where one does not read so or names a function the request has no tool for."""
    calls = []
    for node in tree.elts:
        if not isinstance(node.func, ast.Name) or node.args:
            raise _Malformed("calls are NAME(key=value, ...)")
        if schemas and node.func.id not in schemas:
            raise _Malformed("a call to a function the request has no tool for")
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError as exc:
            raise _Malformed(f"an argument is not a literal: {exc}") from exc
        if len(args) != len(node.keywords):
            raise _Malformed("**kwargs")
        try:
            calls.append(_call(node.func.id, args))
        except (TypeError, ValueError) as exc:  # a set, bytes, a complex number: no JSON for it
            raise _Malformed(str(exc)) from exc
    return calls


class Lfm2ToolParser(BlockToolParser):
    """LFM2 / LFM2-MoE (Liquid AI): ``<|tool_call_start|>[get_weather(city="Paris"), ...]<|tool_call_end|>``, a
    pythonic list of calls in each block (read as :class:`PythonicToolParser` reads one: nothing evaluated), or a
    JSON call or list of calls (``{"name", "arguments"}``) where a template asks for JSON; text outside the blocks
    is content."""

    name = "lfm2"
    start_marker = "<|tool_call_start|>"
    end_marker = "<|tool_call_end|>"

    def calls_in(self, body, schemas):
        body = body.strip()
        tree = _call_list(body)
        if tree is not None:
            return _pythonic_calls(tree, schemas), 0
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError as exc:
            raise _Malformed(f"neither a pythonic list of calls nor JSON: {exc}") from exc
        items = parsed if isinstance(parsed, list) else [parsed]
        return [_json_call(json.dumps(item)) for item in items], 0

    def forced_prefix(self, function_name=None, prior_calls=0):
        return self.start_marker + ("[" if function_name is None else f"[{function_name}(")


# -------------------------------------------------------------------------------------------------- Mistral
class MistralToolParser(ToolParser):
    """Mistral-Small 3.x, Devstral, Magistral: after ``[TOOL_CALLS]`` either a JSON array of
    ``{"name", "arguments"[, "id"]}`` (tokenizers up to v7) or ``NAME[ARGS]{json}`` calls, each after its own
    ``[TOOL_CALLS]`` (v11; ``NAME[CALL_ID]ID[ARGS]{json}`` where the model writes ids). Text before the first marker is
    content. Ids: the model's own when it writes them, else 9 letters and digits, the only ids Mistral's chat
    templates accept when the calls come back."""

    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    named_prefix: tuple[str, str] | None = None  # (before, after) the function name: learn_template()
    _PROBE_NAME, _PROBE_ID, _PROBE_ARGS = "forge_probe_fn", "pr0be1d42", {"forge_probe_arg": "v"}
    _V11 = re.compile(r"^\s*(?P<name>[^\[\]\s]+)\s*(?:\[CALL_ID\](?P<id>[^\[]*))?\[ARGS\](?P<args>.*)$", re.DOTALL)

    def parse(self, text, tools=None):
        at = text.find(self.start_marker)
        if at < 0:
            return ParsedCompletion(content=text)
        schemas = _schemas(tools)
        try:
            calls = self.calls_in(text[at:], schemas)
        except _Malformed:
            return ParsedCompletion(content=text, num_malformed=1)
        return ParsedCompletion(content=text[:at].strip() or None, tool_calls=calls)

    def calls_in(self, body: str, schemas: dict) -> list[dict]:
        parts = [p for p in body.split(self.start_marker)[1:]]
        found = []
        if parts and parts[0].lstrip().startswith("["):  # one JSON array of calls
            if len(parts) > 1:
                raise _Malformed("a second [TOOL_CALLS] after a JSON array")
            try:
                items, end = json.JSONDecoder().raw_decode(parts[0].lstrip())
            except json.JSONDecodeError as exc:
                raise _Malformed(str(exc)) from exc
            if parts[0].lstrip()[end:].strip() or not isinstance(items, list) or not items:
                raise _Malformed("not one JSON array of calls")
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                    raise _Malformed("a call without a name")
                found.append((item["name"], item.get("arguments", {}), item.get("id")))
        else:
            for part in parts:
                m = self._V11.match(part)
                if m is None:
                    raise _Malformed("not NAME[ARGS]{...}")
                found.append((m.group("name"), m.group("args").strip(), m.group("id")))
        calls = []
        for name, args, call_id in found:
            if schemas and name not in schemas:
                raise _Malformed("a call to a function the request has no tool for")
            ok_id = isinstance(call_id, str) and call_id.strip().isalnum()
            calls.append(_call(name, _json_args(args), call_id.strip() if ok_id else _mistral_id()))
        return calls

    def learn_template(self, render) -> None:
        """How the template writes a call to a function named NAME, up to where the model's own part starts (its
        call id, as v11 templates with [CALL_ID] write it, or the arguments): a JSON array (tokenizers up to v7:
        ``[TOOL_CALLS][{"name": "NAME", "arguments": ``) or v11's ``[TOOL_CALLS]NAME[ARGS]``. Read off a probe call
        rendered by the template; a template that refuses the probe or writes it otherwise leaves named forcing
        off (tool_choice 'required' still works)."""
        tool = {"type": "function", "function": {"name": self._PROBE_NAME, "description": "probe", "parameters": {
            "type": "object", "properties": {"forge_probe_arg": {"type": "string"}}}}}
        call = {"id": self._PROBE_ID, "type": "function",
                "function": {"name": self._PROBE_NAME, "arguments": self._PROBE_ARGS}}
        messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": self._PROBE_ID, "content": "probe"}]
        try:
            text = render(messages, [tool])
        except Exception:  # noqa: BLE001 - any refusal: the format stays unknown
            return
        at = text.rfind(self.start_marker)
        name_at = text.find(self._PROBE_NAME, at) if at >= 0 else -1
        if name_at < 0:
            return
        after_name = name_at + len(self._PROBE_NAME)
        cuts = [i for i in (text.find(self._PROBE_ID, after_name), text.find('{"forge_probe_arg"', after_name))
                if i >= 0]
        if not cuts:
            return
        self.named_prefix = (text[at:name_at], text[after_name:min(cuts)])

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker
        if self.named_prefix is None:
            raise CannotForceToolCall("the mistral parser forces a named call only when it has read from the chat "
                                      "template how a call is written (a JSON array or NAME[ARGS]), and this "
                                      "template did not show it; use tool_choice 'required'")
        before, after = self.named_prefix
        name = json.dumps(function_name, ensure_ascii=False)[1:-1] if before.endswith('"') else function_name
        return before + name + after


def _mistral_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(alphabet[b % len(alphabet)] for b in uuid.uuid4().bytes[:9])


# --------------------------------------------------------------------------------------------- harmony (gpt-oss)
class GptOssToolParser(ToolParser):
    """gpt-oss's harmony format: a message to ``functions.NAME`` is a call (rules in harmony.py)."""

    name = "gpt-oss"

    def __init__(self, calls: bool = True):
        self.calls = calls

    def parse(self, text, tools=None):
        schemas = _schemas(tools)
        pieces, calls, malformed = [], [], 0
        for m in harmony.split_messages(text):
            if m.recipient is not None and self.calls and m.header_done:
                name = m.recipient.removeprefix("functions.")
                try:
                    if not name:
                        raise _Malformed("no function name")
                    if schemas and name not in schemas:
                        raise _Malformed("a call to a function the request has no tool for")
                    calls.append(_call(name, _json_args(m.body.strip() or "{}")))
                except _Malformed:
                    malformed += 1
                    pieces.append(("raw", m.raw))
            elif m.plain or not m.header_done or m.channel == "analysis" or m.recipient is not None:
                pieces.append(("raw", m.raw))
            else:
                pieces.append(("body", m.body))
        content = harmony.join_content(pieces)
        if calls:
            content = content.strip() or None
        return ParsedCompletion(content=content, tool_calls=calls, num_malformed=malformed)

    def streamable(self, text):
        return harmony.stream_content(text, calls=self.calls)

    def without_calls(self):
        return GptOssToolParser(calls=False)

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return f"{harmony.CHANNEL}commentary to=functions."
        return f"{harmony.CHANNEL}commentary to=functions.{function_name} {harmony.CONSTRAIN}json{harmony.MESSAGE}"


class DeepSeekV32ToolParser(BlockToolParser):
    """DeepSeek-V3.2's DSML: ``<｜DSML｜function_calls>`` then per call ``<｜DSML｜invoke name="f">`` with
    ``<｜DSML｜parameter name="a" string="true|false">V</｜DSML｜parameter>`` lines: ``string="true"`` values are the
    text as written, ``string="false"`` ones JSON (a value that does not parse makes the call malformed). DeepSeek-V4
    (``deepseekv4``) wraps the same calls in ``tool_calls``."""

    name = "deepseekv32"
    start_marker = "<｜DSML｜function_calls>"
    end_marker = "</｜DSML｜function_calls>"
    _INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]*)">(.*?)</｜DSML｜invoke>', re.DOTALL)
    _PARAM = re.compile(r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.DOTALL)

    def calls_in(self, body, schemas):
        calls = []
        for m in self._INVOKE.finditer(body):
            name, inner = m.group(1).strip(), m.group(2)
            if not name:
                raise _Malformed("no function name")
            args = {}
            for key, is_string, raw in _pairs(inner, self._PARAM):
                if is_string == "true":
                    args[key] = raw
                else:
                    try:
                        args[key] = json.loads(raw)
                    except json.JSONDecodeError as exc:
                        raise _Malformed(f"parameter {key!r} is not JSON: {exc}") from exc
            calls.append(_call(name, args))
        if not calls or self._INVOKE.sub("", body).strip():
            raise _Malformed("not <invoke name=...>...</invoke>")
        return calls, 0

    def forced_prefix(self, function_name=None, prior_calls=0):
        if function_name is None:
            return self.start_marker + "\n"
        return f'{self.start_marker}\n<｜DSML｜invoke name="{function_name}">\n'


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
    name = "deepseekv4"
    start_marker = "<｜DSML｜tool_calls>"
    end_marker = "</｜DSML｜tool_calls>"


# ------------------------------------------------------------------------------------------------ Gemma 4
_G4_QUOTE = '<|"|>'


class _G4Bare(str):
    """A value Gemma 4 wrote without string delimiters (a number, true / false / null, or a bare word)."""


def _g4_skip(text: str, i: int) -> int:
    """The index of the first non-blank character of ``text`` from ``i``."""
    while i < len(text) and text[i] in " \n\t":
        i += 1
    return i


def _g4_value(text: str, i: int) -> tuple[object, int]:
    """(value, index after it) of the Gemma 4 value starting at ``text[i]``: a delimited string, an object, an
    array, or a bare token (:class:`_G4Bare`, typed by the caller)."""
    i = _g4_skip(text, i)
    if text.startswith(_G4_QUOTE, i):
        end = text.find(_G4_QUOTE, i + len(_G4_QUOTE))
        if end < 0:
            raise _Malformed("a string left open")
        return text[i + len(_G4_QUOTE):end], end + len(_G4_QUOTE)
    if text.startswith("{", i):
        return _g4_object(text, i)
    if text.startswith("[", i):
        items, i = [], i + 1
        while True:
            i = _g4_skip(text, i)
            if text.startswith("]", i):
                return [_g4_plain(v) for v in items], i + 1
            if items:
                if not text.startswith(",", i):
                    raise _Malformed("array items not separated by ','")
                i += 1
            value, i = _g4_value(text, i)
            items.append(value)
    j = i
    while j < len(text) and text[j] not in ",}]" and not text.startswith(_G4_QUOTE, j):
        j += 1
    token = text[i:j].strip()
    if not token:
        raise _Malformed("a missing value")
    return _G4Bare(token), j


def _g4_object(text: str, i: int) -> tuple[dict, int]:
    """({key: value}, index after the closing brace) of the object whose ``{`` is at ``text[i]``; bare values
    stay :class:`_G4Bare` at this level (nested ones are read as JSON literals or kept as text)."""
    out, i = {}, i + 1
    while True:
        i = _g4_skip(text, i)
        if text.startswith("}", i):
            return out, i + 1
        if out:
            if not text.startswith(",", i):
                raise _Malformed("arguments not separated by ','")
            i += 1
        colon = text.find(":", i)
        key = text[i:colon].strip() if colon >= 0 else ""
        if not key or any(c in key for c in "{}[],") or _G4_QUOTE in key:
            raise _Malformed("an argument without a name")
        value, i = _g4_value(text, colon + 1)
        out[key] = value if isinstance(value, _G4Bare) else _g4_plain(value)


def _g4_plain(value):
    """A nested value with its bare tokens read as JSON literals (or kept as text)."""
    if isinstance(value, _G4Bare):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return str(value)
    if isinstance(value, dict):
        return {k: _g4_plain(v) for k, v in value.items()}
    return value


class Gemma4ToolParser(BlockToolParser):
    """Gemma 4: ``<|tool_call>call:NAME{...}<tool_call|>``, one call per block; its own argument notation (the
    module docstring's table). A bare top-level value is typed by the tool's schema (a string parameter keeps the
    text), nested ones are read as JSON literals."""

    name = "gemma4"
    start_marker = "<|tool_call>"
    end_marker = "<tool_call|>"

    def calls_in(self, body, schemas):
        body = body.strip()
        brace = body.find("{")
        if not body.startswith("call:") or brace < 0:
            raise _Malformed("not call:NAME{...}")
        name = body[len("call:"):brace].strip()
        if not name or any(c.isspace() for c in name):
            raise _Malformed("no function name")
        args, end = _g4_object(body, brace)
        if body[end:].strip():
            raise _Malformed("text after the arguments")
        params, misfits = schemas.get(name, {}), 0
        for key, value in args.items():
            if isinstance(value, _G4Bare):
                args[key], fits = typed_value(str(value), params.get(key))
                misfits += not fits
        return [_call(name, args)], int(misfits > 0)

    def forced_prefix(self, function_name=None, prior_calls=0):
        return f"{self.start_marker}call:" + (f"{function_name}{{" if function_name is not None else "")


_PARSERS: dict[str, type[ToolParser]] = {
    "none": ToolParser, "hermes": HermesToolParser, "qwen": HermesToolParser, "qwen25": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "glm45": Glm45ToolParser, "glm": Glm45ToolParser,
    "glm47": Glm47ToolParser, "minimax-m2": MinimaxM2ToolParser, "minimax_m2": MinimaxM2ToolParser,
    "minimax-m1": MinimaxM1ToolParser, "minimax_m1": MinimaxM1ToolParser,
    "kimi_k2": KimiK2ToolParser, "deepseekv31": DeepSeekV31ToolParser, "deepseekv3": DeepSeekV3ToolParser,
    "gpt-oss": GptOssToolParser, "gpt_oss": GptOssToolParser, "llama3": Llama3ToolParser,
    "mistral": MistralToolParser, "pythonic": PythonicToolParser, "lfm2": Lfm2ToolParser,
    "deepseekv32": DeepSeekV32ToolParser,
    "deepseekv4": DeepSeekV4ToolParser, "seed_oss": SeedOssToolParser, "gemma4": Gemma4ToolParser,
    "hunyuan": HunyuanToolParser, "longcat": LongcatToolParser, "granite": GraniteToolParser,
    "cohere": CohereToolParser,
}


def register_parser(name: str, cls: type[ToolParser]) -> None:
    """Make ``cls`` available as ``--tool-parser name``."""
    _PARSERS[name] = cls


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; available: {parser_names()}")
    return _PARSERS[name]()
