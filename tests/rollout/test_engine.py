"""forge-engine against the HF reference: outputs and logprobs come from the weights; sampling, stops, pause modes,
weight swaps (disk and gloo broadcast). Real HTTP on loopback; CPU only."""

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.rollout.engine_server import SamplingParams, RequestError, sample_next
from forge_megatron.rollout.launch import start_engine
from forge_megatron.rollout.sglang_client import EngineRequestError, SGLangClient
from forge_megatron.rollout.weight_group import broadcast_tensor, init_weight_update_group
from forge_megatron.utils.ports import free_port

PROMPT = [7, 30, 41, 5, 99, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), sampling_seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    h = start_engine(model_dir, in_process=True)
    yield h
    h.stop()


def run(coro):
    return asyncio.run(coro)


async def _gen(url, ids=PROMPT, **sp):
    c = SGLangClient(url)
    try:
        return await c.generate(ids, sp)
    finally:
        await c.close()


def hf_greedy_and_logprobs(model_dir, prompt, n):
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    return out, teacher_forced_logprobs(m, prompt, out)


def teacher_forced_logprobs(model, prompt, completion, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logp[torch.arange(len(completion)), torch.tensor(completion)].tolist()


def test_greedy_tokens_and_logprobs_match_hf(engine, model_dir):
    res = run(_gen(engine.url, temperature=0, max_new_tokens=12, ignore_eos=True))
    ref_ids, ref_lp = hf_greedy_and_logprobs(model_dir, PROMPT, 12)
    assert res.output_ids == ref_ids
    assert res.logprobs == pytest.approx(ref_lp, abs=1e-4)
    assert res.finish_reason == {"type": "length", "length": 12}
    assert res.prompt_tokens == len(PROMPT) and res.completion_tokens == 12


def test_sampled_logprobs_are_tempered_and_seeded(engine, model_dir):
    """As SGLang's sampler by default: the logprob of the distribution sampled from, softmax(z / T), before the
    top_p cut (the teacher-forced logits divided by T give the same numbers; undivided ones do not)."""
    a = run(_gen(engine.url, temperature=1.3, top_p=0.9, max_new_tokens=10, sampling_seed=5, ignore_eos=True))
    b = run(_gen(engine.url, temperature=1.3, top_p=0.9, max_new_tokens=10, sampling_seed=5, ignore_eos=True))
    c = run(_gen(engine.url, temperature=1.3, top_p=0.9, max_new_tokens=10, sampling_seed=6, ignore_eos=True))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    assert a.output_ids != c.output_ids
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert a.logprobs == pytest.approx(teacher_forced_logprobs(m, PROMPT, a.output_ids, 1.3), abs=1e-4)
    assert a.logprobs != pytest.approx(teacher_forced_logprobs(m, PROMPT, a.output_ids), abs=1e-3)


def test_top_logprobs_are_the_scored_distributions_most_likely(engine, model_dir):
    """``top_logprobs_num`` (SGLang's field): per output token the n most likely tokens of the distribution the
    sampled token is scored under (softmax(z / T)), most likely first, in ``output_top_logprobs``; streamed too."""
    async def both():
        c = SGLangClient(engine.url)
        try:
            sp = {"temperature": 1.3, "max_new_tokens": 6, "sampling_seed": 5, "ignore_eos": True}
            whole = await c.generate(PROMPT, sp, top_logprobs_num=4)
            parts = [r async for r in c.generate_stream(PROMPT, sp, top_logprobs_num=4)]
            plain = await c.generate(PROMPT, sp)
            return whole, parts, plain
        finally:
            await c.close()
    whole, parts, plain = run(both())
    assert plain.top_logprobs is None and plain.output_ids == whole.output_ids  # asking changes no sample
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = m(torch.tensor([PROMPT + whole.output_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(PROMPT) - 1:-1] / 1.3, dim=-1)
    assert len(whole.top_logprobs) == len(whole.output_ids) == 6
    for pos, (top, token, lp) in enumerate(zip(whole.top_logprobs, whole.output_ids, whole.logprobs)):
        want = torch.topk(logp[pos], 4)
        assert [i for _, i in top] == want.indices.tolist()
        assert [v for v, _ in top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert all(a[0] >= b[0] for a, b in zip(top, top[1:]))
        if token in [i for _, i in top]:
            assert dict((i, v) for v, i in top)[token] == pytest.approx(lp, abs=1e-6)
    assert parts[-1].top_logprobs == whole.top_logprobs and parts[-1].output_ids == whole.output_ids
    assert [len(p.top_logprobs) for p in parts] == [len(p.output_ids) for p in parts]


def test_concurrent_requests_equal_sequential(engine):
    async def both():
        c = SGLangClient(engine.url)
        conc = await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 15, "sampling_seed": s, "ignore_eos": True})
                                      for s in range(6)))
        seq = [await c.generate(PROMPT, {"max_new_tokens": 15, "sampling_seed": s, "ignore_eos": True}) for s in range(6)]
        await c.close()
        return conc, seq
    conc, seq = run(both())
    assert [r.output_ids for r in conc] == [r.output_ids for r in seq]
    assert len({tuple(r.output_ids) for r in conc}) > 1


