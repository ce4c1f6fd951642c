"""Verifiers from the command line (forge_megatron.agents.runner.build_verifier): one for every domain, one per
domain for mixed-domain training (DomainVerifier), exact match by default; misspelt domains and duplicates are
refused by forge-rollout and forge-eval before anything runs."""

import json

import pytest

from forge_megatron.agents.runner import DomainVerifier, build_verifier, exact_match
from forge_megatron.agents.tasks import Task


def by_length(task, output):
    return float(len(output or ""))


def always_half(task, output):
    return 0.5


HERE = __name__  # tests.agents.test_verifier


def _task(domain, answer="7"):
    return Task(task_id=f"{domain}-1", prompt="3+4", domain=domain, answer=answer)


def test_default_and_single_verifier():
    assert build_verifier(None) is exact_match and build_verifier([]) is exact_match
    assert build_verifier([f"{HERE}:by_length"]) is by_length


def test_per_domain_verifiers_dispatch_on_the_task_domain():
    v = build_verifier([f"code={HERE}:by_length", f"{HERE}:always_half", f"qa={HERE}:by_length"])
    assert isinstance(v, DomainVerifier)
    assert v(_task("code"), "abcd") == 4.0 and v(_task("qa"), "ab") == 2.0
    assert v(_task("math"), "7") == 0.5  # no entry: the unprefixed verifier
    only = build_verifier([f"code={HERE}:by_length"])
    assert only(_task("math"), " 7 ") == 1.0 and only(_task("math"), "8") == 0.0  # else exact match
    only.check_domains([_task("code"), _task("math")])
    with pytest.raises(ValueError, match=r"names domain\(s\) \['code'\] that no task has"):
        only.check_domains([_task("math")])


def test_none_scores_every_episode_zero_and_needs_no_answer():
    """``--verifier none`` (on-policy distillation from a teacher alone): 0 for any output of any task, answered or
    not (exact match refuses a task without an answer); per domain too."""
    from forge_megatron.agents.runner import no_reward

    v = build_verifier(["none"])
    assert v is no_reward and v(_task("chat", answer=None), "anything") == 0.0 and v(_task("math"), "7") == 0.0
    with pytest.raises(ValueError, match="has no answer"):
        build_verifier([])(_task("chat", answer=None), "anything")
    mixed = build_verifier(["chat=none"])
    assert mixed(_task("chat", answer=None), "x") == 0.0 and mixed(_task("math"), "7") == 1.0


@pytest.mark.parametrize("specs,message", [
    ([f"{HERE}:by_length", f"{HERE}:always_half"], "two verifiers for every domain"),
    ([f"code={HERE}:by_length", f"code={HERE}:always_half"], "domain 'code' already has a verifier"),
    ([f"={HERE}:by_length"], "empty domain"),
    (["code=nocolon"], "expected 'package.module:function'"),
])
def test_bad_specs_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        build_verifier(specs)


@pytest.mark.parametrize("prog", ["driver", "evaluate"])
def test_cli_refuses_a_domain_no_task_has(tmp_path, prog):
    import importlib

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "a", "prompt": "3+4", "domain": "math", "answer": "7"}) + "\n")
    main = importlib.import_module(f"forge_megatron.agents.{prog}").main
    base = ["--gateway-url", "http://127.0.0.1:9", "--tasks", str(tasks), "--agent-python", f"{HERE}:by_length"]
    with pytest.raises(SystemExit, match=r"names domain\(s\) \['maths'\] that no task has"):
        main(base + ["--verifier", f"maths={HERE}:by_length"])
    with pytest.raises(SystemExit, match="No module named 'no_such_rewards'"):
        main(base + ["--verifier", "math=no_such_rewards:score"])
