"""Test helper: a tiny model fine-tuned to answer fixed chats, served by an in-process engine and gateway."""

from contextlib import contextmanager

from forge_megatron.models.tiny import finetune_on_chats
from forge_megatron.rollout.launch import start_engine, start_gateway


@contextmanager
def fine_tuned_gateway(model_dir: str, chats: list, tools: list, config: dict, steps: int = 150):
    """Fine-tune ``model_dir`` on ``chats`` (models/tiny.py), then serve it with gateway ``config`` fields."""
    finetune_on_chats(model_dir, chats, tools=tools, steps=steps, lr=5e-3)
    engine = start_engine(model_dir, in_process=True)
    gw = start_gateway(model_dir, [engine.url], in_process=True, config=config)
    try:
        yield gw
    finally:
        gw.stop()
        engine.stop()


def tool_follow_up(user: list[dict], first: dict, result: str) -> list[dict]:
    """``user`` + the assistant's tool-call message + the result of its first call."""
    return user + [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": result}]