def test_sample_next_filters():
    gen = torch.Generator().manual_seed(0)
    logits_V = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    top_p = {sample_next(logits_V, SamplingParams(top_p=0.6), gen)[0] for _ in range(300)}
    top_k = {sample_next(logits_V, SamplingParams(top_k=3), gen)[0] for _ in range(300)}
    assert top_p == {0, 1} and top_k == {0, 1, 2}
    token, lp = sample_next(logits_V, SamplingParams(temperature=0.5), gen)
    assert lp == pytest.approx(float(torch.log_softmax(logits_V / 0.5, -1)[token]), abs=1e-6)  # SGLang's default
    token, lp = sample_next(logits_V, SamplingParams(temperature=0.5), gen, original_logprob=True)
    assert lp == pytest.approx(float(logits_V[token]), abs=1e-6)  # SGLANG_RETURN_ORIGINAL_LOGPROB=1
    token, lp = sample_next(logits_V, SamplingParams(temperature=0), gen)
    assert token == 0 and lp == pytest.approx(float(logits_V[0]), abs=1e-6)  # greedy: untempered, as SGLang


def test_original_logprob_switch_reads_sglangs_variable(monkeypatch):
    from forge_megatron.rollout.engine_server import ORIGINAL_LOGPROB_ENV, return_original_logprob

    assert ORIGINAL_LOGPROB_ENV == "SGLANG_RETURN_ORIGINAL_LOGPROB"
    for value, want in (("1", True), ("True", True), ("0", False), ("", False)):
        monkeypatch.setenv(ORIGINAL_LOGPROB_ENV, value)
        assert return_original_logprob() is want


def test_stop_token_ids_and_stop_strings(engine, model_dir):
    free = run(_gen(engine.url, temperature=0, max_new_tokens=12, ignore_eos=True))
    stop_tok = free.output_ids[3]
    res = run(_gen(engine.url, temperature=0, max_new_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True))
    assert res.output_ids == free.output_ids[:free.output_ids.index(stop_tok) + 1]
    assert res.finish_reason == {"type": "stop", "matched": stop_tok}
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(model_dir).decode(free.output_ids[:6])
    stop = text[-3:] if len(text) >= 3 else text
    res = run(_gen(engine.url, temperature=0, max_new_tokens=12, stop=stop, ignore_eos=True))
    assert res.finish_reason == {"type": "stop", "matched": stop}
    assert len(res.output_ids) <= 6 and stop not in res.text


@pytest.mark.parametrize("body, field", [
    ({"sampling_params": {}}, "input_ids"),
    ({"input_ids": PROMPT, "sampling_params": {"bogus": 1}}, "bogus"),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5000}}, "context length"),
    ({"input_ids": [10**6], "sampling_params": {}}, "outside"),
    ({"input_ids": PROMPT, "sampling_params": {}, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": PROMPT, "sampling_params": {}, "top_logprobs_num": "5"}, "top_logprobs_num"),
])
def test_bad_generate_requests_are_400(engine, body, field):
    async def call():
        c = SGLangClient(engine.url)
        try:
            await c._call("POST", "/generate", body)
        finally:
            await c.close()
    with pytest.raises(EngineRequestError, match=field):
        run(call())
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)


