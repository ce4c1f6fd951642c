"""Anthropic Messages API on the gateway: ``POST /v1/messages`` for agents written against Anthropic's SDK.

Agents built on the ``anthropic`` client (and scaffolds that only speak this API) run against the gateway with
``base_url = <gateway>/s/<session key>`` (``anthropic_base_url`` in the session reply; the key may also come as
``x-api-key`` or a bearer token). Each request is translated into the gateway's OpenAI form and served by the same
path (chat template, token-in/token-out engine call, tool parser, recording, pause / partial rollout), so an episode
may mix both APIs and a conversation continues its segment exactly as through ``/v1/chat/completions``.

Request -> OpenAI form:
  system (string or text blocks)          -> a leading system message
  user text / tool_result blocks          -> user message / one tool message per result (tool_call_id = tool_use_id)
  user image blocks (base64 source; a url source only under the gateway's image URL policy, multimodal/fetch.py),
  images in tool_result content           -> OpenAI image parts (vision-language models: see gateway.py)
  assistant text / tool_use blocks        -> assistant content + tool_calls (arguments = JSON of ``input``, as the
                                             gateway's parser writes them, so the re-rendered turn is the sampled one)
  assistant thinking blocks               -> reasoning_content (the chat template renders it back, so a turn the
                                             gateway answered with a thinking block continues its segment);
                                             redacted_thinking blocks are dropped
  tools [{name, description, input_schema}] -> function tools; tool_choice auto | any | tool | none
  max_tokens (required), stop_sequences, temperature, top_p, top_k, stream; extension: ignore_eos
  documents and other block types are a 400 naming the block.
Reply: content blocks (a thinking block when the gateway has a reasoning parser and the model wrote a reasoning
block, then text, then tool_use {id, name, input}), stop_reason end_turn | tool_use | max_tokens | stop_sequence
(with stop_sequence), usage {input_tokens, output_tokens}. Thinking blocks carry an empty ``signature`` (nothing
verifies it here). Streaming follows Anthropic's events: message_start, content_block_start / content_block_delta
(thinking_delta and signature_delta, text_delta, input_json_delta) / content_block_stop, message_delta
(stop_reason, usage), message_stop; an error after the stream started is an ``error`` event.
Errors: ``{"type": "error", "error": {"type", "message"}}`` with the gateway's status codes.
``POST /v1/messages/count_tokens`` answers ``{input_tokens}``: the prompt the same request would send (nothing is
recorded).
"""

from __future__ import annotations

import asyncio
import json
import os

from aiohttp import web

from forge_megatron.middleware.gateway import (
    GATEWAY, IMAGE_KEY, ApiError, ChatRequest, Gateway, StreamProgress, _body, adopt_streamed_calls,
    parse_chat_request, serve_call,
)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "invalid_request_error", 413: "request_too_large", 502: "api_error", 503: "overloaded_error"}


def error_body(exc: ApiError) -> dict:
    kind = _ERROR_TYPES.get(exc.status, "api_error")
    message = exc.message if exc.param is None else f"{exc.param}: {exc.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _text_of(blocks, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(where, f"{where} must be a string or an array of text blocks")
    parts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}[{i}]", f"{where}[{i}] must be a text block {{type: 'text', text: str}}")
        parts.append(b["text"])
    return "".join(parts)


