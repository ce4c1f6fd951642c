"""Reward-model rewards (agents/reward_model.py) against a real reward model: a tiny Qwen2ForSequenceClassification
taught to prefer the right answer, served by forge-engine's /classify as SGLang serves reward models
(rollout/reward_model.py), checked against transformers' own scores. GPUs needed: 0."""

import argparse
import json
import math
import urllib.request

import pytest
import torch

from forge_megatron.agents.reward_model import (RewardModelError, RewardModelVerifier, add_reward_model_arguments,
                                                reward_model_from_args)
from forge_megatron.agents.runner import DomainVerifier, build_verifier, exact_match
from forge_megatron.agents.tasks import Task
from tests.agents.test_judge import _post

TASK = Task(task_id="t1", prompt="What is 6 * 7?", answer="42")


def _conversation_ids(tok, task, answer):
    ids = tok.apply_chat_template([{"role": "user", "content": task.prompt}, {"role": "assistant", "content": answer}],
                                  tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny reward model taught (a few Adam steps of regression) to score "42" at +2 and "41" at -2."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from forge_megatron.models.tiny import build_tiny_reward_model

    d = build_tiny_reward_model(str(tmp_path_factory.mktemp("rm")), seed=5)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForSequenceClassification.from_pretrained(d, dtype=torch.float32)
    data = [(torch.tensor([_conversation_ids(tok, TASK, a)]), target) for a, target in (("42", 2.0), ("41", -2.0))]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(60):
        opt.zero_grad()
        sum((model(input_ids=ids).logits[0, 0] - target) ** 2 for ids, target in data).backward()
        opt.step()
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def rm_engine(rm_dir):
    from forge_megatron.rollout.launch import start_engine

    engine = start_engine(rm_dir, in_process=True)
    try:
        yield engine
    finally:
        engine.stop()


def _hf_score(rm_dir, ids):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_classify_answers_as_sglang_with_transformers_scores(rm_dir, rm_engine):
    """/classify: a single input gives one object, a batch a list, each ``embedding`` the classifier's logits at the
    last token (transformers' score); ``text`` is tokenized as the tokenizer encodes it; bad inputs are 400s naming
    the field; /generate is refused by name; /get_model_info says it does not generate."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    good, bad = _conversation_ids(tok, TASK, "42"), _conversation_ids(tok, TASK, "41")
    status, one = _post(f"{rm_engine.url}/classify", {"input_ids": good})
    assert status == 200 and one["meta_info"]["prompt_tokens"] == len(good)
    assert one["embedding"][0] == pytest.approx(_hf_score(rm_dir, good), abs=1e-5)
    status, both = _post(f"{rm_engine.url}/classify", {"input_ids": [good, bad]})
    assert status == 200 and [b["embedding"][0] for b in both] == pytest.approx(
        [_hf_score(rm_dir, good), _hf_score(rm_dir, bad)], abs=1e-5)
    assert both[0]["embedding"][0] > 1.0 > -1.0 > both[1]["embedding"][0]  # it learnt to prefer the right answer
    text = tok.decode(good)
    status, by_text = _post(f"{rm_engine.url}/classify", {"text": text})
    assert status == 200 and by_text["embedding"][0] == pytest.approx(_hf_score(rm_dir, tok.encode(text)), abs=1e-5)
    for body, message in [({}, "exactly one of text and input_ids"), ({"input_ids": []}, "takes 1 to"),
                          ({"input_ids": [[1, 2], []]}, "input 1 is empty"),
                          ({"input_ids": [10**6]}, "outside the vocabulary"),
                          ({"input_ids": [1] * 5000}, "over the context length"),
                          ({"input_ids": [1, 2], "image_data": "x"}, "unsupported field"),
                          ({"text": 5}, "text must be a string")]:
        status, err = _post(f"{rm_engine.url}/classify", body)
        assert status == 400 and message in err["error"]["message"], (body, err)
    status, err = _post(f"{rm_engine.url}/generate", {"input_ids": good, "sampling_params": {}})
    assert status == 400 and "is a reward model" in err["error"]["message"]
    with urllib.request.urlopen(f"{rm_engine.url}/get_model_info", timeout=30) as resp:
        assert json.loads(resp.read())["is_generation"] is False


def test_reward_model_verifier_scores_episodes(rm_dir, rm_engine):
    """The verifier renders the conversation with the reward model's chat template, sends the ids and returns the
    score (raw) or its sigmoid; a group's repeated answer is scored once; as ``--verifier qa=rm`` the domain's tasks
    go to it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    rm = RewardModelVerifier(f"{rm_engine.url}/", rm_dir)
    want = _hf_score(rm_dir, _conversation_ids(tok, TASK, "42"))
    assert rm(TASK, "42") == pytest.approx(want, abs=1e-5) and rm(TASK, "41") < rm(TASK, "42")
    sigmoid = RewardModelVerifier(rm_engine.url, rm_dir, transform="sigmoid")
    assert sigmoid(TASK, "42") == pytest.approx(1 / (1 + math.exp(-want)), abs=1e-6)
    assert (sigmoid.reward_of(-800.0), sigmoid.reward_of(800.0), sigmoid.reward_of(-2.0)) == \
        (0.0, 1.0, pytest.approx(1 / (1 + math.exp(2.0))))
    assert rm(TASK, {"answer": 42}) != rm(TASK, "42")  # a non-string answer is scored as its JSON
    from concurrent.futures import ThreadPoolExecutor

    answers = [f"{n}" for n in range(30, 46)]  # a group's episodes score on their own threads
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda a: rm(TASK, a), answers))
    assert together == [rm(TASK, a) for a in answers]
    rm.base_url = "http://127.0.0.1:9"  # nothing listens there: the repeated answer is not asked again
    assert rm(TASK, "42") == pytest.approx(want, abs=1e-5)
    args = _args(["--rm-url", rm_engine.url, "--rm-tokenizer", rm_dir, "--rm-transform", "sigmoid"])
    verifier = build_verifier(["qa=rm"], args)
    assert isinstance(verifier, DomainVerifier) and isinstance(verifier.verifiers["qa"], RewardModelVerifier)
    assert verifier.default is exact_match
    qa = Task(task_id="t2", prompt=TASK.prompt, domain="qa")
    assert verifier(qa, "42") == pytest.approx(1 / (1 + math.exp(-want)), abs=1e-6)


