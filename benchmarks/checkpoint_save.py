"""How long training stops for a checkpoint: a synchronous save against ``--async-save``, side by side in one run.

A rank's state is stood in for by fp32 tensors of ``--state-mib`` in all, sized like a model's weights, Adam moments
and masters (``--tensors`` of them). ``sync`` is what the trainer waits for without ``--async-save``: the rank file
written (``write_rank_files``: torch.save, fsync, rename) and published (``latest``). ``async`` is what it waits for
with it: the copy to host memory (``host_copy``, what ``AsyncCheckpointSaver.save`` does before its thread starts);
``async_write_s`` is how long the thread then writes, while training would go on (measured until ``poll(block=True)``
publishes). One gloo rank, files under ``--dir`` (default: a temporary directory; give one on the disk checkpoints
go to). Best of ``--repeats``. One JSON line:

    python benchmarks/checkpoint_save.py --state-mib 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from forge_megatron.training.checkpoint import AsyncCheckpointSaver, host_copy, publish_checkpoint, write_rank_files
from forge_megatron.utils.ports import free_port


def make_state(mib: int, tensors: int) -> dict:
    per = max(1, (mib << 20) // 4 // tensors)
    return {"model": {f"w{i}": torch.randn(per) for i in range(tensors)}, "iteration": 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="forge-ckpt-bench-", dir=args.dir)
    try:
        state = make_state(args.state_mib, args.tensors)
        nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
        saver = AsyncCheckpointSaver()
        sync, stall, write = [], [], []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            write_rank_files(root, 2 * r + 1, 0, state, {"rank": 0})
            publish_checkpoint(root, 2 * r + 1, keep=1)
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            copy = host_copy(state)
            stall.append(time.perf_counter() - t0)
            saver.start(root, 2 * r + 2, copy, {"rank": 0}, keep=1)
            t1 = time.perf_counter()
            saver.poll(block=True)
            write.append(time.perf_counter() - t1)
        print(json.dumps({"benchmark": "checkpoint_save", "state_mib": round(nbytes / 2**20, 1),
                          "tensors": args.tensors, "sync_save_s": round(min(sync), 4),
                          "async_stall_s": round(min(stall), 4), "async_write_s": round(min(write), 4),
                          "stall_ratio": round(min(stall) / min(sync), 4)}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
