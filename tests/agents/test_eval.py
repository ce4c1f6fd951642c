"""Evaluation (agents/evaluate.py): pass@k, gateway eval sessions that never reach the sink, evaluate() and the
periodic evaluator against a real forge-engine and forge-gateway. CPU, 0 GPUs."""

import itertools
import json
import threading
import time

import pytest

from forge_megatron.agents.evaluate import PeriodicEval, evaluate, pass_at_k, pass_ks, summarise
from forge_megatron.agents.gateway_api import GatewayClient, GatewayError
from forge_megatron.agents.runner import EpisodeReport, PythonAgent, run_episode
from forge_megatron.agents.tasks import Task
from tests.agents.agent_cases import Scripted, one_call


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_pass_at_k_is_the_subset_probability(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            expected = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(3, 4, 1)
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]


def _report(task_id, status="finished", reward=1.0, tokens=10, versions=(3, 3)):
    return EpisodeReport(task_id, "d", "s", status, reward, "x", 2.0, tokens, list(versions))


def test_summarise_counts_failures_as_unsuccessful():
    reports = [_report("a"), _report("a", reward=0.0), _report("b", status="timed_out", reward=None, tokens=0,
                                                                   versions=()),
               _report("b", versions=(4, 5))]
    out = summarise(reports, samples=2)
    assert out["pass@1"] == pytest.approx((0.5 + 0.5) / 2) and out["pass@2"] == pytest.approx(1.0)
    assert out["finished"] == pytest.approx(0.75) and out["mean_reward"] == pytest.approx(2 / 3)
    assert out["completion_tokens_mean"] == pytest.approx(10) and out["policy_versions"] == [3, 5]
    assert (out["tasks"], out["episodes"]) == (2, 4)
    # a reward model's raw scores: success above a threshold of the user's (here 0.5; -1.2 and 0.3 do not pass)
    scored = [_report("a", reward=2.5), _report("a", reward=-1.2), _report("b", reward=0.3), _report("b", reward=0.7)]
    assert summarise(scored, samples=2)["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert summarise(scored, samples=2, success_threshold=0.5)["pass@1"] == pytest.approx((0.5 + 0.5) / 2)


def test_eval_sessions_are_served_but_never_reach_the_sink(stack):
    gw, sink = stack["gateway"], stack["sink"]
    before = len(sink.episodes)
    session = gw.open_eval_session("held-out-1", "math", {"k": 1})
    one_call(session)
    ended = gw.end_session(session.session_id)
    assert ended["sink"] == "eval" and ended["num_calls"] == 1
    assert ended["completion_tokens"] > 0 and len(ended["policy_versions"]) == 2
    assert len(sink.episodes) == before  # not trained on
    summary = gw.request("GET", f"/forge/sessions/{session.session_id}")
    assert summary["eval"] is True and len(summary["calls"]) == 1
    for body, message in [({"eval": True, "task_id": "t", "group_id": "g000000001"}, "belongs to no group"),
                          ({"eval": True}, "needs task_id"),
                          ({"eval": "yes", "task_id": "t"}, "eval must be true or false"),
                          ({"eval": True, "task_id": "t", "domain": ""}, "domain must be a non-empty string")]:
        with pytest.raises(GatewayError, match=message) as err:
            gw.request("POST", "/forge/sessions", body)
        assert err.value.status == 400
    group = gw.create_group("trained", 1)  # a training session still reaches the sink, with its versions
    train = gw.open_session(group)
    one_call(train)
    assert gw.end_session(train.session_id)["sink"] == "accepted" and len(sink.episodes) == before + 1


TASKS = [Task(task_id=f"{d}-{i}", prompt="1+1", domain=d, answer="2") for d in ("easy", "hard", "coin") for i in range(2)]


def test_evaluate_reports_pass_at_k_per_domain(stack):
    gw, sink = stack["gateway"], stack["sink"]
    before = len(sink.episodes)
    result = evaluate(gw, PythonAgent(Scripted()), TASKS, samples=4, concurrency=4)
    assert len(sink.episodes) == before and result["episodes"] == 24 and result["samples"] == 4
    domains = result["domains"]
    assert [domains[d]["pass@1"] for d in ("easy", "hard", "coin")] == [1.0, 0.0, 0.5]
    assert domains["coin"]["pass@2"] == pytest.approx(1 - 1 / 6)  # 2 of 4 right: C(2,2)/C(4,2) pairs miss
    assert domains["coin"]["pass@4"] == 1.0 and domains["hard"]["pass@4"] == 0.0
    assert result["pass@1"] == pytest.approx(0.5) and result["finished"] == 1.0
    assert result["mean_reward"] == pytest.approx(0.5) and result["completion_tokens_mean"] > 0
    assert result["policy_version"] == gw.state()["policy_version"]
    crashing = PythonAgent(lambda task, session: 1 / 0)  # agent bugs count as unsuccessful episodes
    failed = evaluate(gw, crashing, TASKS[:1], samples=2)
    assert failed["pass@1"] == 0.0 and failed["finished"] == 0.0 and failed["mean_reward"] is None
    assert len(sink.episodes) == before


def test_periodic_eval_follows_the_policy_version(stack, tmp_path):
    gw = stack["gateway"]
    start = gw.state()["policy_version"]
    out = tmp_path / "evals.jsonl"
    periodic = PeriodicEval(gw, PythonAgent(Scripted()), TASKS[:2], every_versions=2, output=str(out), poll_s=0.05)
    periodic.next_due = start  # the run's first evaluation
    stop = threading.Event()
    thread = periodic.start(stop)
    try:
        def wait_for(count):
            deadline = time.time() + 60
            while len(periodic.results) < count:
                assert time.time() < deadline, "no evaluation came"
                time.sleep(0.05)

        wait_for(1)
        gw.resume(start + 1)  # not a multiple of 2 past the last evaluation: nothing
        time.sleep(0.5)
        assert len(periodic.results) == 1
        gw.resume(start + 3)  # passed start + 2: one evaluation, the next one due at start + 4
        wait_for(2)
        gw.resume(start + 4)
        wait_for(3)
    finally:
        stop.set()
        thread.join(60)
        gw.resume(start)
    assert [r["policy_version"] for r in periodic.results] == [start, start + 3, start + 4]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["policy_version"] for r in lines] == [start, start + 3, start + 4]
    assert all(r["pass@1"] == 1.0 and "domains" not in r for r in lines)  # one domain: no breakdown
    with pytest.raises(ValueError, match="every_versions must be >= 1"):
        PeriodicEval(gw, None, TASKS, every_versions=0)


