"""LLM-graded rewards (agents/judge.py) against a real judge: a tiny model fine-tuned to grade two answers, served by
forge-engine's OpenAI-compatible /v1/chat/completions (rollout/engine_server.py), whose route is checked against
/generate. GPUs needed: 0."""

import argparse
import json
import re
import urllib.error
import urllib.request

import pytest

from forge_megatron.agents.judge import DEFAULT_RUBRIC, JudgeError, JudgeVerifier, add_judge_arguments, judge_from_args
from forge_megatron.agents.runner import DomainVerifier, build_verifier, exact_match
from forge_megatron.agents.tasks import Task

RUBRIC = "Grade the answer.\nTask: {prompt}\nAnswer: {output}\nReply with Score: N out of {max_score}."
TASK = Task(task_id="t1", prompt="What is 6 * 7?", answer="42")
GRADES = {"42": "Correct. Score: 9", "41": "Wrong. Score: 2"}


@pytest.fixture(scope="module")
def judge_engine(tmp_path_factory):
    """A tiny model taught to grade the two answers of TASK (greedy: exactly GRADES), served by forge-engine."""
    from forge_megatron.models.tiny import build_tiny_model, finetune_on_chats
    from forge_megatron.rollout.launch import start_engine

    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("judge")), seed=3)
    judge = JudgeVerifier("http://127.0.0.1:9/v1", rubric=RUBRIC)
    chats = [([{"role": "user", "content": judge.prompt_for(TASK, out)}], reply) for out, reply in GRADES.items()]
    finetune_on_chats(model_dir, chats, steps=150, lr=5e-3)
    engine = start_engine(model_dir, in_process=True)
    try:
        yield engine
    finally:
        engine.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_judge_scores_answers_through_the_engine(judge_engine):
    judge = JudgeVerifier(f"{judge_engine.url}/v1/", rubric=RUBRIC)
    assert judge(TASK, "42") == pytest.approx(0.9) and judge(TASK, "41") == pytest.approx(0.2)
    judge.base_url = "http://127.0.0.1:9/v1"  # nothing listens there: a group's repeated answer is not asked again
    assert judge(TASK, "42") == pytest.approx(0.9)
    with pytest.raises(JudgeError, match="cannot reach it"):  # a new answer is
        judge(TASK, "40")
    # as --verifier qa=judge: the domain's tasks go to the judge, the others to exact match
    args = _args(["--judge-url", f"{judge_engine.url}/v1", "--judge-max-score", "10"])
    args.judge_rubric = None
    verifier = build_verifier(["qa=judge"], args)
    assert isinstance(verifier, DomainVerifier) and isinstance(verifier.verifiers["qa"], JudgeVerifier)
    assert verifier.default is exact_match


def test_a_judge_without_a_readable_score_fails_the_episode_loudly(judge_engine):
    """Every attempt is asked (the retries at a higher temperature); none has a score the pattern reads, so the
    verifier raises naming the endpoint and the last answer, never a silent zero."""
    judge = JudgeVerifier(f"{judge_engine.url}/v1", rubric=RUBRIC, score_pattern=r"grade\s*=\s*(\d+)", attempts=2)
    with pytest.raises(JudgeError, match=r"/v1/chat/completions gave no score for task t1 in 2 attempt\(s\): no score"):
        judge(TASK, "42")


def test_judge_refusals_and_dead_endpoints(judge_engine):
    """A 4xx answer fails at once with the server's message; an endpoint that does not answer is tried every
    attempt, then fails naming it."""
    too_long = JudgeVerifier(f"{judge_engine.url}/v1", rubric=RUBRIC, max_tokens=10**6)
    with pytest.raises(JudgeError, match="refused the request: HTTP 400: .*exceed the context length"):
        too_long(TASK, "42")
    dead = JudgeVerifier("http://127.0.0.1:9/v1", rubric=RUBRIC, attempts=2, timeout_s=5)
    with pytest.raises(JudgeError, match="cannot reach it"):
        dead(TASK, "42")