def _long_request_and_pause(handle, mode, flush=False):
    """Start a long seeded request, pause with ``mode`` mid-way, continue; return (result, result without pause)."""
    async def go():
        c = SGLangClient(handle.url)
        sp = {"max_new_tokens": 300, "sampling_seed": 3, "ignore_eos": True}
        task = asyncio.create_task(c.generate(PROMPT, sp))
        while not any(len(r.output_ids) >= 2 for r in list(handle.engine.running.values())):  # mid-way
            await asyncio.sleep(0.002)
        await c.pause_generation(mode)
        held = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 2, "sampling_seed": 1}))
        await asyncio.sleep(0.2)
        assert not held.done()  # new requests wait while paused
        held_reqs = list(handle.engine.running.values())
        if mode == "retract":  # KV caches dropped, recomputed on continue
            assert held_reqs and all(r.past is None for r in held_reqs)
        if mode == "in_place":  # KV caches kept
            assert held_reqs and all(r.past is not None for r in held_reqs)
        if flush:
            await c.flush_cache()
            assert all(r.past is None for r in held_reqs)
        await c.continue_generation()
        res, _ = await task, await held
        ref = await c.generate(PROMPT, sp)
        await c.close()
        return res, ref
    return run(go())


def test_pause_abort_returns_aborted_requests(engine):
    res, ref = _long_request_and_pause(engine, "abort")
    assert res.finish_type == "abort"
    assert 2 <= len(res.output_ids) < 300 and res.output_ids == ref.output_ids[:len(res.output_ids)]


@pytest.mark.parametrize("mode, flush", [("in_place", False), ("in_place", True), ("retract", False)])
def test_pause_keep_modes_resume_exactly(engine, mode, flush):
    res, ref = _long_request_and_pause(engine, mode, flush)
    assert res.finish_type == "length"
    assert res.output_ids == ref.output_ids
    assert res.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_update_weights_from_disk_swaps_weights(tmp_path, model_dir):
    other = build_tiny_model(str(tmp_path / "other"), sampling_seed=1)
    h = start_engine(model_dir, in_process=True)
    try:
        async def go():
            c = SGLangClient(h.url)
            await c.update_weights_from_disk(other, weight_version="7")
            res = await c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
            version = await c.get_weight_version()
            with pytest.raises(EngineRequestError, match="not a directory"):
                await c.update_weights_from_disk(str(tmp_path / "missing"))
            await c.close()
            return res, version
        res, version = run(go())
    finally:
        h.stop()
    ref_ids, ref_lp = hf_greedy_and_logprobs(other, PROMPT, 8)
    assert res.output_ids == ref_ids and res.logprobs == pytest.approx(ref_lp, abs=1e-4)
    assert version == "7" and res.weight_version == "7"


def test_update_weights_from_distributed_over_gloo(tmp_path, model_dir):
    """This process plays the trainer (rank 0); a forge-engine subprocess joins as rank 1 and receives tensors."""
    other = build_tiny_model(str(tmp_path / "other"), sampling_seed=2)
    new_sd = AutoModelForCausalLM.from_pretrained(other).state_dict()
    names = list(new_sd)
    h = start_engine(model_dir)
    try:
        port = free_port()
        holder = {}
        t = threading.Thread(target=lambda: holder.update(pg=init_weight_update_group("127.0.0.1", port, 0, 2, "wg")))
        t.start()

        async def go():
            c = SGLangClient(h.url)
            await c.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", "gloo")
            t.join()
            send = threading.Thread(target=lambda: [broadcast_tensor(holder["pg"], new_sd[n].contiguous())
                                                    for n in names])
            upd = asyncio.create_task(c.update_weights_from_distributed(
                names, ["float32"] * len(names), [list(new_sd[n].shape) for n in names], "wg", weight_version="3"))
            send.start()
            await upd
            send.join()
            res = await c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
            destroyed = await c._call("POST", "/destroy_weights_update_group", {"group_name": "wg"})
            gone = []
            for route, body in (("/destroy_weights_update_group", {"group_name": "wg"}),
                                ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                                      "group_name": "wg"})):
                with pytest.raises(EngineRequestError) as err:
                    await c._call("POST", route, body)
                gone.append(str(err.value))
            await c.close()
            return res, destroyed, gone
        res, destroyed, gone = run(go())
    finally:
        h.stop()
    ref_ids, ref_lp = hf_greedy_and_logprobs(other, PROMPT, 8)
    assert res.output_ids == ref_ids and res.logprobs == pytest.approx(ref_lp, abs=1e-4)
    assert res.weight_version == "3"
    assert destroyed["success"] is True  # SGLang's /destroy_weights_update_group; the group is then unknown
    assert all("no weight update group 'wg'" in g for g in gone), gone


