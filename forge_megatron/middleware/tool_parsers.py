"""Tool-call parsers: completion text -> (content, OpenAI tool calls), pluggable by name.

Black-box agents speak the OpenAI schema, models speak their chat format. A parser turns the text a model generated
into ``content`` plus ``tool_calls`` [{id, type: "function", function: {name, arguments: <JSON string>}}], and counts
malformed calls (a process-reward signal: ``Episode.num_malformed_tool_calls``).

``hermes`` (alias ``qwen``): each call is ``<tool_call>{"name": str, "arguments": object}</tool_call>``, as in
Hermes-2-Pro and the Qwen2.5/Qwen3 chat templates. A block that is not such JSON, or an unclosed ``<tool_call>``, is
malformed: it is counted and its text stays in ``content`` so the agent sees what the model wrote.
Register others with :func:`register_parser`.

*Forcing a call* (``tool_choice`` "required" or a named function) needs no constrained decoding: the gateway appends
:meth:`ToolParser.forced_prefix` to the prompt ids and parses prefix + completion. For Hermes/Qwen the prefix is what
the chat template writes at the start of an assistant tool call, ``<tool_call>\n`` and, for a named function,
``{"name": "<name>", "arguments":`` after it, so the forced text + completion is the text the template renders for
that call on the next turn. The named prefix stops before the template's space after ``"arguments":``: byte-level
BPE merges that space with the next character (`` {"``), so a prompt ending in a lone space token is one the model
never saw in training (a tiny model continued it with garbage); the model writes `` {`` itself.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ParsedCompletion:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    num_malformed: int = 0


class CannotForceToolCall(ValueError):
    """The parser has no text that commits a model to a tool call."""


class ToolParser:
    """Base: no tool calls; ``start_marker`` is where streaming must stop emitting content (None: never)."""

    name = "none"
    start_marker: str | None = None

    def parse(self, text: str) -> ParsedCompletion:
        return ParsedCompletion(content=text)

    def forced_prefix(self, function_name: str | None = None) -> str:
        """Text that, appended to the prompt, commits the model to a tool call (to ``function_name`` when given)."""
        raise CannotForceToolCall(f"tool parser {self.name!r} cannot force a tool call; use tool_choice 'auto' or "
                                  "'none', or serve with a parser that can (e.g. --tool-parser hermes)")


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text: str) -> ParsedCompletion:
        pattern = re.compile(re.escape(self.start_marker) + r"(.*?)" + re.escape(self.end_marker), re.DOTALL)
        calls, kept, malformed, pos = [], [], 0, 0
        for m in pattern.finditer(text):
            kept.append(text[pos:m.start()])
            call = _call_from_json(m.group(1))
            if call is None:
                malformed += 1
                kept.append(m.group(0))
            else:
                calls.append(call)
            pos = m.end()
        rest = text[pos:]
        if self.start_marker in rest:  # opened but never closed (e.g. cut by max_tokens)
            malformed += 1
        kept.append(rest)
        content = "".join(kept)
        if calls:
            content = content.strip() or None
        return ParsedCompletion(content=content, tool_calls=calls, num_malformed=malformed)

    def forced_prefix(self, function_name: str | None = None) -> str:
        if function_name is None:
            return self.start_marker + "\n"
        return f'{self.start_marker}\n{{"name": {json.dumps(function_name, ensure_ascii=False)}, "arguments":'


def _call_from_json(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


_PARSERS: dict[str, type[ToolParser]] = {"none": ToolParser, "hermes": HermesToolParser, "qwen": HermesToolParser}


def register_parser(name: str, cls: type[ToolParser]) -> None:
    """Make ``cls`` available as ``--tool-parser name``."""
    _PARSERS[name] = cls


def get_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; available: {sorted(_PARSERS)}")
    return _PARSERS[name]()
