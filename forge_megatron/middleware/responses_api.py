"""OpenAI Responses API on the gateway: ``POST /v1/responses`` for agents written against it (Codex CLI, the OpenAI
Agents SDK's default model class, ``client.responses.create``), and ``GET`` / ``DELETE /v1/responses/{id}``.

Agents use the same ``base_url`` as for chat completions (``<gateway>/s/<session key>/v1``, or the key as a bearer
token). Each request is translated into the gateway's chat form and served by the same path (chat template,
token-in/token-out engine call, tool parser, recording, pause / partial rollout), so an episode may mix APIs and a
conversation whose output items are sent back as input continues its segment exactly as through
``/v1/chat/completions``.

Request -> chat form:
  instructions                               -> a leading system message (not carried over by previous_response_id,
                                                as in the API)
  previous_response_id                       -> the stored conversation of that response (its input and output,
                                                back along its own chain) before this request's input
  input: a string                            -> one user message
  input items: messages (user / system / developer / assistant; content a string or input_text / output_text
  parts, and input_image parts (a data URL, or an image URL under the gateway's image URL policy) in user
  messages; developer counts as system)
                                             -> messages (images: OpenAI image parts; see gateway.py)
  reasoning items (content reasoning_text, or only the encrypted_content this gateway issued)
                                             -> reasoning_content of the next assistant message (the chat template
                                                renders it back, so the turn continues its segment)
  function_call items (call_id, name, arguments) and custom_tool_call items (call_id, name, input)
                                             -> tool_calls of the assistant message they follow (one turn's message
                                                and calls become one assistant message again)
  function_call_output / custom_tool_call_output items (call_id, output: a string, or text and input_image parts)
                                             -> tool messages
  tools: {type: function, name, description, parameters} -> function tools
         {type: custom, name, description, format: text | {type: grammar, syntax: lark | regex, definition}}
                                             -> a function tool taking one string parameter ``input`` (described
                                                by the format's grammar, which is shown to the model, not enforced)
  tool_choice auto | none | required | {type: function | custom, name}; max_output_tokens, temperature, top_p,
  stream, store, include [reasoning.encrypted_content, message.output_text.logprobs], top_logprobs;
  reasoning.effort -> the chat template variable ``reasoning_effort`` (as chat completions' reasoning_effort);
  extension: ignore_eos
  other item, part and tool types (files, image file_ids, built-in tools), background, conversation and
  prompt are a 400
  naming them.
Reply: a ``response`` object whose ``output`` holds a reasoning item (``content`` [reasoning_text]; with a reasoning
parser and a reasoning block; ``encrypted_content`` too when asked by ``include``), a message item (output_text, with
the logprobs of the tokens that wrote its text when asked: ``Gateway.text_token_span``) and
one function_call item per call (a custom_tool_call item, ``input`` = the call's ``input`` argument, for a custom
tool); ``status`` completed, or incomplete with ``incomplete_details.reason`` max_output_tokens; usage
input/output/total tokens.
Streaming follows the API's events: response.created, response.in_progress, then per item output_item.added,
content_part.added, reasoning_text.delta / output_text.delta / function_call_arguments.delta /
custom_tool_call_input.delta and their .done events, content_part.done, output_item.done, and response.completed (or
response.incomplete); an error after the stream started is an ``error`` event. Errors otherwise: ``{"error":
{message, type, param, code}}`` (the gateway's OpenAI error body).

*Stored responses.* With ``store`` (true unless the request says false, as in the API) a response is kept in its
session, so ``previous_response_id`` can continue it and ``GET /v1/responses/{id}`` return it, until the session
ends (an ended session serves nothing, so they are dropped then) or the response is deleted. A stored response
keeps only its request's input messages and its answer and points to its predecessor, so a chain of n calls costs
O(n), not O(n^2). Responses of other sessions are not visible.

*Encrypted reasoning.* Clients written for OpenAI's hosted models, which return no reasoning text, send a reasoning
item back as its id, summary and ``encrypted_content`` only; without the text, the next prompt would not render the
turn the model sampled and would start a new segment. With ``include: ["reasoning.encrypted_content"]`` the gateway
puts the reasoning text, sealed with an HMAC under a per-process key (tamper-evident, not secret: the text is in
``content`` too), into ``encrypted_content`` and accepts it back in place of the text; a seal it did not issue is a
400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass

from aiohttp import web

from forge_megatron.middleware.anthropic_api import _session_key
from forge_megatron.middleware.gateway import (
    GATEWAY, ApiError, ChatRequest, Gateway, StreamProgress, _body, adopt_streamed_calls, parse_chat_request,
    serve_call,
)

CUSTOM_INPUT = "input"
"""The one string parameter of a custom tool's function form (its free-form input)."""
ENCRYPTED_REASONING = "reasoning.encrypted_content"
TEXT_LOGPROBS = "message.output_text.logprobs"
_SEAL_KEY = os.urandom(32)  # per process: a seal outlives neither the gateway nor, therefore, its sessions
_SEAL_PREFIX = "forge1."


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def seal(text: str) -> str:
    """The ``encrypted_content`` of a reasoning item: its text, base64url, and an HMAC-SHA256 tag of it."""
    payload = base64.urlsafe_b64encode(text.encode()).decode()
    tag = hmac.new(_SEAL_KEY, payload.encode(), hashlib.sha256).hexdigest()
    return f"{_SEAL_PREFIX}{payload}.{tag}"


