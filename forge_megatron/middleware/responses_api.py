"""OpenAI Responses API on the gateway: ``POST /v1/responses`` for agents written against it (Codex CLI, the OpenAI
Agents SDK's default model class, ``client.responses.create``).

Agents use the same ``base_url`` as for chat completions (``<gateway>/s/<session key>/v1``, or the key as a bearer
token). Each request is translated into the gateway's chat form and served by the same path (chat template,
token-in/token-out engine call, tool parser, recording, pause / partial rollout), so an episode may mix APIs and a
conversation whose output items are sent back as input continues its segment exactly as through
``/v1/chat/completions``. Nothing is stored: ``previous_response_id`` is refused (send the whole conversation, as
``store: false`` clients do).

Request -> chat form:
  instructions                               -> a leading system message
  input: a string                            -> one user message
  input items: messages (user / system / developer / assistant; content a string or input_text / output_text
  parts; developer counts as system)         -> messages
  reasoning items (content reasoning_text)   -> reasoning_content of the next assistant message (the chat template
                                                renders it back, so the turn continues its segment)
  function_call items (call_id, name, arguments) -> tool_calls of the assistant message they follow (one turn's
                                                message and calls become one assistant message again)
  function_call_output items (call_id, output) -> tool messages
  tools [{type: function, name, description, parameters}] -> function tools; tool_choice auto | none | required |
  {type: function, name}; max_output_tokens, temperature, top_p, stream; extension: ignore_eos
  other item, part and tool types (images, files, built-in tools) are a 400 naming them.
Reply: a ``response`` object whose ``output`` holds a reasoning item (``content`` [reasoning_text]; with a reasoning
parser and a reasoning block), a message item (output_text) and one function_call item per call; ``status``
completed, or incomplete with ``incomplete_details.reason`` max_output_tokens; usage input/output/total tokens.
Streaming follows the API's events: response.created, response.in_progress, then per item output_item.added,
content_part.added, reasoning_text.delta / output_text.delta / function_call_arguments.delta and their .done
events, content_part.done, output_item.done, and response.completed (or response.incomplete); an error after the
stream started is an ``error`` event. Errors otherwise: ``{"error": {message, type, param, code}}`` (the gateway's
OpenAI error body).
"""

from __future__ import annotations

import json
import os
import time

from aiohttp import web

from forge_megatron.middleware.anthropic_api import _session_key
from forge_megatron.middleware.gateway import (
    GATEWAY, ApiError, ChatRequest, Gateway, StreamProgress, _body, adopt_streamed_calls, parse_chat_request,
    serve_call,
)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def _text(content, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or the text of parts of the given types joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"{where} must be a string or an array of content parts")
    parts = []
    for i, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        text = p.get("refusal" if kind == "refusal" else "text") if isinstance(p, dict) else None
        if kind not in kinds or not isinstance(text, str):
            raise _bad(f"{where}[{i}]", f"{where}[{i}]: part type {kind!r} is not supported here (text parts: "
                                        f"{', '.join(kinds)})")
        parts.append(text)
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("instructions", "instructions must be a string")
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "input must be a string or a non-empty array of items")
    reasoning: list[str] = []  # reasoning items waiting for the assistant message they precede
    in_turn = False  # the last chat message is an assistant message of the turn the items are describing

    def assistant() -> dict:
        """The current turn's assistant message, opened (with any pending reasoning) if there is none."""
        nonlocal in_turn
        if not in_turn:
            out.append({"role": "assistant", "content": None})
            in_turn = True
        if reasoning:
            out[-1]["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role", f"{where}.role must be 'user', 'system', 'developer' or 'assistant'")
            if role == "assistant":
                text = _text(item.get("content"), f"{where}.content", ("output_text", "input_text", "text",
                                                                         "refusal"))
                in_turn = False  # a message item starts the assistant turn its calls and reasoning belong to
                msg = assistant()
                msg["content"] = (msg["content"] or "") + text
            else:
                text = _text(item.get("content"), f"{where}.content", ("input_text", "text"))
                out.append({"role": "system" if role == "developer" else role, "content": text})
                in_turn = False
        elif kind == "reasoning":
            content = item.get("content") or []
            reasoning.append(_text(content, f"{where}.content", ("reasoning_text",)))
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise _bad(f"{where}.{field}", f"{where}.{field} must be a string")
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id", f"{where}.call_id must be a string")
            output = _text(item.get("output"), f"{where}.output", ("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            in_turn = False
        else:
            raise _bad(f"{where}.type", f"{where}: item type {kind!r} is not supported (message, reasoning, "
                                        "function_call, function_call_output)")
    for msg in out:  # as the gateway's parser returns them: content stripped or None next to tool calls
        if msg["role"] == "assistant":
            if msg.get("tool_calls"):
                msg["content"] = (msg["content"] or "").strip() or None
            elif msg["content"] is None:
                msg["content"] = ""
    return out


def _tools(body: dict):
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be an array of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}].type", f"tools[{i}]: tool type {kind!r} is not supported (function tools only)")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools[{i}].name", f"tools[{i}] needs a name")
        fn = {"name": t["name"]}  # chat completions' key order: the template renders the tools as JSON
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or {type: 'function', name}")


