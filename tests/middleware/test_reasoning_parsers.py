"""Reasoning parsers (middleware/reasoning_parsers.py): final splits, and streams that never take back text."""

import random

import pytest

from forge_megatron.middleware.reasoning_parsers import (
    ReasoningParser, Split, get_reasoning_parser, reasoning_parser_names,
)

QWEN3 = get_reasoning_parser("qwen3")


def test_block_at_the_start_or_opened_by_the_prompt():
    assert QWEN3.split("<think>\nplan\n</think>\n\nanswer", False) == Split("plan", "answer")
    assert QWEN3.split("  <think>plan</think>answer", False) == Split("plan", "answer")
    assert QWEN3.split("plan\n</think>\n\nanswer", True) == Split("plan", "answer")  # prompt ended with <think>
    assert QWEN3.split("answer <think>x</think>", False) == Split(None, "answer <think>x</think>")  # not at start
    assert QWEN3.split("<think>\n\n</think>\n\nok", False) == Split("", "ok")  # empty block kept as ""
    assert QWEN3.split("<think>\nlong plan cut by max_tokens", False) == Split("long plan cut by max_tokens", "")
    assert QWEN3.split("plain answer", False) == Split(None, "plain answer")


def test_prompt_decides_where_the_completion_starts():
    assert QWEN3.opens("<|im_start|>assistant\n<think>\n") and not QWEN3.opens("<|im_start|>assistant\n")
    assert not QWEN3.opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    r1 = get_reasoning_parser("deepseek-r1")
    assert r1.opens("anything") and r1.split("plan</think>answer", r1.opens("x")) == Split("plan", "answer")


def test_tool_call_opening_ends_an_unclosed_block():
    text = "<think>\nI will call it\n<tool_call>\n{}\n</tool_call>"
    assert QWEN3.split(text, False) == Split("I will call it", "<tool_call>\n{}\n</tool_call>")
    assert QWEN3.split("<think>a</think>b <tool_call>", False) == Split("a", "b <tool_call>")  # closed first
    kimi_k2 = get_reasoning_parser("kimi_k2")
    assert kimi_k2.split("<think>x<|tool_calls_section_begin|>y", False) == Split("x", "<|tool_calls_section_begin|>y")
    kimi = get_reasoning_parser("kimi")
    assert kimi.split("◁think▷x◁/think▷y", False) == Split("x", "y")
    seed = get_reasoning_parser("seed_oss")  # Seed-OSS: its own tags, its tool-call block ends an open one
    assert seed.split("<seed:think>x</seed:think>y", False) == Split("x", "y")
    assert seed.split("<seed:think>x<seed:tool_call>y", False) == Split("x", "<seed:tool_call>y")
    mistral = get_reasoning_parser("mistral")  # Magistral / Ministral 3: [THINK] blocks, [TOOL_CALLS] ends an open one
    assert mistral.split("[THINK]x[/THINK]y", False) == Split("x", "y")
    assert mistral.split("[THINK]x[TOOL_CALLS]f[ARGS]{}", False) == Split("x", "[TOOL_CALLS]f[ARGS]{}")
    assert mistral.split("no block", False) == Split(None, "no block")
    gemma4 = get_reasoning_parser("gemma4")  # Gemma 4: a "thought" channel (its newline is the channel's, not text)
    assert gemma4.split("<|channel>thought\nx\n<channel|>y", False) == Split("x", "y")
    assert gemma4.split("<|channel>thought\nx<|tool_call>call:f{}<tool_call|>", False) == \
        Split("x", "<|tool_call>call:f{}<tool_call|>")
    longcat = get_reasoning_parser("longcat")  # LongCat-Flash-Thinking: its own tags, its tool call ends an open one
    assert longcat.split("<longcat_think>\nx\n</longcat_think>\n\ny", False) == Split("x", "y")
    assert longcat.split("<longcat_think>x<longcat_tool_call>{}", False) == Split("x", "<longcat_tool_call>{}")
    assert longcat.split("no block", False) == Split(None, "no block")
    cohere = get_reasoning_parser("cohere")  # Command A Reasoning / A / R7B: its plan, then an action or the answer
    assert cohere.split("<|START_THINKING|>x<|END_THINKING|><|START_RESPONSE|>y<|END_RESPONSE|>", False) == \
        Split("x", "<|START_RESPONSE|>y<|END_RESPONSE|>")  # (the answer's markers are the cohere tool parser's)
    assert cohere.split("<|START_THINKING|>x<|START_ACTION|>[]<|END_ACTION|>", False) == \
        Split("x", "<|START_ACTION|>[]<|END_ACTION|>")
    assert cohere.split("x<|END_THINKING|>\n<|START_ACTION|>", cohere.opens("<|CHATBOT_TOKEN|><|START_THINKING|>")) \
        == Split("x", "<|START_ACTION|>")
    assert cohere.split("<|START_RESPONSE|>no plan<|END_RESPONSE|>", False) == \
        Split(None, "<|START_RESPONSE|>no plan<|END_RESPONSE|>")


def test_names():
    assert {"qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "kimi_k2", "minimax",
            "cohere"} <= \
        set(reasoning_parser_names())
    assert get_reasoning_parser(None) is None and get_reasoning_parser("none") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        get_reasoning_parser("o1")


@pytest.mark.parametrize("parser", [QWEN3, get_reasoning_parser("kimi"), get_reasoning_parser("deepseek-r1"),
                                    get_reasoning_parser("seed_oss"), get_reasoning_parser("mistral"),
                                    get_reasoning_parser("gemma4"), get_reasoning_parser("longcat"),
                                    get_reasoning_parser("cohere"),
                                    ReasoningParser("two-char", start="<<", end=">>", tool_start="@@")])
def test_a_stream_only_ever_extends_what_it_gave_out(parser):
    """Cut a completion at every character: each partial split's reasoning and content extend the previous one's
    and end as prefixes of the final split's (nothing a stream sent has to be taken back)."""
    rng = random.Random(parser.name)
    pieces = [parser.start, parser.end, parser.start[:1], parser.end[:-1], "\n", "\n\n", " ", "plan", "answer",
              parser.tool_start or "", "x"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for open_at_start in (False, True):
            final = parser.split(text, open_at_start)
            prev = Split(None, "")
            for cut in range(len(text) + 1):
                part = parser.split(text[:cut], open_at_start, final=False)
                if part.reasoning is not None:
                    assert final.reasoning is not None and final.reasoning.startswith(part.reasoning), (text, cut)
                    assert part.reasoning.startswith(prev.reasoning or ""), (text, cut)
                assert final.content.startswith(part.content) and part.content.startswith(prev.content), (text, cut)
                prev = part
