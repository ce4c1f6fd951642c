"""FP8 (or int4) weight sync cost and saving: block-wise quantization of one MoE decoder layer's HF tensors (what
``--weight-sync-fp8`` does on each stage lead before the broadcast; with ``--int4``, the group-wise int4 packing of
``--weight-sync-int4`` under Kimi's ignore list: the routed experts only) vs a plain copy of the same bf16 tensors,
measured side by side in one run; and the bytes each sends.

    python benchmarks/fp8_sync.py [--hidden 2048 --experts 16 --moe-intermediate 768 --repeats 3] [--int4 [--group 32]]

Defaults: a Qwen3-30B-A3B layer's shapes (hidden 2048, 32 query / 4 KV heads of 128, experts of 768) with 16 of its 128
experts (CPU memory and time; the ratios do not depend on the count). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from forge_megatron.weight_sync import fp8, int4


def layer_tensors(hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int, inter: int):
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    p = "model.layers.0."
    named = [(p + "input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)),
             (p + "self_attn.q_proj.weight", w(heads * head_dim, hidden)),
             (p + "self_attn.k_proj.weight", w(kv_heads * head_dim, hidden)),
             (p + "self_attn.v_proj.weight", w(kv_heads * head_dim, hidden)),
             (p + "self_attn.o_proj.weight", w(hidden, heads * head_dim)),
             (p + "mlp.gate.weight", w(experts, hidden))]
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            named.append((f"{p}mlp.experts.{e}.{proj}.weight", w(*shape)))
    return named


def nbytes(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--int4", action="store_true", help="int4 packing (Kimi-K2-Thinking's format) instead of FP8")
    ap.add_argument("--group", type=int, default=32, help="int4 group size")
    args = ap.parse_args()
    named = layer_tensors(args.hidden, args.heads, args.kv_heads, args.head_dim, args.experts, args.moe_intermediate)
    if args.int4:  # Kimi-K2-Thinking's ignore list: attention, shared experts and dense MLPs stay bf16
        cfg = int4.Int4Config(group=args.group, ignore=("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                                        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"))
        quantize_named = int4.quantize_named
    else:
        cfg, quantize_named = fp8.Fp8Config(block=tuple(args.block)), fp8.quantize_named
    copy_s, quant_s, sent = [], [], []
    for _ in range(args.repeats):  # alternate the two so load changes hit both alike
        t0 = time.perf_counter()
        copied = [(n, t.clone()) for n, t in named]
        copy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sent = [x for item in quantize_named(named, cfg) for x in (item if isinstance(item, list) else [item])]
        quant_s.append(time.perf_counter() - t0)
        del copied
    bf16 = nbytes(named)
    quantized = nbytes(sent)
    kind = "int4" if args.int4 else "fp8"
    print(json.dumps({
        "benchmark": f"{kind}_sync", "tensors": len(named), "bytes_bf16": bf16, f"bytes_{kind}": quantized,
        "byte_ratio": round(quantized / bf16, 4), "quantize_gbps": round(bf16 / min(quant_s) / 1e9, 3),
        "copy_gbps": round(bf16 / min(copy_s) / 1e9, 3), "quantize_over_copy_time": round(min(quant_s) / min(copy_s), 2),
        **({"group": args.group} if args.int4 else {"block": args.block}), "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
