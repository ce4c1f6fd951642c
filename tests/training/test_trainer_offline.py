"""The Megatron trainer's offline modes (``scripts/train_forge.py --sft-data / --preference-data [--reward-model]``,
training/offline.py): each mode's micro-batch loss, normalised over the whole batch, gives exactly the gradients of
the one-rank tool's loss (forge-sft, forge-dpo, forge-rm) on the same samples however the batch is split into
micro-batches; whole runs under PP = 2 and TP = 2 train like one rank; a run stopped and resumed trains the same
data as an uninterrupted one. CPU, gloo."""

import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.training import preference as P
from forge_megatron.training.offline import PreferenceFeed
from tests.dist_utils import run_script

from .test_preference import _tool_pairs, _write
from .trainer_run import TRAIN, model_args, read_steps, train_env


@pytest.mark.parametrize("kind", ["sigmoid", "simpo"])
def test_trainer_dpo_loss_gives_forge_dpos_gradients(tmp_path, kind):
    """Four pairs through the trainer's rank_batch (a token budget that packs them into several micro-batches, the
    pairs whole) and offline_forward_backward, the reference another checkpoint (SimPO: none): the gradients
    equal those of forge-dpo's loss (mean over pairs) on the same pairs; so do the loss and the pair metrics."""
    from forge_megatron.mcore import parallel
    from forge_megatron.mcore.forward import make_tree_forward_step
    from forge_megatron.training.trainer import offline_forward_backward, rank_batch, run_schedule

    base = build_tiny_model(str(tmp_path / "base"), seed=0)
    ref_dir = build_tiny_model(str(tmp_path / "ref"), seed=5)
    data = _write(tmp_path / "pairs.jsonl", _tool_pairs(4, seed=2))
    feed = PreferenceFeed(data, base, pairs_per_step=4, token_budget=320, seed=0)
    batch = feed.batch(0)
    args = type("A", (), {"dpo_beta": 0.4, "dpo_loss": kind, "dpo_label_smoothing": 0.1, "dpo_sft_coef": 0.3,
                          "simpo_gamma": 0.2})
    parallel.initialize(seed=0)
    try:
        model, _ = P.sft.build_model(base, None, False)
        ref, _ = P.sft.build_model(ref_dir, None, False)
        rb = rank_batch(batch, 320, True, 0, 1, [], "cost-groups")
        assert len(rb.micro_batches) >= 2  # several forests, each holding whole pairs

        def keep(logp_M, entropy_M, mb):
            mb.extras["ref_logp_M"] = logp_M.detach()
            return logp_M.sum() * 0.0, {}

        if kind != "simpo":
            with torch.no_grad():
                run_schedule([ref], rb, make_tree_forward_step(keep), forward_only=True)
        metrics = offline_forward_backward([model], rb, "dpo", args)
        ours = _grads(model)
        model.zero_grad()

        pairs = []
        for k in range(0, len(batch.samples), 2):
            c, r = batch.samples[k], batch.samples[k + 1]
            pairs.append(P.Pair((c.tokens.tolist(), c.loss_mask.tolist(), []),
                                (r.tokens.tolist(), r.loss_mask.tolist(), [])))
        if kind != "simpo":
            P.set_reference(ref, pairs, 4)
        loss, want = P.dpo_pairs_loss(model, None, 0.4, kind, 0.1, 0.3, gamma=0.2)(pairs)
        loss.backward()
    finally:
        parallel.destroy()
    from forge_megatron.training.metrics import combine_micro_batch_metrics

    got = combine_micro_batch_metrics(metrics)
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["dpo/num_pairs"] == 4 and got["dpo/accuracy"] == pytest.approx(want["accuracy"])
    assert got["dpo/margin"] == pytest.approx(want["margin"], rel=1e-4, abs=1e-6)
    _assert_same_grads(ours, model)


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(ours: dict, model) -> None:
    """``ours`` (the trainer's gradients) equal ``model``'s present ones to fp32 round-off, every parameter."""
    theirs = _grads(model)
    assert set(ours) == set(theirs) and theirs
    for name, g in theirs.items():
        assert torch.allclose(ours[name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item()), name


def _assert_same_steps(one: list, other: list, name: str, margin: str) -> None:
    """``other`` (a run in another layout, or resumed) trained ``one``'s steps: loss, gradient norm and ``margin``.
    (Each Adam step carries the layouts' fp32 round-off into the next: by the 10th of the reward model's steps at lr
    3e-3 its gradient norms were 1.5e-4 apart under TP = 2 on an AVX2 machine, within 1e-4 on another: 5e-4 from the
    third step on.)"""
    assert len(other) == len(one), name
    for i, (a, b) in enumerate(zip(one, other)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), name
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4 if i < 2 else 5e-4), name
        assert b[margin] == pytest.approx(a[margin], rel=1e-3, abs=1e-5), name


