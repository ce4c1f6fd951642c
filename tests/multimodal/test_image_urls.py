"""Image URLs through the gateway (multimodal/fetch.py): fetched only under the gateway's policy, recorded as the same
normalised image an inline data URL gives; a URL sent again in a session's history keeps the image the model saw,
one in a new message is fetched anew; every guard refuses with a 400 that says why
(real HTTP server on loopback, real engine and gateway)."""

from __future__ import annotations

import base64
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import numpy as np
import openai
import pytest

from tests.middleware.test_gateway import end, episode, http, new_session
from tests.multimodal.test_vision_tree import png

RNG = np.random.default_rng(11)
PICTURE = png(RNG, 30, 50)
OTHER = png(RNG, 20, 20)


class _Images(BaseHTTPRequestHandler):
    hits: dict = {}
    lock = threading.Lock()
    serving = 0  # "/wait/..." requests being served now, and the most at once
    most = 0

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        type(self).hits[self.path] = type(self).hits.get(self.path, 0) + 1
        if self.path.startswith("/wait/"):  # a picture that takes a while: counts how many are served at once
            cls = type(self)
            with cls.lock:
                cls.serving += 1
                cls.most = max(cls.most, cls.serving)
            time.sleep(0.4)
            with cls.lock:
                cls.serving -= 1
            return self._send(200, {"Content-Type": "image/png"}, OTHER if self.path.endswith("b") else PICTURE)
        routes = {
            "/a.png": (200, {"Content-Type": "image/png"}, PICTURE),
            "/b.png": (200, {"Content-Type": "image/png; charset=binary"}, OTHER),
            "/redirect": (302, {"Location": "/a.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/away": (302, {"Location": "http://images.example.invalid/a.png"}, b""),
            "/text": (200, {"Content-Type": "text/html"}, b"<html>not an image</html>"),
            "/big": (200, {"Content-Type": "image/png", "Content-Length": str(64 << 20)}, b""),
        }
        if self.path.startswith("/screen"):  # a "latest screenshot" URL: another picture on every fetch
            return self._send(200, {"Content-Type": "image/png"}, (PICTURE, OTHER)[(type(self).hits[self.path] - 1) % 2])
        if self.path == "/slow":
            time.sleep(3)
        self._send(*routes.get(self.path, (404, {"Content-Type": "text/plain"}, b"no such image")))

    def _send(self, status, headers, body):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)


@pytest.fixture(scope="module")
def image_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("screens")
    (d / "shot.png").write_bytes(PICTURE)
    outside = tmp_path_factory.mktemp("elsewhere") / "secret.png"
    outside.write_bytes(OTHER)
    os.symlink(outside, d / "link.png")  # a link out of the directory
    return d, outside


@pytest.fixture(scope="module")
def served(tmp_path_factory, image_dir):
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.launch import start_engine, start_gateway

    vl = build_tiny_model(str(tmp_path_factory.mktemp("vl_urls")), "qwen3_vl", images=True, seed=2)
    engine = start_engine(vl, in_process=True)
    gw = start_gateway(vl, [engine.url], in_process=True, config={
        "image_url_hosts": ("127.0.0.1",), "image_url_private": True, "image_dir": str(image_dir[0]),
        "image_url_timeout_s": 1.0})
    plain = start_gateway(vl, [engine.url], in_process=True)  # the default policy: no URL is fetched
    yield gw, plain
    plain.stop()
    gw.stop()
    engine.stop()


# (*) The first completion is greedy where a test needs the next call to continue its segment: a sampled image token
# ends a completion and (by design) starts a new segment, since its text is not the token; at temperature 1 the tiny
# model samples it about once in 200 calls.


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(gw, messages):
    s = new_session(gw)
    status, body = http(s["base_url"] + "/chat/completions", {"model": "tiny", "messages": messages,
                                                             "max_tokens": 4, "temperature": 1.0})
    return s, status, body


def test_a_fetched_image_is_recorded_as_the_inline_one(served, image_server, image_dir):
    """An http URL (directly and through a redirect), Anthropic's url source, the Responses API's input_image URL
    and a file:// URL under --image-dir: the same prompt tokens and normalised image as the picture sent inline."""
    gw, _ = served
    inline = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
    sessions = []
    for url in (inline, f"{image_server}/a.png", f"{image_server}/redirect", (image_dir[0] / "shot.png").as_uri()):
        s, status, body = _chat(gw, [{"role": "user", "content": [{"type": "text", "text": "what?"}, _part(url)]}])
        assert status == 200, body
        sessions.append(s)
    anth = new_session(gw)
    anthropic.Anthropic(base_url=anth["anthropic_base_url"], api_key="ignored", max_retries=0).messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what?"}, {"type": "image", "source": {"type": "url",
                                                                         "url": f"{image_server}/a.png"}}]}])
    resp = new_session(gw)
    openai.OpenAI(base_url=resp["base_url"], api_key="ignored", max_retries=0, timeout=60).responses.create(
        model="tiny", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": f"{image_server}/a.png"}]}])
    sessions += [anth, resp]
    counted = []
    for url in (f"{image_server}/a.png", inline):  # count_tokens too (its image fetched off the event loop)
        counted.append(http(anth["anthropic_base_url"] + "/v1/messages/count_tokens", {
            "model": "tiny", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what?"},
                {"type": "image", "source": {"type": "url", "url": url} if url.startswith("http") else
                 {"type": "base64", "media_type": "image/png", "data": inline.split(",", 1)[1]}}]}]},
            headers={"x-api-key": anth["api_key"]}))
    assert counted[0] == counted[1] and counted[0][0] == 200 and counted[0][1]["input_tokens"] > 16
    prompts = []
    for s in sessions:
        _, summary = http(f"{gw.url}/forge/sessions/{s['session_id']}", method="GET")
        prompts.append(summary["calls"][0]["prompt_ids"])
        assert end(gw, s)[0] == 200
    assert all(p == prompts[0] for p in prompts)
    images = [episode(gw, s).segments[0].images for s in sessions]
    assert images[0] and all(x == images[0] for x in images)


