"""What the demo's black-box agent services share: a JSON request handler and the ready line their launcher reads.

An agent service answers ``POST / {"task", "base_url", "api_key"}`` with ``{"output"}`` (agents/runner.py HttpAgent);
:func:`serve` prints ``FORGE_READY port=N`` once it listens (rollout/launch.py waits for that line).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_http = None  # the one HTTP client every session's openai client sends through (see _shared_http_client)
_http_lock = threading.Lock()


def _shared_http_client():
    """One ``openai.DefaultHttpxClient`` for the whole service: its connection pool is thread-safe, and a client per
    session would build a TLS context per episode (the system's CA certificates loaded each time: most of an agent
    service's CPU in the demo, though it talks plain HTTP)."""
    global _http
    with _http_lock:
        if _http is None:
            import openai

            _http = openai.DefaultHttpxClient()
        return _http


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler answering JSON, quiet (the demo's output stays readable)."""

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass

    def body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def answer_with(self, base_url: str, api_key: str, solve) -> None:
        """Answer ``{"output": solve(client)}`` with an ``openai.OpenAI`` client of the session (502 when the model
        call fails). The session's clients share the service's connection pool (not closed here)."""
        import openai

        client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=120.0, max_retries=0,
                               http_client=_shared_http_client())
        try:
            output = solve(client)
        except openai.OpenAIError as exc:
            return self._answer(502, {"error": str(exc)})
        return self._answer(200, {"output": output})


def serve(handler: type, host: str, port: int) -> None:
    """Serve ``handler`` on ``host:port`` (0: a free port) until killed."""
    server = ThreadingHTTPServer((host, port), handler)
    print(f"FORGE_READY port={server.server_address[1]}", flush=True)
    server.serve_forever()