def _run(tmp_path, name, model_dir, data, nproc=1, extra=(), exits=(None,), iters=4, preference=True, env_extra=None,
         model_flags=True):
    """train_forge.py on ``data`` in ``tmp_path/name`` (the tiny model's network flags unless not ``model_flags``:
    the architecture is then the checkpoint's); (metric steps, output of each process of ``exits``)."""
    run_dir = str(tmp_path / name)
    outs = []
    mode = ["--preference-data", data, "--dpo-beta", "0.5"] if preference else []
    for exit_at in exits:
        args = [*(model_args() if model_flags else []), "--hf-checkpoint", model_dir, "--lr", "2e-3", "--train-iters", str(iters),
                "--save", f"{run_dir}/ckpt", "--load", f"{run_dir}/ckpt", "--save-interval", "2", *mode,
                "--train-batch-groups", "4", "--tree-token-budget", "400",
                "--log-interval", "1", "--metrics-jsonl", f"{run_dir}/metrics.jsonl", *extra,
                *(["--exit-interval", str(exit_at)] if exit_at else [])]
        env = train_env() if nproc == 1 else {**os.environ, "OMP_NUM_THREADS": "1"}
        out = run_script(TRAIN, args, nproc=nproc, env={**env, **(env_extra or {})})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        outs.append(out.stdout + out.stderr)
    return read_steps(f"{run_dir}/metrics.jsonl"), outs


