"""KTO (training/kto.py): the example forms and their loss masks, the mismatched samples of the KL estimate, the loss
and every gradient against transformers on prefix trees (the reference point clamped and not), and forge-kto end
to end on unpaired examples (the policy learns the desirable behaviour). CPU, one rank."""

import json
import math

import pytest
import torch

from forge_megatron.agents import calculator
from forge_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer
from forge_megatron.training import kto as K
from tests.training.test_preference import _assert_close_grads, _hf_grads, _write

PROMPT = [{"role": "user", "content": "12+7"}]


def _unpaired(n: int, seed: int) -> list[dict]:
    """The demo's preference as unpaired feedback: calling the calculator is desirable, a (wrong) direct answer is
    not; each task gives one example, alternately of each kind, so that no prompt has both."""
    out = []
    for i, t in enumerate(calculator.make_tasks(n, seed=seed)):
        good = i % 2 == 0
        out.append({"prompt": [{"role": "user", "content": t.prompt}], "tools": calculator.TOOLS, "label": good,
                    "completion": [calculator.tool_call_message()] if good else str(int(t.answer) + 1 + i % 3)})
    return out


@pytest.fixture
def one_rank():
    from forge_megatron.mcore import parallel

    parallel.initialize(seed=0)
    yield
    parallel.destroy()