def unseal(token, where: str) -> str:
    """The reasoning text of an ``encrypted_content`` this process issued; a 400 naming ``where`` otherwise."""
    if isinstance(token, str) and token.startswith(_SEAL_PREFIX) and token.count(".") == 2:
        payload, tag = token[len(_SEAL_PREFIX):].split(".")
        want = hmac.new(_SEAL_KEY, payload.encode(), hashlib.sha256).hexdigest()
        if hmac.compare_digest(tag, want):
            try:
                return base64.urlsafe_b64decode(payload.encode()).decode()
            except (binascii.Error, UnicodeDecodeError):
                pass
    raise _bad(where, f"{where} was not issued by this gateway (it accepts back only the encrypted_content of its own "
                      "reasoning items, from this process); send the reasoning item's content instead")


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


def _with_images(content, where: str, kinds: tuple[str, ...]):
    """:func:`_text`, or OpenAI content parts when ``content`` has ``input_image`` parts (``image_url`` a data URL,
    or a URL the gateway fetches only under its image URL policy; a ``file_id`` is refused)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where, kinds)
    parts = []
    for i, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "input_image":
            if not isinstance(p.get("image_url"), str):
                raise _bad(f"{where}[{i}].image_url", f"{where}[{i}].image_url must be a data URL or an image URL "
                                                      "(file_ids are not supported)")
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        else:
            parts.append({"type": "text", "text": _text([p], where, kinds)})
    return parts


def _strings(item: dict, where: str, fields: tuple[str, ...]) -> None:
    for name in fields:
        if not isinstance(item.get(name), str):
            raise _bad(f"{where}.{name}", f"{where}.{name} must be a string")


def custom_arguments(text: str) -> str:
    """A custom tool call's ``input`` as its function form's arguments (the tool parsers' own JSON spelling, so a
    call sent back renders as the model wrote it)."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """A custom tool call's ``input`` from its function form's arguments: the ``input`` string when that is all the
    arguments hold, else the arguments text as the model wrote them (nothing it wrote is dropped)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict) and list(args) == [CUSTOM_INPUT] and isinstance(args[CUSTOM_INPUT], str):
        return args[CUSTOM_INPUT]
    return arguments