def test_trainer_dpo_runs_under_pp_and_tp_and_resumes(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "model"))
    data = _write(tmp_path / "pairs.jsonl", _tool_pairs(12, seed=0))
    held = ["--offline-eval-data", _write(tmp_path / "held.jsonl", _tool_pairs(5, seed=9))]
    runs = {}
    runs["one"], outs = _run(tmp_path, "one", model_dir, data, extra=held)
    assert "--preference-data" in outs[0] and "12 pairs, 4 per step: 1.33 epoch(s)" in outs[0]
    assert "reference model for the DPO term loaded" in outs[0] and "iter 4 | loss " in outs[0]
    assert "| accuracy 1.000 | margin " in outs[0]
    runs["pp2"], _ = _run(tmp_path, "pp2", model_dir, data, nproc=2,
                          extra=held + ["--pipeline-model-parallel-size", "2"])
    runs["tp2"], _ = _run(tmp_path, "tp2", model_dir, data, nproc=2, extra=["--tensor-model-parallel-size", "2"])
    runs["dp2"], _ = _run(tmp_path, "dp2", model_dir, data, nproc=2, extra=held)
    assert "val/loss" not in runs["one"][0] and runs["one"][-1]["val/accuracy"] == 1.0  # (at the end only)
    for name in ("pp2", "dp2"):  # held-out pairs scored alike (DP = 2: 5 pairs dealt 3 + 2, sums reduced)
        for key in ("val/loss", "val/accuracy", "val/margin"):
            assert runs[name][-1][key] == pytest.approx(runs["one"][-1][key], rel=1e-4, abs=1e-6), (name, key)
    runs["resumed"], outs = _run(tmp_path, "resumed", model_dir, data, exits=(2, None))
    assert "resumed from" in outs[1]
    lora, outs = _run(tmp_path, "lora", model_dir, data, extra=["--lora-rank", "8", "--lr", "1e-2"])
    assert "reference: the policy with its LoRA adapters off" in outs[0] and "reference model for" not in outs[0]
    assert lora[0]["loss"] == pytest.approx(np.log(2), rel=1e-5) and lora[-1]["loss"] < lora[0]["loss"]
    simpo, outs = _run(tmp_path, "simpo", model_dir, data, extra=["--dpo-loss", "simpo", "--dpo-beta", "2"])
    assert "reference model" not in outs[0] and "DPO simpo" in outs[0]  # reference-free: no second model
    assert len(simpo) == 4 and simpo[-1]["loss"] < simpo[0]["loss"] and simpo[-1]["dpo/accuracy"] == 1.0
    one = runs["one"]
    assert len(one) == 4 and one[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # the policy is the reference
    assert one[-1]["loss"] < 0.5 * one[0]["loss"] and one[-1]["dpo/accuracy"] == 1.0
    assert [s["batch_id"] for s in one] == [0, 1, 2, 3]
    for name in ("pp2", "tp2", "resumed"):
        _assert_same_steps(one, runs[name], name, "dpo/margin")
        assert runs[name][-1]["dpo/accuracy"] == 1.0, name  # (at step 1 the margins are round-off: no accuracy)


def test_preference_flags_are_checked(tmp_path):
    from forge_megatron.training import arguments

    base = ["--hf-checkpoint", str(tmp_path), "--lr", "1e-3", "--train-iters", "1", "--num-layers", "2"]
    data = _write(tmp_path / "pairs.jsonl", _tool_pairs(2, seed=0))
    for extra, message in ((["--preference-data", str(tmp_path / "none.jsonl")], "is not a file"),
                           (["--preference-data", data, "--rl-kl-coef", "0.1"], "drop --rl-kl-coef"),
                           (["--preference-data", data, "--engine-urls", "http://127.0.0.1:1"], "trains offline"),
                           (["--preference-data", data, "--dpo-beta", "0"], "--dpo-beta must be > 0"),
                           (["--ref-hf-checkpoint", str(tmp_path)], "--rl-kl-coef > 0, --preference-data or --kto-data"),
                           (["--reward-model"], "--reward-model needs --preference-data"),
                           (["--preference-data", data, "--reward-model", "--lora-rank", "8"], "drop --lora-rank"),
                           (["--preference-data", data, "--reward-model", "--context-parallel-size", "2"],
                            "not under context parallelism"),
                           (["--preference-data", data, "--reward-model", "--ref-hf-checkpoint", str(tmp_path)],
                            "drop --ref-hf-checkpoint"),
                           (["--preference-data", data, "--dpo-loss", "simpo", "--ref-hf-checkpoint", str(tmp_path)],
                            "simpo has no reference model"),
                           (["--sft-data", data, "--preference-data", data], "one offline mode per run"),
                           (["--sft-data", str(tmp_path / "none.jsonl")], "--sft-data .* is not a file"),
                           (["--sft-data", data, "--rl-kl-coef", "0.1"], "--sft-data trains supervised"),
                           (["--offline-eval-data", data], "--offline-eval-data needs --sft-data, --preference-data or --kto"),
                           (["--sft-data", data, "--offline-eval-interval", "2"], "--offline-eval-interval needs"),
                           (["--sft-data", data, "--teacher-hf-checkpoint", str(tmp_path)],
                            "supervised distillation: it needs a dense --distill-kl"),
                           (["--sft-data", data, "--teacher-from-gateway", "--distill-kl", "forward"],
                            "not with --preference-data, --kto-data or a served teacher offline"),
                           (["--preference-data", data, "--teacher-hf-checkpoint", str(tmp_path), "--distill-kl",
                             "forward"], "not with --preference-data, --kto-data or a served teacher offline")):
        with pytest.raises(ValueError, match=message):
            arguments.validate_args(arguments.build_parser().parse_args(base + extra))
    args = arguments.build_parser().parse_args(base + ["--preference-data", data])
    arguments.validate_args(args)
    assert args.weight_sync_transport == "none" and json.loads(open(data).readline())["chosen"]


def test_trainer_reward_model_loss_gives_forge_rms_gradients(tmp_path):
    """--reward-model: the trainer's Bradley-Terry loss over several micro-batches (margins from the data, the
    centring term) gives forge-rm's loss, pair metrics and every gradient (the score head's too) on the same pairs."""
    from forge_megatron.mcore import parallel
    from forge_megatron.training.metrics import combine_micro_batch_metrics
    from forge_megatron.training.trainer import offline_forward_backward, rank_batch

    base = build_tiny_model(str(tmp_path / "base"), seed=0)
    records = _tool_pairs(4, seed=2, mixed=True)
    for i, r in enumerate(records):
        r["margin"] = 0.25 * i
    data = _write(tmp_path / "pairs.jsonl", records)
    feed = PreferenceFeed(data, base, pairs_per_step=4, token_budget=320, seed=0)
    batch = feed.batch(0)
    parallel.initialize(seed=0)
    try:
        rm = P.RewardModel(base)
        rb = rank_batch(batch, 320, True, 0, 1, [], "cost-groups")
        assert len(rb.micro_batches) >= 2
        args = type("A", (), {"rm_center_coef": 0.2})
        metrics = combine_micro_batch_metrics(offline_forward_backward([rm.model], rb, "rm", args))
        ours = _grads(rm.model)
        rm.model.zero_grad()
        pairs = []
        for k in range(0, len(batch.samples), 2):
            c, r = batch.samples[k], batch.samples[k + 1]
            pairs.append(P.Pair((c.tokens.tolist(), c.loss_mask.tolist(), []),
                                (r.tokens.tolist(), r.loss_mask.tolist(), []), margin=c.reward))
        assert sorted(p.margin for p in pairs) == [0.0, 0.25, 0.5, 0.75]
        loss, want = P.reward_model_loss(rm, center_coef=0.2)(pairs)
        loss.backward()
        assert "score_head.weight" in ours and ours["score_head.weight"].abs().sum() > 0
        _assert_same_grads(ours, rm.model)
    finally:
        parallel.destroy()
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5) and metrics["rm/num_pairs"] == 4
    assert metrics["rm/accuracy"] == pytest.approx(want["accuracy"])
    assert metrics["rm/margin"] == pytest.approx(want["margin"], rel=1e-4, abs=1e-6)


