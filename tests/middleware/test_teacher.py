"""A served distillation teacher (middleware/teacher.py): forge-engine's prefill-only input logprobs (SGLang's
``logprob_start_len`` / ``input_token_logprobs``) against transformers, the gateway scoring each ended episode's
sampled tokens with a teacher engine (``teacher_urls``), failover, a teacher that does not answer (503, nothing
lost) or refuses (the episode sent as failed), and the logprobs travelling through the wire, the pool's database and
its batches. CPU, real HTTP servers."""

import asyncio
import math

import numpy as np
import pytest
import torch

from forge_megatron.middleware.schema import Episode, SchemaError, Segment
from forge_megatron.middleware.wire import (WireError, batch_from_wire, batch_to_wire, episode_from_blob,
                                            episode_from_wire, episode_to_blob, episode_to_wire)
from forge_megatron.models.tiny import build_tiny_model, build_tiny_teacher
from forge_megatron.rollout.launch import start_engine, start_gateway
from forge_megatron.rollout.sglang_client import EngineRequestError, SGLangClient
from forge_megatron.utils.ports import free_port
from tests.middleware.test_gateway import calls, client, end, episode, http, new_session

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher")
    return build_tiny_model(str(d / "student")), build_tiny_teacher(str(d / "teacher"), seed=3, num_hidden_layers=3)


@pytest.fixture(scope="module")
def teacher_engine(models):
    engine = start_engine(models[1], in_process=True)
    yield engine
    engine.stop()


