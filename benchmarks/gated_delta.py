"""Time and saved memory of the chunked gated delta rule (Gated DeltaNet), forward and backward, side by side.

Variants, all on the same inputs (B sequences of L tokens, H value heads, key / value head dims dk / dv, fp32):

- ``autograd_loop``: the chunked rule with autograd through a Python loop over chunks (what kernels/gated_delta.py
  did before its scan got a hand-written backward; kept here as the baseline): every chunk's state and Vn are saved
  for the backward, which runs a dozen small kernels per chunk;
- ``torch_scan``: ``chunked_gated_delta(backend="torch")``, the CPU path: the same loops without autograd, the states
  recomputed in the backward, one reverse scan, the other gradients batched over chunks;
- ``triton_scan``: ``backend="triton"`` (CUDA only; the kernels are tested on CPU under the interpreter, not timed).

Per variant: ``ms`` (median forward + backward of ``--repeats`` after a warm-up), ``saved_mib`` (distinct storages
autograd keeps from forward to backward, the layer's activation memory for this op) and ``max_err`` (largest
difference of the output and of every input's gradient from ``autograd_loop``'s). Ratios ``*_speedup`` and
``*_saved_ratio`` are against ``autograd_loop``. Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/gated_delta.py [--batch 2 --len 2048 --heads 4 --dk 128 --dv 128 --chunk 64]
"""

import argparse
import json
import statistics
import time

import torch

from forge_megatron.kernels import gated_delta as gd


def autograd_loop(q, k, v, g, beta, initial_state, chunk):
    """The baseline: the chunked rule's per-chunk loop under autograd."""
    B, L, H, dk = k.shape
    dv, n = v.shape[-1], L // chunk

    def chunks(x):
        x = x.float().transpose(1, 2)
        return x.reshape(B, H, n, chunk, *x.shape[3:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    dec = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = torch.eye(chunk, device=q.device) + (k_beta @ k.transpose(-1, -2) * dec).tril(-1)
    U = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, k_beta * G.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = q @ k.transpose(-1, -2) * dec
    q_dec, k_dec = q * G.exp().unsqueeze(-1), k * (G[..., -1:] - G).exp().unsqueeze(-1)
    chunk_decay = G[..., -1].exp()[..., None, None]
    state, outs = initial_state.float(), []
    for i in range(n):
        v_new = U[:, :, i] - W[:, :, i] @ state
        outs.append(q_dec[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(B, H, L, dv).transpose(1, 2), state


def run(fn, inputs, weights, repeats, device):
    def once():
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, final = fn(*xs)
        grads = torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), xs)
        return o.detach(), grads, sum(storages.values())

    once()  # warm-up (and the Triton compile)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, grads, saved = once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, saved, o, grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2, help="sequences (segments of one level of a forest)")
    p.add_argument("--len", type=int, default=2048, help="tokens per sequence (a multiple of --chunk)")
    p.add_argument("--heads", type=int, default=4, help="value heads (per tensor-parallel rank)")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    B, L, H, dk, dv = args.batch, args.len, args.heads, args.dk, args.dv
    q = torch.nn.functional.normalize(torch.randn(B, L, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, L, H, dk, generator=g), dim=-1)
    v = torch.randn(B, L, H, dv, generator=g)
    decay = -torch.rand(B, L, H, generator=g) * 0.1
    beta = torch.rand(B, L, H, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g) * 0.1
    inputs = [x.to(device) for x in (q, k, v, decay, beta, state)]
    weights = [torch.randn(B, L, H, dv, generator=g).to(device), torch.randn(B, H, dk, dv, generator=g).to(device)]

    variants = {"autograd_loop": lambda *xs: autograd_loop(*xs, args.chunk),
                "torch_scan": lambda *xs: gd.chunked_gated_delta(*xs, chunk=args.chunk, backend="torch")}
    if device.type == "cuda":
        variants["triton_scan"] = lambda *xs: gd.chunked_gated_delta(*xs, chunk=args.chunk, backend="triton")
    out = {}
    base = None
    for name, fn in variants.items():
        ms, saved, o, grads = run(fn, inputs, weights, args.repeats, device)
        if base is None:
            base = (o, grads)
        err = max([float((o - base[0]).abs().max())] + [float((a - b).abs().max()) for a, b in zip(grads, base[1])])
        out[name] = {"ms": ms, "saved_mib": saved / 2**20, "max_err": err}
    for name in list(out)[1:]:
        out[f"{name}_speedup"] = out["autograd_loop"]["ms"] / out[name]["ms"]
        out[f"{name}_saved_ratio"] = out[name]["saved_mib"] / out["autograd_loop"]["saved_mib"]
    out["config"] = dict(batch=B, len=L, heads=H, dk=dk, dv=dv, chunk=args.chunk, device=str(device),
                         chunks=L // args.chunk)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
