"""Preference training (training/preference.py): pair rendering and loss masks, reward-model scores and DPO
log-probabilities and every gradient against transformers on prefix trees, and forge-rm / forge-dpo end to end
(the exported reward model served by forge-engine's /classify code, the DPO policy preferring what it was taught).
CPU, one rank."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from forge_megatron.agents import calculator
from forge_megatron.models.tiny import build_tiny_model, build_tiny_reward_model, build_tiny_tokenizer
from forge_megatron.training import preference as P

PROMPT = [{"role": "user", "content": "12+7"}]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _tool_pairs(n: int, seed: int, mixed: bool = False) -> list[dict]:
    """The demo's preference: calling the calculator beats answering directly (wrongly, as a tiny model does);
    ``mixed``: every other pair prefers the direct answer to a call of a tool that does not exist, so that no one
    direction of the score (tool call or not) ranks every pair."""
    pairs = []
    for i, t in enumerate(calculator.make_tasks(n, seed=seed)):
        pair = {"prompt": [{"role": "user", "content": t.prompt}], "tools": calculator.TOOLS,
                "chosen": [calculator.tool_call_message()], "rejected": str(int(t.answer) + 1 + i % 3)}
        if mixed and i % 2:
            wrong = calculator.tool_call_message()
            wrong["tool_calls"][0]["function"]["name"] = "search"
            pair.update(chosen=str(int(t.answer) + 1 + i % 3), rejected=[wrong])
        pairs.append(pair)
    return pairs


@pytest.fixture
def one_rank():
    from forge_megatron.mcore import parallel

    parallel.initialize(seed=0)
    yield
    parallel.destroy()


def test_pair_forms_and_loss_masks(tmp_path):
    tok = build_tiny_tokenizer()
    history = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}, *PROMPT]
    pair = P.render_pair(tok, {"prompt": history, "chosen": "19", "rejected": {"role": "assistant", "content": "20"}})
    for (ids, mask, images), answer in ((pair.chosen, "19"), (pair.rejected, "20")):
        assert images == [] and len(ids) == len(mask)
        assert tok.decode([t for t, m in zip(ids, mask) if m]) == answer + "<|im_end|>"  # not the history's "2"
    whole = P.render_pair(tok, {"chosen": history[:2] + PROMPT + [{"role": "assistant", "content": "19"}],
                                "rejected": history[:2] + PROMPT + [{"role": "assistant", "content": "20"}]})
    assert whole.chosen[0] == pair.chosen[0]
    assert tok.decode([t for t, m in zip(*whole.chosen[:2]) if m]) == "2<|im_end|>19<|im_end|>"  # every turn
    tools = P.render_pair(tok, {"prompt": PROMPT, "tools": calculator.TOOLS, "margin": 1.5,
                                "chosen": [calculator.tool_call_message()], "rejected": "20"})
    assert "<tool_call>" in tok.decode([t for t, m in zip(*tools.chosen[:2]) if m]) and tools.margin == 1.5
    tokens = P.render_pair(tok, {"chosen": {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
                                 "rejected": {"input_ids": [1, 2, 4], "loss_mask": [0, 0, 1]}})
    assert tokens.chosen == ([1, 2, 3], [0, 1, 1], []) and tokens.rejected[1] == [0, 0, 1]

    bad = {"missing": {"chosen": "19", "prompt": PROMPT},
           "same": {"prompt": PROMPT, "chosen": "19", "rejected": "19"},
           "no prompt": {"chosen": "19", "rejected": "20"},
           "margin": {"prompt": PROMPT, "chosen": "19", "rejected": "20", "margin": "big"},
           "no assistant": {"chosen": PROMPT, "rejected": PROMPT + [{"role": "assistant", "content": "1"}]},
           "token prompt": {"prompt": PROMPT, "chosen": {"input_ids": [1, 2], "loss_mask": [0, 1]},
                            "rejected": {"input_ids": [1, 3], "loss_mask": [0, 1]}},
           "token mask": {"chosen": {"input_ids": [1, 2], "loss_mask": [0]},
                          "rejected": {"input_ids": [1, 3], "loss_mask": [0, 1]}}}
    for name, record in bad.items():
        path = _write(tmp_path / "bad.jsonl", [{"prompt": PROMPT, "chosen": "1", "rejected": "2"}, record])
        with pytest.raises(ValueError, match="bad.jsonl:2"):
            P.load_pairs(path)
    (tmp_path / "junk.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="junk.jsonl:1: not valid JSON"):
        P.load_pairs(str(tmp_path / "junk.jsonl"))
    with pytest.raises(ValueError, match="pair 0: token id 99999 is outside"):
        P.render_pairs(tok, [{"chosen": {"input_ids": [1, 99999], "loss_mask": [0, 1]},
                              "rejected": {"input_ids": [1, 2], "loss_mask": [0, 1]}}])
    kept = P.render_pairs(tok, [{"prompt": PROMPT, "chosen": "19", "rejected": "20"},
                                {"prompt": PROMPT, "chosen": "19" * 40, "rejected": "20"}], max_length=30)
    assert len(kept) == 1


def _hf_grads(model, prefix_map=None) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_grads(ours: dict, theirs: dict) -> None:
    biggest = max(g.abs().max().item() for g in theirs.values())
    for name, ref in theirs.items():
        err = ((ours[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-3 * biggest)).item()
        assert err < 1e-3, (name, err)


def test_reward_scores_and_gradients_equal_transformers(tmp_path, one_rank):
    """Pairs sharing their prompts, as one tree: every score equals transformers' sequence classifier's, and so does
    every gradient of the Bradley-Terry loss (with margins and the centring term)."""
    from transformers import AutoModelForSequenceClassification

    rm_dir = build_tiny_reward_model(str(tmp_path / "rm"))
    tok = build_tiny_tokenizer()
    records = [{"prompt": PROMPT, "chosen": "19", "rejected": "20", "margin": 0.5},
               {"prompt": PROMPT, "chosen": "19", "rejected": "21"},
               {"prompt": [{"role": "user", "content": "3+4"}], "tools": calculator.TOOLS,
                "chosen": [calculator.tool_call_message()], "rejected": "8"}]
    pairs = P.render_pairs(tok, records)
    samples = P._samples(pairs)
    rm = P.RewardModel(rm_dir)
    layout = P.sft.batch_layout(samples)
    assert layout.unique_tokens < 0.6 * layout.total_tokens  # the prompts are computed once
    loss, metrics = P.reward_model_loss(rm, center_coef=0.1)(pairs)
    loss.backward()
    ours = dict(rm.bridge.export((n, p.grad) for n, p in rm.model.named_parameters()))

    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    scores = torch.stack([hf(input_ids=torch.tensor([ids])).logits[0, 0] for ids, _, _ in samples])
    with torch.no_grad():
        assert torch.allclose(rm.scores(samples), scores, atol=1e-5)
    c, r = scores[0::2], scores[1::2]
    want = (-F.logsigmoid(c - r - torch.tensor([0.5, 0.0, 0.0])).mean() + 0.1 * ((c + r) ** 2).mean())
    want.backward()
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-5)
    assert metrics["accuracy"] == (c > r).float().mean().item()
    theirs = _hf_grads(hf)
    assert set(theirs) == set(ours)
    _assert_close_grads(ours, theirs)


def test_dpo_logprobs_and_gradients_equal_transformers(tmp_path, one_rank):
    """Response log-probability sums over the loss masks, the DPO loss with label smoothing and the chosen NLL term,
    and every gradient: equal to transformers' causal LM scoring each side alone."""
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(str(tmp_path / "base"))
    tok = build_tiny_tokenizer()
    pairs = P.render_pairs(tok, _tool_pairs(4, seed=3))
    torch.manual_seed(0)
    for p in pairs:  # a reference other than the policy, so that delta is not zero
        p.ref = tuple(torch.randn(2).mul(3).tolist())
    model, bridge = P.sft.build_model(base, None, False)
    loss, metrics = P.dpo_pairs_loss(model, None, beta=0.3, label_smoothing=0.1, sft_coef=0.5)(pairs)
    loss.backward()
    ours = dict(bridge.export((n, p.grad) for n, p in model.named_parameters()))

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    sums, counts = [], []
    for ids, mask, _ in P._samples(pairs):
        logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        logp = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        m = torch.tensor(mask[1:], dtype=torch.float32)
        sums.append((logp * m).sum())
        counts.append(m.sum())
    sums, counts = torch.stack(sums), torch.stack(counts)
    ref = torch.tensor([p.ref for p in pairs])
    delta = (sums[0::2] - ref[:, 0]) - (sums[1::2] - ref[:, 1])
    want = (-0.9 * F.logsigmoid(0.3 * delta) - 0.1 * F.logsigmoid(-0.3 * delta)).mean()
    want = want + 0.5 * -(sums[0::2] / counts[0::2]).mean()
    want.backward()
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-5)
    assert metrics["accuracy"] == (delta > 0).float().mean().item()
    _assert_close_grads(ours, _hf_grads(hf))
    ipo, _ = P.dpo_loss(sums[0::2], sums[1::2], ref[:, 0], ref[:, 1], beta=0.5, kind="ipo")
    assert math.isclose(ipo.item(), ((delta - 1.0) ** 2).mean().item(), rel_tol=1e-6)


