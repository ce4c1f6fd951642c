"""On-policy distillation in the trainer (--teacher-hf-checkpoint, training/distill.py): a frozen teacher of another
size scores the sampled tokens on the step's prefix trees, and the per-token advantage is its logprob minus the
student's. Checked against transformers (both models run on every sample apart), on one rank and split over two
pipeline stages or two tensor-parallel ranks; bad teachers are refused with the reason. CPU, 0 GPUs (gloo)."""

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from forge_megatron.models.tiny import build_tiny_model, build_tiny_teacher
from tests.dist_utils import run_script

from .trainer_run import (TRAIN, model_args, read_steps, refused_start, run_on_fresh_pool, train_cmd, train_env,
                          with_a_swapped_token)

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny student and a teacher twice as deep and 1.5x as wide (6 heads of 16, 2 key-value heads)."""
    d = tmp_path_factory.mktemp("distill")
    return build_tiny_model(str(d / "student")), build_tiny_teacher(str(d / "teacher"))


def _episodes(seed: int = 4, group_size: int = 4):
    """One group: a shared 10-token prompt, completions of 5..8 tokens (token ids within the tiny vocabulary)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(10, 300, size=10).tolist()
    return [(prompt, rng.integers(10, 300, size=int(rng.integers(5, 9))).tolist()) for _ in range(group_size)]


def _feed(episodes, teacher: list | None = None, topk: list | None = None):
    """A pool feeder of ``episodes`` (one group); ``teacher``: per episode its completion's teacher logprobs, recorded
    with the episode as a gateway with --teacher-urls does; ``topk``: per episode (ids, logprobs) of the teacher's
    top-k at each completion token (--teacher-topk); an episode's None: recorded without them. The lists are read
    when the feeder runs."""
    from forge_megatron.middleware.schema import Episode, Segment

    def feed(client):
        gid = client.register_group("task-0", len(episodes), "default")
        for e, (prompt, completion) in enumerate(episodes):
            seg = Segment(tokens=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                          rollout_logprobs=[0.0] * len(prompt) + [-5.0] * len(completion),
                          policy_versions=[-1] * len(prompt) + [0] * len(completion),
                          teacher_logprobs=None if teacher is None or teacher[e] is None else
                          [0.0] * len(prompt) + teacher[e].tolist(),
                          teacher_topk_ids=None if topk is None or topk[e] is None else topk[e][0],
                          teacher_topk_logprobs=None if topk is None or topk[e] is None else topk[e][1])
            eid = f"{gid}-e{e}"
            client.episode_started(gid, eid)
            now = time.time()
            client.submit_episode(Episode(episode_id=eid, group_id=gid, task_id="task-0", segments=[seg],
                                          reward=float(e % 2), started_at=now - 1, ended_at=now))
    return feed


def _completion_logprobs(model_dir: str, episodes) -> list[torch.Tensor]:
    """transformers' logprob of every completion token, each sample run alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, completion in episodes:
            ids = torch.tensor([prompt + completion])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            targets = ids[0, len(prompt):]
            out.append(logp[len(prompt) - 1:-1].gather(-1, targets[:, None])[:, 0])
    return out


def test_teacher_logprobs_and_loss_equal_transformers(models, tmp_path):
    """Pure distillation (--distill-outcome-coef 0) at step 1 with recomputed old logprobs (ratio 1): the metrics
    distill_teacher_logp and distill_reverse_kl are the token means of transformers' teacher logprobs and of student
    minus teacher, and CISPO's loss is -(1/N) sum_t coef (teacher_t - student_t) student_t, the same on one rank,
    over two pipeline stages (the teacher's 4 layers 2 per stage, the student's 1), over two TP ranks with sequence
    parallelism and over two context-parallel ranks (each holding half of the tree, for the teacher too)."""
    student, teacher = models
    episodes = _episodes()
    s = torch.cat(_completion_logprobs(student, episodes))
    t = torch.cat(_completion_logprobs(teacher, episodes))
    coef = 0.5
    expect = {"distill_teacher_logp": t.mean().item(), "distill_reverse_kl": (s - t).mean().item(),
              "loss": -(coef * (t - s) * s).mean().item(), "num_tokens": float(s.numel())}
    flags = ["--teacher-hf-checkpoint", teacher, "--distill-coef", str(coef), "--distill-outcome-coef", "0",
             "--old-logprobs", "recompute"]
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("pp2", ["--pipeline-model-parallel-size", "2"], 2),
                               ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
                               ("cp2", ["--context-parallel-size", "2"], 2)):
        runs[name], stdouts, _ = run_on_fresh_pool(tmp_path, name, student, _feed(episodes), iters=1, groups=1,
                                                   extra=flags + extra, nproc=nproc, lr="1e-2")
        assert "teacher for on-policy distillation loaded from" in stdouts[0]
        (step,) = runs[name]
        for key, value in expect.items():  # (fp32 logprobs of ~5 nats are good to ~5e-7 each; the KL and loss
            # are means of differences of two of them: 2e-7 off on one machine's vector width, within 1e-7 on another)
            assert step[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        assert step["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for other in ("pp2", "tp2", "cp2"):
        assert runs["one"][0]["grad_norm"] == pytest.approx(runs[other][0]["grad_norm"], rel=1e-5), other


def _next_token_logprobs(model_dir: str, episodes, grad: bool = False):
    """transformers' full next-token log-distributions [completion tokens, vocabulary] of every sample run alone
    (fp64), concatenated; with ``grad`` also the model, its graph kept for a backward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    rows = []
    with torch.set_grad_enabled(grad):
        for prompt, completion in episodes:
            logits = model(torch.tensor([prompt + completion])).logits[0].double()
            rows.append(torch.log_softmax(logits[len(prompt) - 1:-1], -1))
    return torch.cat(rows), model