def _logprobs(model_dir: str, ids: list[int], temperature: float = 1.0) -> list[float]:
    """transformers' logprob of ids[t] given ids[:t], t = 1..n-1, under softmax(logits / temperature)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    return [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def test_engine_scores_the_input_as_sglang_does(models, teacher_engine):
    """/generate with ``logprob_start_len`` s and ``max_new_tokens: 0``: ``input_token_logprobs`` has one
    [logprob, token_id, None] per position from s, the first None, the others transformers' (at temperature 1 and
    0.7: tempered like the output logprobs); with new tokens too, the output is sampled as before. A start outside
    the input is a 400 naming the field."""
    _, teacher = models
    ids = list(range(20, 44))
    c = SGLangClient(teacher_engine.url)

    async def run():
        try:
            for temperature in (1.0, 0.7):
                got = await c.input_logprobs(ids, 5, temperature)
                want = _logprobs(teacher, ids, temperature)[5:]
                assert len(got) == len(ids) - 6
                assert np.allclose(got, want, atol=2e-5), np.abs(np.subtract(got, want)).max()
            raw = await c._call("POST", "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                                      "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
            meta = raw["meta_info"]
            assert meta["input_token_logprobs"][0] == [None, ids[0], None]
            assert [e[1] for e in meta["input_token_logprobs"]] == ids
            assert len(raw["output_ids"]) == 3 and len(meta["output_token_logprobs"]) == 3
            with pytest.raises(EngineRequestError, match="logprob_start_len must be -1"):
                await c.input_logprobs(ids, len(ids))
        finally:
            await c.close()

    asyncio.run(run())


def _two_call_segment(gw, first: int, second: int) -> Segment:
    """A session of two calls on ``gw`` (``first`` then ``second`` sampled tokens, the second call extending the
    first: one segment), ended; the segment the sink got."""
    s = new_session(gw)
    c = client(s)
    msgs = [{"role": "user", "content": "Count with me"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=first, seed=1,
                                  extra_body={"ignore_eos": True})
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "More"}]
    c.chat.completions.create(model="tiny", messages=msgs, max_tokens=second, seed=2, extra_body={"ignore_eos": True})
    assert len(calls(gw, s)) == 2
    assert end(gw, s)[0] == 200
    (seg,) = episode(gw, s).segments
    return seg


def test_gateway_records_the_teachers_logprobs_of_sampled_tokens(models, teacher_engine):
    """A two-call session on the student (the second extending the first: one segment) ended through a gateway
    with a teacher: the sink's episode has, at every sampled token, the teacher's logprob of it given everything
    before (transformers on the teacher), 0 elsewhere; the state says a teacher is configured and counts the
    scored tokens. A teacher list whose first URL is dead still scores (the next engine answers)."""
    student, teacher = models
    engine = start_engine(student, in_process=True)
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(student, [engine.url], in_process=True,
                       config={"teacher_urls": (dead, teacher_engine.url), "teacher_timeout_s": 20.0})
    try:
        seg = _two_call_segment(gw, 6, 5)
        want = _logprobs(teacher, seg.tokens)
        sampled = [t for t, m in enumerate(seg.loss_mask) if m]
        assert len(sampled) == 11 and seg.teacher_logprobs is not None
        for t in range(len(seg.tokens)):
            if seg.loss_mask[t]:
                assert seg.teacher_logprobs[t] == pytest.approx(want[t - 1], abs=2e-5)
            else:
                assert seg.teacher_logprobs[t] == 0.0
        # the teacher is another model: its logprobs are not the student's (recorded as rollout logprobs)
        assert max(abs(seg.teacher_logprobs[t] - seg.rollout_logprobs[t]) for t in sampled) > 0.05
        state = http(gw.url + "/forge/admin/state", method="GET")[1]
        assert state["config"]["teacher"] is True and state["teacher_scored_tokens"] == 11
    finally:
        gw.stop()
        engine.stop()


def test_a_teacher_that_does_not_answer_or_refuses(models, tmp_path):
    """No teacher engine answering: the end is a 503 ``teacher_unavailable`` and the session stays open (its calls
    kept; once a teacher answers, the same end goes through). A teacher that refuses (its context shorter than the
    episode: a 400 a retry would not change): the episode is sent as failed, the reason in its metadata."""
    student, teacher = models
    engine = start_engine(student, in_process=True)
    port = free_port()
    gw = start_gateway(student, [engine.url], in_process=True,
                       config={"teacher_urls": (f"http://127.0.0.1:{port}",), "teacher_timeout_s": 10.0})
    short = start_engine(teacher, in_process=True, extra_args=["--context-length", "8"])
    refusing = start_gateway(student, [engine.url], in_process=True, config={"teacher_urls": (short.url,)})
    try:
        s = new_session(gw)
        client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        status, body = end(gw, s)
        assert status == 503 and body["error"]["code"] == "teacher_unavailable", body
        assert "nothing was lost" in body["error"]["message"]
        assert http(f"{gw.url}/forge/sessions/{s['session_id']}", method="GET")[1]["status"] is None  # still open
        assert not gw.gateway.sink.episodes
        gw.gateway.teacher.clients[0].url = short.url.rstrip("/")  # a teacher answers now (it refuses: see below)
        gw.gateway.config.teacher_urls = (short.url,)
        s2 = new_session(refusing)
        client(s2).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert end(refusing, s2)[0] == 200
        ep = episode(refusing, s2)
        assert ep.status == "failed" and "exceed the context length" in ep.metadata["teacher_error"]
        assert all(seg.teacher_logprobs is None for seg in ep.segments)
        assert http(refusing.url + "/forge/admin/state", method="GET")[1]["teacher_failed_episodes"] == 1
        # the first gateway's session, ended again now that a teacher answers: sent (as failed: that one refuses)
        assert end(gw, s)[0] == 200 and episode(gw, s).status == "failed"
    finally:
        for server in (gw, refusing, short, engine):
            server.stop()


def test_the_driver_sends_the_end_again_until_the_teacher_answers(models, teacher_engine):
    """The rollout runner's end (agents/runner.end_session) on a gateway whose teacher is down at first: the 503 is
    answered by sending the end again after a wait; once the teacher is back the episode reaches the sink scored.
    Another error (the session unknown: 404) is raised at once."""
    import threading

    from forge_megatron.agents.gateway_api import GatewayClient, GatewayError
    from forge_megatron.agents.runner import end_session

    student, _ = models
    engine = start_engine(student, in_process=True)
    gw = start_gateway(student, [engine.url], in_process=True,
                       config={"teacher_urls": (f"http://127.0.0.1:{free_port()}",), "teacher_timeout_s": 10.0})
    try:
        s = new_session(gw)
        client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        back = threading.Timer(0.5, lambda: setattr(gw.gateway.teacher.clients[0], "url",
                                                    teacher_engine.url.rstrip("/")))
        back.start()
        ended = end_session(GatewayClient(gw.url), s["session_id"], "finished", backoff_s=(1.5,))
        back.join()
        assert ended["sink"] == "accepted"
        (seg,) = episode(gw, s).segments
        assert seg.teacher_logprobs is not None and sum(seg.loss_mask) == 4
        assert all(x < 0 for x, m in zip(seg.teacher_logprobs, seg.loss_mask) if m)
        with pytest.raises(GatewayError) as err:
            end_session(GatewayClient(gw.url), "no-such-session", "finished", backoff_s=(0.0,))
        assert err.value.status == 404
    finally:
        gw.stop()
        engine.stop()


def test_a_privileged_teacher_reads_its_own_system_message_first(models, teacher_engine):
    """--teacher-prompt: each group's teacher reads a system message of its own (the template filled in with the
    task's metadata), then the segment: the recorded logprobs are transformers' teacher's on prefix + tokens at the
    sampled tokens' shifted positions (the student's own tokens are unchanged). A group whose task lacks a field the
    template names is refused when it is created; the BOS both start with is read once; the teacher's top-k
    (``topk``) is read at the same shifted positions."""
    from forge_megatron.middleware.teacher import TeacherScorer

    student, teacher = models
    engine = start_engine(student, in_process=True)
    gw = start_gateway(student, [engine.url], in_process=True,
                       config={"teacher_urls": (teacher_engine.url,), "teacher_prompt": "The answer is {answer}."})
    try:
        status, g = http(gw.url + "/forge/groups", {"task_id": "t", "size": 1, "metadata": {"answer": "42"}})
        assert status == 200, g
        status, s = http(gw.url + "/forge/sessions", {"group_id": g["group_id"]})
        client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          extra_body={"ignore_eos": True})
        assert end(gw, s)[0] == 200
        (seg,) = episode(gw, s).segments
        prefix = gw.gateway.teacher_prefix("t", "default", {"answer": "42"})
        assert "The answer is 42." in gw.gateway.renderer.tok.decode(prefix)
        want = _logprobs(teacher, prefix + seg.tokens)
        for t, m in enumerate(seg.loss_mask):
            assert seg.teacher_logprobs[t] == (pytest.approx(want[len(prefix) + t - 1], abs=2e-5) if m else 0.0)
        plain = _logprobs(teacher, seg.tokens)  # (the prompt changes what the teacher says)
        assert max(abs(seg.teacher_logprobs[t] - plain[t - 1]) for t, m in enumerate(seg.loss_mask) if m) > 1e-3
        status, body = http(gw.url + "/forge/groups", {"task_id": "u", "size": 1, "metadata": {"hint": "x"}})
        assert status == 400 and "--teacher-prompt needs {answer}" in body["error"]["message"]
    finally:
        gw.stop()
        engine.stop()
    scorer = TeacherScorer([teacher_engine.url])

    async def scored():
        try:
            return await scorer.segment_logprobs([7, 20, 21, 22], [0, 0, 1, 1], prefix=[7, 8, 9], bos=7)
        finally:
            await scorer.close()

    got = asyncio.run(scored())
    want = _logprobs(teacher, [7, 8, 9, 20, 21, 22])
    assert got[:2] == [0.0, 0.0] and got[2:] == pytest.approx(want[3:], abs=2e-5)
    # with the teacher's top-k too (--teacher-topk): its rows read at the same shifted positions
    scorer = TeacherScorer([teacher_engine.url], topk=5)

    async def scored_topk():
        try:
            return await scorer.segment_logprobs([7, 20, 21, 22], [0, 0, 1, 1], prefix=[7, 8, 9], bos=7)
        finally:
            await scorer.close()

    values, ids, logp = asyncio.run(scored_topk())
    want_ids, want_logp = _top(teacher, [7, 8, 9, 20, 21, 22], 5)
    assert values == pytest.approx(got, abs=1e-6)
    assert np.array_equal(ids, want_ids[3:]) and np.allclose(logp, want_logp[3:], atol=2e-5)


def test_an_aborted_scoring_is_tried_again_not_refused(teacher_engine):
    """An engine that aborts the prefill (SGLang answers a request cut by pause_generation with finish_reason
    abort and no logprobs: teacher URLs may be the policy's own engines, paused by a weight sync) is an unavailable
    engine, not a refusal: the scorer goes on to the next URL, and with none left the episode's end is retried
    later (TeacherUnavailable), never sent as failed. (SGLang cannot run here: a server answering as it does.)"""
    from aiohttp import web

    from forge_megatron.middleware.teacher import TeacherScorer, TeacherUnavailable
    from forge_megatron.rollout.launch import ThreadServer

    async def aborted(request):
        body = await request.json()
        return web.json_response({"text": "", "output_ids": [], "meta_info": {
            "id": "x", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0}})

    async def serve(ready):
        app = web.Application()
        app.router.add_post("/generate", aborted)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ready(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    server = ThreadServer(serve, host="127.0.0.1")
    try:
        async def run(urls):
            scorer = TeacherScorer(urls)
            try:
                return await scorer.segment_logprobs([20, 21, 22, 23], [0, 0, 1, 1])
            finally:
                await scorer.close()

        got = asyncio.run(run([server.url, teacher_engine.url]))  # the aborting one first, then a live teacher
        assert got[:2] == [0.0, 0.0] and all(x < 0 for x in got[2:])
        with pytest.raises(TeacherUnavailable, match="the scoring was aborted"):
            asyncio.run(run([server.url]))
    finally:
        server.stop()


def _segment(n: int, seed: int, teacher: bool = True) -> Segment:
    rng = np.random.default_rng(seed)
    mask = [0] * 4 + [1] * (n - 4)
    return Segment(tokens=rng.integers(0, 300, n).tolist(), loss_mask=mask,
                   rollout_logprobs=[0.0] * 4 + (-rng.random(n - 4)).tolist(), policy_versions=[-1] * 4 + [0] * (n - 4),
                   teacher_logprobs=[0.0] * 4 + (-rng.random(n - 4) * 3).astype(np.float32).tolist() if teacher else None)


def test_teacher_logprobs_travel_through_the_wire_the_database_and_the_batches(make_pool):
    """An episode's teacher logprobs survive the wire and the database blob exactly (float32), reach the trainer's
    batch samples as float32 arrays aligned with the tokens (with routed experts beside them), and come back from
    the batch's wire form, also when it mixes samples with and without them; a segment whose teacher logprobs have
    another length or a positive value is refused naming it."""
    from forge_megatron.middleware.batch import TrainBatch

    segs = [_segment(9, 1), _segment(7, 2)]
    segs[1].routed_experts = np.full((7, 2, 2), 3, np.int16)
    segs[0].routed_experts = np.full((9, 2, 2), 1, np.int16)
    ep = Episode(episode_id="e0", group_id="g", task_id="t", segments=segs, reward=1.0, started_at=0, ended_at=1)
    for back in (episode_from_wire(*episode_to_wire(ep)), episode_from_blob(episode_to_blob(ep))):
        for a, b in zip(ep.segments, back.segments):
            assert b.teacher_logprobs == pytest.approx(a.teacher_logprobs, abs=0)
            assert np.array_equal(a.routed_experts, b.routed_experts)
    pool = make_pool(generation_batch_groups=1)
    gid = pool.register_group("t", 2, "default")
    for e in range(2):
        pool.episode_started(gid, f"e{e}")
        pool.submit_episode(Episode(episode_id=f"e{e}", group_id=gid, task_id="t", segments=[_segment(9, 10 + e)],
                                    reward=float(e), started_at=0, ended_at=1))
    batch = pool.next_batch(1)
    assert len(batch.samples) == 2
    for s in batch.samples:
        want = _segment(9, 10 + int(s.episode_id[1:])).teacher_logprobs
        assert s.teacher_logprobs.dtype == np.float32 and s.teacher_logprobs.tolist() == pytest.approx(want, abs=0)
    back = batch_from_wire(*batch_to_wire(batch))
    assert all(np.array_equal(a.teacher_logprobs, b.teacher_logprobs) for a, b in zip(batch.samples, back.samples))
    # a batch mixing samples with and without them (episodes recorded before the gateway had a teacher) travels,
    # the sample without them still without them
    mixed = TrainBatch(batch_id=1, samples=[batch.samples[0], type(batch.samples[1])(
        **{**batch.samples[1].__dict__, "teacher_logprobs": None})], group_indices=[0])
    back = batch_from_wire(*batch_to_wire(mixed))
    assert back.samples[1].teacher_logprobs is None
    assert np.array_equal(back.samples[0].teacher_logprobs, mixed.samples[0].teacher_logprobs)
    bad = _segment(9, 5)
    bad.teacher_logprobs = bad.teacher_logprobs[:-1]
    with pytest.raises(SchemaError, match="teacher_logprobs has length 8, tokens has 9"):
        bad.validate("segments[0]")
    bad.teacher_logprobs = [0.5] * 9
    with pytest.raises(SchemaError, match="teacher_logprobs must be finite logprobs"):
        bad.validate("segments[0]")
    assert not math.isnan(sum(s.teacher_logprobs.sum() for s in batch.samples))


def _top(model_dir: str, ids: list[int], k: int, temperature: float = 1.0):
    """transformers' k most likely tokens after ids[:t], t = 1..n-1: (ids [n-1, k], logprobs [n-1, k])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double() / temperature
    values, top = torch.log_softmax(logits, -1)[:-1].topk(k, dim=-1)
    return top.numpy(), values.numpy()


def test_engine_and_client_answer_the_inputs_top_logprobs(models, teacher_engine):
    """``top_logprobs_num`` with ``logprob_start_len``: ``input_top_logprobs`` has one entry per position from the
    start, the first None, the others the k most likely tokens of transformers' teacher (most likely first, tempered
    as the input logprobs); the client returns them as int32 / float32 [n, k] beside the logprobs. Answers that are
    not k distinct tokens in descending order are refused naming the position."""
    _, teacher = models
    ids = list(range(30, 52))
    c = SGLangClient(teacher_engine.url)

    async def run():
        try:
            raw = await c._call("POST", "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 3,
                                                      "top_logprobs_num": 4,
                                                      "sampling_params": {"max_new_tokens": 0}})
            entries = raw["meta_info"]["input_top_logprobs"]
            assert entries[0] is None and len(entries) == len(ids) - 3 and all(len(e) == 4 for e in entries[1:])
            values, top_ids, top_logp = await c.input_logprobs(ids, 3, 0.7, top_logprobs_num=5)
            want_ids, want_logp = _top(teacher, ids, 5, 0.7)
            assert top_ids.dtype == np.int32 and top_logp.dtype == np.float32 and top_ids.shape == (len(ids) - 4, 5)
            assert np.array_equal(top_ids, want_ids[3:]) and np.allclose(top_logp, want_logp[3:], atol=2e-5)
            assert np.allclose(values, _logprobs(teacher, ids, 0.7)[3:], atol=2e-5)
            for bad in ([[-0.1, 5, None], [-0.2, 5, None]], [[-0.5, 5, None], [-0.1, 6, None]], [[-0.1, 5, None]]):
                with pytest.raises(EngineRequestError, match=r"input_top_logprobs\[1\] is not 2"):
                    c._input_top([None, bad], 2, 2)
            with pytest.raises(EngineRequestError, match="input_top_logprobs should have 3 entries"):
                c._input_top([None], 3, 2)
        finally:
            await c.close()

    asyncio.run(run())