def input_messages(items) -> list[dict]:
    """Chat messages of a request's ``input`` (a string or items; instructions and stored history not included)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "input must be a string or a non-empty array of items")
    out: list[dict] = []
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
                text = (_with_images if role == "user" else _text)(item.get("content"), f"{where}.content",
                                                                   ("input_text", "text"))
                out.append({"role": "system" if role == "developer" else role, "content": text})
                in_turn = False
        elif kind == "reasoning":
            if not item.get("content") and item.get("encrypted_content") is not None:  # clients of hosted models
                reasoning.append(unseal(item["encrypted_content"], f"{where}.encrypted_content"))
            else:
                reasoning.append(_text(item.get("content") or [], f"{where}.content", ("reasoning_text",)))
        elif kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            _strings(item, where, ("call_id", "name", "input" if custom else "arguments"))
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"],
                "arguments": custom_arguments(item["input"]) if custom else item["arguments"]}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _strings(item, where, ("call_id",))
            output = _with_images(item.get("output"), f"{where}.output", ("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            in_turn = False
        else:
            raise _bad(f"{where}.type", f"{where}: item type {kind!r} is not supported (message, reasoning, "
                                        "function_call, function_call_output, custom_tool_call, "
                                        "custom_tool_call_output)")
    for msg in out:  # as the gateway's parser returns them: content stripped or None next to tool calls
        if msg["role"] == "assistant":
            if msg.get("tool_calls"):
                msg["content"] = (msg["content"] or "").strip() or None
            elif msg["content"] is None:
                msg["content"] = ""
    return out


def _custom_parameters(tool: dict, where: str) -> dict:
    fmt = tool.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        about = "The tool's input: free-form text."
    elif kind == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if syntax not in ("lark", "regex") or not isinstance(definition, str):
            raise _bad(f"{where}.format", f"{where}.format: a grammar needs syntax 'lark' or 'regex' and a "
                                          "definition string")
        about = f"The tool's input: text in this {syntax} grammar:\n{definition}"
    else:
        raise _bad(f"{where}.format", f"{where}.format must be {{type: 'text'}} or {{type: 'grammar', syntax, "
                                      "definition}")
    return {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": about}},
            "required": [CUSTOM_INPUT]}


def chat_tools(body: dict) -> tuple[list | None, frozenset[str]]:
    """(chat-form function tools or None, names of the custom tools among them)."""
    tools = body.get("tools")
    if tools is None:
        return None, frozenset()
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be an array of function or custom tools")
    out, custom = [], set()
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in ("function", "custom"):
            raise _bad(f"tools[{i}].type", f"tools[{i}]: tool type {kind!r} is not supported (function and custom "
                                           "tools only: built-in tools run on OpenAI's servers)")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].name", f"tools[{i}] needs a name")
        if any(o["function"]["name"] == name for o in out):
            raise _bad(f"tools[{i}].name", f"tools[{i}]: two tools are named {name!r}")
        fn = {"name": name}  # chat completions' key order: the template renders the tools as JSON
        if t.get("description"):
            fn["description"] = t["description"]
        if kind == "custom":
            fn["parameters"] = _custom_parameters(t, f"tools[{i}]")
            custom.add(name)
        else:
            fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out, frozenset(custom)


def _tool_choice(choice):
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and \
            isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or {type: 'function' | 'custom', name}")


@dataclass
class ResponsesRequest:
    """A validated Responses API body: the chat request it is served as, and what its reply and storage need."""

    chat: ChatRequest
    inputs: list[dict]  # chat messages of this request's input (without instructions and stored history)
    custom: frozenset[str]  # names of custom tools: their calls are custom_tool_call items
    sealed: bool  # include reasoning.encrypted_content
    store: bool
    previous: str | None  # previous_response_id


@dataclass
class StoredResponse:
    """A response kept for ``previous_response_id`` and ``GET``: its request's input messages and its answer (chat
    form), linked to the response it continued; the whole conversation is the chain's messages in order."""

    parent: StoredResponse | None
    messages: list[dict]
    body: dict  # the response object as returned

    def conversation(self) -> list[dict]:
        chain, r = [], self
        while r is not None:  # iterative: agent chains run to hundreds of calls
            chain.append(r.messages)
            r = r.parent
        return [m for part in reversed(chain) for m in part]