def test_engine_cli_help_teaches():
    from forge_megatron.rollout.engine_server import build_parser
    text = build_parser().format_help()
    assert "--model-path" in text and "SGLang" in text and "--port" in text


def test_engine_cli_reports_missing_model(tmp_path):
    from forge_megatron.rollout.engine_server import main

    with pytest.raises(SystemExit, match="forge-engine: --model-path .* is not a directory"):
        main(["--model-path", str(tmp_path / "missing")])


def test_moe_per_expert_names_load_into_fused_experts(tmp_path):
    """Checkpoints and SGLang name experts one by one; transformers 5 fuses them per layer. Both must load."""
    from forge_megatron.rollout.engine_server import ReferenceEngine

    d = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe")
    eng = ReferenceEngine(d)
    try:
        fused = eng.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
        n_exp, two_i, hidden = fused.shape
        inter = two_i // 2
        g = torch.Generator().manual_seed(0)
        gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
        down = torch.randn(hidden, inter, generator=g)
        pre = "model.layers.0.mlp.experts.3"
        eng.load_state({f"{pre}.gate_proj.weight": gate, f"{pre}.up_proj.weight": up, f"{pre}.down_proj.weight": down})
        sd = eng.model.state_dict()
        assert torch.equal(sd["model.layers.0.mlp.experts.gate_up_proj"][3], torch.cat([gate, up]))
        assert torch.equal(sd["model.layers.0.mlp.experts.down_proj"][3], down)
        # Reference semantics: HF's expert forward takes gate from the first half of gate_up_proj.
        x = torch.randn(1, hidden, generator=g)
        h_gate, h_up = torch.nn.functional.linear(x, sd["model.layers.0.mlp.experts.gate_up_proj"][3]).chunk(2, -1)
        assert torch.allclose(h_gate, x @ gate.T) and torch.allclose(h_up, x @ up.T)
        with pytest.raises(RequestError, match="expert 9 >= num_experts"):
            eng.load_state({"model.layers.0.mlp.experts.9.gate_proj.weight": gate})
        with pytest.raises(RequestError, match="shape of"):
            eng.load_state({f"{pre}.down_proj.weight": gate})
        with pytest.raises(RequestError, match="unknown parameter name"):
            eng.load_state({"model.layers.0.mlp.experts.1.bogus_proj.weight": gate})
    finally:
        eng.worker.shutdown()


def test_flush_and_pause_survive_requests_coming_and_going(engine):
    """flush_cache runs on the worker thread while the event loop adds and removes running requests; iterating the
    live dict raised "dictionary changed size during iteration" (a 500 on /pause_generation that left the demo's
    only engine excluded). A request whose cache drop makes another request arrive reproduces it deterministically."""
    eng = engine.engine
    saved = eng.running

    class Arriving:
        aborted = False

        def __init__(self, name):
            self.name = name

        @property
        def past(self):
            return None

        @past.setter
        def past(self, value):  # another request arrives while the loop is dropping caches
            eng.running[f"{self.name}+"] = Arriving(f"{self.name}+")

        def __setattr__(self, key, value):
            if key == "aborted":
                eng.running[f"{self.name}*"] = Arriving(f"{self.name}*")
            object.__setattr__(self, key, value)

    try:
        eng.running = {"a": Arriving("a"), "b": Arriving("b")}
        eng.flush_cache()
        assert {"a+", "b+"} <= set(eng.running)
        eng.pause("abort")
        assert {"a*", "b*"} <= set(eng.running)
    finally:
        eng.running = saved
        eng.resume()


