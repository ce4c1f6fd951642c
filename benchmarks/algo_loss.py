"""Cost of the algorithm layer: policy_loss (forward + backward) against the bare loss expression, and score_group.

``policy_loss`` validates its inputs and computes metrics (each a host sync on GPU); the bare expression is the
CISPO formula alone, ``sum(-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp * m) / sum(m)``, on the same
tensors. ``overhead_cispo`` = time(policy_loss) / time(bare), measured side by side in this run. ``score_group_us``
is the wall time to score one group (the data pool runs it once per finished group).

    python benchmarks/algo_loss.py --tokens 262144 --samples 256
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from forge_megatron.algo import EpisodeOutcome, LossConfig, RewardConfig, policy_loss, score_group


def _timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _inputs(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    M, S = args.tokens, args.samples
    cuts = torch.sort(torch.randperm(M - 1, generator=gen)[: S - 1] + 1).values
    return {
        "logp_M": (-torch.rand(M, generator=gen) * 3).to(device).requires_grad_(),
        "old_M": (-torch.rand(M, generator=gen) * 3).to(device),
        "adv_M": torch.randn(M, generator=gen).to(device),
        "mask_M": (torch.rand(M, generator=gen) < 0.8).float().to(device),
        "cu_S1": torch.cat([torch.tensor([0]), cuts, torch.tensor([M])]).to(device),
    }


def _bare_cispo(x: dict[str, torch.Tensor], cfg: LossConfig) -> None:
    ratio_M = torch.exp((x["logp_M"] - x["old_M"]).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    w_M = ratio_M.detach().clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = (-w_M * x["adv_M"] * x["logp_M"] * x["mask_M"]).sum() / x["mask_M"].sum()
    loss.backward()


def _full(x: dict[str, torch.Tensor], cfg: LossConfig) -> None:
    loss, _ = policy_loss(x["logp_M"], x["old_M"], x["adv_M"], x["mask_M"], x["cu_S1"], cfg)
    loss.backward()


def _group(size: int, segments: int) -> list[EpisodeOutcome]:
    return [EpisodeOutcome(float(i % 2), bool(i % 2), 10.0 + i, num_segments=segments,
                           process_terms={"malformed_tool_calls": 1.0}, segment_rewards=[0.1] * segments)
            for i in range(size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=262144, help="M, loss positions of all samples")
    parser.add_argument("--samples", type=int, default=256, help="S, number of samples")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    x = _inputs(args, device)
    result = {"device": device.type, "tokens": args.tokens, "samples": args.samples,
              "threads": torch.get_num_threads()}
    bare_s = _timed(lambda: _bare_cispo(x, LossConfig()), args.repeats, device)
    result["bare_cispo_ms"] = round(bare_s * 1e3, 3)
    for loss_type in ("cispo", "ppo", "gspo"):
        cfg = LossConfig.recommended(loss_type)
        result[f"{loss_type}_ms"] = round(_timed(lambda: _full(x, cfg), args.repeats, device) * 1e3, 3)
    result["overhead_cispo"] = round(result["cispo_ms"] / result["bare_cispo_ms"], 3)
    group, cfg = _group(args.group_size, segments=4), RewardConfig(completion_time_bound=0.2, gamma=0.9)
    result["score_group_us"] = round(_timed(lambda: score_group(group, cfg), 50, torch.device("cpu")) * 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
