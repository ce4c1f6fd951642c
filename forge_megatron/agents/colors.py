"""The vision demo's task and black-box agent: name the colour of a picture, over the official ``openai`` client.

Task: a picture filled with one of :data:`COLORS` (noisy, of a size between 8 and 32 pixels a side, made from the
task's metadata, so the same task always shows the same picture); the answer is the colour's name. The agent sends
the picture inline (an OpenAI image part with a data URL) with the question and submits the model's text; the
default verifier compares it with the answer. A model that does not look at the picture is right one time in four:
reading the colour off the vision tower's features is what RL must teach.

With ``--serve`` it is a black-box agent service for :class:`~forge_megatron.agents.runner.HttpAgent`:
``POST / {"task", "base_url", "api_key"}`` -> ``{"output"}``.

:func:`sft_conversations` writes the supervised warm-start data (OpenAI chats with the picture): a fraction
``correct_fraction`` of the answers name the right colour, the others a random one, so the warm-started policy has
the answer format and only a weak hold on the colours, and RL has room to raise the success rate.
"""

from __future__ import annotations

import base64
import io
import random

import numpy as np

from forge_megatron.agents.service import JsonHandler, serve
from forge_megatron.agents.tasks import Task

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
QUESTION = "What colour is the picture?"


def make_tasks(n: int, seed: int = 0, domain: str = "vision") -> list[Task]:
    """``n`` tasks, deterministic for ``seed``: colour, picture size and noise seed in the metadata."""
    rng = random.Random(seed)
    names = sorted(COLORS)
    tasks = []
    for i in range(n):
        color = rng.choice(names)
        tasks.append(Task(task_id=f"color-{seed}-{i}", prompt=QUESTION, domain=domain, answer=color,
                          metadata={"color": color, "height": rng.randint(8, 32), "width": rng.randint(8, 32),
                                    "noise_seed": rng.randrange(1 << 30)}))
    return tasks


def picture(task: Task) -> bytes:
    """The task's picture: a PNG of its colour with +-20 of noise per channel."""
    from PIL import Image

    m = task.metadata
    rng = np.random.default_rng(m["noise_seed"])
    base = np.array(COLORS[m["color"]], dtype=np.int64)
    pixels = np.clip(base + rng.integers(-20, 21, size=(m["height"], m["width"], 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def user_message(task: Task) -> dict:
    url = "data:image/png;base64," + base64.b64encode(picture(task)).decode()
    return {"role": "user", "content": [{"type": "text", "text": task.prompt},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def sft_conversations(tasks: list[Task], correct_fraction: float, seed: int = 0) -> list[list[dict]]:
    """One chat per task: the right colour with probability ``correct_fraction``, else a random one."""
    rng = random.Random(seed)
    names = sorted(COLORS)
    return [[user_message(t), {"role": "assistant",
                               "content": t.answer if rng.random() < correct_fraction else rng.choice(names)}]
            for t in tasks]


def solve(task: Task, client, model: str = "forge", max_tokens: int = 8, temperature: float = 1.0) -> str:
    reply = client.chat.completions.create(model=model, messages=[user_message(task)], max_tokens=max_tokens,
                                           temperature=temperature)
    return (reply.choices[0].message.content or "").strip()


class _AgentHandler(JsonHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        try:
            body = self.body()
            task, base_url, api_key = Task(**body["task"]), body["base_url"], body["api_key"]
            picture(task)
        except (ValueError, KeyError, TypeError) as exc:
            return self._answer(400, {"error": f"expected {{task: {{..., metadata: {{color, height, width, "
                                               f"noise_seed}}}}, base_url, api_key}}: {exc}"})
        return self.answer_with(base_url, api_key, lambda client: solve(task, client))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="colors-agent", description="the vision demo's agent service (see the module)")
    p.add_argument("--serve", action="store_true", required=True, help="run as an HTTP agent service")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    serve(_AgentHandler, args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