def _routers_topk(model, ids):
    """Top-k expert ids [len(ids), layers, topk] of a full teacher-forced forward (HF, no cache)."""
    got = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[-1]))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([got[i].reshape(len(ids), -1) for i in range(len(model.model.layers))], dim=1)


def test_routed_experts_are_the_models_own_routing(tmp_path):
    """return_routed_experts (MoE, --enable-return-routed-experts): base64 int32 [prompt + output - 1, layers, topk],
    equal (as sets per token) to the routers' choice in one teacher-forced HF forward of the whole sequence, across
    a retracting pause that recomputes the KV cache mid-generation; refused without the server flag, and a dense
    model cannot enable it."""
    import base64
    import json
    import urllib.request

    import numpy as np

    from forge_megatron.rollout.engine_server import ReferenceEngine

    d = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", sampling_seed=0)
    h = start_engine(d, in_process=True, extra_args=["--enable-return-routed-experts"])
    plain = start_engine(d, in_process=True)
    try:
        def post(url, body):
            req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return 200, json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        body = {"input_ids": PROMPT, "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 9, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}}
        status, out = post(h.url, body)
        assert status == 200
        model = h.engine.model
        layers, top_k = len(model.model.layers), model.config.num_experts_per_tok
        ids = PROMPT + out["output_ids"]
        routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        routed = torch.from_numpy(routed.copy()).reshape(len(ids) - 1, layers, top_k)
        want = _routers_topk(model, ids[:-1])
        assert torch.equal(routed.sort(-1).values, want.to(torch.int32).sort(-1).values)
        assert routed.min() >= 0 and routed.max() < model.config.num_experts

        # A retracting pause mid-generation drops the KV cache; positions are recomputed and still recorded.
        eng = h.engine
        req = eng.new_request(body)
        eng._step(req)
        eng._step(req)
        eng.flush_cache()
        while req.finish is None:
            eng._step(req)
        again = eng.routed_experts(req)
        full = PROMPT + req.output_ids
        assert torch.equal(again.sort(-1).values, _routers_topk(model, full[:-1]).to(torch.int32).sort(-1).values)

        status, err = post(plain.url, body)
        assert status == 400 and "--enable-return-routed-experts" in err["error"]["message"]
    finally:
        h.stop()
        plain.stop()
    with pytest.raises(ValueError, match="no MoE router"):
        ReferenceEngine(build_tiny_model(str(tmp_path / "dense")), return_routed_experts=True)


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "kimi_k25"])
def test_vision_language_release_swaps_in_by_its_checkpoint_names(tmp_path, arch):
    """An engine serving a vision-language release (transformers' image-text-to-text model) loads another checkpoint
    of it from disk by the released names: Qwen3-VL-MoE's transposed fused experts, Kimi-K2.5's language_model.*
    names and per-expert tensors. Its greedy logprobs then equal transformers' on that checkpoint, and
    /get_model_info reports the language model's vocabulary (the top-level config has none)."""
    from forge_megatron.models import load_causal_lm

    first = build_tiny_model(str(tmp_path / "a"), arch=arch, seed=1)
    other = build_tiny_model(str(tmp_path / "b"), arch=arch, seed=2)
    h = start_engine(first, in_process=True)
    try:
        async def go():
            c = SGLangClient(h.url)
            info = await c.get_model_info()
            await c.update_weights_from_disk(other)
            res = await c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
            await c.close()
            return info, res
        info, res = run(go())
    finally:
        h.stop()
    ref = load_causal_lm(other, dtype=torch.float32).eval()
    assert info["vocab_size"] == ref.config.get_text_config().vocab_size
    assert res.logprobs == pytest.approx(teacher_forced_logprobs(ref, PROMPT, res.output_ids), abs=1e-4)
    mine = load_causal_lm(first, dtype=torch.float32).eval()  # the control: the first checkpoint scores otherwise
    assert teacher_forced_logprobs(mine, PROMPT, res.output_ids) != pytest.approx(res.logprobs, abs=1e-3)


