"""LoRA weight sync: the merged weights (``--weight-sync-lora merged``: W + scaling B A of every adapted linear, the
whole model broadcast to a paused engine) vs the adapters alone (``adapter``: one PEFT adapter written and loaded by
the engine beside its weights, nothing paused), on the same trainer model, the same forge-engine, alternating, in one
run. While they run a client streams from the engine without a break: the longest gap between two of its tokens and
the calls the syncs cut (aborted) are what a rollout sees of each sync.

    python benchmarks/lora_sync.py [--hidden 1024 --layers 4 --rank 16 --repeats 3]

Prints ONE JSON line: merged_s, adapter_s, speedup (merged_s / adapter_s), merged_bytes, adapter_bytes, and per mode
the longest token gap (max_stall_s) and the aborted calls. CPU (gloo); the engine is forge-engine, not SGLang (whose
LoRA kernels cost decode time this does not measure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from weight_sync import _setup  # noqa: E402  (the trainer model of the weight-sync benchmark)


class Streamer:
    """Streams from the engine call after call; records each token's arrival and the calls a sync aborted."""

    def __init__(self, url: str):
        self.url, self.stamps, self.aborts, self.stop = url, [], 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = json.dumps({"input_ids": [5, 17, 42, 99], "stream": True,
                           "sampling_params": {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}})
        while not self.stop.is_set():
            req = urllib.request.Request(self.url + "/generate", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        self.stamps.append(time.perf_counter())
                        if (json.loads(line[6:])["meta_info"]["finish_reason"] or {}).get("type") == "abort":
                            self.aborts += 1

    def window(self, t0: float, t1: float) -> float:
        """The longest gap between tokens that overlaps [t0, t1]."""
        stamps = list(self.stamps)
        gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b >= t0 and a <= t1]
        return max(gaps, default=0.0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (every attention and MLP linear adapted)")
    p.add_argument("--repeats", type=int, default=3, help="syncs per mode (best time reported; stalls: the worst)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from forge_megatron.mcore.lora import LoraConfig, install
    from forge_megatron.rollout.launch import start_engine
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer

    with tempfile.TemporaryDirectory() as root:
        hf_dir, bridge, model = _setup(args, root)
        install([model], LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
        engine = start_engine(hf_dir, extra_args=["--enable-lora"])
        syncers = {"merged": WeightSyncer(WeightSyncConfig(engine_urls=[engine.url], bucket_bytes=128 << 20),
                                          bridge),
                   "adapter": WeightSyncer(WeightSyncConfig(engine_urls=[engine.url], lora="adapter",
                                                            disk_dir=os.path.join(root, "adapters")), bridge)}
        results = {mode: {"seconds": [], "bytes": 0, "stall": 0.0, "aborts": 0} for mode in syncers}
        streamer = Streamer(engine.url)
        try:
            version = 0
            for mode, syncer in syncers.items():  # warm-up: the merged sync's group, the adapter directory
                version += 1
                syncer.sync([model], version)
            time.sleep(1.0)
            for _ in range(args.repeats):
                for mode, syncer in syncers.items():
                    version += 1
                    aborts = streamer.aborts
                    t0 = time.perf_counter()
                    report = syncer.sync([model], version)
                    t1 = time.perf_counter()
                    time.sleep(0.5)  # the tokens right after the sync
                    r = results[mode]
                    r["seconds"].append(report.seconds)
                    r["bytes"] = report.bytes
                    r["stall"] = max(r["stall"], streamer.window(t0, t1))
                    r["aborts"] += streamer.aborts - aborts
        finally:
            streamer.close()
            for syncer in syncers.values():
                syncer.close()
            engine.stop()
    merged, adapter = results["merged"], results["adapter"]
    print(json.dumps({
        "benchmark": "lora_sync", "hidden": args.hidden, "layers": args.layers, "rank": args.rank,
        "merged_s": round(min(merged["seconds"]), 4), "adapter_s": round(min(adapter["seconds"]), 4),
        "speedup": round(min(merged["seconds"]) / min(adapter["seconds"]), 2),
        "merged_bytes": merged["bytes"], "adapter_bytes": adapter["bytes"],
        "merged_max_stall_s": round(merged["stall"], 4), "adapter_max_stall_s": round(adapter["stall"], 4),
        "merged_aborts": merged["aborts"], "adapter_aborts": adapter["aborts"]}))


if __name__ == "__main__":
    main()