def test_gateway_records_the_teachers_top_k_at_sampled_tokens(models, teacher_engine):
    """A gateway with ``teacher_topk`` 6: the ended episode's segment carries, for each sampled token in order, the
    teacher's 6 most likely tokens and their logprobs given everything before (transformers), beside its logprobs;
    the state reports the top-k. The top-k survives the wire, the database blob, the pool's batches and their wire
    form; a segment whose rows do not match its sampled tokens, or top-k without teacher logprobs, is refused."""
    student, teacher = models
    engine = start_engine(student, in_process=True)
    gw = start_gateway(student, [engine.url], in_process=True,
                       config={"teacher_urls": (teacher_engine.url,), "teacher_topk": 6})
    try:
        seg = _two_call_segment(gw, 5, 4)
        sampled = [t for t, m in enumerate(seg.loss_mask) if m]
        want_ids, want_logp = _top(teacher, seg.tokens, 6)
        assert seg.teacher_topk_ids.shape == (len(sampled), 6) == seg.teacher_topk_logprobs.shape
        assert np.array_equal(seg.teacher_topk_ids, want_ids[[t - 1 for t in sampled]])
        assert np.allclose(seg.teacher_topk_logprobs, want_logp[[t - 1 for t in sampled]], atol=2e-5)
        assert http(gw.url + "/forge/admin/state", method="GET")[1]["config"]["teacher_topk"] == 6
    finally:
        gw.stop()
        engine.stop()
    ep = Episode(episode_id="e0", group_id="g", task_id="t", segments=[seg], reward=1.0, started_at=0, ended_at=1)
    for back in (episode_from_wire(*episode_to_wire(ep)), episode_from_blob(episode_to_blob(ep))):
        assert np.array_equal(back.segments[0].teacher_topk_ids, seg.teacher_topk_ids)
        assert np.array_equal(back.segments[0].teacher_topk_logprobs, seg.teacher_topk_logprobs)
    bad = Segment(**{**seg.__dict__, "teacher_topk_ids": seg.teacher_topk_ids[:-1]})
    with pytest.raises(SchemaError, match=r"must be \[sampled tokens=9, K\], got \[8, 6\] and \[9, 6\]"):
        bad.validate()
    with pytest.raises(SchemaError, match="come together, with teacher_logprobs"):
        Segment(**{**seg.__dict__, "teacher_logprobs": None}).validate()