def test_run_episode_reports_sampled_versions(stack):
    gw = stack["gateway"]
    report = run_episode(gw, PythonAgent(lambda t, s: (one_call(s), "2")[1]), TASKS[0], None)
    assert report.status == "finished" and report.reward == 1.0
    assert report.completion_tokens > 0 and len(report.policy_versions) == 2


def cli_agent(task, session):
    """The white-box agent of the forge-eval CLI test (imported by name)."""
    one_call(session)
    return task.answer if task.domain == "easy" else "wrong"


def test_forge_eval_cli(stack, tmp_path, capsys):
    from forge_megatron.agents.driver import build_parser as driver_parser
    from forge_megatron.agents.evaluate import main
    from forge_megatron.agents.tasks import write_tasks

    tasks = tmp_path / "heldout.jsonl"
    write_tasks(str(tasks), [TASKS[0], TASKS[2]])
    out = tmp_path / "evals.jsonl"
    argv = ["--gateway-url", stack["gateway"].base_url, "--tasks", str(tasks), "--agent-python",
            "tests.agents.test_eval:cli_agent", "--eval-samples", "2", "--eval-output", str(out)]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["pass@1"] == 0.5 and printed["domains"]["easy"]["pass@2"] == 1.0 and printed["episodes"] == 4
    with pytest.raises(SystemExit, match="must be >= 1"):
        main(argv[:-4] + ["--eval-samples", "0"])
    args = driver_parser().parse_args(["--gateway-url", "u", "--tasks", "t", "--agent-url", "a", "--eval-tasks",
                                       str(tasks), "--eval-every-versions", "5", "--no-eval-at-start"])
    assert (args.eval_tasks, args.eval_every_versions, args.eval_at_start) == (str(tasks), 5, False)


