"""Command lines and metrics of scripts/train_forge.py runs, shared by the trainer tests."""

import json
import os
import shlex
import subprocess

from .pool_feed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "scripts", "train_forge.py")


def model_args() -> list[str]:
    script = os.path.join(ROOT, "scripts", "models", "tiny.sh")
    out = subprocess.run(["bash", "-c", f'source {shlex.quote(script)}; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def train_cmd(model_dir, pool, run_dir, iters, groups, extra=(), model=None):
    """train_forge.py arguments for the tiny model against ``pool``: metrics to ``run_dir``/metrics.jsonl.
    ``model``: the network flags (default the tiny dense model's; [] takes the architecture from the checkpoint)."""
    return [*(model_args() if model is None else model), "--hf-checkpoint", model_dir, "--lr", "1e-3", "--train-iters", str(iters),
            "--save", f"{run_dir}/ckpt", "--load", f"{run_dir}/ckpt", "--save-interval", "2",
            "--pool-addr", pool.addr, "--weight-sync-transport", "none", "--train-batch-groups", str(groups),
            "--log-interval", "1", "--metrics-jsonl", f"{run_dir}/metrics.jsonl", "--batch-timeout-s", "120", *extra]


def train_env():
    """Environment of a one-process trainer run (torch.distributed variables set, one OpenMP thread)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def read_steps(path):
    """The per-step metric dicts of a metrics.jsonl (none if the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_on_fresh_pool(tmp_path, name: str, model_dir: str, feed, *, iters: int, groups: int, extra=(), nproc: int = 1,
                      exits=(None,), env_extra: dict | None = None, lr: str | None = None, model=None):
    """Start a forge-pool process, ``feed(client)`` it, and train ``iters`` iterations of the tiny model on it: one
    process (or ``nproc`` under torchrun) per entry of ``exits`` (--exit-interval N, None: to the end; or a tuple
    (N or None, more flags, nproc) for a stage run in another layout), all in ``tmp_path/name``. Returns (metric
    steps, stdout of each process, steps written after each process)."""
    from tests.dist_utils import run_script

    from .pool_feed import PoolProcess

    pool = PoolProcess(str(tmp_path / f"{name}.sqlite"))
    try:
        feed(pool.client)
        run_dir = str(tmp_path / name)
        stdouts, counts = [], []
        for stage in exits:
            exit_at, more, procs = stage if isinstance(stage, tuple) else (stage, (), nproc)
            stop = ["--exit-interval", str(exit_at)] if exit_at else []
            args = train_cmd(model_dir, pool, run_dir, iters=iters, groups=groups, extra=[*extra, *more, *stop],
                             model=model)
            if lr is not None:
                args[args.index("--lr") + 1] = lr
            env = train_env() if procs == 1 else {**os.environ, "OMP_NUM_THREADS": "1"}
            out = run_script(TRAIN, args, nproc=procs, env={**env, **(env_extra or {})})
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
            stdouts.append(out.stdout)
            counts.append(len(read_steps(f"{run_dir}/metrics.jsonl")))
        return read_steps(f"{run_dir}/metrics.jsonl"), stdouts, counts
    finally:
        pool.stop()


def refused_start(model_dir: str, tmp_path, extra, model=None, nproc: int = 1) -> str:
    """A trainer start against a fresh pool that must fail before training: its output (``model``: as
    :func:`train_cmd`'s; ``nproc`` processes under torchrun)."""
    from tests.dist_utils import run_script

    from .pool_feed import PoolProcess

    pool = PoolProcess(str(tmp_path / "refuse.sqlite"))
    try:
        env = train_env() if nproc == 1 else {**os.environ, "OMP_NUM_THREADS": "1"}
        out = run_script(TRAIN, train_cmd(model_dir, pool, str(tmp_path / "refused"), iters=1, groups=1, extra=extra,
                                          model=model), nproc=nproc, env=env)
    finally:
        pool.stop()
    assert out.returncode != 0
    return out.stdout + out.stderr


def with_a_swapped_token(src: str, dst: str) -> str:
    """A copy of the HF checkpoint ``src`` in ``dst`` whose tokenizer gives two tokens each other's ids (a vocabulary
    that is not the policy's, by one pair). Returns ``dst``."""
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[20:22]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(os.path.join(dst, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    return dst


REPLAY_KEYS = ("loss", "grad_norm", "routing_mismatch", "routing_replayed_rows")
# layout name -> (its trainer flags, processes)
LAYOUTS = {"one": ([], 1), "tp2sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
           "cp2": (["--context-parallel-size", "2"], 2), "pp2": (["--pipeline-model-parallel-size", "2"], 2),
           "ep2": (["--expert-model-parallel-size", "2"], 2)}


def run_layouts(tmp_path, model_dir: str, feed, names, extra=(), iters: int = 2) -> dict:
    """{layout: its steps}: ``iters`` steps of the trainer on a fresh pool for each of ``names`` (keys of
    :data:`LAYOUTS`), every run with ``extra`` flags too; each must have run all its steps."""
    steps = {}
    for name in names:
        flags, nproc = LAYOUTS[name]
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=iters, groups=1, nproc=nproc,
                                              extra=flags + list(extra), model=[])
    assert [len(v) for v in steps.values()] == [iters] * len(steps), {k: len(v) for k, v in steps.items()}
    return steps


def assert_same_as_one_rank(steps: dict, runs, keys=("loss", "grad_norm"), data_parallel=("ep2",)) -> None:
    """Each run in ``runs`` trained the same steps as ``steps["one"]``: ``keys`` equal to fp32 reduction order (the
    loss, ~1e-2 here, sums O(1) terms that nearly cancel: summed in another order it moves ~1e-7, and after an Adam
    step on parameters that differ by round-off up to 7e-7, measured on an AVX2 machine; 1e-6 allowed). A run in
    ``data_parallel`` (EP = 2 runs as DP = 2: its loss and row counts are rank 0's share of the batch) is compared
    by the DP-reduced gradient norm only."""
    import pytest

    for other in runs:
        assert len(steps[other]) == len(steps["one"]), other
        for a, b in zip(steps["one"], steps[other]):
            for key in ("grad_norm",) if other in data_parallel else keys:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6 if key == "loss" else 1e-7), (other, key)


def random_groups(n_groups: int, seed: int, group_size: int = 4) -> list:
    """``n_groups`` groups of ``group_size`` episodes ``(prompt, completion, reward)``: a shared 10-token prompt,
    completions of 5..8 tokens (ids within the tiny vocabulary), rewards 0 / 1 / 0.5 alternating (nonzero group
    advantages)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_groups):
        prompt = rng.integers(10, 300, size=10).tolist()
        out.append([(prompt, rng.integers(10, 300, size=int(rng.integers(5, 9))).tolist(), (0.0, 1.0, 0.5)[e % 3])
                    for e in range(group_size)])
    return out


def episodes_feed(groups, logprobs=None, call_rewards=None):
    """A pool feed (:func:`run_on_fresh_pool`'s ``feed``) submitting ``groups`` (:func:`random_groups`' form) in
    order, one segment per episode: ``logprobs[g][e]`` episode e of group g's rollout logprobs of its completion
    (default -5 each); ``call_rewards[(g, e)]`` its segment's ``[position, reward]`` pairs."""
    import time

    from forge_megatron.middleware.schema import Episode, Segment

    def feed(client):
        for g, episodes in enumerate(groups):
            gid = client.register_group(f"task-{g}", len(episodes), "default")
            for e, (prompt, completion, reward) in enumerate(episodes):
                logp = logprobs[g][e] if logprobs is not None else [-5.0] * len(completion)
                seg = Segment(tokens=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                              rollout_logprobs=[0.0] * len(prompt) + list(logp),
                              policy_versions=[-1] * len(prompt) + [0] * len(completion),
                              call_rewards=(call_rewards or {}).get((g, e)))
                eid = f"{gid}-e{e}"
                client.episode_started(gid, eid)
                now = time.time()
                client.submit_episode(Episode(episode_id=eid, group_id=gid, task_id=f"task-{g}", segments=[seg],
                                              reward=reward, started_at=now - 1, ended_at=now))
    return feed

