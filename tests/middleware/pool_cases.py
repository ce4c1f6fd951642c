"""Shared helpers of the data pool / scheduler / transport tests: synthetic episodes and a forge-pool subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from forge_megatron.middleware.schema import Episode, Segment
from forge_megatron.utils.ports import free_port  # noqa: F401 (the tests' import point)


def make_segment(rng: np.random.Generator, length: int, version: int) -> Segment:
    """A prompt half (not trained) followed by a sampled half (trained, with logprobs and versions)."""
    prompt = length // 2
    mask = [0] * prompt + [1] * (length - prompt)
    return Segment(
        tokens=[int(t) for t in rng.integers(0, 50_000, size=length)],
        loss_mask=mask,
        rollout_logprobs=[float(-rng.random()) if m else 0.0 for m in mask],
        policy_versions=[version if m else -1 for m in mask],
    )


def make_episode(group_id: str, episode_id: str, reward: float = 1.0, status: str = "finished", segments: int = 1,
                 length: int = 12, version: int = 0, seed: int = 0, duration_s: float = 1.0) -> Episode:
    rng = np.random.default_rng(seed)
    segs = [make_segment(rng, length + s, version) for s in range(segments)] if status == "finished" else []
    return Episode(episode_id=episode_id, group_id=group_id, task_id=f"task-{group_id}", segments=segs,
                   status=status, reward=reward, started_at=100.0, ended_at=100.0 + duration_s)


def fill_group(sink, group_id: str, size: int, rewards: list[float] | None = None, version: int = 0) -> list[Episode]:
    """Submit ``size`` finished episodes (rewards 0, 1, 0, 1, ... unless given) to a group."""
    rewards = rewards or [float(i % 2) for i in range(size)]
    episodes = [make_episode(group_id, f"{group_id}-e{i}", reward=r, seed=i, version=version)
                for i, r in enumerate(rewards)]
    for ep in episodes:
        sink.submit_episode(ep)
    return episodes


def start_pool_process(db: str, bind: str, *extra: str) -> subprocess.Popen:
    """forge-pool in its own process group; returns once it printed its endpoint."""
    cmd = [sys.executable, "-m", "forge_megatron.middleware.pool_server", "--db", db, "--bind", bind, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = proc.stdout.readline()
    if "serving on" not in line:
        stop_process(proc)
        raise RuntimeError(f"forge-pool did not start: {line!r}")
    return proc


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    if proc.stdout is not None:
        proc.stdout.close()


def wait_until(cond, timeout_s: float = 20.0, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(interval_s)


def produce_groups(addr: str, num_groups: int, size: int, pause_s: float) -> None:
    """Rollout side in its own process: register groups and submit their episodes through a PoolClient."""
    from forge_megatron.middleware.transport import PoolClient

    client = PoolClient(addr, timeout_s=1.0, retries=60)
    for i in range(num_groups):
        gid = client.register_group(f"task{i}", size)
        for e in range(size):
            client.episode_started(gid, f"{gid}-e{e}")
            client.submit_episode(make_episode(gid, f"{gid}-e{e}", reward=float(e % 2), seed=i * size + e))
        time.sleep(pause_s)
    client.close()


def train_then_hang(addr: str, num_batches: int, groups_per_batch: int, checkpoint_after: int, queue) -> None:
    """Trainer in its own process: pull batches, commit a checkpoint after ``checkpoint_after`` of them, report the
    group indices of every batch, then wait to be killed (a crash)."""
    from forge_megatron.middleware.transport import PoolClient

    client = PoolClient(addr, timeout_s=5.0)
    for step in range(1, num_batches + 1):
        batch = client.get_batch(groups_per_batch, timeout_s=10.0)
        if step == checkpoint_after:
            client.commit(up_to_batch_id=batch.batch_id)
        queue.put(batch.group_indices)
    queue.put("done")
    time.sleep(600)