def test_teacher_top_k_reaches_the_batches(make_pool):
    """Episodes of two segments each with a teacher top-k: the pool's batch samples carry each segment's own rows
    (int32 / float32 [sampled, K]), and so does the batch's wire form, also mixing samples with and without them;
    frames of the wrong size are refused."""
    from forge_megatron.middleware.batch import TrainBatch

    def segs(seed):
        out = []
        for j, n in enumerate((9, 7)):
            seg = _segment(n, seed + j)
            rng = np.random.default_rng(seed + j)
            seg.teacher_topk_ids = rng.integers(0, 300, (n - 4, 3)).astype(np.int32)
            seg.teacher_topk_logprobs = -np.sort(rng.random((n - 4, 3)), axis=1).astype(np.float32)
            out.append(seg)
        return out

    pool = make_pool(generation_batch_groups=1)
    gid = pool.register_group("t", 2, "default")
    for e in range(2):
        pool.episode_started(gid, f"e{e}")
        pool.submit_episode(Episode(episode_id=f"e{e}", group_id=gid, task_id="t", segments=segs(20 * e),
                                    reward=float(e), started_at=0, ended_at=1))
    batch = pool.next_batch(1)
    assert len(batch.samples) == 4
    by_episode = {}
    for s in batch.samples:
        by_episode.setdefault(s.episode_id, []).append(s)
    for eid, samples in by_episode.items():
        for s, want in zip(sorted(samples, key=lambda x: len(x.tokens), reverse=True), segs(20 * int(eid[1:]))):
            assert s.teacher_topk_ids.dtype == np.int32 and np.array_equal(s.teacher_topk_ids, want.teacher_topk_ids)
            assert np.array_equal(s.teacher_topk_logprobs, want.teacher_topk_logprobs)
    back = batch_from_wire(*batch_to_wire(batch))
    assert all(np.array_equal(a.teacher_topk_ids, b.teacher_topk_ids) for a, b in zip(batch.samples, back.samples))
    mixed = TrainBatch(batch_id=1, samples=[batch.samples[0], type(batch.samples[1])(
        **{**batch.samples[1].__dict__, "teacher_topk_ids": None, "teacher_topk_logprobs": None}), batch.samples[2]],
        group_indices=[0])
    back = batch_from_wire(*batch_to_wire(mixed))  # travels: the second sample without a top-k, the third with its own
    assert back.samples[1].teacher_topk_ids is None
    assert np.array_equal(back.samples[2].teacher_topk_ids, mixed.samples[2].teacher_topk_ids)
    meta, arrays = batch_to_wire(mixed)
    with pytest.raises(WireError, match="teacher top-k must hold"):  # frames of the wrong size are named
        batch_from_wire(meta, arrays[:5] + [arrays[5], arrays[6][:-3], arrays[7][:-3]] + arrays[8:])
