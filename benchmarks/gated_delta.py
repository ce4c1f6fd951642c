"""Time and saved memory of the chunked gated delta rule (Gated DeltaNet), forward and backward, side by side.

Variants, all on the same inputs (B sequences of L tokens, H value heads, key / value head dims dk / dv, fp32):

- ``autograd_loop``: the chunked rule with autograd through a Python loop over chunks (what kernels/gated_delta.py
  did before its scan got a hand-written backward; kept here as the baseline): every chunk's state and Vn are saved
  for the backward, which runs a dozen small kernels per chunk;
- ``torch_scan``: ``chunked_gated_delta(backend="torch")``, the CPU path: the same loops without autograd, the states
  recomputed in the backward, one reverse scan, the other gradients batched over chunks;
- ``triton_scan``: ``backend="triton"`` (CUDA only; the kernels are tested on CPU under the interpreter, not timed);
- ``*_recompute``: the same under a non-reentrant activation checkpoint, as the layer runs it
  (``tree_gated_delta_rule(recompute=True)``, the default): only the inputs wait for the backward.

Per variant: ``ms`` (median forward + backward of ``--repeats`` after a warm-up), ``saved_mib`` (memory the forward
made that is still alive when it returns, its outputs excluded: what waits for the backward beyond the inputs (which
every variant keeps too; ``config.input_mib``), counted by a dispatch mode in an untimed pass) and ``max_err`` (largest
difference of the output and of every input's gradient from ``autograd_loop``'s). Ratios ``*_speedup`` and
``*_saved_ratio`` are against ``autograd_loop``. Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/gated_delta.py [--batch 2 --len 2048 --heads 4 --dk 128 --dv 128 --chunk 64]

``--channel-decay``: Kimi Delta Attention's rule (a decay per key channel, g [B, L, H, dk]; chunk 16 by default):
the baseline is then transformers' ``chunk_kimi_delta_attention`` (Kimi Linear's reference, chunks of 64, autograd
through its loops), against which ``torch_scan`` (and ``triton_scan`` on CUDA) are timed and compared.

``--plain``: Mamba-2's rule (``delta=False``: no correction term; x -> v, B -> k, C -> q, dt -> beta, dt * A -> the
log decay, --dk the state size, --dv the head dim, ``--groups`` B / C groups shared by the heads). The baseline is
transformers' ``mamba2_chunk_scan`` (the torch path of its Mamba-2, Nemotron-H and Granite 4.0-H mixers); beside it
``zero_correction``, the rule as forge ran it before (the delta rule's chunked path with W = 0: the strictly lower
A K K^T products, W's inputs and every product with W computed and thrown away), and ``torch_scan`` (and
``triton_scan`` on CUDA), which skip them.

``--layer``: instead, the bytes per token a bf16 Gated DeltaNet mixer (mcore/gated_delta_net.py, one rank, a tiny
Qwen3.5 with hidden 256, 4 key heads of 32, 8 value heads of 32) keeps from its forward to its backward, with its
recurrence and gated norm recomputed (the default) and without (what the layer keeps when Megatron's full
recomputation is on and reruns it anyway), next to forge-plan's estimate and the attention layer's mixer.
"""

import argparse
import gc
import json
import statistics
import time

import torch
import torch.utils.checkpoint

from forge_megatron.kernels import gated_delta as gd
from forge_megatron.utils.memory import LiveBytes, held_by_module


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


def zero_correction(q, k, v, g, beta, chunk):
    """The plain rule as kernels/gated_delta.py computed it before its W-free path: the delta rule's in-chunk
    terms (A, W's inputs) computed, W = 0, and the scan's products with W run."""
    B, L, H, dk = k.shape
    n = L // chunk

    def chunks(x):
        x = x.float().transpose(1, 2)
        return x.reshape(B * H, n, chunk, *x.shape[3:]).contiguous()

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(2)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta.unsqueeze(-1)
    dec = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    (k_beta @ k.transpose(-1, -2) * dec).tril(-1)  # A: computed, unused (as before)
    attn = q @ k.transpose(-1, -2) * dec
    W_in, q_dec = k_beta * G.exp().unsqueeze(-1), q * G.exp().unsqueeze(-1)
    k_dec = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    U, W = v * beta.unsqueeze(-1), torch.zeros_like(W_in)
    o, final = gd._ChunkScan.apply(U, W, q_dec, attn, k_dec, G[..., -1].exp(), None, "torch")
    return o.reshape(B, H, L, -1).transpose(1, 2), final.reshape(B, H, dk, -1)


