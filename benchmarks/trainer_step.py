"""One trainer forward+backward on an agent batch, with and without prefix-tree merging, side by side.

Workload (the demo's shape): ``--groups`` tasks x ``--group-size`` episodes; every episode is the rendered chat prompt
of the calculator agent (the tools system prompt, shared by all episodes, plus a short user expression) followed by a
random ``--completion-tokens`` completion. The same batch goes through ``training.trainer.forward_backward`` (Megatron
schedule, CISPO loss, tree forward) packed as prefix forests under ``--token-budget`` (merged) and as one sample per
micro-batch (unmerged, what ``--no-tree-merging`` does). The two losses must agree (exactness); the times are medians
of ``--repeats`` runs after one warm-up. Prints one JSON line.

``--teacher``: also the forward-only pass of an on-policy distillation teacher (the tiny teacher, 1.5x as wide and
twice as deep: models/tiny.build_tiny_teacher) over the same batch, merged and unmerged: what
``--teacher-hf-checkpoint`` adds to a step (``teacher_*`` keys; its mean logprob must agree between the two).

    python benchmarks/trainer_step.py [--groups 4 --group-size 8 --completion-tokens 24] [--teacher]
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def synthetic_sample(prompt, completion, g: int, e: int, rng: np.random.Generator):
    """Episode ``e`` of group ``g``: ``prompt`` (not trained) + ``completion`` (trained, logprob -3, version 0, one
    random advantage); also used by benchmarks/dp_balance.py."""
    from forge_megatron.middleware.batch import TrainSample

    tokens = np.r_[np.asarray(prompt), np.asarray(completion)].astype(np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(completion))].astype(np.uint8)
    return TrainSample(
        tokens=tokens, loss_mask=mask, rollout_logprobs=np.where(mask, -3.0, 0.0).astype(np.float32),
        policy_versions=np.where(mask, 0, -1).astype(np.int32),
        advantages=np.where(mask, rng.standard_normal(), 0.0).astype(np.float32), sample_weight=1.0,
        group_index=g, episode_id=f"{g}-{e}", domain="math", reward=float(e % 2))


def make_batch(tokenizer, groups: int, group_size: int, completion_tokens: int, seed: int):
    from forge_megatron.agents import calculator
    from forge_megatron.middleware.batch import TrainBatch

    rng = np.random.default_rng(seed)
    samples = []
    for g, task in enumerate(calculator.make_tasks(groups, seed=seed)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": task.prompt}], tools=calculator.TOOLS,
                                               tokenize=True, add_generation_prompt=True, return_dict=False)
        for e in range(group_size):
            completion = rng.integers(10, len(tokenizer), completion_tokens)
            samples.append(synthetic_sample(prompt, completion, g, e, rng))
    return TrainBatch(batch_id=1, samples=samples, group_indices=list(range(groups)))


@contextlib.contextmanager
def tiny_trainer(seed: int, master_port: int, arch: str = "qwen2", **model_overrides):
    """One-process Megatron set-up with the tiny model (``arch``, config ``model_overrides``) built from the trainer's
    own code paths: yields (model config, DDP chunks, loss config); also used by benchmarks/dp_balance.py and
    benchmarks/routing_replay.py."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(master_port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import parallel
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.training import arguments
    from forge_megatron.training.trainer import build_model_and_optimizer

    parallel.initialize(seed=seed)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_tiny_model(os.path.join(tmp, "m"), arch=arch, **model_overrides)
            cfg = Bridge(model_dir).cfg
            args = arguments.build_parser().parse_args(["--hf-checkpoint", model_dir, "--lr", "1e-4",
                                                        "--train-iters", "1"])
            _, ddp, _, _ = build_model_and_optimizer(args, cfg)
            yield cfg, ddp, arguments.loss_config(args)
    finally:
        parallel.destroy()


def timed_step(ddp, rb, loss_cfg) -> tuple[float, list[dict]]:
    """Seconds and micro-batch metrics of one forward+backward of ``rb`` (gradients zeroed first)."""
    from forge_megatron.training.trainer import forward_backward

    for d in ddp:
        d.zero_grad_buffer()
    t0 = time.perf_counter()
    metrics = forward_backward(ddp, rb, loss_cfg, ["math"])
    return time.perf_counter() - t0, metrics


