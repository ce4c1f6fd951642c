"""Wire format of the pool transport: a versioned msgpack header frame followed by raw array frames.

    frames = [msgpack(header), array_0.data, array_1.data, ...]
    header = {"v": PROTOCOL_VERSION, "rid": request id, "op" | "ok": ..., "arrays": [[dtype, shape], ...], ...}

Arrays travel as their raw bytes (sent with ``copy=False``, received as ``np.frombuffer`` views of the frames),
so a batch is never pickled nor re-encoded element by element. Every message is checked on arrival: total size
against a limit, protocol version, header type, the dtype whitelist, and that each frame has exactly the bytes its
declared dtype and shape need. Failures raise :class:`WireError` whose message names the problem; the server
returns it to the sender and keeps serving.

Episodes and batches concatenate their per-token arrays (T = all tokens of all segments/samples) with per-item
lengths in the header, so a batch is five frames whatever its number of samples. Routed experts (rollout routing
replay), when any item has them, are one more int8 or int16 frame [T * layers * topk] with ``routing_shape`` =
[layers, topk] and ``routing_dtype`` in the header; items without them get ``-1`` rows (nothing recorded: the trainer
routes those tokens itself). Teacher logprobs (on-policy distillation from a served teacher), when any item has
them, are one more float32 frame [T] after the per-token ones, flagged by ``teacher_logprobs: true`` in the header;
items without them (scored before the gateway had a teacher) hold zeros, listed in ``teacher_missing``, and the
trainer trains them without the teacher's term. A served teacher's top-k (``--teacher-topk K``) adds two frames right
after it, int32 ids and float32 logprobs [R * K] of the R sampled tokens (loss_mask = 1) of the items that have one,
in order, flagged by ``teacher_topk: K`` (the others listed in ``teacher_topk_missing``; only with the teacher
logprobs). A batch's samples may carry ``return`` (the segment's reward-to-go, a learned critic's value target).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np

from forge_megatron.middleware.batch import TOKEN_FIELDS, TrainBatch, TrainSample, teacher_parts
from forge_megatron.middleware.schema import ROUTING_DTYPES, SCHEMA_VERSION, Episode, split_images

PROTOCOL_VERSION = 1
ALLOWED_DTYPES = ("int32", "uint8", "float32", "int64", "float64", "int16", "int8")
EPISODE_FIELDS = TOKEN_FIELDS[:4]  # an episode has no advantages yet


class WireError(ValueError):
    """A message that does not follow the wire format; the message says what is wrong."""


def pack(header: dict[str, Any], arrays: list[np.ndarray] = ()) -> list:
    """Frames of one message; array frames are zero-copy views of contiguous arrays."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    for a in arrays:
        if a.dtype.name not in ALLOWED_DTYPES:
            raise WireError(f"array dtype {a.dtype.name} is not allowed (allowed: {ALLOWED_DTYPES})")
    head = dict(header, v=PROTOCOL_VERSION, arrays=[[a.dtype.name, list(a.shape)] for a in arrays])
    return [msgpack.packb(head, use_bin_type=True)] + [memoryview(a).cast("B") if a.size else b"" for a in arrays]