def test_example_forms_masks_and_mismatched_samples(tmp_path):
    tok = build_tiny_tokenizer()
    history = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}, *PROMPT]
    (e,) = K._render(tok, {"prompt": history, "completion": "19", "label": True})
    ids, mask, _ = e.sample
    assert e.desirable and tok.decode([t for t, m in zip(ids, mask) if m]) == "19<|im_end|>"  # not the history's "2"
    (whole,) = K._render(tok, {"messages": history + [{"role": "assistant", "content": "19"}], "label": False})
    assert whole.sample[0] == ids and not whole.desirable
    assert tok.decode([t for t, m in zip(*whole.sample[:2]) if m]) == "2<|im_end|>19<|im_end|>"  # every turn
    (tokens,) = K._render(tok, {"input_ids": ids, "loss_mask": mask, "label": True})
    assert tokens.sample[:2] == (ids, mask)
    good, bad = K._render(tok, {"prompt": PROMPT, "chosen": "19", "rejected": "20"})
    assert (good.desirable, bad.desirable) == (True, False)
    assert tok.decode([t for t, m in zip(*bad.sample[:2]) if m]) == "20<|im_end|>"
    tokens = {"chosen": {"input_ids": good.sample[0], "loss_mask": good.sample[1]},  # (forge-pool-export --pairs')
              "rejected": {"input_ids": bad.sample[0], "loss_mask": bad.sample[1]}}
    K.check_example(tokens, "f.jsonl:1")
    assert [(e.sample[:2], e.desirable) for e in K._render(tok, tokens)] == [(good.sample[:2], True),
                                                                           (bad.sample[:2], False)]
    whole_pair = K._render(tok, {"chosen": history + [{"role": "assistant", "content": "19"}],
                                 "rejected": history + [{"role": "assistant", "content": "20"}]})
    assert [e.desirable for e in whole_pair] == [True, False] and whole_pair[0].sample[0] == ids

    other = K._render(tok, {"prompt": [{"role": "user", "content": "3+4"}],
                            "completion": [calculator.tool_call_message()], "label": False})[0]
    ids_kl, mask_kl, _ = K.mismatched(e, other)
    a, b = K.answer_start(e.sample), K.answer_start(other.sample)
    assert ids_kl == ids[:a] + other.sample[0][b:] and mask_kl == [0] * a + other.sample[1][b:]
    assert tok.decode(ids_kl[:a]).endswith("12+7<|im_end|>\n<|im_start|>assistant\n")  # this prompt, that answer
    assert "<tool_call>" in tok.decode([t for t, m in zip(ids_kl, mask_kl) if m])

    examples = K.render_records(tok, _unpaired(7, seed=0))
    K.attach_mismatched(examples, seed=3)
    answers = sorted(tuple(x.kl[0][K.answer_start(x.kl):]) for x in examples)
    assert answers == sorted(tuple(x.sample[0][K.answer_start(x.sample):]) for x in examples)  # each answer once
    for x in examples:  # its own prompt (and another's answer: the multiset above; equal answers can meet)
        assert x.kl[0][:K.answer_start(x.sample)] == x.sample[0][:K.answer_start(x.sample)]
    assert sum(x.kl[0] != x.sample[0] for x in examples) >= 5
    with pytest.raises(ValueError, match="at least two examples"):
        K.attach_mismatched(examples[:1], seed=0)

    bad_records = [({"prompt": PROMPT, "completion": "1"}, "needs a 'label'"),
                   ({"prompt": PROMPT, "completion": "1", "label": 1}, "needs a 'label'"),
                   ({"prompt": PROMPT, "completion": "1", "messages": history, "label": True}, "exactly one of"),
                   ({"messages": history, "prompt": PROMPT, "label": True}, "takes no 'prompt'"),
                   ({"prompt": PROMPT, "completion": {"role": "user", "content": "x"}, "label": True},
                    "no assistant turn"),
                   ({"prompt": PROMPT, "chosen": "1", "rejected": "2", "label": True}, "takes no label"),
                   ({"input_ids": [1, 2], "loss_mask": [1, 0], "label": True}, "trains no token")]
    for record, message in bad_records:
        with pytest.raises(ValueError, match=message):
            K.check_example(record, "f.jsonl:1")
    path = _write(tmp_path / "bad.jsonl", [_unpaired(1, 0)[0], {"prompt": PROMPT, "label": True}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: give exactly one of"):
        K.load_examples(path)
    assert "suggests" not in K.balance_note(examples, 1.0, 1.0)  # 4 desirable, 3 undesirable: 1.33 is in range
    assert "suggests 1 to 4/3" in K.balance_note(examples, 1.0, 2.0)
    assert "suggests 1 to 4/3" in K.balance_note(examples, 1.0, 0.5)
    assert "only one kind" in K.balance_note([x for x in examples if x.desirable], 1.0, 1.0)


def _hf_sums(hf, samples) -> torch.Tensor:
    sums = []
    for ids, mask, _ in samples:
        logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        logp = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        sums.append((logp * torch.tensor(mask[1:], dtype=torch.float32)).sum())
    return torch.stack(sums)


@pytest.mark.parametrize("kl_offset", [1.5, -2.0])
def test_kto_loss_and_gradients_equal_transformers(tmp_path, one_rank, kl_offset):
    """The examples and their mismatched samples as one forest: the loss (desirable and undesirable weights, the
    reference point from the mismatched samples: positive, and clamped to 0 when their mean log-ratio is negative),
    its metrics and every gradient equal transformers' causal LM scoring each sample alone."""
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(str(tmp_path / "base"))
    tok = build_tiny_tokenizer()
    examples = K.render_records(tok, _unpaired(6, seed=5))
    K.attach_mismatched(examples, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        kl_sums = _hf_sums(hf, [e.kl for e in examples])
    torch.manual_seed(0)
    for e, s in zip(examples, kl_sums.tolist()):  # references other than the policy; the KL term's mean log-ratio
        e.ref = (float(torch.randn(()) * 3), s - kl_offset + float(torch.randn(()) * 0.1))  # near kl_offset
    model, bridge = K.sft.build_model(base, None, False)
    loss, metrics = K.kto_examples_loss(model, beta=0.4, desirable_weight=1.2, undesirable_weight=0.8)(examples)
    loss.backward()
    ours = dict(bridge.export((n, p.grad) for n, p in model.named_parameters()))

    sums = _hf_sums(hf, [e.sample for e in examples])
    ref = torch.tensor([e.ref for e in examples])
    z0 = max(0.0, (kl_sums - ref[:, 1]).mean().item())
    assert (z0 > 1.0) == (kl_offset > 0) and math.isclose(metrics["kl"], z0, rel_tol=1e-4, abs_tol=1e-6)
    r = sums - ref[:, 0]
    good = torch.tensor([e.desirable for e in examples])
    want = torch.where(good, 1.2 * (1 - torch.sigmoid(0.4 * (r - z0))), 0.8 * (1 - torch.sigmoid(0.4 * (z0 - r))))
    want = want.mean()
    want.backward()
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-5)
    signed = torch.where(good, 1.0, -1.0) * (r.detach() - z0)
    assert metrics["accuracy"] == (signed > 0).float().mean().item()
    assert math.isclose(metrics["margin"], 0.4 * signed.mean().item(), rel_tol=1e-4, abs_tol=1e-6)
    _assert_close_grads(ours, _hf_grads(hf))


def test_held_out_reference_point_is_the_whole_sets(tmp_path, one_rank):
    """A held-out set's loss does not depend on how it is batched: one reference point over the whole set (equal to
    the estimate of one forest of all of it), its examples scored against it."""
    base = build_tiny_model(str(tmp_path / "base"))
    ref = build_tiny_model(str(tmp_path / "ref"), seed=7)
    examples = K.render_records(build_tiny_tokenizer(), _unpaired(5, seed=8))
    K.attach_mismatched(examples, seed=0)
    model, _ = K.sft.build_model(base, None, False)
    reference, _ = K.sft.build_model(ref, None, False)
    K.set_reference(reference, examples, 2)
    z0 = K.held_out_reference_point(model, examples, 2)
    with torch.no_grad():
        _, whole = K.kto_examples_loss(model, 0.3)(examples)
    assert z0 > 0.5 and math.isclose(z0, whole["kl"], rel_tol=1e-5)
    by_two, by_five = (K.evaluate(model, examples, size, 0.3) for size in (2, 5))
    assert by_two["examples"] == by_five["examples"] == 5
    for key in ("loss", "accuracy", "margin", "kl", "desirable_reward", "undesirable_reward"):
        assert math.isclose(by_two[key], by_five[key], rel_tol=1e-5, abs_tol=1e-7), key
    with torch.no_grad():
        _, plain = K.kto_examples_loss(model, 0.3, kl=False, reference_point=z0)(examples)
    assert math.isclose(by_two["margin"], plain["margin"], rel_tol=1e-5) and "desirable_reward" not in plain


def test_kto_without_kl_runs_the_examples_only(tmp_path, one_rank):
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(str(tmp_path / "base"))
    examples = K.render_records(build_tiny_tokenizer(), _unpaired(4, seed=2))
    for i, e in enumerate(examples):
        e.ref = (-3.0 - i, 0.0)
    model, _ = K.sft.build_model(base, None, False)
    loss, metrics = K.kto_examples_loss(model, beta=0.2, kl=False)(examples)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        r = _hf_sums(hf, [e.sample for e in examples]) - torch.tensor([e.ref[0] for e in examples])
    good = torch.tensor([e.desirable for e in examples])
    want = torch.where(good, 1 - torch.sigmoid(0.2 * r), 1 - torch.sigmoid(-0.2 * r)).mean()
    assert metrics["kl"] == 0.0 and math.isclose(loss.item(), want.item(), rel_tol=1e-5)


def test_forge_kto_teaches_the_policy_from_unpaired_feedback(tmp_path, capsys):
    """forge-kto on unpaired examples (no prompt has both kinds): held-out examples end on their label's side of the
    reference point, and the exported policy gives the desirable answers (the tool call) more probability, and the
    undesirable ones less, than the base did."""
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(str(tmp_path / "base"))
    data = _write(tmp_path / "train.jsonl", _unpaired(48, seed=0))
    held = _write(tmp_path / "eval.jsonl", _unpaired(16, seed=1))
    out = str(tmp_path / "kto")
    assert K.main(["--hf-checkpoint", base, "--data", data, "--eval-data", held, "--out", out, "--steps", "24",
                   "--lr", "2e-3", "--batch-size", "8", "--beta", "0.5", "--log-every", "100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("24 desirable, 24 undesirable examples" in line for line in lines)
    summary = json.loads(lines[-1])
    before = summary["eval_before"]  # the policy is the reference: every log-ratio 0 (to round-off), the loss 1/2
    assert abs(before["margin"]) < 1e-4 and before["kl"] < 1e-4 and abs(before["loss"] - 0.5) < 1e-4
    assert summary["eval_before"]["examples"] == 16 and summary["balance"] == 1.0
    assert summary["eval_after"]["accuracy"] >= 0.9 and summary["eval_after"]["margin"] > 0.5

    tok = build_tiny_tokenizer()
    examples = K.render_records(tok, K.load_examples(held))

    def mean_logp(path, desirable):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            sums = _hf_sums(model, [e.sample for e in examples if e.desirable == desirable])
        return sums.mean().item()

    assert mean_logp(out, True) > mean_logp(base, True) + 1.0
    assert mean_logp(out, False) < mean_logp(base, False) - 0.25


def test_forge_kto_refuses_bad_options(tmp_path, capsys):
    data = _write(tmp_path / "train.jsonl", _unpaired(2, seed=0))
    for argv, message in ((["--beta", "0"], "--beta must be positive"),
                          (["--undesirable-weight", "0"], "must be positive"),
                          (["--batch-size", "0"], "--batch-size must be at least 1"),
                          (["--eval-data", str(tmp_path / "none.jsonl")], "--eval-data: ")):
        with pytest.raises(SystemExit):
            K.main(["--hf-checkpoint", str(tmp_path), "--data", data, "--out", str(tmp_path / "o"), *argv])
        assert message in capsys.readouterr().err
    one = _write(tmp_path / "one.jsonl", _unpaired(1, seed=0))
    base = build_tiny_model(str(tmp_path / "base"))
    with pytest.raises(SystemExit):
        K.main(["--hf-checkpoint", base, "--data", one, "--out", str(tmp_path / "o")])
    assert "at least two examples (or --no-kl)" in capsys.readouterr().err