def _completions(gw, session, n, **params):
    """``n`` calls of the same one-message chat with seeds 0..n-1; the sampled ids of each and the recorded sampling."""
    import openai

    with openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
        for seed in range(n):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "3+4"}], max_tokens=8,
                                           seed=seed, **params)
    calls = gw.request("GET", f"/forge/sessions/{session.session_id}")["calls"]
    return [tuple(c["completion_ids"]) for c in calls], [c["sampling"] for c in calls]


def test_eval_session_sampling_replaces_the_agents(stack):
    gw = stack["gateway"]
    greedy = gw.open_eval_session("t", "math", sampling={"temperature": 0.0})
    ids, used = _completions(gw, greedy, 4, temperature=1.0)  # the agent asks for sampling, the session says greedy
    assert len(set(ids)) == 1 and all(u == {"temperature": 0.0, "top_p": 1.0} for u in used)
    plain = gw.open_eval_session("t", "math")
    ids, used = _completions(gw, plain, 4, temperature=1.0)
    assert len(set(ids)) > 1 and all(u["temperature"] == 1.0 for u in used)  # the agent's values otherwise
    for s in (greedy, plain):
        gw.end_session(s.session_id)
    group = gw.create_group("t", 1)
    for body, message in [({"eval": True, "task_id": "t", "sampling": {"temperature": 3}}, "temperature must be"),
                          ({"eval": True, "task_id": "t", "sampling": {"seed": 1}}, "sampling must be an object"),
                          ({"group_id": group, "sampling": {"temperature": 0}}, "only eval sessions take sampling")]:
        with pytest.raises(GatewayError, match=message) as err:
            gw.request("POST", "/forge/sessions", body)
        assert err.value.status == 400


@pytest.mark.parametrize("policy_sampling", [False, True])
def test_training_calls_sample_from_the_policy(stack, policy_sampling):
    """An agent asking for greedy decoding: with policy_sampling its training calls are sampled at temperature 1 (the
    distribution the recorded logprobs belong to); without it they are greedy and counted as tempered."""
    gw, server = stack["gateway"], stack["server"]
    server.config.policy_sampling = policy_sampling
    try:
        before = dict(server.stats)
        session = gw.open_session(gw.create_group("policy", 1))
        ids, used = _completions(gw, session, 4, temperature=0.0, top_p=0.5, extra_body={"top_k": 3})
        gw.end_session(session.session_id)
    finally:
        server.config.policy_sampling = False
    overrides = server.stats["policy_sampling_overrides"] - before["policy_sampling_overrides"]
    tempered = server.stats["tempered_calls"] - before["tempered_calls"]
    if policy_sampling:
        assert len(set(ids)) > 1 and all(u == {"temperature": 1.0, "top_p": 1.0} for u in used)
        assert (overrides, tempered) == (4, 0)
    else:
        assert len(set(ids)) == 1 and all(u == {"temperature": 0.0, "top_p": 0.5, "top_k": 3} for u in used)
        assert (overrides, tempered) == (0, 4)
    assert {"policy_sampling_overrides", "tempered_calls"} <= set(gw.state())


