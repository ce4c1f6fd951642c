"""Fixed-size buckets of named tensors, and the small JSON messages between pipeline-stage leads and rank 0.

A bucket is a list of ``(name, tensor)`` whose bytes add up to at most ``bucket_bytes`` (a tensor larger than that
gets a bucket of its own). Each bucket costs one engine request, so buckets trade request overhead against
memory held in flight.

Every pipeline stage's lead sends its own buckets to the engines; only their descriptions (names, dtypes, shapes)
and short control messages travel to global rank 0, which drives the engines' HTTP protocol. Those go as JSON over
point-to-point ``send``/``recv`` of the default group (never pickle).

Legend: B = bytes of a packed bucket.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64", torch.float8_e4m3fn: "float8_e4m3fn", torch.int32: "int32"}  # int32: int4
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Tensors an engine must receive in one request. SGLang's DeepSeek-V2/V3 loader (models with a query latent:
# DeepSeek-V3, Kimi-K2) fuses each layer's q_a_proj and kv_a_proj_with_mqa into one projection as both arrive within one
# load_weights call, i.e. one update request; a request holding one of them without the other loses it. Its DeepSeek
# sparse attention indexer (DeepSeek-V3.2, GLM-5) fuses wk and weights_proj the same way in its FP4 releases.
LOADED_TOGETHER = (("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa."),
                   ("self_attn.indexer.wk.", "self_attn.indexer.weights_proj."))


def together(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the layer prefix, the group) when ``name`` belongs to a :data:`LOADED_TOGETHER` group, else None."""
    for group in LOADED_TOGETHER:
        for member in group:
            if member in name:
                return name.split(member)[0], group
    return None


def missing_partners(names) -> list[str]:
    """For a request's tensor names: the group members (``<prefix><member>weight``) that must come with them and
    do not."""
    names = set(names)
    missing = []
    for name in sorted(names):
        found = together(name)
        if found is not None:
            prefix, group = found
            missing += [prefix + m + "weight" for m in group if prefix + m + "weight" not in names]
    return sorted(set(missing))


def keep_together(named):
    """Pass a stream of ``(name, tensor)`` items (or lists of them, see :func:`make_buckets`) through, holding the
    members of each :data:`LOADED_TOGETHER` group back until the whole group has come and yielding them as one
    list item, so no bucket splits them."""
    held: dict[str, list] = {}
    for item in named:
        group_items = item if isinstance(item, list) else [item]
        found = together(group_items[0][0])
        if found is None:
            yield item
            continue
        prefix, group = found
        held.setdefault(prefix, []).extend(group_items)
        names = {n for n, _ in held[prefix]}
        if all(any(n.startswith(prefix + m) for n in names) for m in group):
            yield held.pop(prefix)
    for rest in held.values():  # an incomplete group (a model without the partner): as it is
        yield rest


def make_buckets(named, bucket_bytes: int):
    """Group a stream of ``(name, tensor)`` into lists of at most ``bucket_bytes`` bytes. An item may also be a
    list of ``(name, tensor)`` that must travel in one bucket (an FP8 weight and its scales)."""
    bucket, size = [], 0
    for item in named:
        group = item if isinstance(item, list) else [item]
        n = sum(nbytes(t) for _, t in group)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += n
    if bucket:
        yield bucket


def wire_view(t: torch.Tensor, backend: str) -> torch.Tensor:
    """What goes into a broadcast: gloo has no float8 type, so FP8 travels as its bytes (same on both sides)."""
    return t.view(torch.uint8) if backend == "gloo" and t.dtype == torch.float8_e4m3fn else t


def describe(bucket) -> dict:
    """SGLang's per-request tensor description: names, dtypes, shapes."""
    return {"names": [n for n, _ in bucket], "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def pack(bucket) -> torch.Tensor:
    """The bucket's bytes as one flat uint8 tensor (tensor after tensor, in order)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def comm_device() -> torch.device:
    """Where point-to-point tensors must live for the default group's backend (NCCL: the current GPU)."""
    from forge_megatron.mcore.parallel import comm_device as device_for

    return device_for()


def send_json(obj: dict, dst: int) -> None:
    """Send a small JSON message to global rank ``dst`` point-to-point over the default group (never pickle)."""
    dev = comm_device()
    data = json.dumps(obj).encode()
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=dev), dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), dst)


def recv_json(src: int) -> dict:
    """Receive one :func:`send_json` message from global rank ``src``."""
    dev = comm_device()
    size = torch.empty(1, dtype=torch.int64, device=dev)
    dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.recv(data, src)
    return json.loads(bytes(data.cpu().tolist()))


def meta_bytes(meta: dict) -> int:
    """Bytes of the tensors a :func:`describe` header announces."""
    return sum(int(torch.Size(shape).numel()) * torch.empty((), dtype=DTYPES[dtype]).element_size()
               for dtype, shape in zip(meta["dtypes"], meta["shapes"]))


def send_tensors(named: dict, dst: int) -> None:
    """Send ``named`` ({name: tensor}) to global rank ``dst``: a :func:`describe` header as JSON, then the bytes in
    one message (:func:`pack`)."""
    items = list(named.items())
    send_json(describe(items), dst)
    if items:
        dist.send(pack(items).to(comm_device()), dst)


def recv_tensors(src: int) -> dict:
    """Receive one :func:`send_tensors` message from global rank ``src`` (CPU tensors)."""
    meta = recv_json(src)
    flat = torch.empty(meta_bytes(meta), dtype=torch.uint8, device=comm_device())
    if flat.numel():
        dist.recv(flat, src)
    flat, out, at = flat.cpu(), {}, 0
    for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
        t = torch.empty(shape, dtype=DTYPES[dtype])
        out[name] = flat[at:at + nbytes(t)].view(t.dtype).view(shape).clone()
        at += nbytes(t)
    return out
