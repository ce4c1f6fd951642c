"""What the remote verifiers share (the LLM judge, judge.py; the reward model, reward_model.py): one JSON POST with
the failures sorted into retryable and final, the checks of a base URL and of their options, and a bounded cache of
scores."""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request
from collections import OrderedDict


class Retryable(Exception):
    """A failure worth another attempt: the endpoint unreachable, timed out, 5xx, or an answer that is not JSON."""


def check_base_url(url: str, what: str) -> str:
    """``url`` without a trailing slash; ValueError unless it is http(s)://host[:port][/path]."""
    url = url.rstrip("/")
    if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
        raise ValueError(f"{what} must be http(s)://host[:port][/path], got {url!r}")
    return url


def options_checked(args, prefix: str) -> str | None:
    """The API key of ``args``' ``--{prefix}-api-key-env`` (None without one); ValueError when that variable is unset
    or when ``--{prefix}-attempts`` requests of ``--{prefix}-timeout-s`` each (and the back-offs between them) would
    not fit the time the runner gives a verifier."""
    from forge_megatron.agents.runner import VERIFIER_TIMEOUT_S

    field = prefix.replace("-", "_")
    env, attempts, timeout_s = (getattr(args, f"{field}_{k}") for k in ("api_key_env", "attempts", "timeout_s"))
    if attempts * (timeout_s + 1.0) > VERIFIER_TIMEOUT_S:
        raise ValueError(f"--{prefix}-attempts {attempts} x --{prefix}-timeout-s {timeout_s:g} (plus back-offs) "
                         f"exceed the {VERIFIER_TIMEOUT_S:g} s the runner gives a verifier: lower either")
    if not env:
        return None
    if not os.environ.get(env):
        raise ValueError(f"--{prefix}-api-key-env {env}: the variable is not set")
    return os.environ[env]


def post_json(url: str, body: dict, timeout_s: float, api_key: str | None, refused: type[Exception],
              who: str) -> object:
    """POST ``body`` as JSON to ``url`` and decode the answer. Raises :class:`Retryable` for connection errors,
    timeouts, 5xx and answers that are not JSON; ``refused`` (naming ``who`` and the server's message) for 4xx,
    which another attempt would not change (a wrong model name, a bad key, a malformed request)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        if exc.code >= 500:
            raise Retryable(f"HTTP {exc.code}: {detail}") from None
        raise refused(f"{who} {url} refused the request: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
        raise Retryable(f"cannot reach it ({getattr(exc, 'reason', exc)})") from None
    except json.JSONDecodeError:
        raise Retryable("its answer is not JSON") from None


class ScoreCache:
    """The scores of the last ``size`` keys (least recently used dropped first); thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self._scores: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key) -> float | None:
        with self._lock:
            if key not in self._scores:
                return None
            self._scores.move_to_end(key)
            return self._scores[key]

    def put(self, key, score: float) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._scores[key] = score
            while len(self._scores) > self.size:
                self._scores.popitem(last=False)

    def __len__(self) -> int:
        return len(self._scores)
