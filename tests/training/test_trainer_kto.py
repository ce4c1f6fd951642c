"""The Megatron trainer's KTO (``scripts/train_forge.py --kto-data``, training/offline.py): its loss over several
micro-batches, with the batch's reference point from a forward-only pre-pass, gives forge-kto's loss, metrics and
every gradient on the same examples (pictures too); whole runs under PP = 2, TP = 2 with sequence parallelism and DP
= 2 (held-out examples too) and a stopped and resumed run train like one rank. CPU, gloo."""

import pytest
import torch

from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.training import kto as K
from forge_megatron.training.offline import KtoFeed

from .test_kto import _unpaired
from .test_preference import _write
from .test_trainer_offline import _assert_same_grads, _assert_same_steps, _grads, _run


def _keep(key: str):
    """A forward step that stores the logprobs on each micro-batch as ``extras[key]`` (the trainer's forward-only
    passes: the policy's pre-pass, the reference's)."""
    from forge_megatron.mcore.forward import make_tree_forward_step

    def step(logp_M, entropy_M, mb):
        mb.extras[key] = logp_M.detach()
        return logp_M.sum() * 0.0, {}
    return make_tree_forward_step(step)


@pytest.mark.parametrize("kl", [True, False])
def test_trainer_kto_loss_gives_forge_ktos_gradients(tmp_path, kl):
    """Six examples (and their mismatched samples) through rank_batch with a token budget that packs them into
    several micro-batches, the reference another checkpoint: the reference point taken over the whole batch, the
    loss, its metrics and every gradient equal forge-kto's on the same examples in one forest."""
    from forge_megatron.mcore import parallel
    from forge_megatron.training.metrics import combine_micro_batch_metrics
    from forge_megatron.training.trainer import kto_reference_point, offline_forward_backward, rank_batch, run_schedule

    base = build_tiny_model(str(tmp_path / "base"), seed=0)
    ref_dir = build_tiny_model(str(tmp_path / "ref"), seed=5)
    data = _write(tmp_path / "examples.jsonl", _unpaired(6, seed=2))
    feed = KtoFeed(data, base, per_step=6, token_budget=320, seed=0, kl=kl)
    batch = feed.batch(0)
    assert len(batch.samples) == (12 if kl else 6)
    args = type("A", (), {"kto_beta": 0.4, "kto_desirable_weight": 1.3, "kto_undesirable_weight": 0.7,
                          "kto_no_kl": not kl})
    parallel.initialize(seed=0)
    try:
        model, _ = K.sft.build_model(base, None, False)
        ref, _ = K.sft.build_model(ref_dir, None, False)
        rb = rank_batch(batch, 320, True, 0, 1, [], "cost-groups")
        assert len(rb.micro_batches) >= 2  # several forests, each holding whole examples (with their mismatched)

        with torch.no_grad():
            if kl:
                run_schedule([model], rb, _keep("kto_policy_logp_M"), forward_only=True)
            run_schedule([ref], rb, _keep("ref_logp_M"), forward_only=True)
        z0 = kto_reference_point([rb], 1) if kl else 0.0
        metrics = combine_micro_batch_metrics(offline_forward_backward([model], rb, "kto", args))
        ours = _grads(model)
        model.zero_grad()

        examples, step = [], 2 if kl else 1
        for k in range(0, len(batch.samples), step):
            s = batch.samples[k]
            e = K.Example((s.tokens.tolist(), s.loss_mask.tolist(), []), bool(s.advantages[0] > 0))
            if kl:
                m = batch.samples[k + 1]
                e.kl = (m.tokens.tolist(), m.loss_mask.tolist(), [])
            examples.append(e)
        assert 0 < sum(e.desirable for e in examples) < len(examples)
        K.set_reference(ref, examples, len(examples))
        loss, want = K.kto_examples_loss(model, 0.4, 1.3, 0.7, kl=kl)(examples)
        loss.backward()
    finally:
        parallel.destroy()
    assert (z0 > 0.5) == kl  # (another checkpoint as the reference: the mismatched answers' log-ratio is large)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["kto/num_examples"] == 6 and metrics["kto/accuracy"] == pytest.approx(want["accuracy"])
    assert metrics["kto/kl_estimate"] == pytest.approx(want["kl"], rel=1e-5, abs=1e-7)
    assert metrics["kto/margin"] == pytest.approx(want["margin"], rel=1e-4, abs=1e-6)
    _assert_same_grads(ours, model)