def test_trainer_checks_the_gateways_temperature(stack):
    """/forge/admin/state says how training calls are sampled; a trainer whose --rollout-temperature differs refuses
    to start (arguments.check_gateway_config, called by the trainer at start with --gateway-url)."""
    from forge_megatron.training import arguments

    gw, server = stack["gateway"], stack["server"]
    config = gw.state()["config"]
    assert config == {"policy_sampling": server.config.policy_sampling, "policy_temperature": 1.0, "teacher": False,
                      "teacher_topk": 0, "tokenizer_fingerprint": server.tokenizer_fingerprint()}
    base = ["--hf-checkpoint", "/x", "--lr", "1e-6", "--train-iters", "1", "--weight-sync-transport", "none"]
    arguments.check_gateway_config(arguments.parse_args(base), config)
    arguments.check_gateway_config(arguments.parse_args(base + ["--rollout-temperature", "0.7"]), {})  # old gateway
    with pytest.raises(ValueError, match="gateway's --policy-temperature is 1.0 but this trainer's "
                                         "--rollout-temperature is 0.7"):
        arguments.check_gateway_config(arguments.parse_args(base + ["--rollout-temperature", "0.7"]), config)
    # a served distillation teacher: the gateway records its logprobs exactly when the trainer distils from them
    with pytest.raises(ValueError, match="the gateway records no teacher logprobs: start it .* with --teacher-urls"):
        arguments.check_gateway_config(arguments.parse_args(base + ["--teacher-from-gateway"]), config)
    with pytest.raises(ValueError, match="records a served teacher's logprobs .* add --teacher-from-gateway"):
        arguments.check_gateway_config(arguments.parse_args(base), {**config, "teacher": True})
    arguments.check_gateway_config(arguments.parse_args(base + ["--teacher-from-gateway"]), {**config, "teacher": True})
    # a dense KL needs the gateway to record at least the trainer's top-k
    dense = arguments.parse_args(base + ["--teacher-from-gateway", "--distill-kl", "reverse", "--distill-topk", "16"])
    with pytest.raises(ValueError, match="records the served teacher's top 8 tokens .* --teacher-topk 16"):
        arguments.check_gateway_config(dense, {**config, "teacher": True, "teacher_topk": 8})
    arguments.check_gateway_config(dense, {**config, "teacher": True, "teacher_topk": 20})


@pytest.mark.parametrize("policy_sampling", [False, True])
def test_policy_temperature_is_the_trainers(stack, policy_sampling):
    """--policy-temperature 0.7 (the trainer's --rollout-temperature): policy sampling samples training calls at 0.7;
    without it, calls at 0.7 are from the policy and calls at 1 are counted as tempered."""
    gw, server = stack["gateway"], stack["server"]
    server.config.policy_sampling, server.config.policy_temperature = policy_sampling, 0.7
    try:
        before = dict(server.stats)
        session = gw.open_session(gw.create_group("policy-t", 1))
        _, used = _completions(gw, session, 2, temperature=0.7)
        _, used_t1 = _completions(gw, session, 2, temperature=1.0)
        used_t1 = used_t1[2:]  # the session's calls so far: the first two were at 0.7
        gw.end_session(session.session_id)
    finally:
        server.config.policy_sampling, server.config.policy_temperature = False, 1.0
    overrides = server.stats["policy_sampling_overrides"] - before["policy_sampling_overrides"]
    tempered = server.stats["tempered_calls"] - before["tempered_calls"]
    assert all(u["temperature"] == 0.7 for u in used)
    if policy_sampling:
        assert all(u["temperature"] == 0.7 for u in used_t1) and (overrides, tempered) == (2, 0)
    else:
        assert all(u["temperature"] == 1.0 for u in used_t1) and (overrides, tempered) == (0, 2)


