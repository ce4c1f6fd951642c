"""What a learned critic's GAE costs the trainer per step (``--critic``, algo/value.py), side by side in one process.

A batch of ``--samples`` samples of ``--tokens`` next-token positions in all (lengths drawn log-uniformly, about
``--trained`` of the positions trained, in runs between prompt / tool-result gaps), values and returns random:

- ``scan``: ``gae_advantages`` (vectorised over every sample at once, fp64, on ``--device``: the trainer runs it where
  the critic's values are);
- ``loop``: the textbook backward recursion, one trained token at a time in Python (what a per-sample loop costs);
- ``policy_loss``: ``algo.policy_loss`` (CISPO) on the same batch, the work the trainer already does per step on the
  CPU path of its loss, for scale.

Both GAE forms must give the same advantages (checked). Times are medians of ``--repeats`` after one warm-up; one
JSON line.

    OMP_NUM_THREADS=1 python benchmarks/gae.py [--tokens 262144 --samples 256 --gamma 0.99 --lam 0.95 --device cuda]
"""

import argparse
import json
import statistics
import sys
import time


def median_time(fn, repeats: int, sync=lambda: None) -> float:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_gae(values, mask, bounds, returns, gamma, lam):
    adv = [0.0] * len(values)
    for s in range(len(bounds) - 1):
        acc, next_v, last = 0.0, 0.0, True
        for t in range(bounds[s + 1] - 1, bounds[s] - 1, -1):
            if not mask[t]:
                continue
            r = returns[s] if last else 0.0
            acc = r + gamma * next_v - values[t] + gamma * lam * acc
            adv[t], next_v, last = acc, values[t], False
    return adv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=262144, help="next-token positions of the batch (default 262144)")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--trained", type=float, default=0.75, help="about this fraction of the positions is trained")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the scan and the loss run (cpu, cuda); the loop: the CPU")
    args = p.parse_args()
    if args.samples < 1 or args.tokens < args.samples:
        sys.exit("gae.py: --tokens must be >= --samples >= 1")

    import torch

    from forge_megatron.algo.losses import LossConfig, policy_loss
    from forge_megatron.algo.value import gae_advantages

    g = torch.Generator().manual_seed(args.seed)
    weights = torch.exp(torch.rand(args.samples, generator=g) * 4.0)  # log-uniform lengths over ~e^4
    lengths = (weights / weights.sum() * args.tokens).long().clamp(min=1)
    lengths[-1] += args.tokens - int(lengths.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    M = int(cu[-1])
    # trained runs of ~64 tokens between untrained gaps (prompts, tool results)
    run = torch.rand(M // 64 + 1, generator=g) < args.trained
    mask = run.repeat_interleave(64)[:M].float()
    values = torch.randn(M, generator=g)
    returns = torch.randn(args.samples, generator=g)

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    on = [t.to(dev) for t in (values, mask, cu, returns)]
    scan_s = median_time(lambda: gae_advantages(*on, args.gamma, args.lam), args.repeats, sync)
    adv, _ = gae_advantages(*on, args.gamma, args.lam)
    adv = adv.cpu()
    v, m, b, r = values.tolist(), mask.tolist(), cu.tolist(), returns.tolist()
    loop_s = median_time(lambda: loop_gae(v, m, b, r, args.gamma, args.lam), max(1, args.repeats // 2))
    want = torch.tensor(loop_gae(v, m, b, r, args.gamma, args.lam))
    err = float((adv.double() - want).abs().max())
    if err > 1e-3:
        sys.exit(f"gae.py: the scan and the loop disagree by {err}")

    logp = (torch.randn(M, generator=g).clamp(max=0) - 0.1).to(dev)
    cfg = LossConfig()
    loss_s = median_time(lambda: policy_loss(logp, logp - 0.01, adv.to(dev), on[1], on[2], cfg), args.repeats, sync)
    print(json.dumps({
        "bench": "gae", "device": args.device, "tokens": M, "samples": args.samples, "trained_tokens": int(mask.sum()),
        "gamma": args.gamma, "lam": args.lam, "threads": torch.get_num_threads(),
        "scan_ms": round(scan_s * 1e3, 3), "loop_ms": round(loop_s * 1e3, 3),
        "policy_loss_ms": round(loss_s * 1e3, 3), "speedup_vs_loop": round(loop_s / scan_s, 2),
        "scan_over_policy_loss": round(scan_s / loss_s, 3), "max_abs_diff": err,
    }))


if __name__ == "__main__":
    main()