def test_trainer_reward_model_runs_under_pp_and_tp_resumes_and_exports(tmp_path):
    """--reward-model runs (12 steps on mixed pairs): PP = 2 and TP = 2 (sequence parallel) equal one rank, a
    stopped-and-resumed run too; the pairs end ranked right; forge-convert trainer-to-hf writes the same
    Qwen2ForSequenceClassification from the one-rank and the PP = 2 checkpoints, which transformers loads and which
    ranks the pairs right."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint
    from forge_megatron.models.tiny import build_tiny_tokenizer

    model_dir = build_tiny_model(str(tmp_path / "model"))
    data = _write(tmp_path / "pairs.jsonl", _tool_pairs(16, seed=0, mixed=True))
    rm = ["--reward-model", "--lr", "3e-3"]
    runs = {}
    runs["one"], outs = _run(tmp_path, "one", model_dir, data, extra=rm, iters=12)
    assert "a Bradley-Terry reward model" in outs[0] and "reference model" not in outs[0]
    assert "| accuracy 1.000 | margin " in outs[0]
    runs["pp2"], _ = _run(tmp_path, "pp2", model_dir, data, nproc=2, iters=12,
                          extra=rm + ["--pipeline-model-parallel-size", "2"])
    runs["tp2"], _ = _run(tmp_path, "tp2", model_dir, data, nproc=2, iters=12,
                          extra=rm + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    runs["resumed"], outs = _run(tmp_path, "resumed", model_dir, data, extra=rm, exits=(6, None), iters=12)
    assert "resumed from" in outs[1]
    one = runs["one"]
    assert len(one) == 12 and one[-1]["loss"] < one[0]["loss"] - 0.02
    assert all(s["rm/accuracy"] == 1.0 for s in one[-4:])  # (the mixed pairs: no one direction ranks them all)
    for name in ("pp2", "tp2", "resumed"):
        _assert_same_steps(one, runs[name], name, "rm/margin")

    exports = {}
    for name in ("one", "pp2"):
        exports[name] = str(tmp_path / f"exported-{name}")
        export_trainer_checkpoint(str(tmp_path / name / "ckpt"), exports[name])
    config = json.load(open(os.path.join(exports["pp2"], "config.json")))
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    tensors = [{k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()} for d in exports.values()]
    assert set(tensors[0]) == set(tensors[1]) and "score.weight" in tensors[0] and "lm_head.weight" not in tensors[0]
    for k in tensors[0]:
        assert torch.allclose(tensors[0][k], tensors[1][k], rtol=1e-3, atol=1e-5), k
    hf = AutoModelForSequenceClassification.from_pretrained(exports["pp2"], dtype=torch.float32)
    pairs = P.render_pairs(build_tiny_tokenizer(), P.load_pairs(data))
    with torch.no_grad():
        scores = [hf(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids, _, _ in P._samples(pairs)]
    assert sum(c > r for c, r in zip(scores[0::2], scores[1::2])) == len(pairs)


def _sft_chats(n: int, seed: int) -> list[dict]:
    from forge_megatron.agents import calculator

    return [{"messages": c, "tools": calculator.TOOLS}
            for c in calculator.sft_conversations(calculator.make_tasks(n, seed=seed), 0.5)]


def test_trainer_sft_loss_gives_forge_sfts_gradients(tmp_path):
    """--sft-data: the trainer's token-mean NLL over several micro-batches gives forge-sft's loss (its sft_loss on
    the same samples) and every gradient; token samples and chats are taken alike."""
    from forge_megatron.mcore import parallel
    from forge_megatron.training.metrics import combine_micro_batch_metrics
    from forge_megatron.training.offline import SftFeed
    from forge_megatron.training.trainer import offline_forward_backward, rank_batch

    base = build_tiny_model(str(tmp_path / "base"), seed=0)
    data = _write(tmp_path / "chats.jsonl", _sft_chats(5, seed=1) + [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}])
    feed = SftFeed(data, base, per_step=6, token_budget=400, seed=0)
    batch = feed.batch(0)
    assert len(batch.samples) == 6 and sorted(len(s.tokens) for s in batch.samples)[0] == 4
    parallel.initialize(seed=0)
    try:
        model, _ = P.sft.build_model(base, None, False)
        rb = rank_batch(batch, 320, True, 0, 1, [], "cost-groups")
        assert len(rb.micro_batches) >= 2 and rb.overlong_samples == 0
        metrics = combine_micro_batch_metrics(offline_forward_backward([model], rb, "sft", None))
        ours = _grads(model)
        model.zero_grad()
        loss = P.sft.sft_loss(model, [(s.tokens.tolist(), s.loss_mask.tolist(), []) for s in batch.samples])
        loss.backward()
        _assert_same_grads(ours, model)
    finally:
        parallel.destroy()
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["sft/nll"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["sft/num_tokens"] == sum(int(s.loss_mask[1:].sum()) for s in batch.samples)


def test_trainer_sft_runs_under_pp_and_tp_and_resumes(tmp_path):
    """--sft-data runs: the loss falls; PP = 2, TP = 2 and a stopped-and-resumed run equal one rank. The held-out set
    (--offline-eval-data, every 2 iterations) is scored alike under PP = 2, TP = 2 and DP = 2 (its per-rank sums
    reduced over DP), and its last val/loss is transformers' token-mean NLL of the exported checkpoint on it."""
    from transformers import AutoModelForCausalLM

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    model_dir = build_tiny_model(str(tmp_path / "model"))
    data = _write(tmp_path / "chats.jsonl", _sft_chats(24, seed=0))
    held = _write(tmp_path / "held.jsonl", _sft_chats(6, seed=5))
    sft = ["--sft-data", data, "--offline-eval-data", held, "--offline-eval-interval", "2"]
    runs = {}
    runs["one"], outs = _run(tmp_path, "one", model_dir, data, extra=sft, preference=False)
    assert "--sft-data" in outs[0] and "24 samples, 4 per step" in outs[0] and "reference model" not in outs[0]
    assert "| epoch " in outs[0] and "trained " in outs[0] and "6 held-out items" in outs[0]
    assert "| val loss " in outs[0]
    runs["pp2"], _ = _run(tmp_path, "pp2", model_dir, data, nproc=2, extra=sft + ["--pipeline-model-parallel-size", "2"],
                          preference=False)
    runs["tp2"], _ = _run(tmp_path, "tp2", model_dir, data, nproc=2,
                          extra=sft + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], preference=False)
    runs["dp2"], _ = _run(tmp_path, "dp2", model_dir, data, nproc=2, extra=sft, preference=False)
    runs["resumed"], outs = _run(tmp_path, "resumed", model_dir, data, extra=sft, exits=(2, None), preference=False)
    assert "resumed from" in outs[1]
    one = runs["one"]
    assert len(one) == 4 and one[-1]["loss"] < one[0]["loss"]
    assert [("val/loss" in m) for m in one] == [False, True, False, True]
    lora, _ = _run(tmp_path, "lora", model_dir, data, extra=sft + ["--lora-rank", "8", "--lr", "1e-2"],
                   preference=False)  # adapters B = 0: the first step scores the checkpoint's model
    assert lora[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5) and lora[-1]["loss"] < lora[0]["loss"]
    assert one[-1]["val/loss"] < one[1]["val/loss"]
    for name in ("pp2", "tp2", "dp2", "resumed"):
        assert len(runs[name]) == 4, name
        for a, b in zip(one, runs[name]):
            if name != "dp2":  # (DP = 2: the loss logged is rank 0's share of the batch)
                assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name
            if "val/loss" in a:
                assert b["val/loss"] == pytest.approx(a["val/loss"], rel=1e-4), name

    out = str(tmp_path / "exported")
    export_trainer_checkpoint(str(tmp_path / "one" / "ckpt"), out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for chat in P.sft.load_chats(held):
            ids, mask, _ = P.sft.render(tok, chat["messages"], chat.get("tools"))
            logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
            m = torch.tensor(mask[1:], dtype=torch.float32)
            nll -= (logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0] * m).sum().item()
            tokens += int(m.sum())
    assert one[-1]["val/loss"] == pytest.approx(nll / tokens, rel=1e-4)


