"""Helpers shared by the agent tests: one real model call through a session, and a scripted white-box agent."""

import threading

from forge_megatron.agents.runner import EpisodeResult


def one_call(session):
    """One short chat call through the session (a real engine sample)."""
    import openai

    with openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}], max_tokens=4)


class Scripted:
    """One real model call per episode, then an answer fixed by the task's domain: 'easy' always right, 'hard' never,
    'coin' right on every second episode of each task."""

    def __init__(self):
        self.lock, self.seen = threading.Lock(), {}

    def __call__(self, task, session):
        one_call(session)
        with self.lock:
            n = self.seen[task.task_id] = self.seen.get(task.task_id, 0) + 1
        right = task.domain == "easy" or (task.domain == "coin" and n % 2 == 0)
        return EpisodeResult(output=task.answer if right else "wrong")
