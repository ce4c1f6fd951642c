"""Tasks, agent runners (white-box, black-box command, black-box HTTP service), timeouts and the rollout driver,
against a real forge-engine and a real forge-gateway over HTTP. CPU, 0 GPUs."""

import sys
import threading

import pytest

from forge_megatron.agents import calculator
from forge_megatron.agents.driver import RolloutDriver
from forge_megatron.agents.gateway_api import GatewayError
from forge_megatron.agents.runner import CommandAgent, EpisodeResult, HttpAgent, PythonAgent, exact_match, run_episode
from forge_megatron.agents.tasks import Task, TaskError, load_tasks, write_tasks
from tests.agents.agent_cases import Scripted


def test_tasks_round_trip_and_errors(tmp_path):
    tasks = calculator.make_tasks(5, seed=1)
    path = tmp_path / "tasks.jsonl"
    write_tasks(str(path), tasks)
    assert load_tasks(str(path)) == tasks
    bad = tmp_path / "bad.jsonl"
    for line, message in [('{"prompt": "1+1"}', "missing field 'task_id'"),
                          ('{"task_id": "a", "prompt": "x", "colour": 1}', "unknown field"),
                          ('{"task_id": "a", "prompt": 3}', "prompt must be a string"),
                          ("not json", "not valid JSON"),
                          ('{"task_id": "a", "prompt": "x"}\n{"task_id": "a", "prompt": "y"}', "duplicate task_id")]:
        bad.write_text(line + "\n")
        with pytest.raises(TaskError, match=message):
            load_tasks(str(bad))


def test_calculator_tool_and_tasks():
    assert calculator.calculate("12+7") == "19" and calculator.calculate("3*-4") == "-12"
    assert calculator.calculate("2**8").startswith("error") and calculator.calculate("__import__('os')").startswith("error")
    tasks = calculator.make_tasks(50, seed=3)
    assert len({t.prompt for t in tasks}) == 50 and all(t.answer == calculator.calculate(t.prompt) for t in tasks)
    chats = calculator.sft_conversations(tasks, tool_fraction=0.5, seed=0)
    with_tool = [c for c in chats if c[1].get("tool_calls")]
    assert 10 < len(with_tool) < 40  # a real mix
    assert all(c[1]["tool_calls"][0]["function"]["name"] == "calculator" for c in with_tool)
    assert all(c[1]["content"] == t.answer for c, t in zip(chats, tasks) if not c[1].get("tool_calls"))
    assert all(len(t.answer) == 2 for t in tasks)
    assert exact_match(tasks[0], f" {tasks[0].answer}\n") == 1.0 and exact_match(tasks[0], "nope") == 0.0


def _white_box(task, session):
    import openai

    with openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
        out = calculator.solve(task.prompt, client, max_tokens=16)
    return EpisodeResult(output=out, reward=0.25, terms={"custom": 1.0})


def test_white_box_and_black_box_episodes_are_recorded(stack):
    gw, sink = stack["gateway"], stack["sink"]
    task = calculator.make_tasks(1, seed=5)[0]
    group = gw.create_group(task.task_id, 3, task.domain)
    before = len(sink.episodes)
    reports = [
        run_episode(gw, PythonAgent(_white_box), task, group),
        run_episode(gw, HttpAgent(stack["agent_url"]), task, group),
        run_episode(gw, CommandAgent([sys.executable, "-m", "forge_megatron.agents.calculator"],
                                     env={"OMP_NUM_THREADS": "1"}), task, group, timeout_s=120),
    ]
    episodes = {e.episode_id: e for e in sink.episodes[before:]}
    assert [r.status for r in reports] == ["finished"] * 3
    assert reports[0].reward == 0.25 and episodes[reports[0].session_id].reward_terms["custom"] == 1.0
    for r in reports:
        ep = episodes[r.session_id]
        assert ep.group_id == group and ep.status == "finished" and len(ep.segments) >= 1
        assert sum(seg.num_trained_tokens for seg in ep.segments) > 0  # the model's tokens were recorded
    for r in reports[1:]:  # black-box rewards come from the verifier on the agent's final answer
        assert r.reward == exact_match(task, r.output) and episodes[r.session_id].reward == r.reward