def unpack(frames: list, max_bytes: int) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Header and arrays of one message after checking size, version and schema."""
    if not frames:
        raise WireError("empty message")
    total = sum(memoryview(f).nbytes for f in frames)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes")
    try:
        header = msgpack.unpackb(memoryview(frames[0]), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"header frame is not valid msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    if header.get("v") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {header.get('v')!r} is not supported (expected {PROTOCOL_VERSION})")
    specs = header.get("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise WireError(f"header declares {len(specs) if isinstance(specs, list) else '?'} arrays, "
                        f"message has {len(frames) - 1} array frames")
    return header, [_array(spec, frame, i) for i, (spec, frame) in enumerate(zip(specs, frames[1:]))]


def _array(spec: Any, frame: Any, i: int) -> np.ndarray:
    ok = isinstance(spec, list) and len(spec) == 2 and spec[0] in ALLOWED_DTYPES and isinstance(spec[1], list)
    ok = ok and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[1])
    if not ok:
        raise WireError(f"array {i}: spec must be [dtype in {ALLOWED_DTYPES}, [dims >= 0]], got {spec!r}")
    dtype = np.dtype(spec[0])
    buf = memoryview(frame)
    expected = math.prod(spec[1]) * dtype.itemsize
    if buf.nbytes != expected:
        raise WireError(f"array {i}: frame has {buf.nbytes} bytes, {spec[0]}{spec[1]} needs {expected}")
    return np.frombuffer(buf, dtype=dtype).reshape(spec[1])


def field(d: dict[str, Any], name: str, kind: type | tuple, where: str = "request") -> Any:
    """``d[name]`` checked to be of ``kind``; a WireError names the field otherwise."""
    if name not in d:
        raise WireError(f"{where} is missing field {name!r}")
    value = d[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, float, (int, float)):
        raise WireError(f"{where} field {name!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _split(arrays: list[np.ndarray], lengths: list[int], fields: tuple, where: str) -> list[list[np.ndarray]]:
    """Per-item views of concatenated per-token arrays; checks dtypes and total length."""
    if len(arrays) != len(fields):
        raise WireError(f"{where} needs {len(fields)} arrays ({[n for n, _ in fields]}), got {len(arrays)}")
    total = sum(lengths)
    for (name, dtype), a in zip(fields, arrays):
        if a.dtype != np.dtype(dtype) or a.shape != (total,):
            raise WireError(f"{where} array {name!r} must be {np.dtype(dtype).name}[{total}], "
                            f"got {a.dtype.name}{list(a.shape)}")
    bounds = np.cumsum([0] + list(lengths))
    return [[a[lo:hi] for a in arrays] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _lengths(meta: dict, key: str, where: str) -> list[int]:
    lengths = field(meta, key, list, where)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths):
        raise WireError(f"{where} field {key!r} must be a list of non-negative ints")
    return lengths


def _routing_frame(items: list[tuple[np.ndarray | None, int]], meta: dict, where: str) -> list[np.ndarray]:
    """[] when no item has routed experts; else one flat int8/int16 frame (the widest of the items') of every item's
    rows (``-1`` rows for items without), and ``meta["routing_shape"]`` / ``meta["routing_dtype"]`` set."""
    shapes = {tuple(r.shape[1:]) for r, _ in items if r is not None}
    if not shapes:
        return []
    if len(shapes) > 1:
        raise WireError(f"{where}: routed_experts of different shapes {sorted(shapes)} (one model per run)")
    shape = list(shapes.pop())
    dtype = np.result_type(*[r.dtype for r, _ in items if r is not None])
    if dtype not in ROUTING_DTYPES:
        raise WireError(f"{where}: routed_experts must be int8 or int16, got {dtype}")
    meta["routing_shape"], meta["routing_dtype"] = shape, dtype.name
    rows = [np.asarray(r, dtype=dtype) if r is not None else np.full((n, *shape), -1, dtype) for r, n in items]
    return [np.ascontiguousarray(np.concatenate(rows)).reshape(-1)]


def _take_routing(meta: dict, arrays: list[np.ndarray], total: int, where: str):
    """(per-token arrays, routed experts [total, layers, topk] or None): splits off the routing frame."""
    shape = meta.pop("routing_shape", None)
    dtype = meta.pop("routing_dtype", "int16")
    if shape is None:
        return arrays, None
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
        raise WireError(f"{where} field 'routing_shape' must be [layers, topk] (positive ints), got {shape!r}")
    if dtype not in ("int8", "int16"):
        raise WireError(f"{where} field 'routing_dtype' must be 'int8' or 'int16', got {dtype!r}")
    if not arrays or arrays[-1].dtype != np.dtype(dtype) or arrays[-1].size != total * shape[0] * shape[1]:
        raise WireError(f"{where} routed experts must be {dtype}[{total * shape[0] * shape[1]}] "
                        f"({total} tokens x {shape}) as the last array")
    return arrays[:-1], arrays[-1].reshape(total, *shape)


def _image_frame(owners: list[list], meta: dict, key: str) -> list[np.ndarray]:
    """[] when no owner (a sample or segment) has images; else one uint8 frame of every image's encoded bytes
    (owners in order, each owner's images in order) and ``meta[key]``: per owner the byte lengths of its images."""
    if not any(owners):
        return []
    for images in owners:
        for image in images:
            if not isinstance(image, (bytes, bytearray, memoryview)):
                raise WireError(f"{key}: images travel encoded (bytes), got {type(image).__name__}")
    meta[key] = [[len(x) for x in images] for images in owners]
    return [np.frombuffer(b"".join(bytes(x) for images in owners for x in images), dtype=np.uint8)]


def _take_images(meta: dict, arrays: list[np.ndarray], owners: int, key: str, where: str):
    """(the other arrays, per owner its list of encoded images (read-only memoryviews) or None): splits off the
    image frame."""
    table = meta.pop(key, None)
    if table is None:
        return arrays, [None] * owners
    ok = isinstance(table, list) and len(table) == owners and all(
        isinstance(r, list) and all(isinstance(n, int) and n > 0 for n in r) for r in table)
    if not ok:
        raise WireError(f"{where} field {key!r} must list, for each of the {owners}, the byte lengths of its images")
    total = sum(sum(r) for r in table)
    if not arrays or arrays[-1].dtype != np.uint8 or arrays[-1].size != total:
        raise WireError(f"{where} images need uint8[{total}] encoded bytes as the last array")
    return arrays[:-1], split_images(table, arrays[-1])


def _teacher_frame(items: list, lengths: list[int], meta: dict) -> list[np.ndarray]:
    """[] when no item has teacher logprobs; else one float32 frame of all of them and ``meta["teacher_logprobs"]``
    set. Items without them (episodes scored before a gateway had a teacher, e.g. across a restart with
    ``--teacher-urls`` added) hold zeros and are listed in ``meta["teacher_missing"]``: the trainer trains them
    without the teacher's term."""
    missing = [i for i, x in enumerate(items) if x is None]
    if len(missing) == len(items):
        return []
    meta["teacher_logprobs"] = True
    if missing:
        meta["teacher_missing"] = missing
    return [np.concatenate([np.zeros(n, np.float32) if x is None else np.asarray(x, dtype=np.float32)
                            for x, n in zip(items, lengths)])]


def _topk_frames(items: list, meta: dict, where: str) -> list[np.ndarray]:
    """[] when no item has a teacher top-k (``(ids [R_i, K], logprobs [R_i, K])`` or None per item); else the two
    flat frames of the items' rows and ``meta["teacher_topk"] = K``, the items without listed in
    ``meta["teacher_topk_missing"]``. Two values of K are refused (WireError)."""
    have = [x for x in items if x is not None]
    if not have:
        return []
    ks = {ids.shape[1] for ids, _ in have}
    if len(ks) != 1:
        raise WireError(f"{where}: items carry teacher top-k of different K {sorted(ks)}")
    meta["teacher_topk"] = ks.pop()
    missing = [i for i, x in enumerate(items) if x is None]
    if missing:
        meta["teacher_topk_missing"] = missing
    return [np.concatenate([np.asarray(x[i], dtype=dt).reshape(-1) for x in have])
            for i, dt in ((0, np.int32), (1, np.float32))]


def _take_topk(meta: dict, arrays: list[np.ndarray], where: str):
    """(the other arrays, (flat ids int32, flat logprobs float32, K) or None): splits off the top-k frames (the last
    two of the arrays left once images and routing are taken); their sizes are checked per item once the per-token
    arrays are split (``batch.teacher_parts``)."""
    k = meta.get("teacher_topk")
    if k is None:
        return arrays, None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not meta.get("teacher_logprobs"):
        raise WireError(f"{where} teacher_topk must be K >= 1, with teacher_logprobs, got {k!r}")
    if len(arrays) < 2 or arrays[-2].dtype != np.int32 or arrays[-1].dtype != np.float32:
        raise WireError(f"{where} teacher top-k must be an int32 frame of ids and a float32 frame of logprobs after "
                        "the teacher logprobs")
    return arrays[:-2], (arrays[-2].reshape(-1), arrays[-1].reshape(-1), k)


def _teacher_items(meta: dict, teacher_T, topk, parts: list, where: str) -> list:
    """Per item, (teacher logprobs or None, top-k or None) (``batch.teacher_parts``), the header's teacher keys
    consumed; WireError for frames of the wrong size."""
    try:
        out = teacher_parts(meta, teacher_T, topk, [int(p[0].shape[0]) for p in parts],
                            [int(np.count_nonzero(p[1])) for p in parts], where)
    except ValueError as exc:
        raise WireError(str(exc)) from None
    for key in ("teacher_topk", "teacher_missing", "teacher_topk_missing"):
        meta.pop(key, None)
    return out


def _take_teacher(meta: dict, arrays: list[np.ndarray], total: int, where: str):
    """(the other arrays, teacher logprobs float32 [total] or None): splits off the teacher frame (the last of the
    arrays left once images, routing and top-k are taken)."""
    if not meta.pop("teacher_logprobs", False):
        return arrays, None
    if not arrays or arrays[-1].dtype != np.float32 or arrays[-1].shape != (total,):
        raise WireError(f"{where} teacher logprobs must be float32[{total}] after the per-token arrays")
    return arrays[:-1], arrays[-1]


def episode_to_wire(episode: Episode) -> tuple[dict[str, Any], list[np.ndarray]]:
    meta = {f.name: getattr(episode, f.name) for f in dataclasses.fields(Episode) if f.name != "segments"}
    meta["schema_version"] = SCHEMA_VERSION
    meta["segment_lengths"] = [len(s.tokens) for s in episode.segments]
    meta["segment_rewards"] = [s.reward for s in episode.segments]
    if any(s.call_rewards for s in episode.segments):  # (optional: pools from before 2026-12-05 never send it)
        meta["segment_call_rewards"] = [[[int(p), float(r)] for p, r in s.call_rewards or []]
                                        for s in episode.segments]
    arrays = [np.concatenate([np.asarray(getattr(s, name), dtype=dtype) for s in episode.segments])
              if episode.segments else np.zeros(0, dtype) for name, dtype in EPISODE_FIELDS]
    arrays += _teacher_frame([s.teacher_logprobs for s in episode.segments], meta["segment_lengths"], meta)
    arrays += _topk_frames([None if s.teacher_topk_ids is None else (s.teacher_topk_ids, s.teacher_topk_logprobs)
                            for s in episode.segments], meta, "episode")
    arrays += _routing_frame([(s.routed_experts, len(s.tokens)) for s in episode.segments], meta, "episode")
    arrays += _image_frame([s.images or [] for s in episode.segments], meta, "segment_images")
    return meta, arrays


def episode_from_wire(meta: dict[str, Any], arrays: list[np.ndarray]) -> Episode:
    """Rebuild and validate an episode (raises SchemaError/WireError naming the bad field)."""
    if not isinstance(meta, dict):
        raise WireError("episode header must be a map")
    meta = dict(meta)
    lengths = _lengths(meta, "segment_lengths", "episode")
    rewards = field(meta, "segment_rewards", list, "episode")
    if len(rewards) != len(lengths):
        raise WireError(f"episode has {len(lengths)} segment_lengths but {len(rewards)} segment_rewards")
    del meta["segment_lengths"], meta["segment_rewards"]
    calls = meta.pop("segment_call_rewards", None)
    if calls is not None and not (isinstance(calls, list) and len(calls) == len(lengths)
                                  and all(isinstance(c, list) for c in calls)):
        raise WireError(f"episode segment_call_rewards must be a list per segment ({len(lengths)})")
    calls = calls if calls is not None else [None] * len(lengths)
    arrays, images = _take_images(meta, arrays, len(lengths), "segment_images", "episode")
    arrays, routed_T = _take_routing(meta, arrays, sum(lengths), "episode")
    arrays, topk = _take_topk(meta, arrays, "episode")
    arrays, teacher_T = _take_teacher(meta, arrays, sum(lengths), "episode")
    parts = _split(arrays, lengths, EPISODE_FIELDS, "episode")
    bounds = np.cumsum([0] + lengths)
    teachers = _teacher_items(meta, teacher_T, topk, parts, "episode")
    meta["segments"] = [
        {name: a.tolist() for (name, _), a in zip(EPISODE_FIELDS, part)}
        | {"reward": r, "routed_experts": None if routed_T is None else routed_T[lo:hi].copy(),
           "images": None if ims is None else [bytes(x) for x in ims],
           "teacher_logprobs": None if teacher is None else teacher.tolist(),
           "teacher_topk_ids": None if top is None else top[0].copy(),
           "teacher_topk_logprobs": None if top is None else top[1].copy(), "call_rewards": c or None}
        for part, r, lo, hi, ims, (teacher, top), c in zip(parts, rewards, bounds[:-1], bounds[1:], images, teachers,
                                                          calls)
    ]
    return Episode.from_dict(meta)


def episode_to_blob(episode: Episode) -> bytes:
    """One self-contained msgpack blob (for the pool's database)."""
    meta, arrays = episode_to_wire(episode)
    return msgpack.packb({"meta": meta, "arrays": [a.tobytes() for a in arrays]}, use_bin_type=True)


def blob_to_wire(blob: bytes) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Header and (read-only) arrays of a stored episode, without rebuilding the Episode."""
    d = msgpack.unpackb(blob, raw=False)
    routing = [np.dtype(d["meta"].get("routing_dtype", "int16"))] if d["meta"].get("routing_shape") else []
    images = [np.dtype(np.uint8)] if d["meta"].get("segment_images") else []
    teacher = [np.dtype(np.float32)] if d["meta"].get("teacher_logprobs") else []
    topk = [np.dtype(np.int32), np.dtype(np.float32)] if d["meta"].get("teacher_topk") else []
    dtypes = [dtype for _, dtype in EPISODE_FIELDS] + teacher + topk + routing + images
    return d["meta"], [np.frombuffer(b, dtype=dtype) for b, dtype in zip(d["arrays"], dtypes)]


def episode_from_blob(blob: bytes) -> Episode:
    return episode_from_wire(*blob_to_wire(blob))


_SAMPLE_KEYS = ("sample_weight", "group_index", "episode_id", "domain", "reward")


def batch_to_wire(batch: TrainBatch) -> tuple[dict[str, Any], list[np.ndarray]]:
    samples = [{"sample_weight": float(s.sample_weight), "group_index": int(s.group_index), "episode_id": s.episode_id,
                "domain": s.domain, "reward": float(s.reward), "length": int(s.tokens.shape[0]),
                **({} if s.segment_return is None else {"return": float(s.segment_return)}),
                **({"call_rewards": [[int(p), float(r)] for p, r in s.call_rewards]} if s.call_rewards else {})}
               for s in batch.samples]
    arrays = [np.concatenate([getattr(s, name) for s in batch.samples]) if batch.samples else np.zeros(0, dtype)
              for name, dtype in TOKEN_FIELDS]
    meta = {"batch_id": batch.batch_id, "group_indices": batch.group_indices, "metrics": batch.metrics,
            "samples": samples}
    arrays += _teacher_frame([s.teacher_logprobs for s in batch.samples], [s["length"] for s in samples], meta)
    arrays += _topk_frames([None if s.teacher_topk_ids is None else (s.teacher_topk_ids, s.teacher_topk_logprobs)
                            for s in batch.samples], meta, "batch")
    arrays += _routing_frame([(s.routed_experts, s.tokens.shape[0]) for s in batch.samples], meta, "batch")
    arrays += _image_frame([s.images or [] for s in batch.samples], meta, "images")
    return meta, arrays


def batch_from_wire(meta: dict[str, Any], arrays: list[np.ndarray]) -> TrainBatch:
    """Samples are views into the received frames (no copy)."""
    if not isinstance(meta, dict):
        raise WireError("batch header must be a map")
    samples_meta = field(meta, "samples", list, "batch")
    keys = set(_SAMPLE_KEYS) | {"length"}
    if not all(isinstance(s, dict) and keys <= s.keys() for s in samples_meta):
        raise WireError(f"batch samples must be maps with the keys {sorted(keys)}")
    returns = [s.get("return") for s in samples_meta]  # optional: the segment's return (a critic's value target)
    if not all(r is None or (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r))
               for r in returns):
        raise WireError("batch samples' return must be a finite number")
    lengths = _lengths({"lengths": [s["length"] for s in samples_meta]}, "lengths", "batch")
    calls = [s.get("call_rewards") for s in samples_meta]  # optional: rewards of single calls (a critic's GAE)
    if not all(c is None or (isinstance(c, list) and all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and 1 <= x[0] < n
            and isinstance(x[1], (int, float)) and not isinstance(x[1], bool) and math.isfinite(x[1]) for x in c))
               for c, n in zip(calls, lengths)):
        raise WireError("batch samples' call_rewards must be [position within the sample, finite reward] pairs")
    meta = dict(meta)
    arrays, images = _take_images(meta, arrays, len(samples_meta), "images", "batch")
    arrays, routed_T = _take_routing(meta, arrays, sum(lengths), "batch")
    arrays, topk = _take_topk(meta, arrays, "batch")
    arrays, teacher_T = _take_teacher(meta, arrays, sum(lengths), "batch")
    parts = _split(arrays, lengths, TOKEN_FIELDS, "batch")
    bounds = np.cumsum([0] + lengths)
    teachers = _teacher_items(meta, teacher_T, topk, parts, "batch")
    samples = [
        TrainSample(**{name: a for (name, _), a in zip(TOKEN_FIELDS, part)}, **{k: s[k] for k in _SAMPLE_KEYS},
                    routed_experts=None if routed_T is None else routed_T[lo:hi], images=ims,
                    teacher_logprobs=teacher, teacher_topk_ids=None if top is None else top[0],
                    teacher_topk_logprobs=None if top is None else top[1],
                    segment_return=None if g is None else float(g), call_rewards=c)
        for part, s, lo, hi, ims, (teacher, top), g, c in zip(parts, samples_meta, bounds[:-1], bounds[1:], images,
                                                               teachers, returns, calls)
    ]
    return TrainBatch(batch_id=field(meta, "batch_id", int, "batch"), samples=samples,
                      group_indices=field(meta, "group_indices", list, "batch"),
                      metrics=field(meta, "metrics", dict, "batch"))
