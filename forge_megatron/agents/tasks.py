"""Task files: one JSON object per line, each a task for an agent, labelled with a domain.

    {"task_id": "add-17", "domain": "math", "prompt": "12+7", "answer": "19", "metadata": {...}}

``task_id`` and ``prompt`` are required; ``domain`` defaults to "default"; ``answer`` (a string) is what the
default verifier compares the agent's final output with; ``metadata`` travels with the group to the data pool
(reward functions see it). Errors name the file, the line and the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


class TaskError(ValueError):
    """A task record that does not match the format; the message names file, line and field."""


@dataclass
class Task:
    task_id: str
    prompt: str
    domain: str = "default"
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.task_id, str) or not self.task_id:
            raise TaskError(f"task_id must be a non-empty string, got {self.task_id!r}")
        if not isinstance(self.prompt, str):
            raise TaskError(f"task {self.task_id}: prompt must be a string")
        if not isinstance(self.domain, str) or not self.domain:
            raise TaskError(f"task {self.task_id}: domain must be a non-empty string")
        if self.answer is not None and not isinstance(self.answer, str):
            raise TaskError(f"task {self.task_id}: answer must be a string or absent")
        if not isinstance(self.metadata, dict):
            raise TaskError(f"task {self.task_id}: metadata must be an object")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_tasks(path: str) -> list[Task]:
    """Read a tasks JSONL file (blank lines skipped); task ids must be unique."""
    from forge_megatron.utils.jsonl import read_records

    tasks, seen = [], set()
    for where, record in read_records(path, TaskError):
        if not isinstance(record, dict):
            raise TaskError(f"{where}: a task must be a JSON object")
        unknown = set(record) - {"task_id", "prompt", "domain", "answer", "metadata"}
        if unknown:
            raise TaskError(f"{where}: unknown field(s) {sorted(unknown)}")
        for required in ("task_id", "prompt"):
            if required not in record:
                raise TaskError(f"{where}: missing field {required!r}")
        try:
            task = Task(**record)
        except TaskError as exc:
            raise TaskError(f"{where}: {exc}") from None
        if task.task_id in seen:
            raise TaskError(f"{where}: duplicate task_id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise TaskError(f"{path}: no tasks")
    return tasks


def write_tasks(path: str, tasks: list[Task]) -> None:
    with open(path, "w") as f:
        for task in tasks:
            f.write(json.dumps(task.to_dict()) + "\n")


def by_domain(tasks: list[Task]) -> dict[str, list[Task]]:
    pools: dict[str, list[Task]] = {}
    for task in tasks:
        pools.setdefault(task.domain, []).append(task)
    return pools