def _topk_kls(student_TV: torch.Tensor, teacher_TV: torch.Tensor, k: int):
    """The forward and reverse KLs per row between the two distributions merged to the teacher's top k tokens and
    one bucket for the rest, written out over the vocabulary (the tail floor of algo/losses.py never binds here)."""
    ids = teacher_TV.topk(k, dim=-1).indices
    keep = torch.zeros_like(teacher_TV, dtype=torch.bool).scatter(1, ids, True)

    def merged(lp_TV):
        p_TV = lp_TV.exp()
        return torch.cat([p_TV.gather(1, ids), (p_TV * ~keep).sum(-1, keepdim=True)], dim=1)

    ps, pt = merged(student_TV), merged(teacher_TV)
    return (pt * (pt.log() - ps.log())).sum(-1), (ps * (ps.log() - pt.log())).sum(-1)


def test_dense_kl_over_the_whole_vocabulary_is_the_exact_kl(models, tmp_path):
    """--distill-kl forward|reverse|jsd with --distill-topk the whole vocabulary: the metrics distill_forward_kl,
    distill_reverse_kl (and distill_jsd at --distill-jsd-beta 0.3) are the exact token-mean divergences between
    transformers' student and teacher distributions, the loss is --distill-coef x the trained one (no outcome term),
    and the gradient norm is that of transformers' student differentiated through the same loss (before clipping):
    the fused loss differentiates through the student's whole distribution."""
    student, teacher = models
    episodes = _episodes(seed=23)
    t_TV, _ = _next_token_logprobs(teacher, episodes)
    vocab = t_TV.shape[1]
    coef, beta = 0.5, 0.3
    for kind in ("forward", "reverse", "jsd"):
        s_TV, model = _next_token_logprobs(student, episodes, grad=True)
        fwd = (t_TV.exp() * (t_TV - s_TV)).sum(-1)
        rev = (s_TV.exp() * (s_TV - t_TV)).sum(-1)
        m_TV = torch.log(beta * t_TV.exp() + (1 - beta) * s_TV.exp())
        jsd = beta * (t_TV.exp() * (t_TV - m_TV)).sum(-1) + (1 - beta) * (s_TV.exp() * (s_TV - m_TV)).sum(-1)
        loss = coef * {"forward": fwd, "reverse": rev, "jsd": jsd}[kind].mean()
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
        (step,), _, _ = run_on_fresh_pool(
            tmp_path, kind, student, _feed(episodes), iters=1, groups=1, lr="1e-2",
            extra=["--teacher-hf-checkpoint", teacher, "--distill-kl", kind, "--distill-topk", str(vocab),
                   "--distill-coef", str(coef), "--distill-outcome-coef", "0", "--old-logprobs", "recompute",
                   *(["--distill-jsd-beta", str(beta)] if kind == "jsd" else [])])
        # (abs: the KLs are sums over the vocabulary of differences of fp32 logprobs)
        assert step["distill_forward_kl"] == pytest.approx(fwd.mean().item(), rel=1e-5, abs=2e-6)
        assert step["distill_reverse_kl"] == pytest.approx(rev.mean().item(), rel=1e-5, abs=2e-6)
        assert step["distill_topk_mass"] == pytest.approx(1.0, abs=1e-5)
        if kind == "jsd":
            assert step["distill_jsd"] == pytest.approx(jsd.mean().item(), rel=1e-5, abs=2e-6)
        assert step["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        assert step["grad_norm"] == pytest.approx(norm, rel=1e-4), kind


def test_dense_kl_over_the_teachers_top_k(models, tmp_path):
    """--distill-kl reverse --distill-topk 8: the KLs of the distributions merged to the teacher's 8 most likely
    tokens and a rest bucket are transformers' (each sample alone) on one rank, over two TP ranks (each choosing
    candidates in its half of the vocabulary), two context-parallel ranks and two pipeline stages, with equal
    gradient norms; they lie below the full KLs. Outcome advantages add their policy-gradient term alone."""
    student, teacher = models
    episodes = _episodes(seed=29)
    t_TV, _ = _next_token_logprobs(teacher, episodes)
    s_TV, _ = _next_token_logprobs(student, episodes)
    fwd, rev = _topk_kls(s_TV, t_TV, 8)
    full_rev = (s_TV.exp() * (s_TV - t_TV)).sum(-1)
    assert (rev < full_rev).all()
    mass = t_TV.exp().topk(8, dim=-1).values.sum(-1)
    flags = ["--teacher-hf-checkpoint", teacher, "--distill-kl", "reverse", "--distill-topk", "8",
             "--distill-outcome-coef", "0", "--old-logprobs", "recompute"]
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
                               ("cp2", ["--context-parallel-size", "2"], 2),
                               ("pp2", ["--pipeline-model-parallel-size", "2"], 2)):
        (step,), _, _ = run_on_fresh_pool(tmp_path, name, student, _feed(episodes), iters=1, groups=1, lr="1e-2",
                                          extra=flags + extra, nproc=nproc)
        runs[name] = step
        assert step["distill_forward_kl"] == pytest.approx(fwd.mean().item(), rel=1e-5), name
        assert step["distill_reverse_kl"] == pytest.approx(rev.mean().item(), rel=1e-5), name
        assert step["distill_topk_mass"] == pytest.approx(mass.mean().item(), rel=1e-5), name
        assert step["loss"] == pytest.approx(rev.mean().item(), rel=1e-5), name
    for other in ("tp2", "cp2", "pp2"):
        assert runs[other]["grad_norm"] == pytest.approx(runs["one"]["grad_norm"], rel=1e-5), other
    (both,), _, _ = run_on_fresh_pool(tmp_path, "both", student, _feed(episodes), iters=1, groups=1, lr="1e-2",
                                      extra=flags[:-4] + ["--old-logprobs", "recompute"])
    assert both["distill_loss"] == pytest.approx(rev.mean().item(), rel=1e-5)
    assert both["loss"] == pytest.approx(both["distill_loss"] + both["pg_loss"], rel=1e-6)
    assert abs(both["pg_loss"]) > 1e-4