def test_a_url_in_the_history_is_fetched_once_and_the_segment_continues(served, image_server):
    gw, _ = served
    _Images.hits.pop("/b.png", None)
    s = new_session(gw)
    c = openai.OpenAI(base_url=s["base_url"], api_key="ignored", max_retries=0, timeout=60)
    history = [{"role": "user", "content": [{"type": "text", "text": "look"}, _part(f"{image_server}/b.png")]}]
    first = c.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0.0)  # (*)
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "and now?"}]
    c.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=1.0)
    assert _Images.hits["/b.png"] == 1
    _, summary = http(f"{gw.url}/forge/sessions/{s['session_id']}", method="GET")
    assert [call["segment_index"] for call in summary["calls"]] == [0, 0]  # the second call continued the first
    assert end(gw, s)[0] == 200 and len(episode(gw, s).segments) == 1


def test_a_url_in_a_new_message_is_fetched_again(served, image_server):
    """A "latest screenshot" URL serving another picture on every fetch: sent again in the history it stays the
    image the model saw (not fetched); sent in the new message it is fetched again, and the model sees the new
    picture; the segment continues and records both, in order. Another session fetches it for itself."""
    from forge_megatron.multimodal.images import ImageProcessor

    gw, _ = served
    url = f"{image_server}/screen"
    s = new_session(gw)
    c = openai.OpenAI(base_url=s["base_url"], api_key="ignored", max_retries=0, timeout=60)
    history = [{"role": "user", "content": [{"type": "text", "text": "look"}, _part(url)]}]
    first = c.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0.0)  # (*)
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": [{"type": "text", "text": "and now?"}, _part(url)]}]
    c.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=1.0)
    assert _Images.hits["/screen"] == 2  # the first call's, and the new message's (not the history's)
    _, summary = http(f"{gw.url}/forge/sessions/{s['session_id']}", method="GET")
    assert [call["segment_index"] for call in summary["calls"]] == [0, 0]  # the history's image is the one seen
    assert end(gw, s)[0] == 200
    (segment,) = episode(gw, s).segments
    processor = ImageProcessor(gw.gateway.config.model_path)
    assert segment.images == [processor.normalize(PICTURE, "x"), processor.normalize(OTHER, "x")]
    _chat(gw, [{"role": "user", "content": [_part(url)]}])
    assert _Images.hits["/screen"] == 3  # another session's call: its own fetch


def test_a_calls_new_urls_are_fetched_at_once(served, image_server):
    """Three new screenshots by URL in one call: fetched side by side (the server serves them at once), recorded
    in prompt order (the first and third are the same picture); a failing one among them is the call's 400."""
    gw, _ = served
    urls = [f"{image_server}/wait/{k}" for k in ("a", "b", "c")]
    s, status, body = _chat(gw, [{"role": "user", "content": [{"type": "text", "text": "compare"},
                                                              *(_part(u) for u in urls)]}])
    assert status == 200, body
    assert _Images.most >= 2
    assert end(gw, s)[0] == 200
    first, second, third = episode(gw, s).segments[0].images
    assert first == third != second
    _, status, body = _chat(gw, [{"role": "user", "content": [_part(f"{image_server}/wait/d"),
                                                              _part(f"{image_server}/missing2")]}])
    assert status == 400 and "HTTP 404" in body["error"]["message"], body


