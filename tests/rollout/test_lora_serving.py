"""forge-engine's LoRA serving (rollout/lora_serving.py, SGLang's API): with ``lora_path`` the engine decodes as PEFT
runs the base model with that adapter (logprobs, greedy tokens), without it as the base; adapters load and unload
while serving; what SGLang refuses is refused with a 400 that says why; an unload waits for the running requests
that use the adapter, which finish with it. Real HTTP, real PEFT adapters."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from forge_megatron.rollout.launch import start_engine
from tests.rollout.peft_adapters import write_peft_adapter

PROMPT = [5, 17, 42, 99, 7, 123]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("lora_serving")
    model = build_tiny_model(str(root / "qwen3"), arch="qwen3", seed=3)
    adapters = {"a": write_peft_adapter(model, str(root / "a"), seed=1),
                "rs": write_peft_adapter(model, str(root / "rs"), targets=("k_proj", "gate_proj", "up_proj"),
                                         rank=8, alpha=4.0, seed=2, use_rslora=True),
                "big": write_peft_adapter(model, str(root / "big"), rank=16, seed=3)}
    engine = start_engine(model, in_process=True,
                          extra_args=["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj",
                                      "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    yield model, adapters, engine
    engine.stop()


def _call(url, route, body=None):
    req = urllib.request.Request(url + route, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _greedy(url, lora_path=None, n=6, **extra):
    status, out = _call(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, **extra,
                                           "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                               "ignore_eos": True},
                                           **({"lora_path": lora_path} if lora_path else {})})
    assert status == 200, out
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def _peft_logprobs(model_dir, adapter_dir, ids):
    """PEFT's logprobs of ``ids`` after PROMPT, with the adapter (or the base model: ``adapter_dir`` None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([PROMPT + ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(ids)]


def test_an_adapter_decodes_as_peft_and_the_base_stays_the_base(served):
    model, adapters, engine = served
    base_ids, base_lps = _greedy(engine.url)
    for name in ("a", "rs"):  # rs: rank 8 on k/gate/up, scaled by alpha / sqrt(r) (use_rslora)
        status, out = _call(engine.url, "/load_lora_adapter", {"lora_name": name, "lora_path": adapters[name]})
        assert status == 200 and out["success"] and out["loaded_adapters"][name] == adapters[name], out
    try:
        for name in ("a", "rs"):
            ids, lps = _greedy(engine.url, name)
            want = _peft_logprobs(model, adapters[name], ids)
            assert max(abs(x - y) for x, y in zip(lps, want)) < 1e-5, name
            assert _peft_logprobs(model, None, ids) != pytest.approx(want, abs=1e-3)  # the adapter matters
        assert _greedy(engine.url) == (base_ids, base_lps)  # requests without lora_path: the base model
        assert max(abs(x - y) for x, y in zip(base_lps, _peft_logprobs(model, None, base_ids))) < 1e-5
        # streamed, with top logprobs: the same adapter
        ids, _ = _greedy(engine.url, "a")
        status, out = _call(engine.url, "/generate", {"input_ids": PROMPT, "lora_path": "a", "top_logprobs_num": 2,
                                                      "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                          "ignore_eos": True}})
        assert status == 200 and out["output_ids"] == ids
        cards = _call(engine.url, "/v1/models")[1]["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [(model, None), ("a", model), ("rs", model)]
    finally:
        for name in ("a", "rs"):
            assert _call(engine.url, "/unload_lora_adapter", {"lora_name": name})[0] == 200
    assert _call(engine.url, "/v1/models")[1]["data"][1:] == []


@pytest.mark.parametrize("route,body,words", [
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}, "is not a directory"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "big"}, "exceeds the server's --max-lora-rank 8"),
    ("/load_lora_adapter", {"lora_name": "", "lora_path": "a"}, "lora_name must be a non-empty string"),
    ("/load_lora_adapter", {"lora_name": "x"}, "lora_path (an adapter directory) is required"),
    ("/unload_lora_adapter", {"lora_name": "never"}, "no LoRA adapter named 'never'"),
    ("/generate", {"input_ids": PROMPT, "lora_path": "never"}, "LoRA adapters are not loaded: never"),
    ("/generate", {"input_ids": PROMPT, "lora_path": ["a"]}, "the name of a loaded adapter"),
])
def test_bad_adapter_requests_are_400_saying_why(served, route, body, words):
    _, adapters, engine = served
    if isinstance(body.get("lora_path"), str) and body["lora_path"] in adapters:
        body = {**body, "lora_path": adapters[body["lora_path"]]}
    status, out = _call(engine.url, route, body)
    assert status == 400 and words in (out.get("error_message") or out.get("message")), out