def test_moe_teacher_for_a_dense_student(models, tmp_path):
    """A Qwen3-MoE teacher (4 experts, top-2) for the dense student: its logprobs of the sampled tokens are
    transformers' on one rank and with its experts split over two tensor-parallel ranks (sequence parallelism, as
    Megatron's MoE layer needs under TP). (Expert parallelism needs a MoE policy: Megatron refuses it for a dense
    one.)"""
    student, _ = models
    teacher = build_tiny_model(str(tmp_path / "moe_teacher"), arch="qwen3_moe", seed=5)
    episodes = _episodes(seed=17)
    t = torch.cat(_completion_logprobs(teacher, episodes))
    flags = ["--teacher-hf-checkpoint", teacher, "--distill-outcome-coef", "0", "--old-logprobs", "recompute"]
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                                  2)):
        runs[name], _, _ = run_on_fresh_pool(tmp_path, name, student, _feed(episodes), iters=1, groups=1,
                                             extra=flags + extra, nproc=nproc, lr="1e-2")
        assert runs[name][0]["distill_teacher_logp"] == pytest.approx(t.mean().item(), rel=1e-5), name
    assert runs["tp2"][0]["grad_norm"] == pytest.approx(runs["one"][0]["grad_norm"], rel=1e-5)


def test_teacher_under_the_interleaved_pipeline(models, tmp_path):
    """PP = 2 with two virtual stages per rank: the 4-layer student and the 4-layer teacher each one layer per chunk,
    the teacher's forward-only pass through Megatron's interleaved schedule: two steps equal one rank's (loss,
    gradient norm, the distillation metrics)."""
    _, teacher = models
    student = build_tiny_model(str(tmp_path / "student4"), num_hidden_layers=4)
    flags = ["--num-layers", "4", "--teacher-hf-checkpoint", teacher, "--old-logprobs", "recompute"]
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    twice = lambda c: [_feed(_episodes(seed=21))(c) for _ in range(2)]  # noqa: E731
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("vpp", vpp, 2)):
        runs[name], _, _ = run_on_fresh_pool(tmp_path, name, student, twice, iters=2, groups=1, lr="1e-2",
                                             extra=flags + extra, nproc=nproc)
    for a, b in zip(runs["one"], runs["vpp"]):
        for key in ("loss", "grad_norm", "distill_reverse_kl", "distill_teacher_logp"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_outcome_advantages_add_and_teacher_offload_trains_the_same(models, tmp_path):
    """Two steps of pure distillation with the teacher's weights in host memory between its passes
    (--teacher-offload) equal the same steps with the teacher resident. Keeping the outcome advantages
    (--distill-outcome-coef 1, the default) changes the loss by the outcome term alone: the teacher's metrics are the
    same at step 1, the loss is not. (Whether distillation teaches the student is the demo's to show: it needs
    samples drawn from the student as it changes, tests/e2e.)"""
    student, teacher = models
    episodes = _episodes(seed=9)
    flags = ["--teacher-hf-checkpoint", teacher, "--old-logprobs", "recompute"]
    twice = lambda c: [_feed(episodes)(c) for _ in range(2)]  # noqa: E731
    runs = {}
    for name, extra in (("pure", ["--distill-outcome-coef", "0"]),
                        ("offload", ["--distill-outcome-coef", "0", "--teacher-offload"]), ("both", [])):
        runs[name], stdouts, _ = run_on_fresh_pool(tmp_path, name, student, twice, iters=2, groups=1, lr="1e-2",
                                                   extra=flags + extra)
        assert ("teacher offloaded to host memory" in stdouts[0]) == (name == "offload")
    for a, b in zip(runs["pure"], runs["offload"]):
        for key in ("loss", "grad_norm", "distill_reverse_kl", "distill_teacher_logp"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    pure, both = runs["pure"][0], runs["both"][0]
    for key in ("distill_reverse_kl", "distill_teacher_logp"):
        assert both[key] == pytest.approx(pure[key], rel=1e-6)
    assert abs(both["loss"] - pure["loss"]) > 1e-4 and both["advantage_mean"] != pytest.approx(pure["advantage_mean"])


def test_teacher_recorded_by_the_gateway_trains_as_the_trainers_own(models, tmp_path):
    """Episodes carrying a served teacher's logprobs (here transformers' teacher, as a gateway with --teacher-urls
    records SGLang's) trained with --teacher-from-gateway: the same two steps as with the teacher in the trainer
    (--teacher-hf-checkpoint): loss, gradient norm and the distillation metrics, to fp32 round-off."""
    student, teacher = models
    episodes = _episodes(seed=12)
    recorded = _completion_logprobs(teacher, episodes)
    flags = ["--old-logprobs", "recompute", "--distill-coef", "0.7"]
    runs = {}
    for name, feed, extra in (("trainer", _feed(episodes), ["--teacher-hf-checkpoint", teacher]),
                              ("gateway", _feed(episodes, recorded), ["--teacher-from-gateway"])):
        runs[name], _, _ = run_on_fresh_pool(tmp_path, name, student, lambda c, f=feed: [f(c), f(c)], iters=2,
                                             groups=1, lr="1e-2", extra=flags + extra)
    for a, b in zip(runs["trainer"], runs["gateway"]):
        for key in ("loss", "grad_norm", "distill_reverse_kl", "distill_teacher_logp", "advantage_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert a["distill_scored_fraction"] == b["distill_scored_fraction"] == 1.0


def test_episodes_recorded_before_the_gateway_had_a_teacher_train_without_its_term(models, tmp_path):
    """A pool holding episodes with and without a served teacher's logprobs (a gateway restarted with --teacher-urls
    added): one batch trains on both, the teacher's term on the scored tokens alone. Pure distillation at step 1
    (ratio 1): the loss is -(coef / N) sum over the scored tokens of (teacher - student) student, N all trained
    tokens; distill_scored_fraction is the scored share, the metrics are means over the scored tokens; the log says
    how many trained tokens went without. A batch with no recordings at all trains (on its outcome advantages: 0
    here) and says so."""
    student, teacher = models
    episodes = _episodes(seed=14)
    s = _completion_logprobs(student, episodes)
    t = _completion_logprobs(teacher, episodes)
    recorded = [t[0], None, t[2], None]  # episodes 1 and 3 from before the teacher
    feed = _feed(episodes, recorded)

    coef, n = 0.5, sum(len(x) for x in s)
    scored_s, scored_t = torch.cat([s[0], s[2]]), torch.cat([t[0], t[2]])
    flags = ["--teacher-from-gateway", "--distill-coef", str(coef), "--distill-outcome-coef", "0",
             "--old-logprobs", "recompute"]
    (step,), outs, _ = run_on_fresh_pool(tmp_path, "mixed", student, feed, iters=1, groups=1, lr="1e-2",
                                         extra=flags)
    assert step["loss"] == pytest.approx(-(coef * (scored_t - scored_s) * scored_s).sum().item() / n, rel=1e-5)
    assert step["distill_scored_fraction"] == pytest.approx(scored_s.numel() / n)
    assert step["distill_teacher_logp"] == pytest.approx(scored_t.mean().item(), rel=1e-5)
    assert step["distill_reverse_kl"] == pytest.approx((scored_s - scored_t).mean().item(), rel=1e-5)
    unscored = n - scored_s.numel()
    assert f"{unscored} of {n} trained tokens carry no served teacher logprobs" in outs[0]
    recorded[0] = recorded[2] = None  # (the feed reads the list when it runs)
    (step,), outs, _ = run_on_fresh_pool(tmp_path, "none", student, feed, iters=1, groups=1, lr="1e-2",
                                         extra=flags)
    assert step["distill_scored_fraction"] == 0.0 and step["loss"] == 0.0
    assert f"{n} of {n} trained tokens carry no served teacher logprobs" in outs[0]


def test_teacher_top_k_recorded_by_the_gateway_trains_as_the_trainers_own(models, tmp_path):
    """Episodes carrying a served teacher's top 10 tokens at every sampled token (transformers' teacher, as a gateway
    with --teacher-urls --teacher-topk 10 records SGLang's) trained with --teacher-from-gateway --distill-kl reverse
    --distill-topk 8 (the first 8 of the 10): the same two steps as the teacher in the trainer; half of them without
    a top-k train the dense term on the others."""
    student, teacher = models
    episodes = _episodes(seed=31)
    recorded = _completion_logprobs(teacher, episodes)
    t_TV, _ = _next_token_logprobs(teacher, episodes)
    top_logp, top_ids = t_TV.float().topk(10, dim=-1)
    bounds = np.cumsum([0] + [len(c) for _, c in episodes])
    topk = [(top_ids[lo:hi].numpy().astype(np.int32), top_logp[lo:hi].numpy()) for lo, hi in zip(bounds[:-1],
                                                                                                  bounds[1:])]
    flags = ["--old-logprobs", "recompute", "--distill-kl", "reverse", "--distill-topk", "8"]
    runs = {}
    for name, feed, extra in (("trainer", _feed(episodes), ["--teacher-hf-checkpoint", teacher]),
                              ("gateway", _feed(episodes, recorded, topk), ["--teacher-from-gateway"])):
        runs[name], _, _ = run_on_fresh_pool(tmp_path, name, student, lambda c, f=feed: [f(c), f(c)], iters=2,
                                             groups=1, lr="1e-2", extra=flags + extra)
    for a, b in zip(runs["trainer"], runs["gateway"]):
        for key in ("loss", "grad_norm", "distill_reverse_kl", "distill_forward_kl", "distill_topk_mass",
                    "distill_teacher_logp"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    # half the episodes without a top-k (recorded before the gateway had --teacher-topk): the dense term on the
    # others alone, the log saying how many trained tokens went without
    half = [topk[0], None, topk[2], None]
    (step,), outs, _ = run_on_fresh_pool(tmp_path, "half", student, _feed(episodes, recorded, half), iters=1, groups=1,
                                         lr="1e-2", extra=flags + ["--teacher-from-gateway"])
    n = sum(len(c) for _, c in episodes)
    scored = len(episodes[0][1]) + len(episodes[2][1])
    assert step["distill_scored_fraction"] == pytest.approx(scored / n)
    assert f"{n - scored} of {n} trained tokens carry no served teacher top-k" in outs[0]


def test_supervised_distillation_on_sft_data(models, tmp_path):
    """--sft-data with --teacher-hf-checkpoint --distill-kl forward (the whole vocabulary as top-k) and
    --distill-outcome-coef 0.5: the loss is (0.5 NLL + KL(teacher || student)) summed over the trained tokens and
    divided by their count, with transformers' student and teacher on each sample alone; so is the gradient norm;
    TP 2 trains the same; the held-out loss (--offline-eval-data, the same file, at --lr 0 so that the weights do not
    move) includes the teacher's term and equals the training loss."""
    student, teacher = models
    rng = np.random.default_rng(41)
    rows = []
    for _ in range(4):
        prompt, answer = rng.integers(10, 300, 6).tolist(), rng.integers(10, 300, int(rng.integers(4, 8))).tolist()
        rows.append({"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    episodes = [(r["input_ids"][:6], r["input_ids"][6:]) for r in rows]
    t_TV, _ = _next_token_logprobs(teacher, episodes)
    s_TV, model = _next_token_logprobs(student, episodes, grad=True)
    targets = torch.tensor([t for _, answer in episodes for t in answer])
    nll = -s_TV.gather(1, targets[:, None])[:, 0]
    kl = (t_TV.exp() * (t_TV - s_TV)).sum(-1)
    loss = (0.5 * nll + kl).mean()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                                  2)):
        run_dir = tmp_path / name
        args = [*model_args(), "--hf-checkpoint", student, "--lr", "0", "--train-iters", "1", "--sft-data", str(data),
                "--offline-eval-data", str(data), "--train-batch-groups", "4", "--log-interval", "1",
                "--metrics-jsonl", str(run_dir / "metrics.jsonl"), "--teacher-hf-checkpoint", teacher,
                "--distill-kl", "forward", "--distill-topk", str(t_TV.shape[1]), "--distill-outcome-coef", "0.5",
                *extra]
        out = run_script(TRAIN, args, nproc=nproc, env=train_env() if nproc == 1 else {**os.environ,
                                                                                           "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        (runs[name],) = read_steps(str(run_dir / "metrics.jsonl"))
        step = runs[name]
        assert step["loss"] == pytest.approx(loss.item(), rel=1e-5), name
        assert step["sft/nll"] == pytest.approx(nll.mean().item(), rel=1e-5), name
        assert step["sft/distill_forward_kl"] == pytest.approx(kl.mean().item(), rel=1e-5, abs=2e-6), name
        assert step["grad_norm"] == pytest.approx(norm, rel=1e-4), name
        assert step["val/loss"] == pytest.approx(step["loss"], rel=1e-5), name
    assert "teacher rkl" in out.stdout


def test_teachers_that_cannot_score_the_policys_tokens_are_refused(models, tmp_path):
    """Another tokenizer (one token's id moved), no tokenizer at all, a dense KL's top-k larger than the vocabulary,
    and layers that do not split over the pipeline stages: each refused at start-up with the reason."""
    student, teacher = models
    other = with_a_swapped_token(teacher, str(tmp_path / "other_vocab"))
    out = refused_start(student, tmp_path, ["--teacher-hf-checkpoint", other])
    assert "its tokenizer is not the policy's" in out and "2 differ" in out
    bare = str(tmp_path / "bare")
    os.makedirs(bare)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(teacher, f), bare)
    assert "has no tokenizer files" in refused_start(student, tmp_path, ["--teacher-hf-checkpoint", bare])
    assert "--distill-topk 1000 is more than the 400 tokens of the tokenizer" in refused_start(
        student, tmp_path, ["--teacher-hf-checkpoint", teacher, "--distill-kl", "forward", "--distill-topk", "1000"])
    three = build_tiny_model(str(tmp_path / "three_layers"), seed=2, num_hidden_layers=3)
    from .pool_feed import PoolProcess

    pool = PoolProcess(str(tmp_path / "pp.sqlite"))
    try:
        res = run_script(TRAIN, train_cmd(student, pool, str(tmp_path / "pp"), iters=1, groups=1,
                                          extra=["--teacher-hf-checkpoint", three,
                                                 "--pipeline-model-parallel-size", "2"]),
                         nproc=2, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        pool.stop()
    assert res.returncode != 0
    assert "the model's 3 layers do not split into 2 pipeline stages" in res.stdout + res.stderr
