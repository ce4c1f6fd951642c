"""Gateway overhead: latency added by forge-gateway over calling the engine directly, and calls/s of both.

Both paths run side by side in one run against the same forge-engine subprocess on the tiny model, with the same
prompt ids and the same number of generated tokens:
  direct:  POST engine /generate {input_ids, sampling_params, return_logprob}
  gateway: POST gateway /v1/chat/completions (one session; chat template, tokenisation, segment rule, tool parsing,
           recording) -> the same engine.
Latency: sequential calls, alternating direct / gateway; added_i = gateway_i - direct_i; p50/p99 over i.
gateway_cpu_ms_per_call: the gateway process's CPU time (user + system) per call in the throughput phase.
Throughput: ``--concurrency`` callers (one gateway session each: calls within a session are serialised) for
``--calls`` calls per path.

    OMP_NUM_THREADS=1 python benchmarks/gateway.py --calls 300 --concurrency 8 --max-tokens 1

``--multi-turn TURNS`` measures instead what grows with an agent's conversation: the gateway's work to turn the
messages of call k into prompt ids (render the chat template over the whole history, render the previous turn with
its answer for the segment rule, tokenise the new tail; ``ChatRenderer.prompt_ids``, in process: the tiny engine
cannot prefill 100k-token prompts on a CPU in useful time). Each turn adds a tool call and a tool result of
``--result-words`` words. Reported at a few turns: prompt tokens and characters, ``prepare_ms`` (that work, median
of ``--repeats``) and ``render_ms`` (one render of the history alone).

    python benchmarks/gateway.py --multi-turn 200

``--workers N`` measures how a gateway in N processes (``forge-gateway --workers N``, gateway_front.py) scales the
work that grows with the conversation: ``--concurrency`` sessions each send Anthropic ``count_tokens`` calls for a
conversation of ``--history-turns`` turns (the gateway renders the chat template over it and tokenises it, as for a
call, without the engine: on a CPU machine the tiny engine's prefill would dominate). Side by side, in rounds:
``one`` (one gateway process), ``workers`` (the N-worker gateway, each call sent to its session's worker, as agents
do) and ``via_front`` (the same sessions' calls sent through the front, which forwards them). Calls/s are medians
over ``--rounds``; on a machine with fewer free cores than N + 1 the speed-up is bounded by the cores.

    python benchmarks/gateway.py --workers 2 --history-turns 50 --calls 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import aiohttp
import numpy as np

from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.rollout.launch import start_engine, start_gateway

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris today? Answer briefly."}]


async def _post(http: aiohttp.ClientSession, url: str, body: dict, headers=None) -> float:
    t0 = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
    return time.perf_counter() - t0


async def _throughput(calls, n: int) -> float:
    """``n`` calls spread over one worker per entry of ``calls`` (each worker its own session/caller)."""
    todo = iter(range(n))

    async def worker(call):
        for _ in todo:
            await call()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(call) for call in calls))
    return n / (time.perf_counter() - t0)


async def _new_session(http: aiohttp.ClientSession, gateway_url: str, group: str) -> dict:
    async with http.post(gateway_url + "/forge/sessions", json={"group_id": group}) as r:
        return {"Authorization": f"Bearer {(await r.json())['api_key']}"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to report the gateway's own cost independent of load."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(engine_url: str, gateway_url: str, prompt_ids: list[int], args, gateway_pid: int) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway_url + "/forge/groups", json={"task_id": "bench", "size": 1}) as r:
            group = (await r.json())["group_id"]
        direct_body = {"input_ids": prompt_ids, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}}
        gw_body = {"model": "tiny", "messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 0,
                   "ignore_eos": True}
        sessions = [await _new_session(http, gateway_url, group) for _ in range(args.concurrency)]

        def direct():
            return _post(http, engine_url + "/generate", direct_body)

        def gateway(auth=sessions[0]):
            return _post(http, gateway_url + "/v1/chat/completions", gw_body, auth)

        for _ in range(args.warmup):
            await direct()
            await gateway()
        added = []
        for _ in range(args.calls):
            d = await direct()
            g = await gateway()
            added.append(g - d)
        direct_cps = await _throughput([direct] * args.concurrency, args.calls)
        cpu0 = cpu_seconds(gateway_pid)
        gateway_cps = await _throughput([lambda a=a: gateway(a) for a in sessions], args.calls)
        cpu_ms = (cpu_seconds(gateway_pid) - cpu0) * 1e3 / args.calls
    added_ms = np.array(added) * 1e3
    return {"p50_added_ms": round(float(np.percentile(added_ms, 50)), 3),
            "p99_added_ms": round(float(np.percentile(added_ms, 99)), 3),
            "gateway_calls_per_s": round(gateway_cps, 1), "direct_calls_per_s": round(direct_cps, 1),
            "gateway_cpu_ms_per_call": round(cpu_ms, 3)}


def multi_turn(model: str, turns: int, result_words: int, repeats: int) -> dict:
    """prepare_ms / render_ms of call k of one growing tool-calling conversation (see the module docstring)."""
    import random

    from transformers import AutoTokenizer

    from forge_megatron.middleware.gateway_sessions import CallRecord, ChatRenderer, Session, _Turn

    tok = AutoTokenizer.from_pretrained(model)
    renderer = ChatRenderer(tok)
    rng = random.Random(0)
    words = "the file test error value patch result line function return import class output".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    tools = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command",
                                               "parameters": {"type": "object",
                                                              "properties": {"cmd": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": text(300)}, {"role": "user", "content": text(100)}]
    answer_ids = tok.encode('<tool_call>\n{"name": "shell", "arguments": {"cmd": "make test"}}\n</tool_call>',
                            add_special_tokens=False) + [tok.eos_token_id]
    at = sorted({t for t in (1, 10, 25, 50, 100, 200, 400) if t <= turns} | {turns})
    out = {"turns": [], "prompt_tokens": [], "prompt_chars": [], "prepare_ms": [], "render_ms": [], "continues": []}
    prev = None
    session, per_call_lists = Session(group_id="g", task_id="bench", domain="bench"), 0  # what the gateway keeps
    for k in range(1, turns + 1):
        if k in at:
            times, render = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                prompt_text, prompt_ids, continues = renderer.prompt_ids(prev, messages, tools)
                times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                renderer.render(messages, tools, add_generation_prompt=True)
                render.append(time.perf_counter() - t0)
            out["turns"].append(k)
            out["prompt_tokens"].append(len(prompt_ids))
            out["prompt_chars"].append(len(prompt_text))
            out["prepare_ms"].append(round(float(np.median(times)) * 1e3, 2))
            out["render_ms"].append(round(float(np.median(render)) * 1e3, 2))
            out["continues"].append(continues)
        else:
            prompt_text, prompt_ids, continues = renderer.prompt_ids(prev, messages, tools)
        call = {"id": f"call{k}", "type": "function",
                "function": {"name": "shell", "arguments": '{"cmd": "make test"}'}}
        answer = {"role": "assistant", "content": None, "tool_calls": [call]}
        turn = _Turn(messages=list(messages), tools=tools, prompt_text=prompt_text, prompt_ids=prompt_ids,
                     completion_ids=answer_ids, assistant_message=answer, template_kwargs={})
        session.record(turn, continues, CallRecord(
            prompt_ids=prompt_ids, completion_ids=answer_ids, logprobs=[-0.1] * len(answer_ids), policy_version=0,
            finish_reason="tool_calls", engine_url="-", segment_index=-1, started_at=0.0, ended_at=0.0))
        prev = session.last_turn  # what the gateway prepares the next call from
        per_call_lists += 8 * (len(prompt_ids) + len(answer_ids))  # what lists of its own per call would point with
        messages = messages + [answer, {"role": "tool", "tool_call_id": call["id"], "content": text(result_words)}]
    out["session_mib"] = round(held_bytes(session) / 2**20, 2)
    # the segments' per-token fields: typed arrays, as kept, against the same fields as lists of Python numbers
    out["segments_mib"] = round(held_bytes(session.segments) / 2**20, 2)
    out["segments_as_lists_mib"] = round(held_bytes([s.to_segment() for s in session.segments]) / 2**20, 2)
    out["per_call_lists_mib"] = round(per_call_lists / 2**20, 2)
    return out


def held_bytes(root) -> int:
    """Bytes of the objects reachable from ``root`` through lists, tuples, dicts, arrays and object attributes, each
    counted once (what a session keeps alive)."""
    import sys

    seen, todo, total = set(), [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, asyncio.Lock)) or callable(obj):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            todo += list(obj)
        elif hasattr(obj, "__dict__"):
            todo.append(obj.__dict__)
        elif isinstance(obj, np.ndarray) and obj.base is not None:
            todo.append(obj.base)
    return total


async def worker_scaling(one_url: str, front_url: str, args) -> dict:
    """calls/s of count_tokens on a long conversation: one gateway process, the N workers directly, through the
    front (module docstring)."""
    import random

    rng = random.Random(0)
    words = "the file test error value patch result line function return import class output".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    messages = [{"role": "user", "content": text(100)}]
    for _ in range(args.history_turns):
        messages += [{"role": "assistant", "content": text(30)}, {"role": "user", "content": text(args.result_words)}]
    body = {"model": "tiny", "max_tokens": 1, "messages": messages}

    async def sessions(http, url: str) -> list[str]:
        out = []
        for _ in range(args.concurrency):  # eval sessions: the front deals them to its workers in turn
            async with http.post(url + "/forge/sessions", json={"eval": True, "task_id": "bench"}) as r:
                out.append((await r.json())["anthropic_base_url"])
        return out

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        bases = {"one": await sessions(http, one_url), "workers": await sessions(http, front_url)}
        bases["via_front"] = [front_url + "/s/" + b.rsplit("/s/", 1)[1] for b in bases["workers"]]
        async with http.post(bases["one"][0] + "/v1/messages/count_tokens", json=body) as r:
            tokens = (await r.json())["input_tokens"]
        rates: dict[str, list[float]] = {name: [] for name in bases}
        for _ in range(args.rounds):
            for name, urls in bases.items():
                calls = [lambda u=u: _post(http, u + "/v1/messages/count_tokens", body) for u in urls]
                rates[name].append(await _throughput(calls, args.calls))
    med = {name: float(np.median(r)) for name, r in rates.items()}
    return {"workers": args.workers, "one_calls_per_s": round(med["one"], 1),
            "workers_calls_per_s": round(med["workers"], 1), "via_front_calls_per_s": round(med["via_front"], 1),
            "speedup": round(med["workers"] / med["one"], 2), "via_front_speedup": round(med["via_front"] / med["one"], 2),
            "prompt_tokens": tokens, "prompt_chars": sum(len(m["content"]) for m in messages),
            "concurrency": args.concurrency, "calls": args.calls, "rounds": args.rounds, "cpus": os.cpu_count()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300, help="calls per path for latency and for throughput")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=8, help="concurrent callers in the throughput phase")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens generated per call")
    p.add_argument("--multi-turn", type=int, default=0, metavar="TURNS",
                   help="measure prompt preparation over a conversation of TURNS tool calls instead (in process)")
    p.add_argument("--result-words", type=int, default=150, help="--multi-turn: words per tool result")
    p.add_argument("--repeats", type=int, default=5, help="--multi-turn: timings per measured turn (median)")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="measure one gateway process against a gateway in N processes instead (module docstring)")
    p.add_argument("--history-turns", type=int, default=50, help="--workers: turns of the conversation sent")
    p.add_argument("--rounds", type=int, default=3, help="--workers: rounds of the three paths (median)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(os.path.join(tmp, "tiny"))
        if args.multi_turn:
            result = multi_turn(model, args.multi_turn, args.result_words, args.repeats)
            print(json.dumps({**result, "result_words": args.result_words}))
            return
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model)
        prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
        engine = start_engine(model)
        if args.workers:
            one = start_gateway(model, [engine.url])
            front = start_gateway(model, [engine.url], extra_args=["--workers", str(args.workers)])
            try:
                print(json.dumps({**asyncio.run(worker_scaling(one.url, front.url, args)),
                                  "result_words": args.result_words}))
            finally:
                front.stop()
                one.stop()
                engine.stop()
            return
        gateway = start_gateway(model, [engine.url])
        try:
            result = asyncio.run(measure(engine.url, gateway.url, prompt_ids, args, gateway.proc.pid))
        finally:
            gateway.stop()
            engine.stop()
    print(json.dumps({**result, "calls": args.calls, "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "prompt_tokens": len(prompt_ids)}))


if __name__ == "__main__":
    main()