def stored(sess, rid) -> StoredResponse:
    """Session ``sess``'s stored response ``rid``; 404 when it has none of that id."""
    found = sess.responses.get(rid) if isinstance(rid, str) else None
    if found is None:
        raise ApiError(404, f"no stored response {rid!r} in this session (responses are stored per session, and only "
                            "with store: true)", param="response_id", code="response_not_found")
    return found


def parse_responses_request(body: dict, default_max_tokens: int,
                            previous: StoredResponse | None = None) -> ResponsesRequest:
    """Validate a Responses API body (``previous``: the stored response its previous_response_id names) and return
    the request the gateway serves for it (400s name the field)."""
    for name, why in (("background", "background responses are not supported (the call is served in the request)"),
                      ("conversation", "conversations are not supported: use previous_response_id or send the "
                                       "whole conversation as input"),
                      ("prompt", "stored prompt templates are not supported: send instructions and input")):
        if body.get(name) not in (None, False):
            raise _bad(name, why)
    if body.get("previous_response_id") is not None and previous is None:
        raise _bad("previous_response_id", "previous_response_id is given but no stored response was resolved")
    text_format = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    if text_format != "text":
        raise _bad("text.format", f"text.format {text_format!r} is not supported (plain text only)")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise _bad("include", "include must be an array of strings")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad("store", "store must be a boolean")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise _bad("instructions", "instructions must be a string")
    inputs = input_messages(body.get("input"))
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") is not None else []
    history = previous.conversation() if previous is not None else []
    chat = {"messages": system + history + inputs, "stream": body.get("stream", False)}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools, custom = chat_tools(body)
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    elif _tool_choice(body.get("tool_choice")) not in ("auto", "none"):
        raise _bad("tool_choice", "tool_choice 'required' or a named tool needs a non-empty tools array")
    for name in ("temperature", "top_p", "ignore_eos", "top_logprobs"):  # ignore_eos: the SGLang/vLLM extension
        if body.get(name) is not None:
            chat[name] = body[name]
    if TEXT_LOGPROBS in include or body.get("top_logprobs"):  # asking for alternatives asks for the logprobs
        chat["logprobs"] = True
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise _bad("reasoning", "reasoning must be an object {effort, summary}")
    if (reasoning or {}).get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    try:
        req = parse_chat_request(chat, default_max_tokens)
    except ApiError as exc:
        renamed = {"max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort"}
        if exc.param in renamed:
            raise _bad(renamed[exc.param], exc.message.replace(exc.param, renamed[exc.param])) from exc
        raise
    return ResponsesRequest(chat=req, inputs=inputs, custom=custom, sealed=ENCRYPTED_REASONING in include,
                            store=store, previous=body.get("previous_response_id"))


def reasoning_item(rid: str, text: str, req: ResponsesRequest, status: str = "completed") -> dict:
    item = {"type": "reasoning", "id": rid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}
    if req.sealed:
        item["encrypted_content"] = seal(text)
    return item


def call_item(tc: dict, req: ResponsesRequest) -> dict:
    """The output item of one tool call: custom_tool_call for a custom tool, else function_call."""
    name, arguments = tc["function"]["name"], tc["function"]["arguments"]
    if name in req.custom:
        return {"type": "custom_tool_call", "id": _id("ctc"), "call_id": tc["id"], "name": name,
                "input": custom_input(arguments), "status": "completed"}
    return {"type": "function_call", "id": _id("fc"), "call_id": tc["id"], "name": name, "arguments": arguments,
            "status": "completed"}