def test_simpo_loss_and_gradients_equal_transformers(tmp_path, one_rank):
    """SimPO: length-normalised, reference-free (Pair.ref unused): loss with gamma and label smoothing, and every
    gradient, equal to transformers' causal LM scoring each side alone."""
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(str(tmp_path / "base"))
    pairs = P.render_pairs(build_tiny_tokenizer(), _tool_pairs(4, seed=4, mixed=True))
    model, bridge = P.sft.build_model(base, None, False)
    loss, metrics = P.dpo_pairs_loss(model, None, beta=2.0, kind="simpo", label_smoothing=0.1, gamma=0.3)(pairs)
    loss.backward()
    ours = dict(bridge.export((n, p.grad) for n, p in model.named_parameters()))

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    means = []
    for ids, mask, _ in P._samples(pairs):
        logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        m = torch.tensor(mask[1:], dtype=torch.float32)
        means.append((logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0] * m).sum() / m.sum())
    means = torch.stack(means)
    z = 2.0 * (means[0::2] - means[1::2]) - 0.3
    want = (-0.9 * F.logsigmoid(z) - 0.1 * F.logsigmoid(-z)).mean()
    want.backward()
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-5)
    assert metrics["accuracy"] == (z + 0.3 > 0).float().mean().item()
    _assert_close_grads(ours, _hf_grads(hf))


