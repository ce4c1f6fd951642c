"""JSON-lines input files (tasks, chats, preference pairs): one JSON value per line, blank lines skipped."""

from __future__ import annotations

import json
from typing import Iterator


def read_records(path: str, error: type[Exception] = ValueError) -> Iterator[tuple[str, object]]:
    """``(where, value)`` for each non-blank line of ``path``, ``where`` being ``"path:line"``; a line that is not
    JSON raises ``error`` naming it."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: not valid JSON ({exc.msg})") from None