def test_driver_records_the_reward_models_scores(stack, rm_dir, rm_engine):
    """The rollout driver with ``--verifier rm``: episodes through the real gateway (one engine call each, then an
    answer right on every second episode) reach the pool's sink with the reward model's score of their answer as
    their reward."""
    import threading

    from forge_megatron.agents.driver import RolloutDriver
    from forge_megatron.agents.runner import PythonAgent
    from tests.agents.agent_cases import Scripted

    rm = RewardModelVerifier(rm_engine.url, rm_dir)
    tasks = [Task(task_id=f"rm-{i}", prompt=TASK.prompt, domain="coin", answer="42") for i in range(2)]
    driver = RolloutDriver(stack["gateway"], PythonAgent(Scripted()), tasks, group_size=2, max_inflight_groups=1,
                           verifier=rm)
    before = len(stack["sink"].episodes)
    driver.run(threading.Event(), max_groups=2)
    new = [e for e in stack["sink"].episodes[before:] if e.task_id.startswith("rm-")]
    assert len(new) == 4
    scores = {answer: rm(TASK, answer) for answer in ("42", "wrong")}
    assert sorted(e.reward for e in new) == pytest.approx(sorted([scores["42"]] * 2 + [scores["wrong"]] * 2))


def test_reward_model_failures_are_loud(rm_dir, rm_engine, tmp_path):
    """A 4xx (an input over the context length) fails at once with the server's message; a dead endpoint is tried
    every attempt then fails naming it; a label the model does not have fails naming both; options are checked."""
    long_task = Task(task_id="t3", prompt="x " * 3000)
    with pytest.raises(RewardModelError, match="refused the request: HTTP 400: .*over the context length"):
        RewardModelVerifier(rm_engine.url, rm_dir)(long_task, "42")
    with pytest.raises(RewardModelError, match=r"127.0.0.1:9/classify gave no score for task t1 in 2 attempt\(s\): "
                                               "cannot reach it"):
        RewardModelVerifier("http://127.0.0.1:9", rm_dir, attempts=2, timeout_s=5)(TASK, "42")
    with pytest.raises(RewardModelError, match="gives 1 output\\(s\\) per input; --rm-label 3"):
        RewardModelVerifier(rm_engine.url, rm_dir, label=3)(TASK, "42")
    with pytest.raises(ValueError, match="needs --rm-url .* and --rm-tokenizer"):
        reward_model_from_args(_args(["--rm-url", rm_engine.url]))
    with pytest.raises(ValueError, match="exceed the 60 s the runner gives a verifier"):
        reward_model_from_args(_args(["--rm-url", rm_engine.url, "--rm-tokenizer", rm_dir, "--rm-attempts", "5",
                                      "--rm-timeout-s", "20"]))
    with pytest.raises(ValueError, match="must be http"):
        RewardModelVerifier("127.0.0.1:9", rm_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="reward model tokenizer"):
        RewardModelVerifier(rm_engine.url, str(tmp_path / "empty"))