def time_step(ddp, rb, loss_cfg, repeats: int) -> tuple[float, float]:
    times, loss = [], None
    for i in range(repeats + 1):
        seconds, metrics = timed_step(ddp, rb, loss_cfg)
        if i:
            times.append(seconds)
        loss = sum(m["loss"] for m in metrics)  # token_mean: each micro-batch's share of the batch loss
    return statistics.median(times), loss


@contextlib.contextmanager
def tiny_teacher():
    """Frozen model chunks of the tiny distillation teacher in the current parallel layout (as the trainer builds
    them: training/distill.py), its weights loaded."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import build_tiny_teacher
    from forge_megatron.training.checkpoint import load_hf_weights
    from forge_megatron.training.trainer import build_reference_model

    with tempfile.TemporaryDirectory() as tmp:
        teacher_dir = build_tiny_teacher(os.path.join(tmp, "teacher"))
        bridge = Bridge(teacher_dir)
        chunks = build_reference_model(bridge.cfg)
        load_hf_weights(chunks, bridge, teacher_dir)
        yield chunks


def time_teacher(chunks, rb, repeats: int) -> tuple[float, float]:
    """Median seconds of the teacher's forward-only pass over ``rb`` and its mean logprob of the trained tokens."""
    import torch

    from forge_megatron.mcore.forward import make_tree_forward_step
    from forge_megatron.training.trainer import run_schedule

    def keep(logp_M, entropy_M, mb):
        mb.extras["teacher_logp_M"] = logp_M.detach()
        return logp_M.sum() * 0.0, {}

    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            run_schedule(chunks, rb, make_tree_forward_step(keep), forward_only=True)
        if i:
            times.append(time.perf_counter() - t0)
    mask = torch.cat([mb.extras["loss_mask_M"] for mb in rb.micro_batches])
    logp = torch.cat([mb.extras["teacher_logp_M"] for mb in rb.micro_batches])
    return statistics.median(times), float((logp * mask).sum() / mask.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=24)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--teacher", action="store_true",
                   help="also time a distillation teacher's forward-only pass, merged and unmerged")
    a = p.parse_args()
    from forge_megatron.models.tiny import build_tiny_tokenizer
    from forge_megatron.training.trainer import rank_batch

    with tiny_trainer(a.seed, 29547) as (_, ddp, loss_cfg):
        batch = make_batch(build_tiny_tokenizer(), a.groups, a.group_size, a.completion_tokens, a.seed)
        merged = rank_batch(batch, a.token_budget, True, 0, 1, ["math"])
        unmerged = rank_batch(batch, a.token_budget, False, 0, 1, ["math"])
        merged_s, merged_loss = time_step(ddp, merged, loss_cfg, a.repeats)
        unmerged_s, unmerged_loss = time_step(ddp, unmerged, loss_cfg, a.repeats)
        teacher = {}
        if a.teacher:
            with tiny_teacher() as chunks:
                t_merged, lp_merged = time_teacher(chunks, merged, a.repeats)
                t_unmerged, lp_unmerged = time_teacher(chunks, unmerged, a.repeats)
            teacher = {"teacher_merged_s": t_merged, "teacher_unmerged_s": t_unmerged,
                       "teacher_speedup": t_unmerged / t_merged, "teacher_logp_mean": lp_merged,
                       "teacher_logp_abs_diff": abs(lp_merged - lp_unmerged)}
    total = sum(mb.layout.total_tokens for mb in merged.micro_batches)
    unique = sum(mb.layout.unique_tokens for mb in merged.micro_batches)
    print(json.dumps({**teacher,
        "samples": len(batch.samples), "total_tokens": total, "unique_tokens": unique, "bound": total / unique,
        "micro_batches_merged": len(merged.micro_batches), "micro_batches_unmerged": len(unmerged.micro_batches),
        "merged_s": merged_s, "unmerged_s": unmerged_s, "speedup": unmerged_s / merged_s,
        "loss_merged": merged_loss, "loss_unmerged": unmerged_loss, "loss_abs_diff": abs(merged_loss - unmerged_loss),
    }))


if __name__ == "__main__":
    sys.exit(main())
