"""Images through the gateway: OpenAI image parts, Anthropic image blocks and Responses input_image parts become the
model's image tokens (one per merged patch) and SGLang's image_data; the episode records the normalised images with
the tokens; a conversation that keeps its images continues its segment; and the trainer's tree forward of what was
recorded scores the sampled tokens as the engine did (real engine, gateway, pool wire form, Megatron model)."""

from __future__ import annotations

import base64

import anthropic
import numpy as np
import openai
import pytest
import torch

from tests.middleware.test_gateway import end, episode, http, new_session
from tests.multimodal.test_vision_tree import png


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("vl_gateway")), "qwen3_vl", images=True, seed=2)


@pytest.fixture(scope="module")
def served(vl_dir):
    from forge_megatron.rollout.launch import start_engine, start_gateway

    engine = start_engine(vl_dir, in_process=True)
    gw = start_gateway(vl_dir, [engine.url], in_process=True)
    yield gw
    gw.stop()
    engine.stop()


@pytest.fixture(scope="module")
def pictures():
    rng = np.random.default_rng(5)
    return [png(rng, 30, 50), png(rng, 16, 16), png(rng, 30, 50)]


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _user(text: str, *images: bytes) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": _url(x)}} for x in images)]}


def _chat(session, messages, **kw):
    c = openai.OpenAI(base_url=session["base_url"], api_key="ignored", max_retries=0, timeout=60)
    return c.chat.completions.create(model="tiny", messages=messages, **{"max_tokens": 6, "temperature": 1.0, **kw})


def test_chat_with_images_records_image_tokens_and_continues(served, vl_dir, pictures):
    from forge_megatron.multimodal.images import ImageProcessor

    proc = ImageProcessor(vl_dir)
    pad = proc.spec.image_token_id
    s = new_session(served)
    first = [_user("what is this?", pictures[0])]
    r1 = _chat(s, first, temperature=0.0)  # greedy: a sampled image token would end it and start a new segment
    history = first + [{"role": "assistant", "content": r1.choices[0].message.content or ""},
                       _user("and these?", pictures[1], pictures[0])]
    r2 = _chat(s, history)
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert end(served, s)[0] == 200
    ep = episode(served, s)
    assert len(ep.segments) == 1  # the second call extends the first: same images first, same tokens
    seg = ep.segments[0]
    normalized = [proc.normalize(x) for x in (pictures[0], pictures[1], pictures[0])]
    assert seg.images == normalized
    tokens = np.array(seg.tokens)
    from forge_megatron.multimodal.families import image_runs

    runs = image_runs(tokens, pad, seg.loss_mask)  # (an image token the model sampled is text)
    assert [b - a for a, b in runs] == [proc.num_tokens(x) for x in normalized] == [15, 4, 15]
    assert all(seg.loss_mask[a:b] == [0] * (b - a) for a, b in runs)
    # the engine took each image as one placeholder and counted the prompt as the gateway wrote it out
    from tests.middleware.test_gateway import scrape

    assert scrape(served.url)["forge_gateway_image_prompt_mismatches_total"] == 0


def test_sampled_image_token_ends_the_call_and_the_segment(served, pictures):
    """A completion that samples the image token stops there (the engine is given it as a stop token), and the next
    call does not continue that segment: its prompt would hold an image token that is no image."""
    from forge_megatron.middleware.gateway import ChatRequest
    from forge_megatron.middleware.gateway_sessions import _Turn

    gw = served.gateway
    pad = gw.images.spec.image_token_id
    s = gw.sessions[new_session(served)["session_id"]]
    call = gw.prepare(s, ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=None, tool_choice="auto",
                                     sampling={"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0}, stream=False,
                                     include_usage=False, logprobs=False, top_logprobs=0, separate_reasoning=True))
    assert pad in call.sampling["stop_token_ids"]
    prev = _Turn(messages=[], tools=None, prompt_text="a", prompt_ids=[5, 6], completion_ids=[7, pad],
                 assistant_message={})
    ids, continues = gw.expand_images(prev, [5, 6, 7, pad, 8], True, "b", [])
    assert not continues and ids == gw.renderer.encode("b")
    prev.completion_ids = [7, 2]
    assert gw.expand_images(prev, [5, 6, 7, 2, 8], True, "b", []) == ([5, 6, 7, 2, 8], True)


def test_changed_image_starts_a_new_segment(served, pictures):
    s = new_session(served)
    r1 = _chat(s, [_user("look", pictures[0])])
    # the same text and an image of the same size with other pixels: same token ids, another image
    _chat(s, [_user("look", pictures[2]), {"role": "assistant", "content": r1.choices[0].message.content or ""},
              {"role": "user", "content": "more"}])
    assert end(served, s)[0] == 200
    ep = episode(served, s)
    assert len(ep.segments) == 2
    assert ep.segments[0].images != ep.segments[1].images[:1]


