"""The gateway's image normalisation: screenshots per second on one thread against ``--threads`` threads (the
gateway's ``--image-threads``), side by side in one run, on the same images.

Each image is a distinct ``--width`` x ``--height`` PNG screenshot stand-in (flat panels, bars and noisy text-like
strips, so it compresses as screenshots do); normalising it is what the gateway does once per new image
(multimodal/images.py ``ImageProcessor.normalize``: decode, RGB, resize to the processor's grid, PNG), here with
Qwen3-VL's processor settings (patch 16, merge 2, up to 16M pixels: 1280 x 800 keeps its size, rounded to the
grid). Median of ``--repeats``. One JSON line:

    python benchmarks/image_normalize.py --images 32 --threads 4
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def screenshot(rng: np.random.Generator, width: int, height: int) -> bytes:
    from PIL import Image

    px = np.full((height, width, 3), 240, np.uint8)
    for _ in range(12):  # panels and bars
        x0, y0 = rng.integers(0, width - 64), rng.integers(0, height - 32)
        px[y0:y0 + rng.integers(16, 200), x0:x0 + rng.integers(32, 400)] = rng.integers(0, 255, 3)
    for _ in range(40):  # text-like strips
        x0, y0 = rng.integers(0, width - 300), rng.integers(0, height - 12)
        px[y0:y0 + 10, x0:x0 + 300] = (rng.random((10, 300, 1)) < 0.3) * 200
    out = io.BytesIO()
    Image.fromarray(px).save(out, format="PNG")
    return out.getvalue()


def processor(out_dir: str):
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor

    build_tiny_model(out_dir, "qwen3_vl", images=True)
    path = os.path.join(out_dir, "preprocessor_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(patch_size=16, merge_size=2, size={"shortest_edge": 65536, "longest_edge": 16777216})
    with open(path, "w") as f:
        json.dump(cfg, f)
    return ImageProcessor(out_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=800)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc = processor(tmp)
        rng = np.random.default_rng(0)
        images = [screenshot(rng, args.width, args.height) for _ in range(args.images)]
        proc.normalize(images[0], "warm-up")
        rates = {1: [], args.threads: []}
        for _ in range(args.repeats):
            for threads in rates:
                with ThreadPoolExecutor(threads) as pool:
                    t0 = time.perf_counter()
                    out = list(pool.map(lambda data: proc.normalize(data, "image"), images))
                    rates[threads].append(len(out) / (time.perf_counter() - t0))
        one, many = statistics.median(rates[1]), statistics.median(rates[args.threads])
        print(json.dumps({"images": args.images, "size": [args.width, args.height],
                          "png_kib_mean": round(sum(map(len, images)) / len(images) / 1024, 1),
                          "cpus": os.cpu_count(), "threads": args.threads, "images_per_s_1_thread": round(one, 2),
                          f"images_per_s_{args.threads}_threads": round(many, 2), "speedup": round(many / one, 3)}))


if __name__ == "__main__":
    main()