def _image_part(block: dict, where: str) -> dict:
    """An Anthropic image block (``source: {type: base64, media_type, data}``, or ``{type: url, url}``, which the
    gateway fetches only under its image URL policy) as an OpenAI image part."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if not isinstance(source, dict) or source.get("type") != "base64" or not isinstance(source.get("data"), str):
        raise _bad(f"{where}.source", f"{where}.source must be {{type: 'base64', media_type, data}} or "
                                      "{type: 'url', url}")
    media = source.get("media_type") or "image/png"
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source['data']}"}}


def _parts_of(blocks, where: str):
    """A tool result's content: a string, or text and image blocks (OpenAI content parts when an image is among
    them, else their text joined)."""
    if isinstance(blocks, str) or not isinstance(blocks, list) or \
            not any(isinstance(b, dict) and b.get("type") == "image" for b in blocks):
        return _text_of(blocks, where)
    parts = []
    for i, b in enumerate(blocks):
        if isinstance(b, dict) and b.get("type") == "image":
            parts.append(_image_part(b, f"{where}[{i}]"))
        else:
            parts.append({"type": "text", "text": _text_of([b], f"{where}[{i}]")})
    return parts


def _joined(parts: list[dict]):
    """OpenAI content of a user message: its parts when it has an image, else their text."""
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _tool_call(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not block["name"]:
        raise _bad(where, f"{where} (tool_use) needs string id and name")
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{where}.input", f"{where}.input must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "messages must be a non-empty array")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role", f"{where}.role must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content", f"{where}.content must be a string or an array of content blocks")
        texts, calls, thinking = [], [], []  # texts: OpenAI content parts
        for j, b in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and m["role"] == "user":
                texts.append(_image_part(b, at))
            elif kind == "thinking" and m["role"] == "assistant":
                if not isinstance(b.get("thinking"), str):
                    raise _bad(f"{at}.thinking", f"{at}.thinking must be a string")
                thinking.append(b["thinking"])
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(_tool_call(b, at))
            elif kind == "tool_result" and m["role"] == "user":
                if texts:  # text before a result: keep the order
                    out.append({"role": "user", "content": _joined(texts)})
                    texts = []
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(f"{at}.tool_use_id", f"{at}.tool_use_id must be a string")
                result = _parts_of(b.get("content", ""), f"{at}.content")
                if b.get("is_error"):
                    result = f"Error: {result}" if isinstance(result, str) else \
                        [{"type": "text", "text": "Error: "}] + result
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            else:
                raise _bad(at, f"{at}: block type {kind!r} is not supported in a {m['role']} message (text, "
                               "tool_use and thinking for the assistant; text, image and tool_result for the user)")
        if m["role"] == "assistant":
            # as the gateway's parser returns them: content stripped or None next to tool calls
            text = "".join(p["text"] for p in texts)
            out.append({"role": "assistant", "content": (text.strip() or None) if calls else text,
                        **({"reasoning_content": "".join(thinking)} if thinking else {}),
                        **({"tool_calls": calls} if calls else {})})
        elif texts:
            out.append({"role": "user", "content": _joined(texts)})
    return out


def _tools(body: dict):
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be an array of {name, description, input_schema}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools[{i}]", f"tools[{i}] needs a name")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}].type", f"tools[{i}]: server tools ({t['type']!r}) are not supported")
        fn = {"name": t["name"]}  # OpenAI's key order: the template renders the tools as JSON
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict):
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise _bad("tool_choice", "tool_choice must be {type: 'auto' | 'any' | 'tool' (with name) | 'none'}")
    return mapped


def parse_messages_request(body: dict, default_max_tokens: int) -> ChatRequest:
    """Validate an Anthropic Messages body and return the gateway's ChatRequest for it (400s name the field)."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad("max_tokens", f"max_tokens is required: an integer >= 1, got {max_tokens!r}")
    stop = body.get("stop_sequences")
    if stop is not None and not isinstance(stop, list):
        raise _bad("stop_sequences", "stop_sequences must be an array of strings")
    openai_body = {"messages": _messages(body), "max_tokens": max_tokens, "stream": body.get("stream", False)}
    tools = _tools(body)
    if tools:
        openai_body["tools"] = tools
        openai_body["tool_choice"] = _tool_choice(body)
    elif body.get("tool_choice") not in (None, {"type": "auto"}, {"type": "none"}):
        raise _bad("tool_choice", "tool_choice 'any' or a named tool needs a non-empty tools array")
    for name in ("temperature", "top_p", "top_k", "ignore_eos"):  # ignore_eos: the SGLang/vLLM extension
        if body.get(name) is not None:
            openai_body[name] = body[name]
    if stop:
        openai_body["stop"] = stop
    return parse_chat_request(openai_body, default_max_tokens)


def stop_reason(finish: str, result) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) from the gateway's OpenAI finish reason and the engine result."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = (result.finish_reason or {}).get("matched")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def content_blocks(message: dict) -> list[dict]:
    blocks = []
    if message.get("reasoning_content") is not None:
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for tc in calls:
        blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                       "input": json.loads(tc["function"]["arguments"])})
    return blocks


def _message_id() -> str:
    return f"msg_{os.urandom(12).hex()}"


def _session_key(request: web.Request) -> str | None:
    key = request.match_info.get("key") or request.headers.get("x-api-key")
    if key is None:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.startswith("Bearer ") else None
    return key


