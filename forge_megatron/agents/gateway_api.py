"""Client of forge-gateway's session API (``/forge/*``), used by the rollout driver and white-box agents.

    POST /forge/groups {task_id, size, domain, metadata} -> {group_id}
    POST /forge/sessions {group_id, metadata}             -> {session_id, api_key, base_url}
    POST /forge/sessions {eval: true, task_id, domain, metadata, sampling}   (evaluation: never trained on)
    POST /forge/sessions/{id}/reward {reward, terms}
    POST /forge/sessions/{id}/end {status}

Plain blocking HTTP (urllib) so it can be used from worker threads; the admin token, when set, goes in the
``X-Forge-Admin-Token`` header. A non-2xx answer raises :class:`GatewayError` with the gateway's message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass


class GatewayError(RuntimeError):
    """The gateway answered with an error status (``status``) or could not be reached (status 0)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"gateway error {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class AgentSession:
    """What an agent needs: an OpenAI base URL and an API key bound to one episode."""

    session_id: str
    api_key: str
    base_url: str
    group_id: str


class GatewayClient:
    def __init__(self, base_url: str, admin_token: str | None = None, timeout_s: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.admin_token = admin_token
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.admin_token:
            req.add_header("X-Forge-Admin-Token", self.admin_token)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise GatewayError(exc.code, _error_message(exc.read())) from None
        except (urllib.error.URLError, OSError) as exc:
            raise GatewayError(0, f"{self.base_url} unreachable: {exc}") from None

    def create_group(self, task_id: str, size: int, domain: str = "default", metadata: dict | None = None) -> str:
        body = {"task_id": task_id, "size": size, "domain": domain, "metadata": metadata or {}}
        return self.request("POST", "/forge/groups", body)["group_id"]

    def open_session(self, group_id: str, metadata: dict | None = None) -> AgentSession:
        out = self.request("POST", "/forge/sessions", {"group_id": group_id, "metadata": metadata or {}})
        return AgentSession(out["session_id"], out["api_key"], out["base_url"], group_id)

    def open_eval_session(self, task_id: str, domain: str = "default", metadata: dict | None = None,
                          sampling: dict | None = None) -> AgentSession:
        """A session whose episode is served and recorded like a training one but never reaches the data pool;
        ``sampling`` ({temperature, top_p, top_k}) replaces the agent's values on every call."""
        body = {"eval": True, "task_id": task_id, "domain": domain, "metadata": metadata or {}}
        if sampling:
            body["sampling"] = sampling
        out = self.request("POST", "/forge/sessions", body)
        return AgentSession(out["session_id"], out["api_key"], out["base_url"], "")

    def set_reward(self, session_id: str, reward: float | None, terms: dict[str, float] | None = None,
                   call_rewards: list[dict] | None = None) -> None:
        """The episode's reward and terms; ``call_rewards``: rewards of single calls, ``{"call": index, "reward":
        r}`` items (docs/middleware.md, "Rewards of single calls")."""
        body = {"reward": reward, "terms": terms or {}}
        if call_rewards:
            body["call_rewards"] = call_rewards
        self.request("POST", f"/forge/sessions/{session_id}/reward", body)

    def session(self, session_id: str) -> dict:
        """``GET /forge/sessions/{id}``: the session's calls as recorded (prompt and completion ids, logprobs, ...)."""
        return self.request("GET", f"/forge/sessions/{session_id}")

    def end_session(self, session_id: str, status: str = "finished") -> dict:
        """End a session; its episode goes to the pool, after a served distillation teacher scored it when the gateway
        has one (a prefill of the whole episode: the answer may take longer than other calls, hence at least 600 s)."""
        return self.request("POST", f"/forge/sessions/{session_id}/end", {"status": status},
                            timeout_s=max(self.timeout_s, 600.0))

    def publish_eval(self, result: dict) -> int:
        """Hand an evaluation result to the gateway, where the trainer picks it up for its metrics."""
        return self.request("POST", "/forge/evals", result)["id"]

    def evals(self, after: int = 0) -> list[dict]:
        """Evaluation results published after id ``after``, oldest first."""
        return self.request("GET", f"/forge/evals?after={int(after)}")["evals"]

    def state(self) -> dict:
        return self.request("GET", "/forge/admin/state")

    def pause(self, drain_timeout_s: float = 0.0) -> dict:
        return self.request("POST", "/forge/admin/pause", {"drain_timeout_s": drain_timeout_s})

    def resume(self, policy_version: int | None = None) -> dict:
        return self.request("POST", "/forge/admin/resume", {"policy_version": policy_version})


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        return body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500]
