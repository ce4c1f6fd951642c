"""Background checkpoint writes (--async-save) and retention (--keep-checkpoints) on two gloo ranks.

A rank's write is held back by an object whose pickling waits for a release (torch.save blocks in it, as a slow disk
would): nothing is published while any rank is writing, ``latest`` moves only once both have written, the callback
(the trainer's pool commit) runs once then; a write that fails on one rank fails ``poll`` on both and leaves
``latest`` where it was; retention deletes the checkpoints older than the newest K but never one newer than
``latest``. The trainer runs it end to end in tests/training/test_trainer.py (exit and resume). CPU."""

import os
import threading
from collections import OrderedDict

import pytest
import torch

from forge_megatron.training.checkpoint import host_copy, prune_checkpoints, saved_iterations
from tests.dist_utils import run_distributed


class _Held:
    """Pickles only once released (a rank still writing its checkpoint)."""

    release = threading.Event()

    def __reduce__(self):
        _Held.release.wait(60)
        return (_Held, ())


def _body(rank, world_size, root):
    import torch.distributed as dist

    from forge_megatron.training.checkpoint import AsyncCheckpointSaver, latest_iteration

    saver = AsyncCheckpointSaver()
    published = []
    out = {}
    state = {"w": torch.full((4,), float(rank)), "held": _Held() if rank == 1 else None}
    saver.start(root, 2, state, {"rank": rank}, keep=2, on_published=lambda: published.append(2))
    out["while_writing"] = (saver.poll(), latest_iteration(root), list(published))
    dist.barrier()
    if rank == 1:
        _Held.release.set()
    out["written"] = (saver.poll(block=True), latest_iteration(root), list(published))
    for it in (4, 6):
        if it == 6 and rank == 0:
            os.makedirs(os.path.join(root, "iter_0000008"))  # a save under way (or cut short), newer than latest
        dist.barrier()
        saver.start(root, it, {"w": torch.full((4,), float(it))}, {"rank": rank}, keep=2,
                    on_published=lambda it=it: published.append(it))
        saver.poll(block=True)
    out["kept"] = (latest_iteration(root), list(published))
    bad = {"w": torch.zeros(1), "f": (lambda: 0) if rank == 1 else None}  # rank 1 cannot pickle its state
    saver.start(root, 10, bad, {"rank": rank}, on_published=lambda: published.append(10))
    try:
        saver.poll(block=True)
        out["failure"] = None
    except RuntimeError as exc:
        out["failure"] = str(exc)
    out["after_failure"] = (latest_iteration(root), list(published), saver.pending is None)
    return out


def test_a_background_checkpoint_is_published_once_every_rank_has_written(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_body, world_size=2, root=root)
    for rank, out in enumerate(results):
        assert out["while_writing"] == (None, None, [])  # rank 1 still writing: nothing published
        assert out["written"] == (2, 2, [2])
        assert out["kept"] == (6, [2, 4, 6])
        assert "checkpoint iteration 10 could not be written" in out["failure"]
        assert ("rank 1: AttributeError: Can't pickle" if rank == 1 else "another rank's write failed") in out["failure"]
        assert out["after_failure"] == (6, [2, 4, 6], True)
    assert saved_iterations(root) == [4, 6, 8, 10]  # 2 pruned (keep 2); 8 (newer than latest) and failed 10 left
    assert torch.equal(torch.load(f"{root}/iter_0000006/rank_00001.pt")["w"], torch.full((4,), 6.0))
    assert prune_checkpoints(root, 1) == [4] and saved_iterations(root) == [6, 8, 10]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(root, 0)


def test_host_copy_is_a_snapshot_that_keeps_sharing_and_metadata():
    """What the background write gets: copies the training step cannot change, one per tensor however often it is
    reached (the optimizer's state under two keys), module state dicts with their ``_metadata``."""
    moment = torch.ones(3)
    sd = OrderedDict(weight=torch.arange(3.0))
    sd._metadata = {"": {"version": 2}}
    state = {"model": sd, "optimizer": {"state": {0: {"exp_avg": moment}}}, "by_name": {"w": {"exp_avg": moment}},
             "steps": [1, torch.tensor(5)], "note": "x"}
    copy = host_copy(state)
    moment.add_(1)
    sd["weight"].zero_()
    assert torch.equal(copy["optimizer"]["state"][0]["exp_avg"], torch.ones(3))
    assert copy["optimizer"]["state"][0]["exp_avg"] is copy["by_name"]["w"]["exp_avg"]
    assert torch.equal(copy["model"]["weight"], torch.arange(3.0)) and copy["model"]._metadata == sd._metadata
    assert isinstance(copy["model"], OrderedDict) and copy["steps"][0] == 1 and copy["note"] == "x"


def test_checkpoint_save_benchmark_runs_and_cleans_up(tmp_path):
    """benchmarks/checkpoint_save.py at a small size: one JSON line with the keys docs/benchmarks.md reports, and
    nothing left in the directory it wrote to."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "checkpoint_save.py"), "--state-mib", "4",
                          "--tensors", "8", "--repeats", "1", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["state_mib"] == 4.0 and result["sync_save_s"] > 0 and result["async_write_s"] > 0
    assert result["stall_ratio"] > 0 and result["async_stall_s"] > 0
    assert os.listdir(tmp_path) == []
