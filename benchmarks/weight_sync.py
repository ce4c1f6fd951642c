"""Weight-sync throughput: a full sync (gather -> HF names -> buckets -> pause/flush -> broadcast to forge-engine ->
continue) vs a raw broadcast of the same bytes, in the same bucket sizes, over the same transport (a gloo group on
CPU, NCCL on GPUs), measured side by side in one run; bucket sizes swept.

    python benchmarks/weight_sync.py [--hidden 512 --layers 4 --buckets-mb 4,32,128 --repeats 3]

Prints ONE JSON line: bytes, sync_gbps, raw_gbps, ratio (at the best bucket size), and the sweep.
Receivers: one forge-engine subprocess (sync) and one bare receiver process (raw), each one rank of its group.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import torch


def _raw_receiver(port: int, sizes: list[int], repeats: int) -> None:
    from forge_megatron.rollout.weight_group import broadcast_tensor, init_weight_update_group

    torch.set_num_threads(1)
    group = init_weight_update_group("127.0.0.1", port, 1, 2, group_name="raw")
    for _ in range(repeats):
        for n in sizes:
            broadcast_tensor(group, torch.empty(n, dtype=torch.uint8), src=0)


class RawBroadcast:
    """A bare receiver process in its own gloo group: broadcasts the packed buckets, nothing else."""

    def __init__(self, buckets, repeats: int):
        from forge_megatron.weight_sync.buckets import pack
        from forge_megatron.utils.ports import free_port
        from forge_megatron.weight_sync.transport import make_group

        self.flat = [pack(b) for b in buckets]
        port = free_port("127.0.0.1")
        sizes = [f.numel() for f in self.flat]
        self.proc = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, sizes, repeats))
        self.proc.start()
        self.store, self.group = make_group("127.0.0.1", port, 2, "raw", "gloo", 120.0)

    def seconds(self) -> float:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        for f in self.flat:
            self.group.broadcast([f], opts).wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.proc.join(timeout=60)
        self.store = self.group = None


def _setup(args, root: str):
    from forge_megatron.convert import checkpoint as ckpt
    from forge_megatron.mcore.model import build_gpt
    from forge_megatron.mcore.parallel import ParallelConfig, initialize
    from forge_megatron.models.tiny import build_tiny_model

    hf_dir = build_tiny_model(os.path.join(root, "hf"), arch="qwen2", hidden_size=args.hidden,
                              intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                              num_attention_heads=8, num_key_value_heads=4)
    ckpt.hf_to_megatron(hf_dir, os.path.join(root, "mcore"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", WORLD_SIZE="1")
    initialize(ParallelConfig())
    bridge, _ = ckpt.read_meta(os.path.join(root, "mcore"))
    model = build_gpt(bridge.cfg).eval()
    model.load_state_dict(ckpt.load_rank_state(os.path.join(root, "mcore"), 0, 0, 0))
    return hf_dir, bridge, model


def _port() -> int:
    from forge_megatron.utils.ports import free_port

    return free_port("127.0.0.1")


def _measure(bridge, model, url: str, bucket_bytes: int, repeats: int) -> dict:
    """Alternate raw and sync passes (same buckets, same transport); best of ``repeats`` each."""
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer
    from forge_megatron.weight_sync.gather import iter_stage_buckets

    raw = RawBroadcast(list(iter_stage_buckets(bridge, [model], bucket_bytes)), repeats)
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[url], bucket_bytes=bucket_bytes), bridge)
    try:
        syncer.sync([model], 0)  # warm-up: builds the group
        raw_s, reports = [], []
        for version in range(1, repeats + 1):
            raw_s.append(raw.seconds())
            reports.append(syncer.sync([model], version))
    finally:
        syncer.close()
        raw.close()
    best = min(reports, key=lambda r: r.seconds)
    sync_gbps, raw_gbps = best.bytes / best.seconds / 1e9, best.bytes / min(raw_s) / 1e9
    return {"bucket_mb": bucket_bytes / (1 << 20), "bytes": best.bytes, "buckets": best.buckets,
            "sync_gbps": round(sync_gbps, 4), "raw_gbps": round(raw_gbps, 4), "ratio": round(sync_gbps / raw_gbps, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--buckets-mb", default="4,32,128", help="comma-separated bucket sizes in MiB")
    p.add_argument("--repeats", type=int, default=3, help="passes per measurement (best is reported)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from forge_megatron.rollout.launch import start_engine

    with tempfile.TemporaryDirectory() as root:
        hf_dir, bridge, model = _setup(args, root)
        engine = start_engine(hf_dir)
        sweep = []
        try:
            for mb in (float(x) for x in args.buckets_mb.split(",")):
                sweep.append(_measure(bridge, model, engine.url, int(mb * (1 << 20)), args.repeats))
        finally:
            engine.stop()
    top = max(sweep, key=lambda s: s["sync_gbps"])
    print(json.dumps({"benchmark": "weight_sync", "transport": "distributed/gloo", "engines": 1,
                      "bytes": top["bytes"], "sync_gbps": top["sync_gbps"], "raw_gbps": top["raw_gbps"],
                      "ratio": top["ratio"], "bucket_mb": top["bucket_mb"], "sweep": sweep}))


if __name__ == "__main__":
    main()