def test_forge_rm_trains_a_reward_model_that_forge_engine_serves(tmp_path, capsys):
    """forge-rm from a causal LM: the held-out loss falls and the pairs are ranked right; the export is a
    Qwen2ForSequenceClassification that forge-engine's reward engine loads and scores the same way, and forge-rm
    takes it again (a reward model trained further)."""
    from forge_megatron.rollout.reward_model import RewardEngine, is_reward_model

    base = build_tiny_model(str(tmp_path / "base"))
    data = _write(tmp_path / "train.jsonl", _tool_pairs(64, seed=0, mixed=True))
    held = _write(tmp_path / "eval.jsonl", _tool_pairs(16, seed=1, mixed=True))
    out = str(tmp_path / "rm")
    assert P.main_rm(["--hf-checkpoint", base, "--data", data, "--eval-data", held, "--out", out, "--epochs", "4",
                      "--lr", "2e-3", "--batch-size", "8", "--micro-batch-size", "4", "--log-every", "100"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    before, after = summary["eval_before"], summary["eval_after"]
    assert summary["steps"] == 32 and before["accuracy"] <= 0.75  # (no one direction ranks the mixed pairs)
    assert after["accuracy"] >= 0.95 and after["loss"] < 0.3 * before["loss"]
    assert is_reward_model(out)

    engine = RewardEngine(out)
    tok = build_tiny_tokenizer()
    pairs = P.render_pairs(tok, P.load_pairs(held))
    served = [engine.model(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids, _, _ in P._samples(pairs)]
    assert sum(c > r for c, r in zip(served[0::2], served[1::2])) >= 0.95 * len(pairs)

    from forge_megatron.mcore import parallel

    parallel.initialize(seed=0)
    try:  # the export read back as a reward model: the same scores
        again = P.RewardModel(out)
        with torch.no_grad():
            ours = again.scores(P._samples(pairs))
    finally:
        parallel.destroy()
    assert torch.allclose(ours, torch.tensor(served), atol=1e-4)


def test_forge_dpo_teaches_the_policy_the_preference(tmp_path, capsys):
    """forge-dpo: the implicit reward ranks held-out pairs right after training, and the exported policy gives the
    chosen answers more probability against the rejected ones than the base did."""
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(str(tmp_path / "base"))
    data = _write(tmp_path / "train.jsonl", _tool_pairs(48, seed=0))
    held = _write(tmp_path / "eval.jsonl", _tool_pairs(16, seed=1))
    out = str(tmp_path / "dpo")
    assert P.main_dpo(["--hf-checkpoint", base, "--data", data, "--eval-data", held, "--out", out, "--steps", "24",
                       "--lr", "2e-3", "--batch-size", "8", "--beta", "0.5", "--log-every", "100"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["eval_before"]["accuracy"] == 0.0 and summary["eval_before"]["margin"] == 0.0  # policy = reference
    assert summary["eval_after"]["accuracy"] >= 0.95 and summary["eval_after"]["margin"] > 1.0

    tok = build_tiny_tokenizer()
    pairs = P.render_pairs(tok, P.load_pairs(held))

    def gap(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out = []
        for ids, mask, _ in P._samples(pairs):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
            out.append((logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0] * torch.tensor(mask[1:])).sum().item())
        return sum(c - r for c, r in zip(out[0::2], out[1::2])) / len(pairs)

    assert gap(out) > gap(base) + 2.0


def test_cli_refuses_bad_options(tmp_path, capsys):
    data = _write(tmp_path / "train.jsonl", _tool_pairs(2, seed=0))
    for argv, message in ((["--batch-size", "0"], "--batch-size must be at least 1"),
                          (["--epochs", "0"], "--epochs must be positive"),
                          (["--beta", "0"], "--beta must be positive"),
                          (["--label-smoothing", "0.5"], "--label-smoothing must be in"),
                          (["--eval-data", str(tmp_path / "none.jsonl")], "--eval-data: ")):
        with pytest.raises(SystemExit):
            P.main_dpo(["--hf-checkpoint", str(tmp_path), "--data", data, "--out", str(tmp_path / "o"), *argv])
        assert message in capsys.readouterr().err
    from forge_megatron.bridge.families import reward_model_config

    with pytest.raises(ValueError, match="reward models are made from text-only causal language models"):
        reward_model_config({"architectures": ["Qwen3VLForConditionalGeneration"]})
