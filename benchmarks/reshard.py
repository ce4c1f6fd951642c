"""Host memory of ``forge-convert reshard``: one target stage at a time against the whole model, side by side.

A tiny-architecture Qwen3 model made wide and deep enough to weigh ``--mib`` (fp32) is converted to
``--from-pp`` pipeline stages, then resharded to ``--to-tp`` x ``--to-pp`` two ways, each in a fresh subprocess
whose peak resident memory (sampled every millisecond from /proc, memory-mapped file pages included, less the
process's size before the reshard) is reported:
``stream`` is ``convert.checkpoint.reshard`` (each target stage joined from the source stages that hold it, their
rank files memory-mapped); ``whole`` is the way it worked before, written out here as the reference: every source
stage loaded, then every target stage written. Both outputs are checked to be identical. One JSON line:

    python benchmarks/reshard.py --mib 256 --from-pp 4 --to-tp 2 --to-pp 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch


def _rss_mib() -> float:
    """Resident memory now (file pages of memory-mapped checkpoints included)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class _PeakSampler(threading.Thread):
    """The highest resident memory seen every millisecond while it runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self._done = _rss_mib(), threading.Event()

    def run(self):
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _rss_mib())

    def stop(self) -> float:
        self._done.set()
        self.join()
        return max(self.peak, _rss_mib())


def run_one(mode: str, src: str, out: str, tp: int, pp: int) -> dict:
    """In this process: reshard ``src`` to ``out`` by ``mode``; the peak memory it added."""
    from forge_megatron.bridge import ParallelLayout
    from forge_megatron.convert import checkpoint as ckpt

    layout = ParallelLayout(tp=tp, pp=pp)
    before = _rss_mib()
    sampler = _PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    if mode == "stream":
        ckpt.reshard(src, out, layout)
    else:  # the whole model in memory, then every stage written
        bridge, source = ckpt.read_meta(src)
        full = {}
        for s in range(source.pp):
            full.update(ckpt.load_megatron_stage(bridge, src, source, s))
        full = {n: t.clone() for n, t in full.items()}  # (held in memory, as torch.load without mmap held them)
        for s in range(layout.pp):
            ckpt.save_megatron_stage(bridge, {n: full[n] for n in ckpt.stage_inputs(bridge, layout, s)}, layout, s,
                                     out)
    seconds = time.perf_counter() - t0
    return {"peak_added_mib": round(sampler.stop() - before, 1), "seconds": round(seconds, 2)}


def _same(a: str, b: str) -> bool:
    for root, _, files in os.walk(os.path.join(a, "release")):
        for f in files:
            x = torch.load(os.path.join(root, f), map_location="cpu", weights_only=True)["model"]
            y = torch.load(os.path.join(b, os.path.relpath(root, a), f), map_location="cpu", weights_only=True)["model"]
            if x.keys() != y.keys() or not all(x[k] is None and y[k] is None or torch.equal(x[k], y[k])
                                               for k in x if not k.endswith("_extra_state")):
                return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="model size in fp32 MiB (about)")
    p.add_argument("--from-pp", type=int, default=4)
    p.add_argument("--to-tp", type=int, default=2)
    p.add_argument("--to-pp", type=int, default=4)
    p.add_argument("--child", nargs=5, metavar=("MODE", "SRC", "OUT", "TP", "PP"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, src, out, tp, pp = args.child
        print(json.dumps(run_one(mode, src, out, int(tp), int(pp))))
        return

    from forge_megatron.bridge import ParallelLayout
    from forge_megatron.convert import checkpoint as ckpt
    from forge_megatron.models.tiny import build_tiny_model

    layers = max(args.from_pp, args.to_pp) * 2
    hidden = 256
    while 12 * hidden * hidden * layers * 4 < (args.mib << 20):  # attention + MLP (about 12 h^2 per layer), fp32
        hidden += 128
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_tiny_model(os.path.join(tmp, "hf"), arch="qwen3", with_tokenizer=False, hidden_size=hidden,
                              intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=8,
                              num_key_value_heads=8, head_dim=hidden // 8)
        src = os.path.join(tmp, "src")
        ckpt.hf_to_megatron(hf, src, ParallelLayout(pp=args.from_pp))
        model_mib = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(src) for f in fs) / 2 ** 20
        results = {}
        for mode in ("stream", "whole"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, src, os.path.join(tmp, mode),
                                  str(args.to_tp), str(args.to_pp)], capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        identical = _same(os.path.join(tmp, "stream"), os.path.join(tmp, "whole"))
    print(json.dumps({"stream_peak_mib": results["stream"]["peak_added_mib"],
                      "whole_peak_mib": results["whole"]["peak_added_mib"],
                      "ratio": round(results["stream"]["peak_added_mib"]
                                     / max(results["whole"]["peak_added_mib"], 1e-9), 3),
                      "stream_s": results["stream"]["seconds"], "whole_s": results["whole"]["seconds"],
                      "model_mib": round(model_mib, 1), "layers": layers, "hidden": hidden,
                      "from_pp": args.from_pp, "to_tp": args.to_tp, "to_pp": args.to_pp, "identical": identical}))


if __name__ == "__main__":
    main()