def output_items(message: dict, req: ResponsesRequest, status: str = "completed",
                 logprobs: list[dict] | None = None) -> list[dict]:
    """The output items of one answer: reasoning, then the message (its text's ``logprobs``), then one item per
    call."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(_id("rs"), message["reasoning_content"], req, status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                   "logprobs": logprobs or []}]})
    return items + [call_item(tc, req) for tc in calls]


def text_logprobs(gw: Gateway, req: ResponsesRequest, call, result, content: str, start: int = 0,
                  final: bool = True, cache: dict | None = None) -> tuple[list[dict], int]:
    """(logprob entries of the tokens of ``content`` from token ``start`` on, the token after them): an output_text
    part's ``logprobs`` (the API's chat-style entries, with top_logprobs), [] unless the request asked for them;
    ``cache``: a stream's (``Gateway.text_token_span``)."""
    if not req.chat.logprobs:
        return [], start
    lo, hi = gw.text_token_span(call, req.chat, result, content, final=final, start=start, cache=cache)
    if hi <= lo:
        return [], start
    top = result.top_logprobs[lo:hi] if result.top_logprobs is not None else None
    return gw.openai_logprobs(result.output_ids[lo:hi], result.logprobs[lo:hi], top)["content"], hi


def _response(gw: Gateway, body: dict, req: ResponsesRequest | None, rid: str, created: int, status: str,
              output: list[dict], usage: dict | None, finish: str | None = None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    return {
        "id": rid, "object": "response", "created_at": created, "model": gw.model_name,
        "status": "incomplete" if incomplete else status, "incomplete_details": incomplete, "error": None,
        "output": output, "usage": usage, "instructions": body.get("instructions"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": req.previous if req is not None else None,
        "store": req.store if req is not None else False,
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "truncation": "disabled", "metadata": body.get("metadata") or {},
    }


def keep(sess, req: ResponsesRequest, previous: StoredResponse | None, message: dict, response: dict) -> None:
    """Store ``response`` in ``sess`` when the request asked for it (``store``, the default)."""
    if req.store:
        sess.responses[response["id"]] = StoredResponse(parent=previous, messages=req.inputs + [message],
                                                        body=response)


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
        previous = None
        if body.get("previous_response_id") is not None:
            try:
                previous = stored(sess, body["previous_response_id"])
            except ApiError as exc:
                raise _bad("previous_response_id", exc.message, code="previous_response_not_found") from exc
        req = parse_responses_request(body, gw.config.default_max_tokens, previous)
        req.chat.response_id = _id("resp")
        served = await serve_call(gw, sess, req.chat,
                                  lambda sess, _, call: _stream(request, gw, sess, req, call, body, previous))
    except ApiError as exc:
        return web.json_response(error_body(exc), status=exc.status)
    if not isinstance(served, tuple):
        return served
    call, result, message, finish = served
    usage = gw.usage(call.turn)
    logprobs, _ = text_logprobs(gw, req, call, result, message.get("content") or "")
    response = _response(gw, body, req, req.chat.response_id, int(time.time()), "completed",
                         output_items(message, req, logprobs=logprobs),
                         _usage(usage["prompt_tokens"], usage["completion_tokens"]), finish)
    keep(sess, req, previous, message, response)
    return web.json_response(response)


async def get_response(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}``: a response this session stored."""
    gw: Gateway = request.app[GATEWAY]
    try:
        sess = gw.session_for_key(_session_key(request))
        return web.json_response(stored(sess, request.match_info["rid"]).body)
    except ApiError as exc:
        return web.json_response(error_body(exc), status=exc.status)


async def delete_response(request: web.Request) -> web.StreamResponse:
    """``DELETE /v1/responses/{id}``: forget a stored response (responses that continued it keep their history)."""
    gw: Gateway = request.app[GATEWAY]
    try:
        sess = gw.session_for_key(_session_key(request))
        rid = request.match_info["rid"]
        stored(sess, rid)
        del sess.responses[rid]
        return web.json_response({"id": rid, "object": "response", "deleted": True})
    except ApiError as exc:
        return web.json_response(error_body(exc), status=exc.status)


async def _stream(request, gw: Gateway, sess, req: ResponsesRequest, call, body: dict,
                  previous: StoredResponse | None) -> web.StreamResponse:
    """The Responses event stream for one call: reasoning and text deltas as the engine produces them (text held back
    at the tool-call marker and stop sequences, like the chat stream), each function_call item whole as soon as its
    call's block closes (formats without closing markers: at the end)."""
    progress = StreamProgress(gw, req.chat, call)
    rid, created = req.chat.response_id, int(time.time())
    resp = None
    seq = 0
    streamed = ""  # the message text sent so far (its tokens' logprobs ride on its deltas)
    lp_next = 0  # the first token whose logprobs were not sent
    decoded: dict[int, int] = {}  # characters in the completion's first k tokens (text_token_span)
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
        shell = _response(gw, body, req, rid, created, "in_progress", [], None)
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
            full = reasoning_item(item["id"], text, req)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": item["logprobs"]}
            await event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, logprobs=item["logprobs"])
            full = {"type": "message", "id": item["id"], "role": "assistant", "status": "completed", "content": [part]}
        await event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        await event("response.output_item.done", output_index=index, item=full)
        done.append(full)
        item = None

    async def delta(kind: str, text: str, logprobs: list[dict] = ()) -> None:
        """Append ``text`` (and its tokens' ``logprobs``) to the open item of ``kind`` ("reasoning" or "message"),
        opening one first."""
        nonlocal item
        index = len(done)
        if item is None or item["type"] != kind:
            await close_item()
            index = len(done)
            item = {"type": kind, "id": _id("rs" if kind == "reasoning" else "msg"), "text": "", "logprobs": []}
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
        item["logprobs"] += logprobs
        if text:
            item["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": list(logprobs)}
            await event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    async def tool_call(tc: dict) -> None:
        await close_item()
        index = len(done)
        full = call_item(tc, req)
        key, kind = (("input", "response.custom_tool_call_input") if full["type"] == "custom_tool_call" else
                     ("arguments", "response.function_call_arguments"))
        await event("response.output_item.added", output_index=index,
                    item={**full, key: "", "status": "in_progress"})
        await event(kind + ".delta", item_id=full["id"], output_index=index, delta=full[key])
        await event(kind + ".done", item_id=full["id"], output_index=index, **{key: full[key]})
        await event("response.output_item.done", output_index=index, item=full)
        done.append(full)

    async def on_partial(result) -> int:
        nonlocal streamed, lp_next
        if resp is None:
            await start()
        reasoning, text, calls = progress.step(result)
        if reasoning:
            await delta("reasoning", reasoning)
        if text:
            streamed += text
            logprobs, lp_next = text_logprobs(gw, req, call, result, streamed, lp_next, final=False, cache=decoded)
            await delta("message", text, logprobs)
        for tc in calls:
            await tool_call(tc)
        return progress.sent

    try:
        result = await gw.generate_streamed(sess, call, on_partial)
        message, finish = gw.finish(sess, call, result, req.chat)
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
    logprobs, _ = text_logprobs(gw, req, call, result, content, lp_next, cache=decoded)  # those not sent yet
    if content[progress.content:] or not (calls or has_message):  # as output_items(); after sent calls: a new item
        await delta("message", content[progress.content:], logprobs)
    elif logprobs and (item or {}).get("type") == "message":
        item["logprobs"] += logprobs
    await close_item()
    for tc in calls[len(progress.calls):]:
        await tool_call(tc)
    usage = _usage(len(call.turn.prompt_ids), len(call.turn.completion_ids))
    final = _response(gw, body, req, rid, created, "completed", done, usage, finish)
    keep(sess, req, previous, message, final)
    await event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    await resp.write_eof()
    return resp