def test_reward_model_flags_refused_for_generating_options(rm_dir, tmp_path):
    """forge-engine's flags: generating-model options on a reward model, and SGLang's --is-embedding on a generating
    checkpoint, are refused by name; --is-embedding on the reward model is accepted (SGLang's launch line)."""
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.engine_server import build_parser, engine_from_args
    from forge_megatron.rollout.reward_model import RewardEngine

    with pytest.raises(ValueError, match="is a reward model"):
        engine_from_args(build_parser().parse_args(["--model-path", rm_dir, "--enable-lora"]))
    assert isinstance(engine_from_args(build_parser().parse_args(["--model-path", rm_dir, "--is-embedding"])),
                      RewardEngine)
    lm = build_tiny_model(str(tmp_path / "lm"), seed=1)
    with pytest.raises(ValueError, match="--is-embedding: .* is not a sequence-classification checkpoint"):
        engine_from_args(build_parser().parse_args(["--model-path", lm, "--is-embedding"]))


def _args(argv):
    p = argparse.ArgumentParser()
    add_reward_model_arguments(p)
    return p.parse_args(argv)


def _two_calls(task, session):
    """A white-box agent of two calls: the task, then a follow-up on its own answer (one segment)."""
    import openai

    c = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": task.prompt}]
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=1.0, seed=1)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content or ""},
             {"role": "user", "content": "Are you sure?"}]
    return c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=1.0, seed=2
                                     ).choices[0].message.content


def _call_args(argv):
    from forge_megatron.agents.call_rewards import add_call_reward_arguments

    p = argparse.ArgumentParser()
    add_call_reward_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("mode", ["delta", "score"])
def test_a_reward_model_rewards_every_call(stack, rm_dir, rm_engine, mode):
    """--call-rm-url: after a white-box agent's two calls the runner scores the conversation as it stood after each
    (the calls' recorded prompt and completion ids) with the reward model and sets those as rewards of single calls:
    ``delta`` w (s_c - s_{c-1}) from the first prompt's score, ``score`` w s_c; the episode reaching the sink carries
    them at each call's last sampled token, equal to transformers' scores of the same ids."""
    from forge_megatron.agents.call_rewards import call_rewards_from_args
    from forge_megatron.agents.runner import PythonAgent, run_episode

    gateway = stack["gateway"]
    scorer = call_rewards_from_args(_call_args(["--call-rm-url", rm_engine.url, "--call-rm-tokenizer", rm_dir,
                                                "--call-rm-weight", "0.5", "--call-rm-mode", mode]), gateway)
    task = Task(task_id=f"calls-{mode}", prompt=TASK.prompt, answer="42")
    group = gateway.create_group(task.task_id, 1)
    report = run_episode(gateway, PythonAgent(_two_calls), task, group, lambda t, o: 1.0, call_scorer=scorer)
    assert report.status == "finished"
    (ep,) = [e for e in stack["sink"].episodes if e.episode_id == report.session_id]
    calls = stack["server"].sessions[report.session_id].summary()["calls"]
    assert len(calls) == 2 and calls[0]["segment_index"] == calls[1]["segment_index"] == 0
    scores = [_hf_score(rm_dir, c["prompt_ids"] + c["completion_ids"]) for c in calls]
    if mode == "delta":
        start = _hf_score(rm_dir, calls[0]["prompt_ids"])
        want = [0.5 * (scores[0] - start), 0.5 * (scores[1] - scores[0])]
    else:
        want = [0.5 * s for s in scores]
    (seg,) = ep.segments
    ends = [len(c["prompt_ids"]) + len(c["completion_ids"]) - 1 for c in calls]
    assert [p for p, _ in seg.call_rewards] == ends
    assert [r for _, r in seg.call_rewards] == pytest.approx(want, abs=1e-5)


def test_call_reward_model_refusals_and_failures(stack, rm_dir, rm_engine, tmp_path):
    """A reward model tokenizer that is not the policy's (two tokens swapped) is refused at start-up naming the
    fingerprints; --call-rm-url without a tokenizer, and its options without the URL, are refused; a dead reward
    model fails the episode (ended as failed, nothing trained on a missing score)."""
    from forge_megatron.agents.call_rewards import CallRewardModel, call_rewards_from_args
    from forge_megatron.agents.runner import PythonAgent, run_episode
    from tests.training.trainer_run import with_a_swapped_token

    gateway = stack["gateway"]
    other = with_a_swapped_token(rm_dir, str(tmp_path / "other"))
    with pytest.raises(ValueError, match="its vocabulary is not the policy's"):
        call_rewards_from_args(_call_args(["--call-rm-url", rm_engine.url, "--call-rm-tokenizer", other]), gateway)
    with pytest.raises(ValueError, match="--call-rm-url needs --call-rm-tokenizer"):
        call_rewards_from_args(_call_args(["--call-rm-url", rm_engine.url]), gateway)
    with pytest.raises(ValueError, match="--call-rm-tokenizer is an option of --call-rm-url"):
        call_rewards_from_args(_call_args(["--call-rm-tokenizer", rm_dir]), gateway)
    assert call_rewards_from_args(_call_args([]), gateway) is None
    task = Task(task_id="calls-dead", prompt=TASK.prompt, answer="42")
    dead = CallRewardModel("http://127.0.0.1:9", attempts=1, timeout_s=5)
    report = run_episode(gateway, PythonAgent(_two_calls), task, gateway.create_group(task.task_id, 1),
                         lambda t, o: 1.0, call_scorer=dead)
    assert report.status == "failed"
    (ep,) = [e for e in stack["sink"].episodes if e.episode_id == report.session_id]
    assert ep.status == "failed"


