#!/usr/bin/env python
"""A few training steps of a tiny Megatron-Core GPT on this machine (CPU + gloo when CUDA is absent).

The quickest check that Megatron-Core, forge_megatron's CPU patches and the optimizer work here:

    python scripts/megatron_smoke.py --steps 20

Runs as one process by default; under torchrun it runs data-parallel (e.g. ``torchrun --nproc-per-node 2``).
"""

import argparse
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    ap.add_argument("--seq-length", type=int, default=64, help="tokens per sequence (default 64)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per step per rank (default 4)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from forge_megatron.mcore import parallel
    from forge_megatron.mcore.model import GPTConfig, build_gpt, causal_mask

    parallel.initialize(parallel.ParallelConfig(), seed=1234)
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=64, max_position_embeddings=args.seq_length)
    model = build_gpt(cfg)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=1.0), [ddp])

    # A learnable synthetic language: each sequence counts upward modulo the vocabulary from a random start.
    g = torch.Generator().manual_seed(rank)
    mask = causal_mask(args.seq_length)
    pos = torch.arange(args.seq_length)[None].expand(args.batch_size, -1)
    if rank == 0:
        print(f"[smoke] tiny GPT ({sum(p.numel() for p in model.parameters())} params), "
              f"{torch.distributed.get_world_size()} rank(s), device=cpu" if not torch.cuda.is_available() else "")
    t0 = time.time()
    for step in range(1, args.steps + 1):
        start = torch.randint(0, cfg.vocab_size, (args.batch_size, 1), generator=g)
        seq = (start + torch.arange(args.seq_length + 1)[None]) % cfg.vocab_size
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(seq[:, :-1], pos, mask, labels=seq[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        if rank == 0 and (step == 1 or step % 5 == 0 or step == args.steps):
            print(f"[smoke] step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.1f}s)", flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