def test_the_agent_through_the_responses_api_records_what_chat_records(stack):
    """The calculator agent with --api responses (client.responses.create, as Codex-style agents call models): at
    temperature 0 it gives the same answer as through chat completions, and the episodes hold the same tokens."""
    import openai

    gw, sink = stack["gateway"], stack["sink"]
    task = calculator.make_tasks(1, seed=7)[0]
    group = gw.create_group(task.task_id, 2, task.domain)
    before = len(sink.episodes)
    outputs = {}
    for api in calculator.APIS:
        def agent(t, session, api=api):
            with openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
                outputs[api] = calculator.solve(t.prompt, client, max_tokens=16, temperature=0.0, api=api)
            return EpisodeResult(output=outputs[api])
        assert run_episode(gw, PythonAgent(agent), task, group).status == "finished"
    chat, responses = sink.episodes[before:before + 2]
    assert outputs["chat"] == outputs["responses"]
    assert [s.tokens for s in chat.segments] == [s.tokens for s in responses.segments]
    assert [s.loss_mask for s in chat.segments] == [s.loss_mask for s in responses.segments]
    with pytest.raises(ValueError, match="api must be one of"):
        calculator.solve("1+1", None, api="grpc")


def test_timeouts_and_failures_end_the_episode(stack):
    gw, sink = stack["gateway"], stack["sink"]
    task = Task(task_id="slow", prompt="1+1", answer="2")
    group = gw.create_group(task.task_id, 3)
    slow = run_episode(gw, CommandAgent([sys.executable, "-c", "import time; time.sleep(60)"]), task, group,
                       timeout_s=1.0)
    crash = run_episode(gw, CommandAgent([sys.executable, "-c", "raise SystemExit(3)"]), task, group)
    hung = run_episode(gw, PythonAgent(lambda t, s: threading.Event().wait(30)), task, group, timeout_s=0.5)
    assert (slow.status, crash.status, hung.status) == ("timed_out", "failed", "timed_out")
    statuses = {e.episode_id: e.status for e in sink.episodes}
    assert [statuses[r.session_id] for r in (slow, crash, hung)] == ["timed_out", "failed", "timed_out"]
    with pytest.raises(GatewayError, match="unknown group_id"):
        gw.open_session("g-does-not-exist")


def test_driver_feeds_groups_with_backpressure(stack):
    gw, sink = stack["gateway"], stack["sink"]
    tasks = calculator.make_tasks(4, seed=7) + [Task(task_id="qa-0", prompt="2+2", domain="qa", answer="4")]
    admitted = []

    def can_admit():  # the pool's admission control: refuse every other check
        admitted.append(len(admitted) % 2 == 0)
        return admitted[-1]

    driver = RolloutDriver(gw, HttpAgent(stack["agent_url"]), tasks, group_size=2, max_inflight_groups=2,
                           can_admit=can_admit, domain_ratios={"math": 0.5, "qa": 0.5})
    before = len(sink.episodes)
    driver.run(threading.Event(), max_groups=4)
    new = sink.episodes[before:]
    assert driver.groups_started == 4 and len(new) == 8
    assert sorted(e.domain for e in new) == ["math"] * 4 + ["qa"] * 4  # ratios respected
    assert False in admitted  # refusals were honoured (the loop asked again)
    assert driver.success_rate() is not None
    with pytest.raises(ValueError, match="domains without tasks"):
        RolloutDriver(gw, None, tasks, 2, domain_ratios={"code": 1.0})


def test_middleware_node_pool_settings(tmp_path):
    from forge_megatron.agents.middleware_node import build_parser, pool_config

    args = build_parser().parse_args(["--model-path", "m", "--engines", "http://127.0.0.1:1", "--pool-db",
                                      str(tmp_path / "p.sqlite"), "--window-fraction", "0.5", "--rollout-batch-groups",
                                      "6", "--reward-weights", "malformed_tool_calls=-0.3", "--advantage-estimator",
                                      "rloo", "--max-staleness", "2"])
    cfg = pool_config(args)
    assert cfg.window_groups == 3 and cfg.max_staleness == 2  # W = ceil(0.5 * 6)
    assert cfg.reward.estimator == "rloo" and cfg.reward.process_weights["malformed_tool_calls"] == -0.3
    assert not cfg.drop_zero_advantage_groups
    assert pool_config(build_parser().parse_args(["--model-path", "m", "--engines", "http://127.0.0.1:1",
                                                  "--drop-zero-advantage-groups"])).drop_zero_advantage_groups


