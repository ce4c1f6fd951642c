"""DeepSeek sparse attention's cost in the trainer (mcore/dsa.py) against dense tree attention, side by side.

One agentic sample: a chain of T tokens (an episode whose calls re-send the whole history merges into one chain), MLA
head sizes (query/key heads of H channels, value heads of Hv), an indexer of H_I heads of D_I channels picking topk
keys. Timed, forward + backward of the core attention:
  dense     the tree-attention kernel over every query (what a dense MLA model runs);
  dsa       SparseTreeAttention's path: the same kernel for the first topk tokens, the indexer (no gradient) and the
            gathered-keys attention over each deeper query's topk selection;
  indexer   the indexer's selection alone (part of dsa).
``max_abs_diff`` checks the DSA output against a dense softmax restricted to the selected keys. Prints ONE JSON line
with the times (ms, median of --repeats), ``dsa_over_dense`` and the share of sparse rows.

  python benchmarks/dsa.py                       # CPU sizes
  python benchmarks/dsa.py --tokens 16384 --topk 2048 --heads 16 --device cuda

The gathered-keys attention is plain PyTorch (gathers, einsums, index_add in the backward): its work grows as
queries x topk, the dense kernel's as queries x T; the indexer's scoring is O(T^2) by design (DeepSeek runs it in
FP8). A fused sparse kernel (FlashMLA's) is the GPU follow-up this benchmark will measure.

Legend: T = tokens, N = heads, H = query/key head dim, Hv = value head dim.
"""

from __future__ import annotations

import argparse
import json
import types

import torch
from _timing import median_ms


def build(args):
    from forge_megatron.mcore.dsa import SparseTreeAttention

    config = types.SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, softmax_scale=None,
                                   kv_channels=args.v_head_dim, hidden_size=args.hidden, q_lora_rank=args.q_lora,
                                   qk_pos_emb_head_dim=args.rope_dim, params_dtype=torch.float32,
                                   sequence_parallel=False, tensor_model_parallel_size=1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, args.rope_dim, 2).float() / args.rope_dim))
    module = SparseTreeAttention(config, layer_number=1, k_channels=args.head_dim, topk=args.topk,
                                 index_heads=args.index_heads, index_head_dim=args.index_head_dim, inv_freq=inv_freq)
    return module.to(args.device)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=48, help="query/key head size (MLA: 192)")
    p.add_argument("--v-head-dim", type=int, default=32, help="value head size (MLA: 128)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--q-lora", type=int, default=64)
    p.add_argument("--rope-dim", type=int, default=16)
    p.add_argument("--index-heads", type=int, default=8)
    p.add_argument("--index-head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    from forge_megatron.kernels.tree_attention import tree_attention

    torch.manual_seed(0)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    T, N = args.tokens, args.heads
    module = build(args)
    q = torch.randn(T, N, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(T, N, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(T, N, args.v_head_dim, device=dev, dtype=dtype, requires_grad=True)
    x = torch.randn(T, args.hidden, device=dev, dtype=dtype)
    qr = torch.randn(T, args.q_lora, device=dev, dtype=dtype)
    sub_end = torch.full((T,), T, dtype=torch.int32, device=dev)  # one chain
    positions = torch.arange(T, device=dev)
    do = torch.randn(T, N, args.v_head_dim, device=dev, dtype=dtype)

    def timed(fn):
        return median_ms(fn, args.repeats, dev)

    def dense():
        o = tree_attention(q, k, v, sub_end, softmax_scale=module.softmax_scale)
        torch.autograd.backward(o, do)

    def dsa():
        o = module._attend(q, k, v, x, qr, sub_end, positions, {}, None)
        torch.autograd.backward(o, do)

    deep = positions >= args.topk
    first = int(torch.argmax(deep.int())) if bool(deep.any()) else T
    rows = torch.arange(first, T, device=dev)  # the queries the indexer selects for

    def indexer():
        module._select(rows, deep, sub_end, x, qr, positions, {})

    with torch.no_grad():  # correctness: dense softmax over the selected keys
        out = module._attend(q, k, v, x, qr, sub_end, positions, {}, None)
        allowed = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        if first < T:
            index, valid = module._select(rows, deep, sub_end, x, qr, positions, {})
            allowed[first:] = False
            allowed[rows[:, None].expand_as(index)[valid], index[valid]] = True
        s = torch.einsum("qnh,tnh->nqt", q.float(), k.float()) * module.softmax_scale
        ref = torch.einsum("nqt,tnh->qnh", s.masked_fill(~allowed[None], float("-inf")).softmax(-1), v.float())
        diff = (out.float() - ref).abs().max().item()
    result = {"tokens": T, "topk": args.topk, "heads": N, "device": dev.type, "dtype": args.dtype,
              "sparse_rows": int(deep.sum()) / T, "dense_ms": round(timed(dense), 2), "dsa_ms": round(timed(dsa), 2),
              "indexer_ms": round(timed(indexer), 2) if first < T else 0.0, "max_abs_diff": diff}
    result["dsa_over_dense"] = round(result["dsa_ms"] / result["dense_ms"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
