#!/usr/bin/env python
"""Agent-RL training with Megatron-Core, in the style of Megatron-LM's pretrain_gpt.py.

Launch one process per GPU (or per CPU rank) with torchrun:

    source scripts/models/qwen3-8B.sh
    torchrun --nproc-per-node 8 scripts/train_forge.py "${MODEL_ARGS[@]}" \\
        --tensor-model-parallel-size 2 --hf-checkpoint /models/Qwen3-8B --lr 1e-6 --train-iters 1000 \\
        --pool-addr tcp://pool-node:5555 --gateway-url http://pool-node:8000 --engine-urls http://r0:30000

Megatron's flags (parallel sizes, network size, optimizer, checkpointing, logging) keep Megatron's names; forge's
flags are in the "forge (agent RL)" group of --help. See docs/training.md and docs/launch.md.
"""

import sys


def main(argv=None) -> int:
    from forge_megatron.training.arguments import parse_args

    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"train_forge.py: error: {exc}", file=sys.stderr)
        return 2
    from forge_megatron.training.trainer import train

    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
