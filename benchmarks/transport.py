"""Batch throughput of the pool transport over ZeroMQ loopback vs a plain memory copy of the same bytes.

A server thread answers each request the way ``PoolServer`` does (``batch_to_wire`` + ``wire.pack``, zero-copy
send); the client receives with ``copy=False`` and rebuilds the batch with ``wire.unpack`` + ``batch_from_wire``
(``np.frombuffer`` views). ``memcpy_gbps`` copies the same per-token arrays into a preallocated buffer, in the same
run. GB/s = 1e9 bytes per second.

    python benchmarks/transport.py --batch-mib 64 --repeats 10
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import zmq

from forge_megatron.middleware.batch import TrainBatch, TrainSample
from forge_megatron.middleware.wire import batch_from_wire, batch_to_wire, pack, unpack

BYTES_PER_TOKEN = 4 + 1 + 4 + 4 + 4  # tokens, loss_mask, rollout_logprobs, policy_versions, advantages


def make_batch(total_bytes: int, sample_tokens: int, rng: np.random.Generator) -> TrainBatch:
    num_samples = max(1, total_bytes // (BYTES_PER_TOKEN * sample_tokens))
    samples = [
        TrainSample(tokens=rng.integers(0, 150_000, sample_tokens, dtype=np.int32),
                    loss_mask=(rng.random(sample_tokens) < 0.7).astype(np.uint8),
                    rollout_logprobs=-rng.random(sample_tokens, dtype=np.float32),
                    policy_versions=np.full(sample_tokens, 3, np.int32),
                    advantages=rng.standard_normal(sample_tokens, dtype=np.float32),
                    sample_weight=1.0, group_index=i // 8, episode_id=f"e{i}", domain="default", reward=1.0)
        for i in range(num_samples)
    ]
    return TrainBatch(batch_id=1, samples=samples, group_indices=sorted({s.group_index for s in samples}))


def serve(sock: zmq.Socket, batch: TrainBatch, requests: int) -> None:
    for _ in range(requests):
        identity, _request = sock.recv_multipart()
        meta, arrays = batch_to_wire(batch)
        sock.send_multipart([identity] + pack({"rid": "r", "ok": True, "result": meta}, arrays), copy=False)


def zmq_seconds(batch: TrainBatch, repeats: int) -> float:
    """Best time of one request -> batch round trip (after a warm-up)."""
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    server.bind("tcp://127.0.0.1:0")
    client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
    thread = threading.Thread(target=serve, args=(server, batch, repeats + 1))
    thread.start()
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        client.send(b"get")
        header, arrays = unpack([f.buffer for f in client.recv_multipart(copy=False)], 1 << 34)
        received = batch_from_wire(header["result"], arrays)
        elapsed = time.perf_counter() - start
        assert len(received.samples) == len(batch.samples)
        if i > 0:  # the first round trip warms up the connection
            best = min(best, elapsed)
    thread.join()
    server.close(linger=0)
    client.close(linger=0)
    ctx.term()
    return best


def memcpy_seconds(batch: TrainBatch, repeats: int) -> float:
    sources = [getattr(s, name).view(np.uint8) for s in batch.samples
               for name in ("tokens", "loss_mask", "rollout_logprobs", "policy_versions", "advantages")]
    dest = np.empty(sum(a.size for a in sources), np.uint8)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        offset = 0
        for a in sources:
            dest[offset:offset + a.size] = a
            offset += a.size
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-mib", type=float, default=64.0, help="per-token bytes per batch, MiB")
    p.add_argument("--sample-tokens", type=int, default=8192, help="tokens per sample (segment)")
    p.add_argument("--repeats", type=int, default=10, help="timed round trips (best is reported)")
    args = p.parse_args()
    batch = make_batch(int(args.batch_mib * (1 << 20)), args.sample_tokens, np.random.default_rng(0))
    nbytes = batch.num_bytes
    z, m = zmq_seconds(batch, args.repeats), memcpy_seconds(batch, args.repeats)
    print(json.dumps({"zmq_gbps": nbytes / z / 1e9, "memcpy_gbps": nbytes / m / 1e9, "batch_bytes": nbytes,
                      "samples": len(batch.samples), "zmq_s": z, "memcpy_s": m}))


if __name__ == "__main__":
    main()
