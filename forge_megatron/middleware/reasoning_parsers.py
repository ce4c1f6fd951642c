"""Reasoning parsers: the thinking block of a completion -> ``reasoning_content``, the rest -> content.

Reasoning models write ``<think> ... </think>`` (or their family's markers) before the answer. With a reasoning
parser (``forge-gateway --reasoning-parser NAME``, SGLang's ``--reasoning-parser`` names) the gateway answers the
block as ``message.reasoning_content`` (streamed as ``delta.reasoning_content``; Anthropic ``thinking`` blocks on
``/v1/messages``) and parses tool calls in the rest only, as SGLang does; a request with ``separate_reasoning``
false gets the raw text as content. Training is unaffected: the recorded tokens are the sampled ones either way.

  name                                  markers              the completion starts inside reasoning
  qwen3, glm45, kimi_k2, minimax,       <think> </think>     when the prompt ends with <think>, or the completion
  deepseek-v3                                                starts with it
  qwen3-thinking, deepseek-r1           <think> </think>     always (their templates open the block in the prompt)
  kimi                                  ◁think▷ ◁/think▷     as qwen3
  seed_oss                              <seed:think> ...     as qwen3
  longcat                               <longcat_think> ...  as qwen3 (LongCat-Flash-Thinking)
  mistral                               [THINK] [/THINK]     as qwen3 (Magistral, Ministral 3 Reasoning)
  gemma4                                <|channel>thought    as qwen3 (Gemma 4 with enable_thinking: its template
                                        ... <channel|>       opens no block in the prompt)
  cohere                                <|START_THINKING|>   as qwen3 (Command A Reasoning; Command A and R7B
                                        ...                  write their tool plans in it); <|START_ACTION|> ends
                                        <|END_THINKING|>     an open one
  gpt-oss                               harmony channels     the analysis messages are the reasoning (harmony.py)

Where the block starts is read from the rendered prompt, not assumed per family: a chat template that ends the
generation prompt with the start marker (DeepSeek-R1, Qwen3-Thinking-2507, GLM with thinking on) leaves the model
inside the block, so the completion is reasoning up to the end marker; otherwise only a completion that begins with
the start marker (after whitespace) has a block. A block never closed (cut by max_tokens) is all reasoning. Qwen3
and Kimi-K2 sometimes open a tool call without closing the block: their tool-call opening ends the reasoning there
(``tool_start``).

*Multi-turn fidelity.* One newline after the start marker and before the end marker, and the newlines after the end
marker, are not part of the texts (the families' templates write them back when they render ``reasoning_content``
on the next turn, which is what lets the gateway recognise the next call as a continuation of the sampled tokens).
Agents must send ``reasoning_content`` back with the assistant message (the gateway also accepts ``reasoning``) for
templates that render it; one that drops it gets a new segment, which is also what the model then sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from forge_megatron.middleware import harmony


class Split(NamedTuple):
    reasoning: str | None  # None: the completion has no reasoning block (yet)
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always: bool = False  # the completion starts inside the block whatever the prompt
    tool_start: str | None = None  # a tool-call opening that ends an unclosed block

    def opens(self, prompt_text: str) -> bool:
        """Whether a completion of ``prompt_text`` starts inside the reasoning block."""
        return self.always or prompt_text.rstrip().endswith(self.start)

    def split(self, text: str, open_at_start: bool, final: bool = True) -> Split:
        """(reasoning, content) of ``text``; ``open_at_start`` from :meth:`opens`. With ``final`` False (a stream
        so far) nothing that could still become a marker is given out: each call's texts extend the last call's."""
        body = text
        if not open_at_start:
            head = text.lstrip()
            if not head.startswith(self.start):
                if not final and head and self.start.startswith(head):
                    return Split(None, "")  # maybe a start marker arriving
                if not final and not head:
                    return Split(None, "")  # whitespace so far: a block may still open
                return Split(None, text)
            body = head[len(self.start):]
        cut = body.find(self.end)
        tool = body.find(self.tool_start) if self.tool_start else -1
        if cut >= 0 and not 0 <= tool < cut:
            return Split(_trim(body[:cut]), body[cut + len(self.end):].lstrip("\n"))
        if tool >= 0:
            return Split(_trim(body[:tool]), body[tool:])
        if not final:
            body = body[:len(body) - _partial_suffix(body, [self.end, self.tool_start])]
        return Split(_trim(body), "")


def _trim(reasoning: str) -> str:
    return reasoning.strip("\n")


def _partial_suffix(text: str, markers: list[str | None]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for m in markers:
        if not m:
            continue
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


@dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss: the ``analysis`` channel's messages are the reasoning, the other messages are left (as written) to
    the tool parser (harmony.py). A completion never starts inside a block: every message names its channel."""

    start: str = "<|channel|>analysis<|message|>"
    end: str = "<|end|>"

    def opens(self, prompt_text: str) -> bool:
        return False

    def split(self, text: str, open_at_start: bool, final: bool = True) -> Split:
        return Split(*harmony.reasoning_and_rest(text, final=final))


_PARSERS = {
    "qwen3": ReasoningParser("qwen3", tool_start="<tool_call>"),
    "qwen3-thinking": ReasoningParser("qwen3-thinking", always=True, tool_start="<tool_call>"),
    "deepseek-r1": ReasoningParser("deepseek-r1", always=True),
    "deepseek-v3": ReasoningParser("deepseek-v3"),
    "glm45": ReasoningParser("glm45"),
    "kimi_k2": ReasoningParser("kimi_k2", tool_start="<|tool_calls_section_begin|>"),
    "kimi": ReasoningParser("kimi", start="◁think▷", end="◁/think▷"),
    "minimax": ReasoningParser("minimax"),
    "seed_oss": ReasoningParser("seed_oss", start="<seed:think>", end="</seed:think>", tool_start="<seed:tool_call>"),
    # Magistral, Ministral 3 Reasoning, Devstral with thinking: [THINK] ... [/THINK], then [TOOL_CALLS] or the answer
    "mistral": ReasoningParser("mistral", start="[THINK]", end="[/THINK]", tool_start="[TOOL_CALLS]"),
    # Gemma 4: a "thought" channel; its tool-call opening ends one left open
    "gemma4": ReasoningParser("gemma4", start="<|channel>thought", end="<channel|>", tool_start="<|tool_call>"),
    "gpt-oss": HarmonyReasoningParser("gpt-oss"),
    # LongCat-Flash-Thinking: its own tags; a tool-call block ends one left open
    "longcat": ReasoningParser("longcat", start="<longcat_think>", end="</longcat_think>",
                               tool_start="<longcat_tool_call>"),
    # Cohere Command A Reasoning (and Command A / R7B tool plans): the rest (<|START_ACTION|> calls, or the answer in
    # <|START_RESPONSE|> ... <|END_RESPONSE|>, whose markers it drops) is the cohere tool parser's
    "cohere": ReasoningParser("cohere", start="<|START_THINKING|>", end="<|END_THINKING|>",
                              tool_start="<|START_ACTION|>"),
}


def register_reasoning_parser(parser: ReasoningParser) -> None:
    """Make ``parser`` available as ``--reasoning-parser parser.name``."""
    _PARSERS[parser.name] = parser


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called ``name``; None for None, "" or "none" (no reasoning parsing)."""
    if name in (None, "", "none"):
        return None
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {reasoning_parser_names()} (or none)")
    return _PARSERS[name]