def test_trainer_sft_with_pictures_gives_forge_sfts_gradients(tmp_path):
    """--sft-data with image parts (the vision demo's chats, a tiny Qwen3-VL): the samples carry their normalised
    images, the trainer's micro-batches (split by the token budget) encode them with the checkpoint's frozen tower,
    and the loss and every gradient equal forge-sft's on the same samples."""
    from forge_megatron.agents import colors
    from forge_megatron.mcore import parallel
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.training.metrics import combine_micro_batch_metrics
    from forge_megatron.training.offline import SftFeed
    from forge_megatron.training.trainer import offline_forward_backward, rank_batch

    base = build_tiny_model(str(tmp_path / "base"), "qwen3_vl", images=True)
    proc = ImageProcessor(base)
    chats = [{"messages": c} for c in colors.sft_conversations(colors.make_tasks(4, seed=2), 1.0)]
    data = _write(tmp_path / "chats.jsonl", chats)
    feed = SftFeed(data, base, per_step=4, token_budget=1000, seed=0, processor=proc)
    batch = feed.batch(0)
    assert all(s.images and len(s.images) == 1 for s in batch.samples)
    parallel.initialize(seed=0)
    try:
        model, _ = P.sft.build_model(base, proc, True)
        longest = max(len(s.tokens) for s in batch.samples)
        rb = rank_batch(batch, longest + 4, True, 0, 1, [], "cost-groups", vision=proc)
        assert len(rb.micro_batches) >= 2 and rb.overlong_samples == 0
        metrics = combine_micro_batch_metrics(offline_forward_backward([model], rb, "sft", None))
        ours = _grads(model)
        model.zero_grad()
        loss = P.sft.sft_loss(model, [(s.tokens.tolist(), s.loss_mask.tolist(), list(s.images))
                                      for s in batch.samples], proc)
        loss.backward()
        _assert_same_grads(ours, model)
    finally:
        parallel.destroy()
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_dpo_pairs_with_pictures_train_the_answers_only(tmp_path):
    """Preference pairs whose prompt holds a picture (the colour task: the right colour against a wrong one): the
    loss mask starts right after the prompt's expanded image tokens, and the trainer's DPO loss over micro-batches
    of pairs with images gives forge-dpo's loss and gradients."""
    from transformers import AutoTokenizer

    from forge_megatron.agents import colors
    from forge_megatron.mcore import parallel
    from forge_megatron.mcore.forward import make_tree_forward_step
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.training.metrics import combine_micro_batch_metrics
    from forge_megatron.training.trainer import offline_forward_backward, rank_batch, run_schedule

    base = build_tiny_model(str(tmp_path / "base"), "qwen3_vl", images=True)
    proc = ImageProcessor(base)
    tok = AutoTokenizer.from_pretrained(base)
    names = sorted(colors.COLORS)
    records = [{"prompt": [colors.user_message(t)], "chosen": t.answer,
                "rejected": next(n for n in names if n != t.answer)} for t in colors.make_tasks(3, seed=3)]
    pair = P.render_pair(tok, records[0], proc)
    ids, mask, images = pair.chosen
    assert len(images) == 1 and tok.decode([t for t, m in zip(ids, mask) if m]) == records[0]["chosen"] + "<|im_end|>"
    assert mask.index(1) == len(P._prompt_ids(tok, records[0]["prompt"], None, proc))
    feed = PreferenceFeed(_write(tmp_path / "pairs.jsonl", records), base, pairs_per_step=3, token_budget=2000,
                          processor=proc)
    batch = feed.batch(0)
    args = type("A", (), {"dpo_beta": 0.5, "dpo_loss": "sigmoid", "dpo_label_smoothing": 0.0, "dpo_sft_coef": 0.0,
                          "simpo_gamma": 0.0})
    parallel.initialize(seed=0)
    try:
        model, _ = P.sft.build_model(base, proc, True)
        ref, _ = P.sft.build_model(base, proc, True)  # the same frozen tower (as the trainer's reference shares it)
        torch.manual_seed(3)
        with torch.no_grad():  # a reference language model other than the policy
            for p in ref.parameters():
                p.add_(0.02 * torch.randn_like(p))
        budget = max(len(s.tokens) for s in batch.samples) + 8  # about one pair per micro-batch
        rb = rank_batch(batch, budget, True, 0, 1, [], "cost-groups", vision=proc)
        assert len(rb.micro_batches) >= 2

        def keep(logp_M, entropy_M, mb):
            mb.extras["ref_logp_M"] = logp_M.detach()
            return logp_M.sum() * 0.0, {}

        with torch.no_grad():
            run_schedule([ref], rb, make_tree_forward_step(keep), forward_only=True)
        metrics = combine_micro_batch_metrics(offline_forward_backward([model], rb, "dpo", args))
        ours = _grads(model)
        model.zero_grad()
        pairs = [P.Pair(*((s.tokens.tolist(), s.loss_mask.tolist(), list(s.images))
                          for s in batch.samples[k:k + 2])) for k in range(0, len(batch.samples), 2)]
        P.set_reference(ref, pairs, 3, proc)
        loss, _ = P.dpo_pairs_loss(model, proc, 0.5)(pairs)
        loss.backward()
        _assert_same_grads(ours, model)
    finally:
        parallel.destroy()
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_trainer_dpo_reference_from_another_vision_checkpoint_runs_its_own_tower(tmp_path):
    """--preference-data on pictures with --ref-hf-checkpoint another vision-language checkpoint (its own frozen
    tower): the reference pass runs that tower (its features kept apart from the policy's), so the first step's
    loss is forge-dpo's with that checkpoint as the reference (it would not be, with the policy's tower)."""
    from forge_megatron.agents import colors
    from forge_megatron.mcore import parallel
    from forge_megatron.multimodal.images import ImageProcessor

    base = build_tiny_model(str(tmp_path / "base"), "qwen3_vl", images=True)
    other = build_tiny_model(str(tmp_path / "other"), "qwen3_vl", images=True, seed=7)
    proc = ImageProcessor(base)
    names = sorted(colors.COLORS)
    records = [{"prompt": [colors.user_message(t)], "chosen": t.answer,
                "rejected": next(n for n in names if n != t.answer)} for t in colors.make_tasks(4, seed=3)]
    data = _write(tmp_path / "pairs.jsonl", records)
    steps, outs = _run(tmp_path, "run", base, data, iters=1, model_flags=False,
                       extra=["--ref-hf-checkpoint", other, "--tree-token-budget", "2000", "--lr", "1e-9"])
    assert f"vision tower of {other} loaded" in outs[0]
    batch = PreferenceFeed(data, base, pairs_per_step=4, token_budget=2000, processor=proc).batch(0)
    pairs = [P.Pair(*((s.tokens.tolist(), s.loss_mask.tolist(), list(s.images)) for s in batch.samples[k:k + 2]))
             for k in range(0, len(batch.samples), 2)]
    parallel.initialize(seed=0)
    try:
        ref, _ = P.sft.build_model(other, proc, True)
        P.set_reference(ref, pairs, 4, proc)
        model, _ = P.sft.build_model(base, proc, True)
        with torch.no_grad():
            loss, _ = P.dpo_pairs_loss(model, proc, 0.5)(pairs)
    finally:
        parallel.destroy()
    assert steps[0]["loss"] == pytest.approx(loss.item(), rel=1e-4)
    assert abs(steps[0]["loss"] - np.log(2)) > 1e-3  # (a reference other than the policy)