def test_anthropic_and_responses_images_record_as_chat(served, pictures):
    """The same image request through the three APIs records the same prompt ids and images."""
    chat = new_session(served)
    _chat(chat, [_user("what is this?", pictures[1])])
    anth = new_session(served)
    a = anthropic.Anthropic(base_url=anth["anthropic_base_url"], api_key="ignored", max_retries=0)
    a.messages.create(model="tiny", max_tokens=6, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(pictures[1]).decode()}}]}])
    resp = new_session(served)
    o = openai.OpenAI(base_url=resp["base_url"], api_key="ignored", max_retries=0, timeout=60)
    o.responses.create(model="tiny", max_output_tokens=6, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": _url(pictures[1])}]}])
    recorded = []
    for s in (chat, anth, resp):
        _, summary = http(f"{served.url}/forge/sessions/{s['session_id']}", method="GET")
        recorded.append(summary["calls"][0]["prompt_ids"])
        assert end(served, s)[0] == 200
        assert episode(served, s).segments[0].images == episode(served, chat).segments[0].images
    assert recorded[0] == recorded[1] == recorded[2]


@pytest.mark.parametrize("message,match", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
     "fetches no image URLs"),  # (tests/multimodal/test_image_urls.py: a gateway that does)
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]},
     "not valid base64"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]},
     "not a readable image"),
    ({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]},
     "must be a text part"),
    ({"role": "user", "content": "a \u0000forge:image\u0000 b"}, "marker the gateway reserves"),
    ({"role": "user", "content": "a <|image_pad|> b"}, "image placeholder"),
])
def test_bad_images_are_400_naming_them(served, message, match):
    s = new_session(served)
    status, body = http(s["base_url"] + "/chat/completions", {"model": "tiny", "messages": [message], "max_tokens": 2})
    assert status == 400 and match in body["error"]["message"], body


def test_text_model_refuses_images(tmp_path, pictures):
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.launch import start_engine, start_gateway

    d = build_tiny_model(str(tmp_path / "text"), "qwen3")
    engine = start_engine(d, in_process=True)
    gw = start_gateway(d, [engine.url], in_process=True)
    try:
        s = new_session(gw)
        status, body = http(s["base_url"] + "/chat/completions",
                            {"model": "tiny", "messages": [_user("x", pictures[1])], "max_tokens": 2})
        assert status == 400 and "takes no images" in body["error"]["message"]
    finally:
        gw.stop()
        engine.stop()


def _trainer_logprobs(rank, world_size, hf_dir, episode_blob, segments):
    """The trainer's path for one recorded episode: pool wire form -> TrainSamples -> rank_batch (images encoded by
    the checkpoint's processor) -> tree forward with the vision tower; logprobs of the sampled tokens."""
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.middleware.batch import TrainBatch, group_samples
    from forge_megatron.middleware.wire import blob_to_wire
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.training.trainer import rank_batch
    from tests.multimodal.test_vision_tree import _tree_model

    _, model, spec, _ = _tree_model(hf_dir)
    samples = group_samples([blob_to_wire(episode_blob)], {"rewards": [1.0], "segment_advantages": [[1.0] * segments],
                                                           "segment_weights": [[1.0] * segments]}, 0)
    rb = rank_batch(TrainBatch(0, samples, [0]), 4096, True, 0, 1, [], hidden_size=8, vision=ImageProcessor(hf_dir))
    (mb,) = rb.micro_batches
    with torch.no_grad():
        logp, _ = tree_logprobs(model, mb.layout)
    return logp, mb.extras["loss_mask_M"], mb.extras["rollout_logp_M"]


@pytest.mark.parametrize("second", ["continued", "rewritten"])
def test_trainer_scores_recorded_images_as_the_engine(served, vl_dir, pictures, second):
    """Two calls with a picture each, the second continuing the first (one segment holding both pictures) or
    rewriting the history (a segment each): the trainer's logprobs of the sampled tokens are the engine's."""
    from tests.multimodal.vl_checks import assert_scored_as_engine

    s = new_session(served)
    r1 = _chat(s, [_user("what is this?", pictures[0])], max_tokens=8)
    history = [_user("what is this?", pictures[0]), {"role": "assistant", "content": r1.choices[0].message.content}]
    _chat(s, [*(history if second == "continued" else []), _user("and this?", pictures[1])], max_tokens=8)
    assert end(served, s)[0] == 200
    if second == "rewritten":
        assert len(episode(served, s).segments) == 2
    ep = episode(served, s)  # (one segment, or two when the first completion sampled the image token: sampling)
    assert_scored_as_engine(vl_dir, ep)


def test_max_body_flag_raises_the_limit_for_image_agents(tmp_path):
    from forge_megatron.middleware.gateway import build_parser, session_options

    args = build_parser().parse_args(["--model-path", str(tmp_path), "--engines", "http://127.0.0.1:1",
                                      "--max-body-mib", "48"])
    assert session_options(args)["max_body_bytes"] == 48 << 20
    default = build_parser().parse_args(["--model-path", str(tmp_path), "--engines", "http://127.0.0.1:1"])
    assert session_options(default)["max_body_bytes"] == 8 << 20


def test_an_engine_counting_the_images_otherwise_is_counted(served, pictures):
    """An engine whose processor writes images out in another form (another SGLang) counts another prompt length
    than the gateway wrote: the call is counted in forge_gateway_image_prompt_mismatches_total (and logged); the
    lengths written out and as sent are not."""
    from forge_megatron.middleware.gateway import _Call
    from forge_megatron.middleware.gateway_sessions import _Turn
    from forge_megatron.rollout.sglang_client import GenerateResult

    gw = served.gateway
    image = gw.images.normalize(pictures[1])
    written = [5, 6, gw.images.vision_start, *gw.images.image_ids(image), gw.images.vision_end, 7]
    turn = _Turn(messages=[], tools=None, prompt_text="", prompt_ids=written, completion_ids=None,
                 assistant_message={}, images=[image])
    call = _Call(turn=turn, continues=False, sampling={}, forced_text="", started=0.0)
    before = gw.stats["image_prompt_mismatches"]
    for counted in (len(written), len(gw.engine_ids(call, written)), len(written) + 3):
        result = GenerateResult(output_ids=[1], logprobs=[-1.0], finish_reason={"type": "length"},
                                prompt_tokens=counted, completion_tokens=1, weight_version=None, text="")
        gw.check_image_prompt(call, result)
    assert len(gw.engine_ids(call, written)) == 6 and gw.stats["image_prompt_mismatches"] == before + 1