@pytest.mark.parametrize("path,words", [
    ("/text", "text/html, not an image"),
    ("/missing", "HTTP 404"),
    ("/big", "over 32 MiB"),
    ("/loop", "more than 3 redirects"),
    ("/away", "'images.example.invalid' is not among the gateway's --image-url-hosts"),
    ("/slow", "took over 1 s"),
])
def test_unusable_urls_are_400_saying_why(served, image_server, path, words):
    gw, _ = served
    _, status, body = _chat(gw, [{"role": "user", "content": [_part(image_server + path)]}])
    assert status == 400 and words in body["error"]["message"], body
    assert body["error"]["param"] == "messages[0].content"


def test_files_outside_the_image_dir_and_the_default_policy_are_refused(served, image_server, image_dir):
    gw, plain = served
    for url, words in (((image_dir[0] / "link.png").as_uri(), "is not under the gateway's --image-dir"),
                       (image_dir[1].as_uri(), "is not under the gateway's --image-dir"),
                       ("file://otherhost/x.png", "must name a file on the gateway's host"),
                       ((image_dir[0] / "none.png").as_uri(), "cannot read")):
        _, status, body = _chat(gw, [{"role": "user", "content": [_part(url)]}])
        assert status == 400 and words in body["error"]["message"], (url, body)
    _, status, body = _chat(plain, [{"role": "user", "content": [_part(f"{image_server}/a.png")]}])
    assert status == 400 and "fetches no image URLs" in body["error"]["message"], body
    assert "data:image/...;base64" in body["error"]["message"]

    def counters():
        import urllib.request

        with urllib.request.urlopen(gw.url + "/metrics", timeout=10) as resp:
            lines = [line.rsplit(" ", 1) for line in resp.read().decode().splitlines() if not line.startswith("#")]
        scraped = {k: float(v) for k, v in lines}
        return scraped["forge_gateway_images_fetched_total"], scraped["forge_gateway_image_fetch_failures_total"]

    # the gateway's counters: a new message's URL fetched; a 404 and a web page refused
    before = counters()
    assert _chat(gw, [{"role": "user", "content": [_part(f"{image_server}/a.png?counted")]}])[1] == 400
    assert _chat(gw, [{"role": "user", "content": [_part(f"{image_server}/a.png#x"), _part(image_server + "/text")]}]
                 )[1] == 400
    fetched, failed = counters()
    assert (fetched - before[0], failed - before[1]) == (1, 2)


def test_private_addresses_need_their_own_flag(image_server):
    """A host allowed by name that resolves to a loopback (or private) address is still refused unless the policy
    takes private addresses; globs match host names."""
    from forge_megatron.multimodal.fetch import ImageURL, UrlPolicy, fetch_image
    from forge_megatron.multimodal.images import ImageError

    url = ImageURL(f"{image_server}/a.png", "part")
    with pytest.raises(ImageError, match="resolves to 127.0.0.1, a private, loopback"):
        fetch_image(url, UrlPolicy(hosts=("127.0.0.*",)))
    assert fetch_image(url, UrlPolicy(hosts=("127.0.0.*",), private=True)) == PICTURE
    with pytest.raises(ImageError, match="not among"):
        fetch_image(url, UrlPolicy(hosts=("*.example.com",), private=True))
    with pytest.raises(ImageError, match="must be http"):
        fetch_image(ImageURL("ftp://127.0.0.1/a.png", "part"), UrlPolicy(hosts=("*",), private=True))


def test_gateway_flags_make_the_policy(tmp_path):
    from forge_megatron.middleware.gateway import build_parser, session_options

    args = build_parser().parse_args(["--model-path", str(tmp_path), "--engines", "http://127.0.0.1:1",
                                      "--image-url-hosts", "a.example.com, *.cdn.example.com",
                                      "--image-url-private", "--image-dir", str(tmp_path),
                                      "--image-url-timeout-s", "3"])
    opts = session_options(args)
    assert opts["image_url_hosts"] == ("a.example.com", "*.cdn.example.com")
    from forge_megatron.middleware.gateway import GatewayConfig

    cfg = GatewayConfig(model_path=str(tmp_path), engine_urls=["http://127.0.0.1:1"], **opts)
    policy = cfg.url_policy()
    assert policy.hosts == ("a.example.com", "*.cdn.example.com") and policy.private and policy.timeout_s == 3
    assert policy.directory == str(tmp_path) and policy.enabled
    with pytest.raises(ValueError, match="not a directory"):
        GatewayConfig(model_path=str(tmp_path), engine_urls=["http://127.0.0.1:1"], image_dir=str(tmp_path / "no"))