def test_step_separators_of_any_script_end_at_the_token_completing_them(tmp_path):
    """A separator outside ASCII ("。", "→" from its escape) whose bytes byte-level tokens split: each step ends at the
    token that completes the separator (the last token of a piece encoded alone), and so do spaces a separator
    starts with; the flag's escapes are read and other characters kept as given."""
    from forge_megatron.agents.call_rewards import CallRewardModel, call_rewards_from_args
    from forge_megatron.models.tiny import build_tiny_tokenizer

    tok_dir = str(tmp_path / "tok")
    tok = build_tiny_tokenizer(tok_dir)
    for separator, texts in (("。", ("步骤一。", "步骤二。", "结束")), (" → ", ("a → ", "b → ", "c")),
                             ("\n\n", ("First.\n\n", "Then.\n\n", "42"))):
        pieces = [tok.encode(t, add_special_tokens=False) for t in texts]
        completion = [t for p in pieces for t in p]
        assert tok.decode(completion) == "".join(texts)  # (the pieces' tokens spell the text)
        ends = [len(pieces[0]) - 1, len(pieces[0]) + len(pieces[1]) - 1, len(completion) - 1]
        model = CallRewardModel("http://127.0.0.1:9", step_separator=separator, tokenizer=tok)
        assert model.step_ends(completion) == ends, separator
        assert model.step_ends(completion[:ends[0]]) == [ends[0] - 1]  # (a separator not yet complete: no step)
    for flag, want in (("。", "。"), ("\\u2192", "→"), ("\\n\\n", "\n\n"), ("é;", "é;")):
        model = call_rewards_from_args(_call_args(["--call-rm-url", "http://127.0.0.1:9", "--call-rm-tokenizer",
                                                   tok_dir, "--call-rm-step-separator", flag]))
        assert model.step_separator == want, flag


def test_a_reward_model_rewards_every_step_of_an_answer(rm_dir, rm_engine):
    """--call-rm-step-separator '\\n\\n': an answer of three steps (two blank-line separators) is scored after each
    step and rewarded at its last token, the delta from the prompt's score on, equal to transformers' scores of the
    same prefixes; a second call continues from the first call's last score; the separator's escapes are read."""
    from transformers import AutoTokenizer

    from forge_megatron.agents.call_rewards import call_rewards_from_args

    tok = AutoTokenizer.from_pretrained(rm_dir)
    pieces = [tok.encode(t, add_special_tokens=False) for t in ("First, 6 * 7.\n\n", "That is 42.\n\n", "42")]
    completion = [t for p in pieces for t in p]
    prompt = tok.encode("What is 6 * 7?", add_special_tokens=False)
    ends = [len(pieces[0]) - 1, len(pieces[0]) + len(pieces[1]) - 1, len(completion) - 1]
    scorer = call_rewards_from_args(_call_args(["--call-rm-url", rm_engine.url, "--call-rm-tokenizer", rm_dir,
                                                "--call-rm-step-separator", "\\n\\n", "--call-rm-weight", "2"]))
    assert scorer.step_separator == "\n\n" and scorer.step_ends(completion) == ends
    second = tok.encode("Sure.", add_special_tokens=False)
    calls = [{"prompt_ids": prompt, "completion_ids": completion},
             {"prompt_ids": prompt + completion + prompt, "completion_ids": second}]
    items = scorer(calls)
    scores = [_hf_score(rm_dir, prompt)] + [_hf_score(rm_dir, prompt + completion[:e + 1]) for e in ends] + \
        [_hf_score(rm_dir, calls[1]["prompt_ids"] + second)]
    assert [(i["call"], i["token"]) for i in items] == [(0, e) for e in ends] + [(1, len(second) - 1)]
    assert [i["reward"] for i in items] == pytest.approx([2 * (b - a) for a, b in zip(scores, scores[1:])], abs=1e-5)
    with pytest.raises(ValueError, match="--call-rm-step-separator is an option of --call-rm-url"):
        call_rewards_from_args(_call_args(["--call-rm-step-separator", "x"]))