async def messages(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    try:
        sess = gw.session_for_key(_session_key(request))
        req = parse_messages_request(await _body(request), gw.config.default_max_tokens)
        req.response_id = _message_id()
        served = await serve_call(gw, sess, req, lambda sess, req, call: _stream(request, gw, sess, req, call))
    except ApiError as exc:
        return web.json_response(error_body(exc), status=exc.status)
    if not isinstance(served, tuple):
        return served
    call, result, message, finish = served
    reason, sequence = stop_reason(finish, result)
    usage = gw.usage(call.turn)
    return web.json_response({
        "id": req.response_id, "type": "message", "role": "assistant", "model": gw.model_name,
        "content": content_blocks(message), "stop_reason": reason, "stop_sequence": sequence,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    })


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt tokens a Messages request would send to the engine (rendered
    with the chat template, the tools included; a continuation counts the whole rendered prompt). Records nothing."""
    gw: Gateway = request.app[GATEWAY]
    try:
        sess = gw.session_for_key(_session_key(request))
        body = await _body(request)
        req = parse_messages_request({**body, "max_tokens": body.get("max_tokens") or 1}, gw.config.default_max_tokens)
        images = None
        if gw.images is not None and any(IMAGE_KEY in m for m in req.messages):
            # images decoded (or fetched: multimodal/fetch.py) on the image threads, off the event loop, as a call's
            req, images = await asyncio.get_running_loop().run_in_executor(gw.image_worker, gw.with_images, req, sess)
        _, prompt_ids, _, _ = gw.prompt_of(sess, req, images)
    except ApiError as exc:
        return web.json_response(error_body(exc), status=exc.status)
    return web.json_response({"input_tokens": len(prompt_ids) + len(gw.renderer.encode(gw.forced_text(req)))})


def _event(kind: str, body: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n".encode()


async def _stream(request, gw: Gateway, sess, req: ChatRequest, call) -> web.StreamResponse:
    """Anthropic's event stream for one call: thinking and text deltas as the engine produces them (text held back
    at the tool-call marker and stop sequences, like the OpenAI stream), each tool_use block whole as soon as its
    call's block closes (formats without closing markers: at the end)."""
    progress = StreamProgress(gw, req, call)
    resp = None
    block = {"index": -1, "type": None}  # the open content block

    async def start() -> None:
        nonlocal resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(_event("message_start", {"message": {
            "id": req.response_id, "type": "message", "role": "assistant", "model": gw.model_name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(call.turn.prompt_ids), "output_tokens": 0}}}))

    async def close_block() -> None:
        if block["type"] == "thinking":
            await resp.write(_event("content_block_delta", {"index": block["index"], "delta": {
                "type": "signature_delta", "signature": ""}}))
        if block["type"] is not None:
            await resp.write(_event("content_block_stop", {"index": block["index"]}))
        block["type"] = None

    async def delta(kind: str, text: str) -> None:
        """Append ``text`` to the open block of ``kind`` ("thinking" or "text"), opening one first."""
        if block["type"] != kind:
            await close_block()
            block["index"] += 1
            block["type"] = kind
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            await resp.write(_event("content_block_start", {"index": block["index"], "content_block": empty}))
        if text:
            field = "thinking" if kind == "thinking" else "text"
            await resp.write(_event("content_block_delta", {"index": block["index"], "delta": {
                "type": f"{field}_delta", field: text}}))

    async def tool_use(tc: dict) -> None:
        await close_block()
        block["index"] += 1
        await resp.write(_event("content_block_start", {"index": block["index"], "content_block": {
            "type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": {}}}))
        await resp.write(_event("content_block_delta", {"index": block["index"], "delta": {
            "type": "input_json_delta", "partial_json": tc["function"]["arguments"]}}))
        await resp.write(_event("content_block_stop", {"index": block["index"]}))

    async def on_partial(result) -> int:
        if resp is None:
            await start()
        thinking, text, calls = progress.step(result)
        if thinking is not None and (thinking or block["index"] < 0):  # a thinking block opens as soon as one starts
            await delta("thinking", thinking)
        if text:
            await delta("text", text)
        for tc in calls:
            await tool_use(tc)
        return progress.sent

    try:
        result = await gw.generate_streamed(sess, call, on_partial)
        message, finish = gw.finish(sess, call, result, req)
    except ApiError as err:
        if resp is None:
            raise
        await resp.write(_event("error", {"error": error_body(err)["error"]}))
        await resp.write_eof()
        return resp
    if resp is None:
        await start()
    calls = adopt_streamed_calls(message, progress.calls)
    blocks = content_blocks(message)
    if blocks and blocks[0]["type"] == "thinking":
        if block["type"] == "thinking" or block["index"] < 0:
            await delta("thinking", blocks[0]["thinking"][progress.reasoning:])
        blocks = blocks[1:]
    if blocks and blocks[0]["type"] == "text":
        rest = blocks[0]["text"][progress.content:]
        if rest or not progress.calls:  # text after calls already sent opens a block of its own
            await delta("text", rest)
        blocks = blocks[1:]
    for tc in calls[len(progress.calls):]:
        await tool_use(tc)
    await close_block()
    reason, sequence = stop_reason(finish, result)
    await resp.write(_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": {"output_tokens": len(call.turn.completion_ids)}}))
    await resp.write(_event("message_stop", {}))
    await resp.write_eof()
    return resp
