"""gpt-oss completions in the harmony format: messages on channels -> reasoning, content and tool calls.

A gpt-oss completion is a run of messages, each ``[<|start|>]HEADER<|message|>BODY`` ended by ``<|end|>`` (more
messages follow), ``<|call|>`` (a tool call: stop) or ``<|return|>`` (the answer is done: stop). The chat template's
generation prompt ends with ``<|start|>assistant``, so the first header is only what follows the role. The header
names the channel (``<|channel|>analysis`` / ``commentary`` / ``final``) and, for a tool call, the recipient
``to=functions.NAME`` (in the role part or the channel part) with an optional ``<|constrain|>json``:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

How the gateway reads them (``--tool-parser gpt-oss --reasoning-parser gpt-oss``, SGLang's names):

* ``analysis`` messages are the reasoning (``reasoning_content``, several joined by a newline); without the
  reasoning parser they stay in ``content`` as written, markers included, as a ``<think>`` block does for the other
  families.
* a message with a recipient is a tool call: ``functions.NAME`` calls NAME, any other recipient (the built-in
  ``browser.*`` and ``python`` tools) is called by its full name; the body is the JSON arguments. A body that is not
  a JSON object, or a function the request has no tool for, is malformed (counted) and kept in ``content`` as
  written. With ``tool_choice`` "none" recipients are not read: those messages stay in ``content`` as written.
* ``final`` and ``commentary`` messages without a recipient (preambles) are ``content``: their bodies, separated by
  a blank line.
* text that is not a message at all (a model that ignores the format) is content as written.

The completion's last stop token (``<|call|>`` / ``<|return|>``) is not in the text the parsers see (the gateway
cuts the matched stop token), so the last message may end without one. Streaming (:func:`stream_content`) gives
out content up to the first message with a recipient (held back to the end, as the other formats hold their call
markers) and never a header before its ``<|message|>``; what it gives is always a prefix of the final content.

*Multi-turn.* The gpt-oss chat template renders an assistant message's reasoning from its ``thinking`` field; the
gateway passes ``reasoning_content`` sent back by the agent as ``thinking`` too (gateway_sessions.py). The template
drops the reasoning of turns that end with a final answer, so such a turn's next call starts a new trajectory segment
(the model really sees the shorter history); a tool call's reasoning is kept, so tool loops continue one segment.
Both stop tokens end a turn for the gateway: it reads them from the model's ``generation_config.json``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Message:
    """One message of a completion. ``channel`` None with ``header_done``: text outside the format (``body`` is
    all of it). ``header_done`` False: the header is still arriving (streams only); ``closed``: a terminator
    followed the body."""

    raw: str
    channel: str | None = None
    recipient: str | None = None
    body: str = ""
    header_done: bool = True
    closed: bool = False

    @property
    def plain(self) -> bool:
        return self.channel is None and self.recipient is None


def split_messages(text: str) -> list[Message]:
    """The messages of ``text`` in order (see the module docstring)."""
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        first, at_start = not out, text.startswith(START, pos)
        if not first and not at_start:  # after a message: a new one, the start of one arriving, or stray text
            rest = text[pos:]
            out.append(Message(raw=rest, header_done=False) if START.startswith(rest) else Message(raw=rest, body=rest))
            break
        head = pos + len(START) if at_start else pos
        msg_at = text.find(MESSAGE, head)
        header = text[head:msg_at] if msg_at >= 0 else text[head:]
        if not _is_header(header, first and not at_start):
            if msg_at < 0 and _could_become_header(header, first and not at_start):
                out.append(Message(raw=text[pos:], header_done=False))
            else:
                out.append(Message(raw=text[pos:], body=text[pos:]))
            break
        if msg_at < 0:
            out.append(Message(raw=text[pos:], header_done=False))
            break
        body_at = msg_at + len(MESSAGE)
        ends = [(i, t) for t in TERMINATORS if (i := text.find(t, body_at)) >= 0]
        stop, term = min(ends) if ends else (len(text), "")
        channel, recipient = _parse_header(header)
        out.append(Message(raw=text[pos:stop + len(term)], channel=channel or "", recipient=recipient,
                           body=text[body_at:stop], closed=bool(term)))
        pos = stop + len(term)
    return out


def _is_header(header: str, first: bool) -> bool:
    """A message header: a role part and/or a channel part, with no message structure or line break in it."""
    if "\n" in header or any(t in header for t in (*TERMINATORS, START)):
        return False
    if first:  # the role is in the prompt: the completion's first header starts at <|channel|> or a recipient
        return header.startswith(CHANNEL) or header.lstrip().startswith("to=")
    return bool(header)


def _could_become_header(header: str, first: bool) -> bool:
    """Streams: text that may still turn into a header (held back until it does or cannot)."""
    if "\n" in header or any(t in header for t in (*TERMINATORS, START)):
        return False
    return not first or CHANNEL.startswith(header) or "to=".startswith(header.lstrip())


def _parse_header(header: str) -> tuple[str | None, str | None]:
    role, _, channel_part = header.partition(CHANNEL)
    channel = channel_part.replace(CONSTRAIN, " ").split()[0] if channel_part.strip() else None
    m = _RECIPIENT.search(role) or _RECIPIENT.search(channel_part)
    recipient = m.group(1) if m else None
    return channel, (None if recipient in (None, "user", "all") else recipient)


def partial_marker(body: str) -> int:
    """Length of the end of ``body`` that may be the start of a terminator (held back while streaming)."""
    for k in range(min(len(body), max(map(len, TERMINATORS)) - 1), 0, -1):
        if any(t.startswith(body[-k:]) for t in TERMINATORS):
            return k
    return 0


def join_content(pieces: list[tuple[str, str]]) -> str:
    """Content from ("body" | "raw", text) pieces: raw text as written, message bodies separated by a blank line."""
    out, last_body = "", False
    for kind, text in pieces:
        if not text:
            continue
        if kind == "body" and last_body:
            out += "\n\n"
        out += text
        last_body = kind == "body"
    return out


def reasoning_and_rest(text: str, final: bool = True) -> tuple[str | None, str]:
    """(analysis bodies joined by newlines or None, the other messages as written) for the reasoning parser. A
    stream so far (``final`` False) gives out neither a header still arriving nor a partial terminator."""
    reasoning: list[str] = []
    rest = []
    for m in split_messages(text):
        if not m.header_done:
            if final:
                rest.append(m.raw)
            break
        if m.channel == "analysis" and m.recipient is None:
            body = m.body if final or m.closed else m.body[:len(m.body) - partial_marker(m.body)]
            reasoning.append(body)
        else:
            rest.append(m.raw)
    return ("\n".join(reasoning) if reasoning else None), "".join(rest)


def stream_content(text: str, calls: bool = True) -> str:
    """The content of a completion so far that a stream may give out (module docstring)."""
    pieces = []
    for m in split_messages(text):
        if not m.header_done or (calls and m.recipient is not None):
            break
        if m.plain:
            pieces.append(("raw", m.raw[:len(m.raw) - partial_marker(m.raw)]))
        elif m.channel == "analysis" or m.recipient is not None:
            pieces.append(("raw", m.raw if m.closed else m.raw[:len(m.raw) - partial_marker(m.raw)]))
        else:
            pieces.append(("body", m.body if m.closed else m.body[:len(m.body) - partial_marker(m.body)]))
        if not m.closed:
            break
    return join_content(pieces)