def _generate_routed(eng) -> tuple[torch.Tensor, list[int]]:
    """(the routed experts the engine recorded, the ids) of a 6-token sampled generation after PROMPT."""
    req = eng.new_request({"input_ids": PROMPT, "return_routed_experts": True,
                           "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3,
                                               "ignore_eos": True}})
    while req.finish is None:
        eng._step(req)
    return eng.routed_experts(req), PROMPT + req.output_ids


def _forward_capturing(eng, ids: list[int], modules: dict, read) -> dict:
    """{key: read(args, output)} of each of ``modules`` (key -> module) in a fresh forward of ``ids``."""
    got, hooks = {}, []
    for key, module in modules.items():
        hooks.append(module.register_forward_hook(lambda m, a, out, key=key: got.__setitem__(key, read(a, out))))
    try:
        with torch.no_grad():
            eng.model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return got


def test_routed_experts_of_nemotron_h_moe_layers(tmp_path):
    """Nemotron-H's routers are its "moe" layers' one mixer (``mixer.gate``): return_routed_experts records them in
    their layers' columns, the Mamba-2 and attention layers' columns -1, the ids the gates' own top-k."""
    d = build_tiny_model(str(tmp_path / "nemotron_h_moe"), arch="nemotron_h_moe", sampling_seed=0)
    h = start_engine(d, in_process=True, extra_args=["--enable-return-routed-experts"])
    try:
        eng = h.engine
        assert sorted(eng.routers) == [1, 3]
        routed, ids = _generate_routed(eng)
        assert routed.shape == (len(ids) - 1, 4, 2)
        assert (routed[:, [0, 2]] == -1).all() and (routed[:, [1, 3]] >= 0).all()
        got = _forward_capturing(eng, ids[:-1], {i: eng.model.model.layers[i].mixer.gate for i in (1, 3)},
                                 lambda args, out: out[-1])
        for i in (1, 3):
            assert torch.equal(routed[:, i].sort(-1).values, got[i].reshape(len(ids) - 1, 2).to(torch.int32)
                               .sort(-1).values), i
    finally:
        h.stop()


@pytest.mark.parametrize("arch,layers,top_k", [("granitemoe_swa", 2, 2), ("lfm2_moe", 2, 2), ("cohere2_moe", 3, 2),
                                              ("afmoe", 3, 2), ("deepseek_v2", 2, 2)])
def test_routed_experts_of_granite_lfm2_and_cohere_moe_blocks(tmp_path, arch, layers, top_k):
    """Granite MoE's routers sit under ``block_sparse_moe``, LFM2-MoE's gates under ``feed_forward`` (choosing with
    their bias), Cohere2-MoE's under ``mlp`` beside a shared expert, AFMoE's ``mlp.router`` (choosing with the
    block's bias), DeepSeek-V2's softmax ``mlp.gate``: return_routed_experts records each MoE layer's
    top-k ids (a dense first layer's column -1), the ids the experts of a fresh forward of the same tokens are given
    (the MoE block's own choice, read off the experts module's inputs)."""
    d = build_tiny_model(str(tmp_path / arch), arch=arch, sampling_seed=0)
    h = start_engine(d, in_process=True, extra_args=["--enable-return-routed-experts"])
    try:
        eng = h.engine
        moe = sorted(eng.routers)
        assert moe and eng.router_top_k == top_k
        routed, ids = _generate_routed(eng)
        assert routed.shape == (len(ids) - 1, layers, top_k)
        assert all((routed[:, i] == -1).all() == (i not in moe) for i in range(layers))
        experts = {i: next(m for name, m in eng.decoder_layers()[i].named_modules()
                           if name.rsplit(".", 1)[-1] == "experts") for i in moe}  # (not shared_experts)
        got = _forward_capturing(eng, ids[:-1], experts, lambda args, out: args[1])
        for i in moe:  # the experts' top_k_index argument: what the block routed each token to
            assert torch.equal(routed[:, i].sort(-1).values,
                               got[i].reshape(len(ids) - 1, top_k).to(torch.int32).sort(-1).values), i
    finally:
        h.stop()
