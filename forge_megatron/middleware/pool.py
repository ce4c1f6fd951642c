"""Data pool: durable store of groups and episodes that serves training batches through the windowed FIFO.

Everything lives in one SQLite database (WAL mode), so a pool restarted after ``kill -9`` resumes exactly where it
stopped (one pool per database file, enforced with a flock). A *group* is the G rollouts of one task, numbered
(``idx``) in registration order; it is the scheduling unit.

Group states:  running -> finished | failed -> delivered -> committed   (requeue: delivered -> finished)
               running | finished -> stale                                 (staleness guarantee, ``max_lag``)
               running -> filtered                          (no learning signal, ``drop_zero_advantage_groups``)
Episode states: running -> finished | failed | timed_out | aborted | late

Failure policy (a crashed agent never blocks the head):
  * a failed / timed_out / aborted episode uses one of the group's ``max_retries``; while retries remain its slot
    stays open for a new episode of the same group (``group_status()['open_slots']`` tells the launcher), otherwise
    the slot closes empty;
  * an episode started more than ``episode_timeout_s`` ago and not submitted is marked timed_out; slots of a group
    idle for ``episode_timeout_s`` with no running episode close as timed out;
  * when every slot is closed the group completes: with >= ``min_finished_episodes`` finished episodes it is
    scored (only its finished episodes) and becomes deliverable, otherwise it fails and leaves the window.

An episode that leaves ``domain`` at "default" takes its group's domain.
Rewards and advantages come from the algorithm layer (``batch.score_episodes``) when a group completes.
Delivery is at-least-once until the trainer commits: ``commit`` marks batches contained in a checkpoint,
``requeue_uncommitted`` returns every delivered-not-committed group after a trainer restart from its last checkpoint.
A ``request_id`` passed to ``next_batch``/``register_group`` makes a resent request return the original result.

Staleness guarantee (``max_lag``): each group records ``admitted_version``, the policy version when it was
registered. When the policy version is set (and before each selection), every group never delivered whose
``scheduler.exceeds_lag(admitted_version, version, max_lag)`` holds, i.e. version - admitted_version > max_lag,
becomes ``stale``: it leaves the window like a failed group, so no delivered group trained at version v started
before v - max_lag, whatever the window. Episodes of a stale group that arrive later are acknowledged "late". The
finished episodes a stale group received (before or after the drop) and their sampled tokens are counted as
wasted in ``metrics()``. A group delivered once (even if requeued after a trainer restart) is never dropped.

Dynamic sampling (``drop_zero_advantage_groups``, DAPO's filter): a group whose every advantage is zero (within
``ZERO_ADVANTAGE_TOL``; e.g. all G episodes solved the task, or all failed, with equal composite rewards) gives the
policy-gradient loss nothing but still costs a trainer step its share of compute and, under a token-mean loss,
dilutes the other groups' gradient. With the option on, such a group becomes ``filtered`` when it completes: it
leaves the window and the undelivered count like a failed group, so admission starts another task in its place and
every delivered batch holds ``num_groups`` groups that carry signal. ``metrics()`` counts them, split into
``filtered_solved`` (every episode succeeded: the task is too easy) and ``filtered_unsolved`` (none did: too hard),
with the episodes and sampled tokens spent on them. KL and entropy terms of the loss do see such groups; the filter
is about the policy gradient only, so it is off by default.

Backpressure (``can_admit``): ``scheduler.admit`` with running groups < ``max_inflight_groups`` and, with
``max_staleness`` = s, undelivered + 1 <= (s + 1) * train_batch_groups.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterable

import msgpack

from forge_megatron.middleware.batch import TrainBatch, group_samples, group_staleness, score_episodes
from forge_megatron.middleware.scheduler import (
    PendingGroup, admit, exceeds_lag, select_groups, window_occupancy, window_size,
)
from forge_megatron.middleware.schema import Episode, EpisodeSink, SchemaError
from forge_megatron.middleware.wire import (
    EPISODE_FIELDS, blob_to_wire, episode_from_blob, episode_to_blob, episode_to_wire,
)

log = logging.getLogger(__name__)

FAILED_EPISODE_STATUSES = ("failed", "timed_out", "aborted")
ZERO_ADVANTAGE_TOL = 1e-6
"""|advantage| at or below this counts as zero for ``drop_zero_advantage_groups`` (advantages of a tied group are
round-off away from zero: a group mean of equal floats need not equal them exactly)."""
_LOSS_MASK = [name for name, _ in EPISODE_FIELDS].index("loss_mask")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    idx INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL, size INTEGER NOT NULL, domain TEXT NOT NULL, metadata BLOB NOT NULL,
    state TEXT NOT NULL, request_id TEXT UNIQUE,
    registered_at REAL NOT NULL, last_activity REAL NOT NULL, admitted_version INTEGER NOT NULL,
    finished INTEGER NOT NULL DEFAULT 0, closed_empty INTEGER NOT NULL DEFAULT 0,
    retries_used INTEGER NOT NULL DEFAULT 0,
    scores BLOB, batch_id INTEGER, staleness INTEGER
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, idx);
CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT PRIMARY KEY, group_idx INTEGER NOT NULL, state TEXT NOT NULL,
    started_at REAL NOT NULL, submitted_seq INTEGER, blob BLOB
);
CREATE INDEX IF NOT EXISTS episodes_group ON episodes(group_idx, state);
CREATE TABLE IF NOT EXISTS batches (
    batch_id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT UNIQUE, state TEXT NOT NULL,
    group_indices BLOB NOT NULL, metrics BLOB NOT NULL, created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass
class PoolConfig:
    """Data pool settings; checked on construction."""

    db_path: str = "pool.sqlite"  # SQLite file (":memory:" for a throwaway pool)
    window_fraction: float = 0.3  # W = ceil(window_fraction * generation_batch_groups) when window is None or 0
    window: float | int | str | None = None  # explicit W (int >= 1, inf / "inf" = greedy); None or 0: use fraction
    generation_batch_groups: int = 16  # N: groups the rollout side generates per policy version
    max_inflight_groups: int | None = None  # can_admit() is False while this many groups are running
    # Admission bound s: can_admit() is False once undelivered + 1 > (s + 1) * train_batch_groups. Delivered in order
    # (strict FIFO) a group then trains at most s + 1 versions late; a window W adds ceil((W - 1) / B) versions;
    # greedy (W = inf) has no bound (see docs/middleware.md).
    max_staleness: int | None = None
    train_batch_groups: int | None = None  # groups per trainer step for the staleness estimate (default N)
    # Staleness guarantee L: an undelivered group started at policy version v0 is dropped (state "stale") once the
    # version passes v0 + L, so every delivered group trains at most L versions after it started. None: never drop.
    max_lag: int | None = None
    max_retries: int = 0  # failed episodes per group that reopen their slot for a new episode
    episode_timeout_s: float | None = None  # running episodes (and idle groups) older than this time out
    min_finished_episodes: int = 1  # a completed group with fewer finished episodes fails
    reward: Any = None  # forge_megatron.algo.rewards.RewardConfig; None -> RewardConfig()
    # Keep every episode's tokens (and routed experts) after its group is committed or dropped, for offline analysis.
    # False: they are deleted then (trained and checkpointed, or never to be trained), so the database stops growing
    # with the run; group states, scores and batch metrics stay.
    keep_trajectories: bool = False
    # Dynamic sampling: completed groups whose advantages are all zero (no policy-gradient signal) are not delivered
    # (state "filtered"); admission replaces them. See the module docstring.
    drop_zero_advantage_groups: bool = False

    def __post_init__(self) -> None:
        if not self.db_path:
            raise ValueError("db_path is empty")
        self.window_groups = window_size(self.window, self.window_fraction, self.generation_batch_groups)
        _positive_or_none("max_inflight_groups", self.max_inflight_groups)
        _positive_or_none("train_batch_groups", self.train_batch_groups)
        _positive_or_none("episode_timeout_s", self.episode_timeout_s)
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.max_lag is not None and (isinstance(self.max_lag, bool) or not isinstance(self.max_lag, int)
                                         or self.max_lag < 0):
            raise ValueError(f"max_lag must be an int >= 0 or None, got {self.max_lag!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.min_finished_episodes < 1:
            raise ValueError(f"min_finished_episodes must be >= 1, got {self.min_finished_episodes}")

    def reward_config(self):
        if self.reward is not None:
            return self.reward
        from forge_megatron.algo.rewards import RewardConfig

        return RewardConfig()


def _positive_or_none(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0 or None, got {value}")


def group_id_of(idx: int) -> str:
    return f"g{idx:09d}"


def _group_idx(group_id: str) -> int:
    if not (isinstance(group_id, str) and group_id.startswith("g") and group_id[1:].isdigit()):
        raise SchemaError(f"group_id {group_id!r} is not a pool group id (expected 'g' + digits)")
    return int(group_id[1:])


def _sampled_tokens(arrays: list) -> int:
    """Policy-sampled tokens (loss_mask = 1) of an episode in wire form."""
    return int(arrays[_LOSS_MASK].sum())


def _no_signal(scores: dict) -> bool:
    """True when every segment advantage of a scored group is zero (``ZERO_ADVANTAGE_TOL``)."""
    return all(abs(a) <= ZERO_ADVANTAGE_TOL for row in scores["segment_advantages"] for a in row)


def _lock_database(db_path: str):
    """One pool per database: an exclusive flock on ``<db>.lock``, released by close() or by the process dying."""
    if db_path == ":memory:":
        return None
    handle = open(f"{db_path}.lock", "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RuntimeError(f"another data pool is using {db_path} (lock {db_path}.lock is held)") from None
    return handle


class DataPool(EpisodeSink):
    """Thread-safe; one SQLite connection guarded by a lock, waiters woken when groups become deliverable."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._reward_config = config.reward_config()  # resolved now: a bad reward_fn fails at startup
        self._lock_file = _lock_database(config.db_path)
        self._db = sqlite3.connect(config.db_path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives process crashes (kill -9)
        self._db.executescript(_SCHEMA)
        self._cond = threading.Condition(threading.RLock())
        self._wait_total_s = 0.0
        self._last_wait_s = 0.0
        self._last_sweep = -math.inf

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _tx(self):
        with self._cond:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, args: Iterable = ()) -> Any:
        row = self._db.execute(sql, tuple(args)).fetchone()
        return None if row is None else row[0]

    def _kv(self, key: str, default: int = 0) -> int:
        value = self._one("SELECT value FROM kv WHERE key = ?", (key,))
        return default if value is None else int(value)

    def _kv_add(self, key: str, amount: int) -> None:
        self._db.execute("INSERT INTO kv VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = value + excluded.value",
                         (key, amount))

    @property
    def policy_version(self) -> int:
        with self._cond:
            return self._kv("policy_version")

    # ------------------------------------------------------------------ EpisodeSink
    def register_group(self, task_id: str, size: int, domain: str = "default", metadata: dict | None = None,
                       request_id: str | None = None) -> str:
        """Add a group of ``size`` episodes; returns its id. Always accepted: callers check ``can_admit`` first."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise SchemaError(f"group size must be an int >= 1, got {size!r}")
        if not isinstance(task_id, str) or not task_id:
            raise SchemaError("task_id must be a non-empty string")
        now = time.time()
        with self._tx() as db:
            if request_id is not None:
                idx = self._one("SELECT idx FROM groups WHERE request_id = ?", (request_id,))
                if idx is not None:
                    return group_id_of(idx)
            cur = db.execute(
                "INSERT INTO groups (task_id, size, domain, metadata, state, request_id, registered_at, last_activity,"
                " admitted_version) VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?)",
                (task_id, size, domain, msgpack.packb(metadata or {}), request_id, now, now,
                 self._kv("policy_version")),
            )
            return group_id_of(cur.lastrowid)

    def episode_started(self, group_id: str, episode_id: str) -> None:
        with self._tx() as db:
            idx = self._running_group(group_id)
            now = time.time()
            db.execute("INSERT OR IGNORE INTO episodes (episode_id, group_idx, state, started_at)"
                       " VALUES (?, ?, 'running', ?)", (episode_id, idx, now))
            db.execute("UPDATE groups SET last_activity = ? WHERE idx = ?", (now, idx))

    def submit_episode(self, episode: Episode) -> str:
        """Record a finished or failed episode. Returns 'accepted', 'duplicate' (same id already closed) or 'late'
        (it timed out, its group completed while it ran, or its group is stale; dropped). Raises SchemaError for an
        invalid episode, an unknown group, or an episode never started that finds no open slot."""
        episode.validate()
        with self._tx() as db:
            idx = _group_idx(episode.group_id)
            state, size, finished, closed = self._group_counts(idx, episode.group_id)
            prior = db.execute("SELECT state, group_idx FROM episodes WHERE episode_id = ?",
                               (episode.episode_id,)).fetchone()
            if prior is not None and prior[1] != idx:
                raise SchemaError(f"episode {episode.episode_id} was started in group {group_id_of(prior[1])}, "
                                  f"not {episode.group_id}")
            if state == "stale" and (prior is None or prior[0] == "running"):
                self._record_late(episode, idx)
                return "late"
            if prior is not None and (prior[0] in ("timed_out", "late")
                                      or prior[0] == "running" and state != "running"):
                return "late"
            if prior is not None and prior[0] != "running":
                return "duplicate"
            if state != "running" or finished + closed >= size:
                raise SchemaError(f"group {episode.group_id} has no open slot for episode {episode.episode_id}")
            if episode.domain == "default":
                group_domain = self._one("SELECT domain FROM groups WHERE idx = ?", (idx,))
                episode = replace(episode, domain=group_domain)
            blob = episode_to_blob(episode) if episode.status == "finished" else None
            seq = self._kv("episode_seq") + 1
            db.execute("INSERT OR REPLACE INTO kv VALUES ('episode_seq', ?)", (seq,))
            db.execute("INSERT OR REPLACE INTO episodes (episode_id, group_idx, state, started_at, submitted_seq, blob)"
                       " VALUES (?, ?, ?, COALESCE((SELECT started_at FROM episodes WHERE episode_id = ?), ?), ?, ?)",
                       (episode.episode_id, idx, episode.status, episode.episode_id, episode.started_at, seq, blob))
            self._close_slot(idx, episode.status)
        return "accepted"

    def _record_late(self, episode: Episode, idx: int) -> None:
        """An episode of a stale group: remembered as 'late' (a resend stays late), its rollout counted as wasted."""
        self._db.execute("INSERT OR REPLACE INTO episodes (episode_id, group_idx, state, started_at)"
                         " VALUES (?, ?, 'late', ?)", (episode.episode_id, idx, episode.started_at))
        if episode.status == "finished":
            self._count_wasted(_sampled_tokens(episode_to_wire(episode)[1]))

    def _count_wasted(self, tokens: int) -> None:
        self._kv_add("stale_episodes", 1)
        self._kv_add("stale_tokens", tokens)

    def _running_group(self, group_id: str) -> int:
        idx = _group_idx(group_id)
        state = self._one("SELECT state FROM groups WHERE idx = ?", (idx,))
        if state is None:
            raise SchemaError(f"unknown group_id {group_id!r}")
        if state != "running":
            raise SchemaError(f"group {group_id} is already complete ({state})")
        return idx

    def _group_counts(self, idx: int, group_id: str) -> tuple[str, int, int, int]:
        row = self._db.execute("SELECT state, size, finished, closed_empty FROM groups WHERE idx = ?",
                               (idx,)).fetchone()
        if row is None:
            raise SchemaError(f"unknown group_id {group_id!r}")
        return row

    def _close_slot(self, idx: int, status: str) -> None:
        """Account one submitted episode of group ``idx``; completes the group when no slot is open."""
        db = self._db
        if status == "finished":
            db.execute("UPDATE groups SET finished = finished + 1 WHERE idx = ?", (idx,))
        elif self._one("SELECT retries_used FROM groups WHERE idx = ?", (idx,)) < self.config.max_retries:
            db.execute("UPDATE groups SET retries_used = retries_used + 1 WHERE idx = ?", (idx,))
        else:
            db.execute("UPDATE groups SET closed_empty = closed_empty + 1 WHERE idx = ?", (idx,))
        db.execute("UPDATE groups SET last_activity = ? WHERE idx = ?", (time.time(), idx))
        self._maybe_complete(idx)

    def _maybe_complete(self, idx: int) -> None:
        size, finished, closed = self._db.execute(
            "SELECT size, finished, closed_empty FROM groups WHERE idx = ?", (idx,)).fetchone()
        if finished + closed < size:
            return
        if finished < self.config.min_finished_episodes:
            self._db.execute("UPDATE groups SET state = 'failed' WHERE idx = ?", (idx,))
            if not self.config.keep_trajectories:  # never to be trained
                self._db.execute("UPDATE episodes SET blob = NULL WHERE group_idx = ?", (idx,))
            log.warning("group %s failed: %d of %d episodes finished", group_id_of(idx), finished, size)
        else:
            blobs = self._finished_blobs(idx)
            task_metadata = msgpack.unpackb(self._one("SELECT metadata FROM groups WHERE idx = ?", (idx,)))
            scores = score_episodes([episode_from_blob(b) for _, b in blobs], self._reward_config, task_metadata)
            scores["episode_ids"] = [eid for eid, _ in blobs]
            state = "finished"
            if self.config.drop_zero_advantage_groups and _no_signal(scores):
                state = "filtered"
                self._count_filtered(scores, blobs)
            self._db.execute("UPDATE groups SET state = ?, scores = ? WHERE idx = ?",
                             (state, msgpack.packb(scores), idx))
            if state == "filtered" and not self.config.keep_trajectories:
                self._db.execute("UPDATE episodes SET blob = NULL WHERE group_idx = ?", (idx,))
        self._cond.notify_all()

    def _count_filtered(self, scores: dict, blobs: list[tuple[str, bytes]]) -> None:
        """Metrics of a filtered group: its episodes and sampled tokens, and whether it was solved by all or none."""
        successes = scores["successes"]
        self._kv_add("filtered_episodes", len(blobs))
        self._kv_add("filtered_tokens", sum(_sampled_tokens(blob_to_wire(b)[1]) for _, b in blobs))
        if all(successes):
            self._kv_add("filtered_solved", 1)
        elif not any(successes):
            self._kv_add("filtered_unsolved", 1)

    def _finished_blobs(self, idx: int) -> list[tuple[str, bytes]]:
        return self._db.execute("SELECT episode_id, blob FROM episodes WHERE group_idx = ? AND state = 'finished'"
                                " ORDER BY submitted_seq", (idx,)).fetchall()

    # ------------------------------------------------------------------ timeouts
    def _sweep_interval(self) -> float | None:
        timeout = self.config.episode_timeout_s
        return None if timeout is None else min(1.0, timeout / 4)

    def _maybe_sweep(self) -> None:
        """Sweep timeouts at most every ``_sweep_interval`` seconds (waiters poll often)."""
        interval = self._sweep_interval()
        if interval is not None and time.monotonic() - self._last_sweep >= interval:
            self._last_sweep = time.monotonic()
            self.sweep_timeouts()

    def sweep_timeouts(self, now: float | None = None) -> int:
        """Time out stale running episodes and idle groups' unstarted slots; returns how many were closed."""
        timeout = self.config.episode_timeout_s
        if timeout is None:
            return 0
        now = time.time() if now is None else now
        closed = 0
        with self._tx() as db:
            stale = db.execute("SELECT e.episode_id, e.group_idx FROM episodes e JOIN groups g ON g.idx = e.group_idx"
                               " WHERE e.state = 'running' AND g.state = 'running' AND e.started_at < ?",
                               (now - timeout,)).fetchall()
            for episode_id, idx in stale:
                db.execute("UPDATE episodes SET state = 'timed_out' WHERE episode_id = ?", (episode_id,))
                self._close_slot(idx, "timed_out")
                closed += 1
            idle = db.execute("SELECT idx, size - finished - closed_empty FROM groups WHERE state = 'running'"
                              " AND last_activity < ?", (now - timeout,)).fetchall()
            for idx, open_slots in idle:
                running = self._one("SELECT COUNT(*) FROM episodes WHERE group_idx = ? AND state = 'running'", (idx,))
                if running == 0 and open_slots > 0:
                    db.execute("UPDATE groups SET closed_empty = closed_empty + ? WHERE idx = ?", (open_slots, idx))
                    self._maybe_complete(idx)
                    closed += open_slots
        return closed

    # ------------------------------------------------------------------ scheduling
    def _drop_stale(self) -> None:
        """Staleness guarantee: never-delivered groups that can no longer train within ``max_lag`` become stale."""
        max_lag = self.config.max_lag
        if max_lag is None:
            return
        with self._cond:
            version = self._kv("policy_version")
            rows = self._db.execute("SELECT idx, admitted_version FROM groups"
                                    " WHERE state IN ('running', 'finished') AND batch_id IS NULL").fetchall()
            stale = [idx for idx, start in rows if exceeds_lag(start, version, max_lag)]
            if not stale:
                return
            with self._tx() as db:
                for idx in stale:
                    db.execute("UPDATE groups SET state = 'stale' WHERE idx = ?", (idx,))
                    for _, blob in self._finished_blobs(idx):
                        self._count_wasted(_sampled_tokens(blob_to_wire(blob)[1]))
                    if not self.config.keep_trajectories:
                        db.execute("UPDATE episodes SET blob = NULL WHERE group_idx = ?", (idx,))
            log.warning("dropped %d stale groups (started more than %d versions before %d): %s", len(stale), max_lag,
                        version, ", ".join(map(group_id_of, stale)))
            self._cond.notify_all()

    def _pending(self) -> list[PendingGroup]:
        rows = self._db.execute("SELECT idx, state FROM groups WHERE state IN ('running', 'finished') ORDER BY idx")
        return [PendingGroup(idx, state == "finished") for idx, state in rows]

    def can_admit(self) -> bool:
        """Backpressure: False while too many groups run or a new group would be trained too stale."""
        self._maybe_sweep()
        cfg = self.config
        with self._cond:
            counts = dict(self._db.execute("SELECT state, COUNT(*) FROM groups WHERE state IN ('running', 'finished')"
                                           " GROUP BY state").fetchall())
        running = counts.get("running", 0)
        return admit(running, running + counts.get("finished", 0), cfg.max_inflight_groups, cfg.max_staleness,
                     cfg.train_batch_groups or cfg.generation_batch_groups)

    def set_policy_version(self, version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"policy version must be an int >= 0, got {version!r}")
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO kv VALUES ('policy_version', ?)", (version,))
        self._drop_stale()

    def next_batch(self, num_groups: int, timeout_s: float | None = None, request_id: str | None = None,
                   waited_s: float = 0.0) -> TrainBatch | None:
        """Take ``num_groups`` finished groups allowed by the window, waiting up to ``timeout_s`` (None = forever).

        Returns None on timeout. A ``request_id`` seen before returns the batch delivered for it. ``waited_s`` is
        time the trainer already waited elsewhere (a server polling on its behalf); it counts in the wait metrics,
        which cover delivered batches.
        """
        if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
        start = time.monotonic()
        deadline = math.inf if timeout_s is None else start + max(0.0, timeout_s)
        with self._cond:
            if request_id is not None:
                batch_id = self._one("SELECT batch_id FROM batches WHERE request_id = ?", (request_id,))
                if batch_id is not None:
                    return self.load_batch(batch_id)
            while True:
                self._maybe_sweep()
                self._drop_stale()
                pending = self._pending()
                chosen = select_groups(pending, self.config.window_groups, num_groups)
                if len(chosen) == num_groups:
                    waited = time.monotonic() - start + waited_s
                    self._wait_total_s += waited
                    self._last_wait_s = waited
                    return self._deliver(chosen, pending[0].index, request_id, waited)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(timeout=min(remaining, self._sweep_interval() or remaining, 3600.0))

    def _deliver(self, indices: list[int], head: int, request_id: str | None, waited_s: float) -> TrainBatch:
        version = self._kv("policy_version")
        groups = [self._group_samples(idx) for idx in indices]
        staleness = [group_staleness(samples, version) for samples in groups]
        metrics = {"policy_version": version, "head": head, "window": self.config.window_groups,
                   "wait_s": waited_s, "staleness_mean": sum(staleness) / len(staleness),
                   "staleness_max": max(staleness), "group_staleness": staleness,
                   "domain_samples": dict(Counter(s.domain for g in groups for s in g)),
                   "filtered_groups_total": self._one("SELECT COUNT(*) FROM groups WHERE state = 'filtered'")}
        with self._tx() as db:
            cur = db.execute("INSERT INTO batches (request_id, state, group_indices, metrics, created_at)"
                             " VALUES (?, 'delivered', ?, ?, ?)",
                             (request_id, msgpack.packb(indices), msgpack.packb(metrics), time.time()))
            for idx, lag in zip(indices, staleness):
                db.execute("UPDATE groups SET state = 'delivered', batch_id = ?, staleness = ? WHERE idx = ?",
                           (cur.lastrowid, lag, idx))
        return TrainBatch(batch_id=cur.lastrowid, samples=[s for g in groups for s in g], group_indices=indices,
                          metrics=metrics)

    def _group_samples(self, idx: int):
        scores = msgpack.unpackb(self._one("SELECT scores FROM groups WHERE idx = ?", (idx,)))
        blobs = dict(self._finished_blobs(idx))
        return group_samples([blob_to_wire(blobs[eid]) for eid in scores["episode_ids"]], scores, idx)

    def load_batch(self, batch_id: int) -> TrainBatch:
        """Rebuild a batch delivered before (same groups, samples and metrics)."""
        with self._cond:
            row = self._db.execute("SELECT group_indices, metrics FROM batches WHERE batch_id = ?",
                                   (batch_id,)).fetchone()
            if row is None:
                raise ValueError(f"unknown batch_id {batch_id}")
            indices = msgpack.unpackb(row[0])
            state = self._one("SELECT state FROM batches WHERE batch_id = ?", (batch_id,))
            if state == "committed" and not self.config.keep_trajectories:
                raise ValueError(f"batch {batch_id} is committed and its trajectories were deleted "
                                 "(PoolConfig.keep_trajectories / --keep-trajectories keeps them)")
            samples = [s for idx in indices for s in self._group_samples(idx)]
        return TrainBatch(batch_id=batch_id, samples=samples, group_indices=indices,
                          metrics=msgpack.unpackb(row[1], strict_map_key=False))

    # ------------------------------------------------------------------ delivery guarantees
    def commit(self, batch_ids: int | list[int] | None = None, *, up_to_batch_id: int | None = None) -> int:
        """The trainer saved a checkpoint containing these batches; returns how many groups became committed."""
        if (batch_ids is None) == (up_to_batch_id is None):
            raise ValueError("commit needs exactly one of batch_ids or up_to_batch_id")
        with self._tx() as db:
            if up_to_batch_id is not None:
                ids = [r[0] for r in db.execute("SELECT batch_id FROM batches"
                                                " WHERE state = 'delivered' AND batch_id <= ?", (up_to_batch_id,))]
            else:
                ids = [batch_ids] if isinstance(batch_ids, int) else list(batch_ids)
                self._check_committable(ids)
            committed = 0
            for batch_id in ids:
                db.execute("UPDATE batches SET state = 'committed' WHERE batch_id = ?", (batch_id,))
                committed += db.execute("UPDATE groups SET state = 'committed'"
                                        " WHERE batch_id = ? AND state = 'delivered'", (batch_id,)).rowcount
                if not self.config.keep_trajectories:
                    db.execute("UPDATE episodes SET blob = NULL WHERE group_idx IN"
                               " (SELECT idx FROM groups WHERE batch_id = ? AND state = 'committed')", (batch_id,))
        return committed

    def _check_committable(self, ids: list[int]) -> None:
        for batch_id in ids:
            state = self._one("SELECT state FROM batches WHERE batch_id = ?", (batch_id,))
            if state is None:
                raise ValueError(f"unknown batch_id {batch_id}")
            if state == "requeued":
                raise ValueError(f"batch {batch_id} was requeued after a trainer restart and cannot be committed")

    def requeue_uncommitted(self) -> list[int]:
        """Trainer restarted from its last checkpoint: delivered-not-committed groups become deliverable again.

        They keep their ``batch_id`` (the batch that delivered them first), which exempts them from ``max_lag``."""
        with self._tx() as db:
            indices = [r[0] for r in db.execute("SELECT idx FROM groups WHERE state = 'delivered' ORDER BY idx")]
            db.execute("UPDATE groups SET state = 'finished', staleness = NULL WHERE state = 'delivered'")
            # Forget their request ids: a late resend must not get a batch the trainer no longer owns.
            db.execute("UPDATE batches SET state = 'requeued', request_id = NULL WHERE state = 'delivered'")
            self._cond.notify_all()
        return indices

    # ------------------------------------------------------------------ introspection
    def group_status(self, group_id: str) -> dict[str, Any]:
        """State of one group; ``open_slots`` = episodes the launcher should still start for it."""
        with self._cond:
            idx = _group_idx(group_id)
            state, size, finished, closed = self._group_counts(idx, group_id)
            running = self._one("SELECT COUNT(*) FROM episodes WHERE group_idx = ? AND state = 'running'", (idx,))
            open_slots = size - finished - closed - running if state == "running" else 0
            return {"group_id": group_id, "index": idx, "state": state, "size": size, "finished": finished,
                    "closed_empty": closed, "running": running, "open_slots": max(0, open_slots),
                    "start_version": self._one("SELECT admitted_version FROM groups WHERE idx = ?", (idx,))}

    def metrics(self) -> dict[str, Any]:
        with self._cond:
            counts = dict(self._db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
            pending = self._pending()
            ready_in_window, pending_in_window = window_occupancy(pending, self.config.window_groups)
            lag = self._db.execute("SELECT AVG(staleness), MAX(staleness) FROM groups"
                                   " WHERE state IN ('delivered', 'committed')").fetchone()
            window = self.config.window_groups
            return {
                "groups": {s: counts.get(s, 0) for s in ("running", "finished", "failed", "delivered", "committed")},
                "queue_depth": counts.get("finished", 0),
                "head": pending[0].index if pending else None,
                "window": window,
                "window_ready": ready_in_window,
                "window_pending": pending_in_window,
                "window_occupancy": ready_in_window / min(window, max(1, len(pending))),
                "policy_version": self._kv("policy_version"),
                "max_lag": self.config.max_lag,
                "stale_groups": counts.get("stale", 0),
                "stale_episodes": self._kv("stale_episodes"),
                "stale_tokens": self._kv("stale_tokens"),
                "filtered_groups": counts.get("filtered", 0),
                "filtered_solved": self._kv("filtered_solved"),
                "filtered_unsolved": self._kv("filtered_unsolved"),
                "filtered_episodes": self._kv("filtered_episodes"),
                "filtered_tokens": self._kv("filtered_tokens"),
                "staleness_mean": float(lag[0] or 0.0),
                "staleness_max": int(lag[1] or 0),
                "trainer_wait_total_s": self._wait_total_s,
                "trainer_wait_last_s": self._last_wait_s,
                "config": self.config_summary(),
            }

    def config_summary(self) -> dict[str, Any]:
        """The settings a trainer must agree with (it checks them at start-up: training.arguments)."""
        r = self._reward_config
        return {
            "window": self.config.window_groups, "window_fraction": self.config.window_fraction,
            "generation_batch_groups": self.config.generation_batch_groups,
            "advantage_estimator": r.estimator, "process_weights": dict(r.process_weights),
            "completion_time_bound": r.completion_time_bound,
            "overlong_max_tokens": r.overlong_max_tokens, "overlong_buffer_tokens": r.overlong_buffer_tokens,
            "overlong_penalty": r.overlong_penalty,
            "drop_zero_advantage_groups": self.config.drop_zero_advantage_groups,
        }

    def close(self) -> None:
        with self._cond:
            self._db.close()
            if self._lock_file is not None:
                self._lock_file.close()  # releases the flock
                self._lock_file = None