def plain_variants(args, A, device):
    """Mamba-2's rule: (variants taking (C, B, x, dt) -> (y [B, L, H, P], final state [B, H, N, P])), the
    transformers baseline first."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    H = args.heads

    def heads(x):  # [B, L, G, N] -> [B, L, H, N]: the groups' B / C shared by H / G heads each
        return x.repeat_interleave(H // x.shape[2], dim=2)

    def transformers_ssd(C, Bm, x, dt):
        y, final = mamba2_chunk_scan(x, dt, A, Bm, C, args.chunk, return_final_states=True)
        return y, final.transpose(-1, -2)  # [B, H, P, N] -> [B, H, N, P]

    def ours(backend, recompute=False, old=False):
        def fn(C, Bm, x, dt):
            if old:
                return zero_correction(heads(C), heads(Bm), x, dt * A, dt, args.chunk)
            return gd.chunked_gated_delta(heads(C), heads(Bm), x, dt * A, dt, chunk=args.chunk, backend=backend,
                                          delta=False)
        if recompute:
            return lambda *xs: torch.utils.checkpoint.checkpoint(fn, *xs, use_reentrant=False)
        return fn

    variants = {"transformers_ssd": transformers_ssd, "zero_correction": ours("torch", old=True),
                "torch_scan": ours("torch"), "torch_scan_recompute": ours("torch", recompute=True)}
    if device.type == "cuda":
        variants["triton_scan"] = ours("triton")
    return variants


def held_bytes(fn, inputs):
    """Memory made by the forward and still alive when it returns, outputs excluded: what waits for the backward."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    with LiveBytes(xs) as mode:
        outs = fn(*xs)
    gc.collect()
    return mode.live - sum(o.untyped_storage().nbytes() for o in outs)


def run(fn, inputs, weights, repeats, device):
    def once():
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o, final = fn(*xs)
        grads = torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), xs)
        return o.detach(), grads

    once()  # warm-up (and the Triton compile)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, grads = once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, held_bytes(fn, inputs), o, grads