def test_trainer_kto_runs_under_pp_and_dp_and_resumes(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "model"))
    data = _write(tmp_path / "examples.jsonl", _unpaired(12, seed=0))
    kto = ["--kto-data", data, "--kto-beta", "0.5"]
    held = ["--offline-eval-data", _write(tmp_path / "held.jsonl", _unpaired(5, seed=9))]
    runs = {}
    runs["one"], outs = _run(tmp_path, "one", model_dir, data, extra=kto + held, preference=False)
    assert "--kto-data" in outs[0] and "12 examples, 4 per step: 1.33 epoch(s)" in outs[0]
    assert "6 desirable, 6 undesirable examples" in outs[0] and "reference model for the KTO term loaded" in outs[0]
    assert "iter 4 | loss " in outs[0] and "| accuracy " in outs[0]
    runs["pp2"], _ = _run(tmp_path, "pp2", model_dir, data, nproc=2, preference=False,
                          extra=kto + held + ["--pipeline-model-parallel-size", "2"])
    runs["dp2"], _ = _run(tmp_path, "dp2", model_dir, data, nproc=2, extra=kto + held, preference=False)
    runs["tp2"], _ = _run(tmp_path, "tp2", model_dir, data, nproc=2, preference=False,
                          extra=kto + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    runs["resumed"], outs = _run(tmp_path, "resumed", model_dir, data, exits=(2, None), extra=kto, preference=False)
    assert "resumed from" in outs[1]
    one = runs["one"]
    assert len(one) == 4 and [s["batch_id"] for s in one] == [0, 1, 2, 3]
    assert one[0]["loss"] == pytest.approx(0.5, rel=1e-5) and one[0]["kto/kl_estimate"] == 0.0  # policy = reference
    assert one[-1]["loss"] < 0.4 and one[-1]["kto/accuracy"] >= 0.75 and one[-1]["kto/kl_estimate"] > 0
    assert one[-1]["val/accuracy"] >= 0.6 and "val/loss" not in one[0]
    # (DP = 2: the loss and means are rank 0's examples'; the gradient norm and the reference point the whole batch's)
    for name in ("pp2", "tp2", "dp2", "resumed"):
        if name != "dp2":
            _assert_same_steps(one, runs[name], name, "kto/margin")
        for s, t in zip(one, runs[name]):
            assert t["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-4), name
            assert t["kto/kl_estimate"] == pytest.approx(s["kto/kl_estimate"], rel=1e-3, abs=1e-6), name
    for name in ("pp2", "dp2"):  # held-out examples scored alike (DP = 2: 5 examples dealt 3 + 2, sums reduced)
        for key in ("val/loss", "val/accuracy", "val/margin"):
            assert runs[name][-1][key] == pytest.approx(one[-1][key], rel=1e-4, abs=1e-6), (name, key)
    plain, outs = _run(tmp_path, "no_kl", model_dir, data, extra=kto + ["--kto-no-kl"], preference=False)
    assert plain[0]["loss"] == pytest.approx(0.5, rel=1e-5) and all(s["kto/kl_estimate"] == 0.0 for s in plain)
    assert plain[0]["total_tokens"] < one[0]["total_tokens"]  # (no mismatched samples)


def test_kto_flags_are_checked(tmp_path):
    from forge_megatron.training import arguments

    base = ["--hf-checkpoint", str(tmp_path), "--lr", "1e-3", "--train-iters", "1", "--num-layers", "2"]
    data = _write(tmp_path / "examples.jsonl", _unpaired(2, seed=0))
    for extra, message in ((["--kto-data", str(tmp_path / "none.jsonl")], "--kto-data .* is not a file"),
                           (["--kto-data", data, "--rl-kl-coef", "0.1"], "drop --rl-kl-coef"),
                           (["--kto-data", data, "--engine-urls", "http://127.0.0.1:1"], "trains offline"),
                           (["--kto-data", data, "--kto-beta", "0"], "--kto-beta must be > 0"),
                           (["--kto-data", data, "--kto-undesirable-weight", "0"], "must be > 0"),
                           (["--kto-data", data, "--reward-model"], "learns from pairs"),
                           (["--kto-data", data, "--sft-data", data], "one offline mode per run"),
                           (["--kto-no-kl"], "--kto-no-kl is a flag of KTO"),
                           (["--kto-beta", "0.2"], "--kto-beta is a flag of KTO"),
                           (["--kto-data", data, "--ppo-epochs", "2"], "offline modes"),
                           (["--kto-data", data, "--teacher-hf-checkpoint", str(tmp_path), "--distill-kl",
                             "forward"], "not with --preference-data, --kto-data")):
        with pytest.raises(ValueError, match=message):
            arguments.validate_args(arguments.build_parser().parse_args(base + extra))
    args = arguments.build_parser().parse_args(base + ["--kto-data", data, "--ref-hf-checkpoint", str(tmp_path),
                                                       "--offline-eval-data", data])
    arguments.validate_args(args)
    assert args.weight_sync_transport == "none" and arguments.uses_reference_policy(args)


def test_kto_examples_with_pictures(tmp_path):
    """Examples whose prompts hold a picture (the colour task), one a whole conversation with a second picture in a
    later user turn (inside its answer): each mismatched sample carries its prompt's pictures and the other answer's,
    and the trainer's KTO loss over micro-batches of such examples gives forge-kto's loss and every gradient."""
    from transformers import AutoTokenizer

    from forge_megatron.agents import colors
    from forge_megatron.mcore import parallel
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.training.metrics import combine_micro_batch_metrics
    from forge_megatron.training.trainer import kto_reference_point, offline_forward_backward, rank_batch, run_schedule

    base = build_tiny_model(str(tmp_path / "base"), "qwen3_vl", images=True)
    proc = ImageProcessor(base)
    tok = AutoTokenizer.from_pretrained(base)
    names = sorted(colors.COLORS)
    tasks = colors.make_tasks(5, seed=4)
    records = [{"prompt": [colors.user_message(t)], "label": i % 2 == 0,
                "completion": t.answer if i % 2 == 0 else next(n for n in names if n != t.answer)}
               for i, t in enumerate(tasks[:3])]
    records.append({"label": True, "messages": [
        colors.user_message(tasks[3]), {"role": "assistant", "content": tasks[3].answer},
        colors.user_message(tasks[4]), {"role": "assistant", "content": tasks[4].answer}]})
    examples = K.render_records(tok, records, processor=proc)
    assert [len(e.sample[2]) for e in examples] == [1, 1, 1, 2] and [e.prompt_images for e in examples] == [1] * 4
    K.attach_mismatched(examples, seed=0)
    for e in examples:  # its own prompt's picture first, then those of the answer it took
        answer = e.kl[0][K.answer_start(e.sample):]
        donor = next(d for d in examples if d.sample[0][K.answer_start(d.sample):] == answer)
        assert e.kl[2] == e.sample[2][:1] + donor.sample[2][1:]
    assert sorted(len(e.kl[2]) for e in examples) == [1, 1, 1, 2]  # the second picture rides with its answer

    feed = KtoFeed(_write(tmp_path / "examples.jsonl", records), base, per_step=4, token_budget=4000, seed=0,
                   processor=proc)
    batch = feed.batch(0)
    args = type("A", (), {"kto_beta": 0.5, "kto_desirable_weight": 1.0, "kto_undesirable_weight": 1.0,
                          "kto_no_kl": False})
    parallel.initialize(seed=0)
    try:
        model, _ = K.sft.build_model(base, proc, True)
        ref, _ = K.sft.build_model(base, proc, True)  # the same frozen tower
        torch.manual_seed(3)
        with torch.no_grad():  # a reference language model other than the policy
            for p in ref.parameters():
                p.add_(0.02 * torch.randn_like(p))
        budget = max(len(s.tokens) for s in batch.samples) * 2 + 8  # about one example per micro-batch
        rb = rank_batch(batch, budget, True, 0, 1, [], "cost-groups", vision=proc)
        assert len(rb.micro_batches) >= 2

        with torch.no_grad():
            run_schedule([model], rb, _keep("kto_policy_logp_M"), forward_only=True)
            run_schedule([ref], rb, _keep("ref_logp_M"), forward_only=True)
        kto_reference_point([rb], 1)
        metrics = combine_micro_batch_metrics(offline_forward_backward([model], rb, "kto", args))
        ours = _grads(model)
        model.zero_grad()
        mine = []
        for k in range(0, len(batch.samples), 2):
            s, m = batch.samples[k], batch.samples[k + 1]
            e = K.Example((s.tokens.tolist(), s.loss_mask.tolist(), list(s.images)), bool(s.advantages[0] > 0))
            e.kl = (m.tokens.tolist(), m.loss_mask.tolist(), list(m.images))
            mine.append(e)
        K.set_reference(ref, mine, 4, proc)
        loss, want = K.kto_examples_loss(model, 0.5, processor=proc)(mine)
        loss.backward()
        _assert_same_grads(ours, model)
    finally:
        parallel.destroy()
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["kto/kl_estimate"] == pytest.approx(want["kl"], rel=1e-5, abs=1e-7) and want["kl"] > 0
    # forge-kto on the same pictures, end to end (its vision-language checkpoint exported whole)
    result = K.run_kto(base, records * 2, str(tmp_path / "out"), steps=2, lr=1e-3, batch_size=4, log_every=100,
                       eval_records=records)
    assert len(result["history"]) == 2 and result["eval_after"]["examples"] == 4
    assert (tmp_path / "out" / "config.json").exists()

