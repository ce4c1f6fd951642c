"""Helpers for trainer tests: a forge-pool subprocess and synthetic finished episodes fed to it over ZeroMQ."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np

from forge_megatron.middleware.schema import Episode, Segment
from forge_megatron.middleware.transport import PoolClient
from forge_megatron.utils.ports import free_port


class PoolProcess:
    """``forge-pool`` in its own process group; ``stop()`` kills the group."""

    def __init__(self, db: str, generation_batch_groups: int = 4, attempts: int = 3):
        for attempt in range(attempts):
            # a free port can be taken by another process (another test worker) before the pool binds it: then
            # start again on another port
            self.addr = f"tcp://127.0.0.1:{free_port()}"
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "forge_megatron.middleware.pool_server", "--db", db, "--bind", self.addr,
                 "--generation-batch-groups", str(generation_batch_groups), "--window", "inf"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            line = self.proc.stdout.readline()
            if "serving" in line:
                break
            try:  # the rest of what it printed (the pool exits after an error)
                output = line + self.proc.communicate(timeout=20)[0]
            except subprocess.TimeoutExpired:
                output = line
            self.stop()
            if "Address already in use" not in output or attempt == attempts - 1:
                raise RuntimeError(f"forge-pool did not start:\n{output[-3000:]}")
        self.client = PoolClient(self.addr, timeout_s=10.0)

    def stop(self) -> None:
        self.client.close() if hasattr(self, "client") else None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _routing_rows(rng: np.random.Generator, n: int, routing: tuple[int, int, int]) -> np.ndarray:
    """Random distinct experts per (token, layer): int16 [n, layers, topk] (``routing`` = layers, experts, topk)."""
    layers, experts, top_k = routing
    return np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :top_k].astype(np.int16)


def feed_groups(client: PoolClient, num_groups: int, rng: np.random.Generator, vocab: int = 300,
                group_size: int = 4, prompt_len: int = 12, completion_len: int | tuple[int, ...] = 6,
                routing: tuple[int, int, int] | None = None) -> list[str]:
    """Register ``num_groups`` groups of ``group_size`` finished episodes (shared prompt, varied completions).

    ``completion_len`` may be a tuple: group g then gets completions of ``completion_len[g % len]`` tokens.
    ``routing`` = (layers, experts, topk): the segments carry random routed experts (one set of rows for the shared
    prompt, the last token unrecorded), as a MoE engine with --enable-return-routed-experts would record.
    """
    group_ids = []
    lens = completion_len if isinstance(completion_len, tuple) else (completion_len,)
    for g in range(num_groups):
        completion_len = lens[g % len(lens)]
        prompt = rng.integers(10, vocab, size=prompt_len).tolist()
        prompt_rows = _routing_rows(rng, prompt_len, routing) if routing else None
        gid = client.register_group(f"task-{uuid.uuid4().hex[:6]}", group_size, "default")
        for e in range(group_size):
            completion = rng.integers(10, vocab, size=completion_len).tolist()
            n = prompt_len + completion_len
            routed = None
            if routing:
                routed = np.concatenate([prompt_rows, _routing_rows(rng, completion_len, routing)])
                routed[-1] = -1
            seg = Segment(tokens=prompt + completion, loss_mask=[0] * prompt_len + [1] * completion_len,
                          rollout_logprobs=[0.0] * prompt_len + [-5.0] * completion_len,
                          policy_versions=[-1] * prompt_len + [0] * completion_len, routed_experts=routed)
            eid = f"{gid}-e{e}"  # in the group's order (data-parallel ranks are dealt episodes by id)
            client.episode_started(gid, eid)
            now = time.time()
            client.submit_episode(Episode(episode_id=eid, group_id=gid, task_id="t", segments=[seg],
                                          reward=float(e % 2), started_at=now - 1, ended_at=now))
            assert len(seg.tokens) == n
        group_ids.append(gid)
    return group_ids