def parse_responses_request(body: dict, default_max_tokens: int) -> ChatRequest:
    """Validate a Responses API body and return the gateway's ChatRequest for it (400s name the field)."""
    if body.get("previous_response_id") is not None:
        raise _bad("previous_response_id", "previous_response_id is not supported: the gateway stores no responses; "
                                           "send the whole conversation as input (store: false)")
    text_format = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    if text_format != "text":
        raise _bad("text.format", f"text.format {text_format!r} is not supported (plain text only)")
    chat = {"messages": _messages(body), "stream": body.get("stream", False)}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    elif _tool_choice(body.get("tool_choice")) not in ("auto", "none"):
        raise _bad("tool_choice", "tool_choice 'required' or a named function needs a non-empty tools array")
    for name in ("temperature", "top_p", "ignore_eos"):  # ignore_eos: the SGLang/vLLM extension
        if body.get(name) is not None:
            chat[name] = body[name]
    try:
        return parse_chat_request(chat, default_max_tokens)
    except ApiError as exc:
        if exc.param == "max_tokens":
            raise _bad("max_output_tokens", exc.message.replace("max_tokens", "max_output_tokens")) from exc
        raise


def output_items(message: dict, status: str = "completed") -> list[dict]:
    """The output items of one answer: reasoning, then the message, then one function_call per call."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                   "logprobs": []}]})
    for tc in calls:
        items.append({"type": "function_call", "id": _id("fc"), "call_id": tc["id"], "name": tc["function"]["name"],
                      "arguments": tc["function"]["arguments"], "status": "completed"})
    return items


def _response(gw: Gateway, body: dict, rid: str, created: int, status: str, output: list[dict],
              usage: dict | None, finish: str | None = None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    return {
        "id": rid, "object": "response", "created_at": created, "model": gw.model_name,
        "status": "incomplete" if incomplete else status, "incomplete_details": incomplete, "error": None,
        "output": output, "usage": usage, "instructions": body.get("instructions"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": None, "store": False,
        "text": {"format": {"type": "text"}}, "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled", "metadata": body.get("metadata") or {},
    }


def _usage(prompt: int, completion: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def error_body(exc: ApiError) -> dict:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}


async def responses(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    try:
        sess = gw.session_for_key(_session_key(request))
        body = await _body(request)
        req = parse_responses_request(body, gw.config.default_max_tokens)
        served = await serve_call(gw, sess, req, lambda sess, req, call: _stream(request, gw, sess, req, call, body))
    except ApiError as exc:
        return web.json_response(error_body(exc), status=exc.status)
    if not isinstance(served, tuple):
        return served
    call, result, message, finish = served
    usage = gw.usage(call.turn)
    return web.json_response(_response(gw, body, _id("resp"), int(time.time()), "completed", output_items(message),
                                       _usage(usage["prompt_tokens"], usage["completion_tokens"]), finish))


async def _stream(request, gw: Gateway, sess, req: ChatRequest, call, body: dict) -> web.StreamResponse:
    """The Responses event stream for one call: reasoning and text deltas as the engine produces them (text held back
    at the tool-call marker and stop sequences, like the chat stream), each function_call item whole as soon as its
    call's block closes (formats without closing markers: at the end)."""
    progress = StreamProgress(gw, req, call)
    rid, created = _id("resp"), int(time.time())
    resp = None
    seq = 0
    done: list[dict] = []  # finished output items
    item: dict | None = None  # the open reasoning or message item

    async def event(kind: str, **fields) -> None:
        nonlocal seq
        await resp.write(f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"
                         .encode())
        seq += 1

    async def start() -> None:
        nonlocal resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        shell = _response(gw, body, rid, created, "in_progress", [], None)
        await event("response.created", response=shell)
        await event("response.in_progress", response=shell)

    async def close_item() -> None:
        nonlocal item
        if item is None:
            return
        index, text = len(done), item["text"]
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            await event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text)
            full = {"type": "reasoning", "id": item["id"], "summary": [], "content": [part], "status": "completed"}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            await event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, logprobs=[])
            full = {"type": "message", "id": item["id"], "role": "assistant", "status": "completed", "content": [part]}
        await event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        await event("response.output_item.done", output_index=index, item=full)
        done.append(full)
        item = None

    async def delta(kind: str, text: str) -> None:
        """Append ``text`` to the open item of ``kind`` ("reasoning" or "message"), opening one first."""
        nonlocal item
        index = len(done)
        if item is None or item["type"] != kind:
            await close_item()
            index = len(done)
            item = {"type": kind, "id": _id("rs" if kind == "reasoning" else "msg"), "text": ""}
            if kind == "reasoning":
                shell = {"type": "reasoning", "id": item["id"], "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                shell = {"type": "message", "id": item["id"], "role": "assistant", "status": "in_progress",
                         "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            await event("response.output_item.added", output_index=index, item=shell)
            await event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        if text:
            item["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            await event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    async def function_call(tc: dict) -> None:
        await close_item()
        index = len(done)
        full = {"type": "function_call", "id": _id("fc"), "call_id": tc["id"], "name": tc["function"]["name"],
                "arguments": tc["function"]["arguments"], "status": "completed"}
        await event("response.output_item.added", output_index=index,
                    item={**full, "arguments": "", "status": "in_progress"})
        await event("response.function_call_arguments.delta", item_id=full["id"], output_index=index,
                    delta=full["arguments"])
        await event("response.function_call_arguments.done", item_id=full["id"], output_index=index,
                    arguments=full["arguments"])
        await event("response.output_item.done", output_index=index, item=full)
        done.append(full)

    async def on_partial(result) -> int:
        if resp is None:
            await start()
        reasoning, text, calls = progress.step(result)
        if reasoning:
            await delta("reasoning", reasoning)
        if text:
            await delta("message", text)
        for tc in calls:
            await function_call(tc)
        return progress.sent

    try:
        result = await gw.generate_streamed(sess, call, on_partial)
        message, finish = gw.finish(sess, call, result, req)
    except ApiError as err:
        if resp is None:
            raise
        await event("error", **error_body(err)["error"])
        await resp.write_eof()
        return resp
    if resp is None:
        await start()
    calls = adopt_streamed_calls(message, progress.calls)
    if message.get("reasoning_content") is not None and (item is None and not done or
                                                         (item or {}).get("type") == "reasoning"):
        await delta("reasoning", message["reasoning_content"][progress.reasoning:])
    content = message.get("content") or ""
    has_message = (item or {}).get("type") == "message" or any(d["type"] == "message" for d in done)
    if content[progress.content:] or not (calls or has_message):  # as output_items(); after sent calls: a new item
        await delta("message", content[progress.content:])
    await close_item()
    for tc in calls[len(progress.calls):]:
        await function_call(tc)
    usage = _usage(len(call.turn.prompt_ids), len(call.turn.completion_ids))
    final = _response(gw, body, rid, created, "completed", done, usage, finish)
    await event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    await resp.write_eof()
    return resp