def test_refusals_sglang_makes(served, tmp_path):
    """A second load under a loaded name, modules outside --lora-target-modules, DoRA, a module the model lacks:
    refused, nothing loaded; a server without --enable-lora refuses every LoRA request."""
    model, adapters, engine = served
    assert _call(engine.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]})[0] == 200
    try:
        status, out = _call(engine.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["rs"]})
        assert status == 400 and "already loaded" in out["error_message"]
    finally:
        _call(engine.url, "/unload_lora_adapter", {"lora_name": "a"})
    narrow = start_engine(model, in_process=True, extra_args=["--enable-lora", "--lora-target-modules", "q_proj"])
    plain = start_engine(model, in_process=True)
    try:
        status, out = _call(narrow.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]})
        assert status == 400 and "not among the server's --lora-target-modules (q_proj)" in out["error_message"]
        dora = write_peft_adapter(model, str(tmp_path / "dora"), targets=("q_proj",), use_dora=True)
        status, out = _call(narrow.url, "/load_lora_adapter", {"lora_name": "d", "lora_path": dora})
        assert status == 400 and "use_dora=True is not supported" in out["error_message"]
        renamed = tmp_path / "renamed"
        renamed.mkdir()
        from safetensors.torch import load_file, save_file

        tensors = {k.replace("layers.0.", "layers.9."): v
                   for k, v in load_file(f"{adapters['a']}/adapter_model.safetensors").items()}
        save_file(tensors, str(renamed / "adapter_model.safetensors"))
        (renamed / "adapter_config.json").write_text(open(f"{adapters['a']}/adapter_config.json").read())
        status, out = _call(engine.url, "/load_lora_adapter", {"lora_name": "r", "lora_path": str(renamed)})
        assert status == 400 and "'model.layers.9.mlp.down_proj' is not a linear layer" in out["error_message"]
        assert _call(narrow.url, "/v1/models")[1]["data"][1:] == []
        status, out = _call(plain.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]})
        assert status == 400 and "--enable-lora" in out["message"]
        status, out = _call(plain.url, "/generate", {"input_ids": PROMPT, "lora_path": "a"})
        assert status == 400 and "--enable-lora" in out["message"]
    finally:
        narrow.stop()
        plain.stop()


def test_an_unload_waits_for_the_requests_using_the_adapter(served):
    """SGLang's unload answers once no running request uses the adapter: a request held (the engine paused in
    place) keeps its adapter through the unload and ends with the adapter's tokens; new requests naming it are
    refused at once."""
    _, adapters, engine = served
    assert _call(engine.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]})[0] == 200
    want = _greedy(engine.url, "a", n=12)
    assert _call(engine.url, "/pause_generation", {"mode": "in_place"})[0] == 200
    got, unloaded = {}, {}
    held = threading.Thread(target=lambda: got.update(out=_greedy(engine.url, "a", n=12)))
    held.start()
    deadline = time.monotonic() + 30
    while not engine.engine.admitted and time.monotonic() < deadline:
        time.sleep(0.01)
    unload = threading.Thread(target=lambda: unloaded.update(
        answer=_call(engine.url, "/unload_lora_adapter", {"lora_name": "a"})))
    unload.start()
    time.sleep(0.5)
    try:
        assert unload.is_alive() and not unloaded  # waiting for the held request
        status, out = _call(engine.url, "/generate", {"input_ids": PROMPT, "lora_path": "a"})
        assert status == 400 and "not loaded" in out["message"]
    finally:
        assert _call(engine.url, "/continue_generation", {})[0] == 200
    held.join(60)
    unload.join(60)
    assert got["out"] == want and unloaded["answer"][0] == 200


def test_the_client_loads_lists_and_unloads_adapters(served):
    """SGLangClient's LoRA calls against the engine: load, list (the adapter after the base, with parent), a
    generate naming it, unload; a failed load is an EngineRequestError saying why."""
    import asyncio

    from forge_megatron.rollout.sglang_client import EngineRequestError, SGLangClient

    model, adapters, engine = served

    async def go():
        client = SGLangClient(engine.url)
        try:
            loaded = await client.load_lora_adapter("c", adapters["a"])
            cards = await client.list_models()
            result = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                                           lora_path="c")
            direct = await asyncio.to_thread(_greedy, engine.url, "c")  # the same request over plain HTTP
            await client.unload_lora_adapter("c")
            with pytest.raises(EngineRequestError, match="exceeds the server's --max-lora-rank 8"):
                await client.load_lora_adapter("big", adapters["big"])
            return loaded, cards, result, direct, await client.list_models()
        finally:
            await client.close()

    loaded, cards, result, direct, after = asyncio.run(go())
    assert loaded["success"] and loaded["loaded_adapters"] == {"c": adapters["a"]}
    assert [(c["id"], c.get("parent")) for c in cards] == [(model, None), ("c", model)]
    assert result.lora_path == "c" and (result.output_ids, result.logprobs) == direct
    assert result.output_ids != _greedy(engine.url)[0]  # (the adapter's tokens, not the base model's)
    assert [c["id"] for c in after] == [model]
