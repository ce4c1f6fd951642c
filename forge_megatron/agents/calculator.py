"""The demo's task and black-box agent: integer arithmetic with a calculator tool, over the official ``openai`` client.

Task: the user message is an expression like ``12+7``; the answer is its value. The agent offers the model one
tool, ``calculator``, which evaluates the task's expression (the agent scaffold knows its task; the tool takes no
arguments). If the model calls it, the agent submits the calculator's output as its answer, like agents that submit
what their code execution printed; otherwise it submits the model's text. A tiny model cannot add two-digit numbers
itself, so direct answers are mostly wrong: learning to use the tool is what RL must teach. (A tiny model learns the
call format in a few SFT steps; copying numbers from the context into its answer takes it far longer, so the task
does not ask for it.)

Run as a program it is a black-box agent for :class:`forge_megatron.agents.runner.CommandAgent`: it reads
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (the official client's own variables) and ``FORGE_TASK_PROMPT``, and prints
its final answer as the last line of stdout; ``--api responses`` makes it call the model through the Responses API
(``client.responses.create``, as Codex-style agents do) instead of chat completions. With ``--serve`` it is a
black-box agent *service* for
:class:`~forge_megatron.agents.runner.HttpAgent` (one long-lived process instead of one process per episode):
``POST / {"task", "base_url", "api_key"}`` -> ``{"output"}``.

:func:`sft_conversations` writes the demo's supervised warm-start data: a fraction ``tool_fraction`` of the
conversations call the tool, the rest answer directly (with the correct value, which the model cannot compute), so
the warm-started policy uses the tool only part of the time and RL has room to raise the success rate.
"""

from __future__ import annotations

import json
import os
import random
import re

from forge_megatron.agents.service import JsonHandler, serve
from forge_megatron.agents.tasks import Task

TOOL_NAME = "calculator"
TOOLS = [{
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "exact value of the task's expression",
        "parameters": {"type": "object", "properties": {}},
    },
}]
_EXPR = re.compile(r"^\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*$")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def calculate(expr: str) -> str:
    """Value of ``a op b`` (integers, op in + - *) as a string, or ``error: ...`` (never ``eval``)."""
    m = _EXPR.match(expr if isinstance(expr, str) else "")
    if not m:
        return f"error: cannot evaluate {expr!r}"
    return str(OPS[m.group(2)](int(m.group(1)), int(m.group(3))))


def make_tasks(n: int, seed: int = 0, max_operand: int = 49, ops: str = "+", domain: str = "math",
               result_digits: int | None = 2) -> list[Task]:
    """``n`` distinct arithmetic tasks, deterministic for ``seed``.

    ``result_digits`` keeps only tasks whose value has that many digits (None: any): with a fixed answer length the
    tool result sits at a fixed distance from every answer digit, which a tiny model learns to copy quickly.
    """
    rng = random.Random(seed)
    pool = [f"{a}{op}{b}" for a in range(max_operand + 1) for b in range(max_operand + 1) for op in ops]
    pool = [e for e in pool if result_digits is None or len(calculate(e)) == result_digits]
    if n > len(pool):
        raise ValueError(f"only {len(pool)} distinct tasks exist, asked for {n}")
    return [Task(task_id=f"calc-{i}", prompt=e, domain=domain, answer=calculate(e))
            for i, e in enumerate(rng.sample(pool, n))]


def tool_call_message() -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": TOOL_NAME, "arguments": "{}"}}]}


def sft_conversations(tasks: list[Task], tool_fraction: float, seed: int = 0) -> list[list[dict]]:
    """One chat per task: with probability ``tool_fraction`` the tool path, else a direct answer."""
    rng = random.Random(seed)
    chats = []
    for task in tasks:
        user = {"role": "user", "content": task.prompt}
        if rng.random() < tool_fraction:
            chats.append([user, tool_call_message()])
        else:
            chats.append([user, {"role": "assistant", "content": task.answer}])
    return chats


APIS = ("chat", "responses")
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat tool form


def solve(prompt: str, client, model: str = "forge", max_tokens: int = 48, temperature: float = 1.0,
          api: str = "chat") -> str:
    """One model call with an ``openai.OpenAI`` client, through chat completions or the Responses API (``api``):
    the calculator's output if the model called it, else the model's text."""
    if api == "responses":
        reply = client.responses.create(model=model, input=prompt, tools=RESPONSES_TOOLS, store=False,
                                        max_output_tokens=max_tokens, temperature=temperature)
        calls = [item for item in reply.output if item.type == "function_call"]
        if calls:
            return _run_tool(calls[0], prompt)
        return reply.output_text.strip()
    if api != "chat":
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                           max_tokens=max_tokens, temperature=temperature).choices[0].message
    if reply.tool_calls:
        return _run_tool(reply.tool_calls[0].function, prompt)
    return (reply.content or "").strip()


def _run_tool(function, task_prompt: str) -> str:
    """The calculator evaluates the task's expression; a wrong tool name or non-JSON arguments get an error.
    ``function``: a chat tool call's function or a Responses function_call item (both have name and arguments)."""
    if function.name != TOOL_NAME:
        return f"error: unknown tool {function.name!r}"
    try:
        json.loads(function.arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    return calculate(task_prompt)


class _AgentHandler(JsonHandler):
    api = "chat"  # set by main(--api)

    def do_POST(self):  # noqa: N802 - http.server's naming
        try:
            body = self.body()
            prompt, base_url, api_key = body["task"]["prompt"], body["base_url"], body["api_key"]
        except (ValueError, KeyError, TypeError) as exc:
            return self._answer(400, {"error": f"expected {{task: {{prompt}}, base_url, api_key}}: {exc}"})
        return self.answer_with(base_url, api_key, lambda client: solve(prompt, client, api=self.api))


def main(argv: list[str] | None = None) -> int:
    import argparse

    import openai

    p = argparse.ArgumentParser(prog="calculator-agent", description="the demo's calculator agent")
    p.add_argument("--serve", action="store_true", help="run as an HTTP agent service instead of one episode")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--api", choices=APIS, default="chat",
                   help="how the agent calls the model: chat completions, or the Responses API (as Codex-style "
                        "agents do); the gateway records both alike")
    args = p.parse_args(argv)
    if args.serve:
        handler = type("_Handler", (_AgentHandler,), {"api": args.api})
        serve(handler, args.host, args.port)
        return 0
    prompt = os.environ.get("FORGE_TASK_PROMPT")
    if prompt is None:
        raise SystemExit("FORGE_TASK_PROMPT is not set (run me through forge's CommandAgent)")
    client = openai.OpenAI(timeout=120.0, max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    print(solve(prompt, client, model=os.environ.get("FORGE_MODEL", "forge"), api=args.api))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
