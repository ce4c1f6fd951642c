"""Timing shared by the attention benchmarks (dsa.py, block_sparse.py): the median over repeats of a function's wall
time after one warm-up call, synchronising the GPU around each call."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls, after a warm-up call."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