@pytest.mark.parametrize("mode", ["sft", "dpo"])
def test_offline_modes_under_context_expert_and_virtual_pipeline_parallelism(tmp_path, mode):
    """SFT and DPO (its reference split like the policy) over two context-parallel ranks, over two expert-parallel
    ranks of an MoE model (EP = 2 runs as DP = 2: compared by the reduced gradient norm) and on an interleaved
    pipeline (two stages of two virtual chunks of a four-layer model) train one rank's steps."""
    if mode == "sft":
        data, extra = _write(tmp_path / "chats.jsonl", _sft_chats(16, seed=0)), ["--sft-data"]
        extra.append(data)
    else:
        data, extra = _write(tmp_path / "pairs.jsonl", _tool_pairs(8, seed=0)), []
    dense = build_tiny_model(str(tmp_path / "model"), num_hidden_layers=4)
    moe = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", seed=2)
    kw = dict(preference=mode == "dpo", iters=2, model_flags=False)
    for model_dir, layouts in ((dense, {"cp2": ["--context-parallel-size", "2"],
                                        "vpp": ["--pipeline-model-parallel-size", "2",
                                                "--num-layers-per-virtual-pipeline-stage", "1"]}),
                               (moe, {"ep2": ["--expert-model-parallel-size", "2"]})):
        name = os.path.basename(model_dir)
        one, _ = _run(tmp_path, f"{name}-one", model_dir, data, extra=extra, **kw)
        assert len(one) == 2 and one[-1]["loss"] < one[0]["loss"]
        for layout, flags in layouts.items():
            other, _ = _run(tmp_path, f"{name}-{layout}", model_dir, data, nproc=2, extra=extra + flags, **kw)
            for a, b in zip(one, other):
                if layout != "ep2":  # (EP = 2 as DP = 2: the logged loss is rank 0's share)
                    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), (layout, a, b)
                assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (layout, a, b)
