"""Cost of rollout routing replay in the trainer: one forward+backward of a MoE agent batch with and without it.

The tiny Qwen3-MoE model (``--experts``, ``--topk``, ``--layers``, ``--hidden``) trains the calculator-shaped batch of
benchmarks/trainer_step.py (``--groups`` x ``--group-size`` episodes sharing a system prompt), each sample carrying
random recorded experts (int8 [tokens, layers, topk] up to 128 experts, as the gateway records them; the last token
unrecorded). Side by side, alternating, in one
process: ``natural`` (every router picks its own top-k) and ``replay`` (``--routing-replay``: the recorded experts,
mcore/routing_replay.py); also the time to pack the batch into micro-batches with and without building the tree's
routing rows (``tree_routing``). Times are medians of ``--repeats`` after one warm-up. Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/routing_replay.py [--experts 16 --topk 4 --layers 4 --hidden 128]
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_step import make_batch, timed_step, tiny_trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=48)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from forge_megatron.mcore import routing_replay
    from forge_megatron.models.tiny import build_tiny_tokenizer
    from forge_megatron.training.trainer import rank_batch

    model = dict(num_experts=a.experts, num_experts_per_tok=a.topk, num_hidden_layers=a.layers, hidden_size=a.hidden,
                 moe_intermediate_size=a.hidden // 2)
    with tiny_trainer(a.seed, 29561, arch="qwen3_moe", **model) as (_, ddp, loss_cfg):
        batch = make_batch(build_tiny_tokenizer(), a.groups, a.group_size, a.completion_tokens, a.seed)
        rng = np.random.default_rng(a.seed)
        dtype = np.int8 if a.experts <= 128 else np.int16  # what the gateway records
        for s in batch.samples:
            rows = np.argsort(rng.random((len(s.tokens), a.layers, a.experts)), axis=-1)[..., :a.topk]
            s.routed_experts = rows.astype(dtype)
            s.routed_experts[-1] = -1
        routing_replay.install(ddp)
        pack = {False: [], True: []}
        step = {False: [], True: []}
        for i in range(a.repeats + 1):
            for replay in (False, True):  # alternate: the machine's load drifts
                t0 = time.perf_counter()
                rb = rank_batch(batch, a.token_budget, True, 0, 1, ["math"], routing_replay=replay)
                packed = time.perf_counter() - t0
                seconds, _ = timed_step(ddp, rb, loss_cfg)
                if i:
                    pack[replay].append(packed)
                    step[replay].append(seconds)
        rows, mismatched = routing_replay.read_counts(ddp)
    tokens = sum(mb.layout.unique_tokens for mb in rb.micro_batches)
    natural_s, replay_s = statistics.median(step[False]), statistics.median(step[True])
    print(json.dumps({
        "benchmark": "routing_replay", "samples": len(batch.samples), "tree_tokens": tokens, "layers": a.layers,
        "experts": a.experts, "topk": a.topk, "hidden": a.hidden,
        "natural_s": round(natural_s, 4), "replay_s": round(replay_s, 4),
        "replay_time_ratio": round(replay_s / natural_s, 3),
        "pack_s": round(statistics.median(pack[False]), 4), "pack_replay_s": round(statistics.median(pack[True]), 4),
        "routing_bytes_per_token": np.dtype(dtype).itemsize * a.layers * a.topk,
        "random_rows_mismatch": round(mismatched / max(rows, 1), 3),
    }))


if __name__ == "__main__":
    sys.exit(main())