def test_chat_route_renders_the_template_as_generate_sees_it(judge_engine):
    """/v1/chat/completions = /generate on the chat template's ids (the assistant turn opened), greedy; OpenAI's
    answer shape; bad requests are 400s naming the field."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(judge_engine.engine.model_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    status, chat = _post(f"{judge_engine.url}/v1/chat/completions",
                         {"model": "judge", "messages": messages, "max_tokens": 12, "temperature": 0})
    assert status == 200, chat
    status, raw = _post(f"{judge_engine.url}/generate",
                        {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert status == 200
    choice = chat["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": raw["text"]}
    assert choice["finish_reason"] == ("length" if raw["meta_info"]["finish_reason"]["type"] == "length" else "stop")
    assert chat["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(raw["output_ids"]),
                             "total_tokens": len(ids) + len(raw["output_ids"])}
    assert chat["object"] == "chat.completion" and chat["model"] == "judge"
    for bad, words in (({"messages": []}, "non-empty list"), ({"messages": messages, "n": 2}, "n must be 1"),
                       ({"messages": messages, "stream": True}, "stream is not supported"),
                       ({"messages": messages, "tools": []}, r"unsupported field\(s\) \['tools'\]"),
                       ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text content")):
        status, err = _post(f"{judge_engine.url}/v1/chat/completions", bad)
        assert status == 400 and re.search(words, err["error"]["message"]), (bad, err)


def _args(argv):
    p = argparse.ArgumentParser()
    add_judge_arguments(p)
    return p.parse_args(argv)


def test_judge_settings_are_checked_when_built(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs --judge-url"):
        build_verifier(["judge"], _args([]))
    with pytest.raises(ValueError, match="base URL must be http"):
        JudgeVerifier("127.0.0.1:30000/v1")
    with pytest.raises(ValueError, match=r"placeholders \['reference'\]"):
        JudgeVerifier("http://h/v1", rubric="{reference} {output}")
    with pytest.raises(ValueError, match="no {output} placeholder"):
        JudgeVerifier("http://h/v1", rubric="grade {prompt}")
    with pytest.raises(ValueError, match="max_score must be a positive number"):
        JudgeVerifier("http://h/v1", max_score=0)
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Task {prompt}\nOutput {output}\nScore: 0-{max_score}")
    with pytest.raises(ValueError, match="FORGE_TEST_JUDGE_KEY: the variable is not set"):
        judge_from_args(_args(["--judge-url", "http://h/v1", "--judge-api-key-env", "FORGE_TEST_JUDGE_KEY"]))
    monkeypatch.setenv("FORGE_TEST_JUDGE_KEY", "secret")
    judge = judge_from_args(_args(["--judge-url", "http://h/v1", "--judge-rubric", str(rubric), "--judge-max-score",
                                   "5", "--judge-api-key-env", "FORGE_TEST_JUDGE_KEY", "--judge-attempts", "1"]))
    assert (judge.api_key, judge.max_score, judge.attempts, judge.url) == \
        ("secret", 5.0, 1, "http://h/v1/chat/completions")
    assert judge.prompt_for(Task("x", "Sum 2 and 2", answer=None), {"sum": 4}) == \
        'Task Sum 2 and 2\nOutput {"sum": 4}\nScore: 0-5'
    with pytest.raises(ValueError, match="exceed the 60 s the runner gives a verifier"):
        judge_from_args(_args(["--judge-url", "http://h/v1", "--judge-attempts", "4", "--judge-timeout-s", "20"]))
    with pytest.raises(ValueError, match="--judge-rubric .*No such file"):
        judge_from_args(_args(["--judge-url", "http://h/v1", "--judge-rubric", str(tmp_path / "missing.txt")]))


def test_scores_are_read_from_the_judges_last_verdict():
    judge = JudgeVerifier("http://h/v1", max_score=10)
    assert judge.parse("Score: 3 ... on reflection, Score: 7") == 7.0
    assert judge.parse("**Score:** 8.5") == 8.5 and judge.parse("score=10") == 10.0
    assert judge.parse("Score: 11") is None and judge.parse("Score: -1") is None and judge.parse("no verdict") is None
    assert "{output}" in DEFAULT_RUBRIC and DEFAULT_RUBRIC.format(prompt="p", answer="", output="o", max_score=10)
