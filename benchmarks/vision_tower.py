"""The vision tower's time per micro-batch under TP: every TP rank encoding all of the images (``replicated``, what
the trainer did before) against each rank encoding its share and all-gathering the features (``shared``,
mcore/vision.py ``_encode``), side by side in one run, on the same ranks and images; forward only (a frozen tower)
and forward + backward (``--train-vision-tower``).

A Qwen3-VL vision tower built from its config (``--depth`` blocks of ``--hidden`` channels, patch 16, merge 2,
DeepStack from three blocks; random weights) encodes ``--images`` images of ``--side`` x ``--side`` patches per
micro-batch on ``--tp`` gloo ranks, one thread each (so the ranks stand in for GPUs that work in parallel). Both
ways' features are checked equal first. Median of ``--repeats``, the slowest rank's time. One JSON line:

    python benchmarks/vision_tower.py --tp 2 --images 8 --side 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.multiprocessing as mp


def _tower_config(hidden: int, depth: int, out_hidden: int) -> dict:
    from transformers import Qwen3VLConfig

    cfg = Qwen3VLConfig(vision_config={"depth": depth, "hidden_size": hidden, "intermediate_size": 4 * hidden,
                                       "num_heads": max(1, hidden // 64), "out_hidden_size": out_hidden,
                                       "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                                       "deepstack_visual_indexes": [0, depth // 2, depth - 1],
                                       "num_position_embeddings": 2304},
                        text_config={"hidden_size": out_hidden, "num_hidden_layers": 1,
                                     "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12],
                                                      "mrope_interleaved": True}},
                        image_token_id=5)
    return cfg.to_dict()


def _rank(rank: int, args, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.tp),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from forge_megatron.mcore import parallel, vision
    from forge_megatron.mcore.parallel import ParallelConfig
    from forge_megatron.multimodal.families import build_vision_tower, vision_spec
    from forge_megatron.multimodal.tree import VisionTree

    parallel.initialize(ParallelConfig(tp=args.tp), seed=0)
    try:
        hf = _tower_config(args.hidden, args.depth, args.out_hidden)
        spec = vision_spec(hf)
        torch.manual_seed(0)
        tower = build_vision_tower(hf)
        grid = torch.tensor([[1, args.side, args.side]] * args.images)
        pixels = torch.randn(args.images * args.side * args.side, 3 * 2 * 16 * 16)
        rows = torch.arange(args.images * args.side * args.side // 4)

        def tree():
            return VisionTree(pixels, grid, rows, torch.zeros(rows.numel(), 3, dtype=torch.int64), spec)

        class Config:
            hidden_size = args.out_hidden
            sequence_parallel = False

        def run(config, backward: bool) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            with torch.set_grad_enabled(backward):
                merged, stack = vision._encode(tower, tree(), config, torch.device("cpu"), grad=backward)
                if backward:
                    (merged.sum() + sum(s.sum() for s in stack)).backward()
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
            return took.item()

        with torch.no_grad():
            a = vision._encode(tower, tree(), None, torch.device("cpu"))
            b = vision._encode(tower, tree(), Config, torch.device("cpu"))
        diff = max((x - y).abs().max().item() for x, y in zip([a[0], *a[1]], [b[0], *b[1]]))
        times = {k: [] for k in ("replicated_fwd", "shared_fwd", "replicated_fwd_bwd", "shared_fwd_bwd")}
        for _ in range(args.repeats):
            for backward in (False, True):
                suffix = "fwd_bwd" if backward else "fwd"
                times[f"replicated_{suffix}"].append(run(None, backward))
                times[f"shared_{suffix}"].append(run(Config, backward))
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            out.put({"tp": args.tp, "images": args.images, "patches_per_image": args.side * args.side,
                     "tower_params": sum(p.numel() for p in tower.parameters()), "max_abs_diff": diff,
                     **{f"{k}_s": round(v, 4) for k, v in med.items()},
                     "speedup_fwd": round(med["replicated_fwd"] / med["shared_fwd"], 3),
                     "speedup_fwd_bwd": round(med["replicated_fwd_bwd"] / med["shared_fwd_bwd"], 3)})
    finally:
        parallel.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--side", type=int, default=32, help="patches per image side (even)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--out-hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from forge_megatron.utils.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.tp)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=1800)
    for proc in procs:
        proc.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