def test_published_evaluations_reach_the_trainers_metrics(stack):
    """PeriodicEval/forge-eval publish each result to the gateway; the trainer's EvalFeed reads the ones it has not
    seen and turns the newest into eval/* metrics (overall and per domain); bad results are refused."""
    from forge_megatron.training.metrics import EvalFeed, eval_metrics

    gw = stack["gateway"]
    feed = EvalFeed(gw.base_url)
    feed.poll()  # whatever earlier tests published
    assert feed.poll() == {}
    first = evaluate(gw, PythonAgent(Scripted()), TASKS, samples=2)
    periodic = PeriodicEval(gw, PythonAgent(Scripted()), TASKS, every_versions=1)
    second = periodic.run_once()  # publishes
    gw.publish_eval(first)
    got = feed.poll()  # two new results: the newest (first, published last) is logged
    assert got == eval_metrics(first) and feed.poll() == {}
    assert got["eval/easy/pass@1"] == 1.0 and got["eval/hard/pass@1"] == 0.0 and got["eval/pass@2"] == 2 / 3
    assert got["eval/policy_version"] == first["policy_version"] and "eval/tasks" not in got
    assert [e["pass@1"] for e in gw.evals(after=0)][-2:] == [second["pass@1"], first["pass@1"]]
    for bad, message in [({"pass@1": 1.0}, "needs policy_version"), ({"policy_version": -1}, "needs policy_version")]:
        with pytest.raises(GatewayError, match=message):
            gw.publish_eval(bad)
    assert EvalFeed("http://127.0.0.1:9").poll() == {}  # unreachable: no metrics, no exception


def test_the_trainers_eval_feed_reads_a_restarted_gateway_from_its_first_result(stack, tmp_path):
    """A gateway restarted at the same address numbers its results from 1 again: the feed, whose last id is past
    them, notices the new instance id and reads them (it used to wait until the new ids passed the old ones)."""
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.launch import start_gateway
    from forge_megatron.training.metrics import EvalFeed, eval_metrics

    gw = stack["gateway"]
    for version in (1, 2, 3):
        gw.publish_eval({"policy_version": version, "pass@1": 0.5})
    feed = EvalFeed(gw.base_url)
    assert feed.poll()["eval/policy_version"] == 3 and feed.last_id >= 3 and feed.gateway is not None
    engine_url = stack["server"].fleet.engines[0].url
    restarted = start_gateway(build_tiny_model(str(tmp_path / "m")), [engine_url], in_process=True)
    try:
        feed.url = restarted.url  # the same trainer flag, a new gateway process behind it
        assert feed.poll() == {}  # nothing published yet (and no stale replay of the old instance's ids)
        GatewayClient(restarted.url).publish_eval({"policy_version": 7, "pass@1": 0.25})
        assert feed.poll() == eval_metrics({"policy_version": 7, "pass@1": 0.25}) and feed.last_id == 1
        assert feed.poll() == {}
    finally:
        restarted.stop()


def test_an_evaluation_cut_by_stopping_is_not_recorded(stack):
    """Stopping while an episode runs (a demo or job shutting down, its gateway going away) can fail that episode:
    the result would score a shutdown as the model's failure, so evaluate() returns None; the same failure without
    a stop is an unsuccessful episode as usual."""
    gw = stack["gateway"]
    stop = threading.Event()

    def cut(task, session):
        one_call(session)
        stop.set()  # the job is told to stop while this episode runs, and the episode does not finish
        raise ConnectionError("agent service went away")

    assert evaluate(gw, PythonAgent(cut), TASKS[:1], samples=1, stop=stop) is None
    failed = evaluate(gw, PythonAgent(cut), TASKS[:1], samples=1, stop=None)
    assert failed["finished"] == 0.0 and failed["pass@1"] == 0.0


def test_periodic_eval_survives_a_failed_evaluation(stack, caplog):
    """An evaluation that raises (here its result hook: a dashboard that is down) is logged, and the loop keeps
    evaluating at the next versions instead of its thread dying silently."""
    gw = stack["gateway"]
    calls = []

    def broken_hook(result):
        calls.append(result["policy_version"])
        raise RuntimeError("dashboard down")

    periodic = PeriodicEval(gw, PythonAgent(Scripted()), TASKS[:1], every_versions=1, poll_s=0.05,
                            on_result=broken_hook)
    start = gw.state()["policy_version"]
    periodic.next_due = start
    stop = threading.Event()
    thread = periodic.start(stop)
    try:
        deadline = time.time() + 60
        while not calls:
            assert time.time() < deadline
            time.sleep(0.05)
        gw.resume(start + 1)
        while len(calls) < 2:  # still evaluating after the first one raised
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(60)
        gw.resume(start)
    assert calls[:2] == [start, start + 1] and "dashboard down" in caplog.text
