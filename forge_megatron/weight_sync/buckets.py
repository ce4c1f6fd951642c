"""Fixed-size buckets of named tensors, and their relay from each pipeline stage's lead to the sending rank.

A bucket is a list of ``(name, tensor)`` whose bytes add up to at most ``bucket_bytes`` (a tensor larger than that
gets a bucket of its own). Each bucket costs one engine request, so buckets trade request overhead against
memory held in flight.

Relay: only global rank 0 talks to the engines. Stage s > 0's lead packs each bucket into one flat byte tensor plus
a JSON header (names, dtypes, shapes; never pickle) and sends both to rank 0 with point-to-point ``send``; a zero
header ends the stage. Rank 0 unpacks them as views into the received buffer (no copy per tensor).

Legend: B = bytes of a packed bucket.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_buckets(named, bucket_bytes: int):
    """Group a stream of ``(name, tensor)`` into lists of at most ``bucket_bytes`` bytes."""
    bucket, size = [], 0
    for name, t in named:
        if bucket and size + nbytes(t) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes(t)
    if bucket:
        yield bucket


def describe(bucket) -> dict:
    """SGLang's per-request tensor description: names, dtypes, shapes."""
    return {"names": [n for n, _ in bucket], "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def pack(bucket) -> torch.Tensor:
    """The bucket's bytes as one flat uint8 tensor (tensor after tensor, in order)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def unpack(meta: dict, data_B: torch.Tensor):
    """Inverse of :func:`pack` with the header from :func:`describe`."""
    out, start = [], 0
    for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
        dt = DTYPES[dtype]
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        out.append((name, data_B[start:start + n].view(dt).reshape(shape)))
        start += n
    return out


def comm_device() -> torch.device:
    """Where point-to-point tensors must live for the default group's backend (NCCL: the current GPU)."""
    from forge_megatron.mcore.parallel import comm_device as device_for

    return device_for()


def send_bucket(bucket, dst: int) -> None:
    dev = comm_device()
    header = json.dumps(describe(bucket)).encode()
    data_B = pack(bucket).to(dev)
    dist.send(torch.tensor([len(header), data_B.numel()], dtype=torch.int64, device=dev), dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev), dst)
    dist.send(data_B, dst)


def send_end(dst: int) -> None:
    dist.send(torch.zeros(2, dtype=torch.int64, device=comm_device()), dst)


def recv_buckets(src: int):
    """Yield the buckets that ``src`` sends with :func:`send_bucket` until :func:`send_end`."""
    dev = comm_device()
    while True:
        sizes = torch.empty(2, dtype=torch.int64, device=dev)
        dist.recv(sizes, src)
        n_header, n_data = (int(x) for x in sizes)
        if n_header == 0:
            return
        header = torch.empty(n_header, dtype=torch.uint8, device=dev)
        dist.recv(header, src)
        data_B = torch.empty(n_data, dtype=torch.uint8, device=dev)
        dist.recv(data_B, src)
        yield unpack(json.loads(bytes(header.cpu().tolist())), data_B)