def layer_memory() -> dict:
    """Bytes per token kept by the mixers of a tiny bf16 Qwen3.5 (layer 0 linear attention, layer 1 attention)."""
    import copy

    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.parallel import ParallelConfig, destroy, initialize
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.plan import gated_delta_net_bytes
    from forge_megatron.tree import build_tree

    import os

    from forge_megatron.utils.ports import free_port

    port = free_port()  # one process: its own rendezvous
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    initialize(ParallelConfig())
    try:
        hf = {**tiny_config("qwen3_5", vocab_size=96, hidden_size=256, linear_num_key_heads=4, linear_key_head_dim=32,
                            linear_num_value_heads=8, linear_value_head_dim=32).to_dict(),
              "architectures": ["Qwen3_5ForCausalLM"]}
        cfg = Bridge(hf).cfg
        cfg.bf16, cfg.params_dtype = True, torch.bfloat16
        layout = build_tree([list(range(90)) * 10 + [1] * 100, list(range(90)) * 10 + [2] * 50])
        out = {"plan_estimate": gated_delta_net_bytes(cfg, tp=1, sp=False), "tokens": layout.unique_tokens}
        for name, inner_recompute in (("gated_delta_net", True), ("gated_delta_net_no_recompute", False),
                                      ("attention", True)):
            torch.manual_seed(0)
            model = build_tree_gpt(cfg).to(torch.bfloat16)
            mixer = model.decoder.layers[1 if name == "attention" else 0].self_attention
            if not inner_recompute:  # what the layer keeps when Megatron's full recomputation reruns it
                mixer.config = copy.copy(mixer.config)
                mixer.config.recompute_granularity = "full"
            mode = LiveBytes()
            held = held_by_module(mixer, mode)
            with mode:
                tree_logprobs(model, layout)
            out[name] = held["held"] / layout.unique_tokens
        return out
    finally:
        destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2, help="sequences (segments of one level of a forest)")
    p.add_argument("--len", type=int, default=2048, help="tokens per sequence (a multiple of --chunk)")
    p.add_argument("--heads", type=int, default=4, help="value heads (per tensor-parallel rank)")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--chunk", type=int, default=None, help="the rule's chunk (default 64; 16 with --channel-decay)")
    p.add_argument("--channel-decay", action="store_true",
                   help="a decay per key channel (Kimi Delta Attention), against transformers' Kimi Linear function")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plain", action="store_true",
                   help="Mamba-2's rule (no correction term), against transformers' mamba2_chunk_scan (see above)")
    p.add_argument("--groups", type=int, default=1, help="--plain: B / C groups (Mamba-2's n_groups)")
    p.add_argument("--layer", action="store_true", help="bytes per token the layer keeps (see above)")
    args = p.parse_args()
    if args.layer:
        print(json.dumps(layer_memory()))
        return
    device = torch.device(args.device)
    args.chunk = args.chunk or (16 if args.channel_decay else 64)
    g = torch.Generator().manual_seed(0)
    B, L, H, dk, dv = args.batch, args.len, args.heads, args.dk, args.dv
    if args.plain:
        if H % args.groups:
            raise SystemExit(f"--heads {H} must be a multiple of --groups {args.groups}")
        A = (-torch.rand(H, generator=g) * 4).to(device)
        C = torch.randn(B, L, args.groups, dk, generator=g) * dk ** -0.5
        Bm = torch.randn(B, L, args.groups, dk, generator=g) * dk ** -0.5
        x = torch.randn(B, L, H, dv, generator=g)
        dt = torch.nn.functional.softplus(torch.randn(B, L, H, generator=g) - 2)
        inputs = [t.to(device) for t in (C, Bm, x, dt)]
        weights = [torch.randn(B, L, H, dv, generator=g).to(device), torch.randn(B, H, dk, dv, generator=g).to(device)]
        return report(plain_variants(args, A, device), inputs, weights, args, device,
                      dict(groups=args.groups, plain=True))
    q = torch.nn.functional.normalize(torch.randn(B, L, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, L, H, dk, generator=g), dim=-1)
    v = torch.randn(B, L, H, dv, generator=g)
    decay = -torch.rand(B, L, H, *((dk,) if args.channel_decay else ()), generator=g) * 0.1
    beta = torch.rand(B, L, H, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g) * 0.1
    inputs = [x.to(device) for x in (q, k, v, decay, beta, state)]
    weights = [torch.randn(B, L, H, dv, generator=g).to(device), torch.randn(B, H, dk, dv, generator=g).to(device)]

    def scan(backend, recompute=False):
        fn = lambda *xs: gd.chunked_gated_delta(*xs, chunk=args.chunk, backend=backend)  # noqa: E731
        if recompute:
            return lambda *xs: torch.utils.checkpoint.checkpoint(fn, *xs, use_reentrant=False)
        return fn

    if args.channel_decay:
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

        def transformers_chunk(q, k, v, g, beta, state):  # it scales q by 1 / sqrt(dk) itself
            return chunk_kimi_delta_attention(q * dk ** 0.5, k, v, g=g, beta=beta, chunk_size=64,
                                              initial_state=state, output_final_state=True)

        variants = {"transformers_chunk": transformers_chunk}
    else:
        variants = {"autograd_loop": lambda *xs: autograd_loop(*xs, args.chunk)}
    variants.update(torch_scan=scan("torch"), torch_scan_recompute=scan("torch", recompute=True))
    if device.type == "cuda":
        variants["triton_scan"] = scan("triton")
        variants["triton_scan_recompute"] = scan("triton", recompute=True)
    report(variants, inputs, weights, args, device, dict(channel_decay=args.channel_decay))


def report(variants, inputs, weights, args, device, extra_config) -> None:
    """Time every variant on the same inputs; print one JSON line (errors and ratios against the first)."""
    out = {}
    base = None
    for name, fn in variants.items():
        ms, saved, o, grads = run(fn, inputs, weights, args.repeats, device)
        if base is None:
            base = (o, grads)
        err = max([float((o - base[0]).abs().max())] + [float((a - b).abs().max()) for a, b in zip(grads, base[1])])
        out[name] = {"ms": ms, "saved_mib": saved / 2**20, "max_err": err}
    baseline = next(iter(variants))
    for name in list(out)[1:]:
        out[f"{name}_speedup"] = out[baseline]["ms"] / out[name]["ms"]
        out[f"{name}_saved_ratio"] = out[name]["saved_mib"] / out[baseline]["saved_mib"]
    out["config"] = dict(batch=args.batch, len=args.len, heads=args.heads, dk=args.dk, dv=args.dv, chunk=args.chunk,
                         device=str(device), chunks=args.len // args.chunk,
                         input_mib=sum(x.nbytes for x in inputs) / 2**20, baseline=baseline, **extra_config)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