def test_agent_and_verifier_faults_end_the_session_as_failed(stack, caplog):
    """A missing agent program, a verifier that raises, returns a non-number or hangs, a white-box agent reporting a
    NaN reward: each episode ends as failed (its group does not wait for it) and the runner returns normally."""
    import time

    gw, sink = stack["gateway"], stack["sink"]
    task = Task(task_id="faulty", prompt="1+1", answer="2")

    def answers(task, session):
        _white_box(task, session)  # one real model call
        return "2"

    def raising(task, output):
        raise RuntimeError("sandbox crashed")

    cases = [(CommandAgent(["/nonexistent/agent-binary"]), exact_match, "could not run"),
             (PythonAgent(answers), raising, "sandbox crashed"),
             (PythonAgent(answers), lambda t, o: "yes", "not a finite number"),
             (PythonAgent(answers), lambda t, o: threading.Event().wait(30), "no answer within"),
             (PythonAgent(lambda t, s: EpisodeResult(output="2", reward=float("nan"))), exact_match, "not a finite")]
    group = gw.create_group(task.task_id, len(cases))
    before = len(sink.episodes)
    for agent, verifier, reason in cases:
        start = time.monotonic()
        caplog.clear()
        with caplog.at_level("WARNING", logger="forge.agents"):
            report = run_episode(gw, agent, task, group, verifier, timeout_s=60, verifier_timeout_s=0.5)
        assert report.status == "failed" and report.reward is None
        assert time.monotonic() - start < 20 and reason in caplog.text  # the reason is logged
    assert [e.status for e in sink.episodes[before:]] == ["failed"] * len(cases)


def test_driver_retires_tasks_every_episode_solves(stack, tmp_path):
    """--retire-solved-after 2: 'easy' tasks (always answered right) leave after two fully solved groups each, the
    'hard' ones keep coming; the retired ids persist, and a new driver reading them starts without those tasks. Once
    every task of a domain is retired the domain leaves the mix; once all are, the driver stops."""
    gw = stack["gateway"]
    tasks = [Task(task_id=f"easy-{i}", prompt="1+1", domain="easy", answer="2") for i in range(2)] + \
            [Task(task_id=f"hard-{i}", prompt="1+1", domain="hard", answer="2") for i in range(2)]
    retired_file = tmp_path / "retired.txt"
    kw = dict(group_size=2, max_inflight_groups=1, retire_solved_after=2, retired_tasks_path=str(retired_file))
    driver = RolloutDriver(gw, PythonAgent(Scripted()), tasks, **kw)
    driver.run(threading.Event(), max_groups=12)
    started = [r.task_id for r in driver.reports]
    assert driver.retired == {"easy-0", "easy-1"}
    assert sorted(retired_file.read_text().split()) == ["easy-0", "easy-1"]
    for task_id in ("easy-0", "easy-1"):  # exactly two groups (of two episodes) each, then no more
        assert started.count(task_id) == 4
    assert started[-4:] and all(t.startswith("hard") for t in started[-4:])
    again = RolloutDriver(gw, PythonAgent(Scripted()), tasks, **kw)
    assert again.retired == {"easy-0", "easy-1"} and set(again.pools) == {"easy", "hard"}
    assert not again.pools["easy"] and {t.task_id for t in again.pools["hard"]} == {"hard-0", "hard-1"}
    everything_easy = [Task(task_id=f"e-{i}", prompt="1+1", domain="easy", answer="2") for i in range(2)]
    solver = RolloutDriver(gw, PythonAgent(Scripted()), everything_easy, group_size=1, max_inflight_groups=1,
                           retire_solved_after=1)
    solver.run(threading.Event(), max_groups=50)
    assert solver.exhausted and solver.groups_started == 2  # one solved group each, then nothing left to start
    with pytest.raises(ValueError, match="retire_solved_after must be >= 0"):
        RolloutDriver(gw, None, tasks, 2, retire_solved_after=-1)


def test_groups_are_registered_with_the_tasks_answer():
    """The driver registers a task's group with its metadata and its answer (unless the metadata names one): what a
    user reward function and a privileged distillation teacher's prompt (--teacher-prompt '{answer}') read."""
    from forge_megatron.agents.driver import group_metadata

    assert group_metadata(Task(task_id="a", prompt="2+2", answer="4", metadata={"k": 1})) == {"k": 1, "answer": "4"}
    assert group_metadata(Task(task_id="b", prompt="x", answer="4", metadata={"answer": "given"})) == {"answer": "given"}
    assert group_metadata(Task(task_id="c", prompt="x")) == {}
