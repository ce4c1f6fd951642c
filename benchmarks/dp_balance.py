"""Step time of a data-parallel job whose batch is split round-robin vs by estimated cost (``--dp-balance``).

A DP step lasts as long as its slowest rank. One heavy-tailed agent batch (``--groups`` GRPO groups of
``--group-size`` episodes; each group's completion length drawn from a lognormal with median ``--median`` tokens and
``--sigma``, capped at ``--max-len``) is split over ``--dp`` ranks by ``training.trainer.rank_batch`` both ways, and
every rank's share runs one real forward+backward (Megatron schedule, tree packing, CISPO) of the tiny model in this
process, one share after the other. Modes: ``round-robin``, ``cost-groups`` (whole groups by estimated cost) and
``cost`` (the default: also deals the episodes of a group costing more than a rank's share to several ranks). Per
mode: the measured time of every share (median of ``--repeats``, the modes interleaved in each repeat), the step
time = the slowest share, the measured and estimated imbalance (slowest over mean) and the groups split.
``speedup`` = round-robin step time / cost step time, ``speedup_split`` = cost-groups step time / cost step time;
``cost_time_corr`` = correlation of the estimated cost with the measured time over all shares (how good the cost
model is). Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/dp_balance.py [--dp 4 --groups 32 --sigma 1.0]
"""

import argparse
import json
import os
import statistics
import sys

import numpy as np


def make_batch(groups: int, group_size: int, prompt: int, median: int, sigma: float, max_len: int, vocab: int,
               seed: int):
    from forge_megatron.middleware.batch import TrainBatch
    from trainer_step import synthetic_sample  # benchmarks/ is on sys.path when run as a script

    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt_ids = rng.integers(10, vocab, prompt)
        length = int(min(max_len, max(2, rng.lognormal(np.log(median), sigma))))
        for e in range(group_size):
            samples.append(synthetic_sample(prompt_ids, rng.integers(10, vocab, length), g, e, rng))
    return TrainBatch(batch_id=1, samples=samples, group_indices=list(range(groups)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=4, help="data-parallel ranks to split the batch over")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per group (shared by its episodes)")
    p.add_argument("--median", type=int, default=64, help="median completion tokens of a group")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the completion lengths")
    p.add_argument("--max-len", type=int, default=2048, help="completion length cap")
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from trainer_step import tiny_trainer, timed_step  # benchmarks/ is on sys.path when run as a script

    from forge_megatron.training.balance import imbalance
    from forge_megatron.training.trainer import rank_batch

    modes = ("round-robin", "cost-groups", "cost")
    with tiny_trainer(a.seed, 29548) as (cfg, ddp, loss_cfg):
        batch = make_batch(a.groups, a.group_size, a.prompt, a.median, a.sigma, a.max_len, cfg.vocab_size, a.seed)
        shares = {m: [rank_batch(batch, a.token_budget, True, r, a.dp, ["math"], balance=m,
                                 hidden_size=cfg.hidden_size) for r in range(a.dp)] for m in modes}
        times = {m: [[] for _ in range(a.dp)] for m in modes}
        for i in range(a.repeats + 1):  # the first pass warms up
            for m in modes:
                for r, rb in enumerate(shares[m]):
                    seconds, _ = timed_step(ddp, rb, loss_cfg)
                    if i:
                        times[m][r].append(seconds)

    out = {"benchmark": "dp_balance", "dp": a.dp, "groups": a.groups, "group_size": a.group_size,
           "sigma": a.sigma, "hidden": cfg.hidden_size, "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0)}
    est, meas = [], []
    for m in modes:
        share_s = [statistics.median(t) for t in times[m]]
        loads = shares[m][0].dp_loads
        out[m] = {"step_s": round(max(share_s), 4), "share_s": [round(s, 4) for s in share_s],
                  "imbalance_measured": round(imbalance(share_s), 3), "imbalance_estimated": round(imbalance(loads), 3),
                  "unique_tokens": [sum(mb.layout.unique_tokens for mb in rb.micro_batches) for rb in shares[m]],
                  "split_groups": shares[m][0].dp_split_groups}
        est += loads
        meas += share_s
    out["speedup"] = round(out["round-robin"]["step_s"] / out["cost"]["step_s"], 3)
    out["speedup_split"] = round(out["cost-groups"]["step_s"] / out["cost"]["step_s"], 3)
    out["cost_time_corr"] = round(float(np.corrcoef(est, meas)[0, 1]), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
