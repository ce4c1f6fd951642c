"""MiniMax-M3's block-sparse attention in the trainer (mcore/block_sparse.py) against dense tree attention.

One agentic sample: a chain of T tokens (an episode whose calls re-send the whole history merges into one chain),
N query heads over K key heads of H channels, an indexer head of D_I channels per key head keeping each query's
``--topk`` blocks of ``--block`` positions. Timed, forward + backward of the core attention, side by side:
  dense     the tree-attention kernel over every query (what the model's dense layers run);
  masked    BlockSparseAttention's path: the same kernel for the queries that keep every block (depth below
            topk x block), the indexer (no gradient) and, for the others, attention over every key before them
            masked to the kept blocks (GATHER_KEYS=False);
  gathered  the same with the kept blocks' keys gathered (GATHER_KEYS=True; the default when they are fewer than
            half the keys before a chunk);
  indexer   the block selection alone (part of both).
``max_abs_diff`` checks both against a dense softmax masked to the kept blocks' visible keys, built independently
here from the indexer's scores. Prints ONE JSON line with the times (ms, median of --repeats), the ratios to dense
and the share of queries that drop blocks.

  python benchmarks/block_sparse.py                                   # CPU sizes
  python benchmarks/block_sparse.py --tokens 16384 --heads 64 --kv-heads 4 --head-dim 128 --block 128 --topk 16 \\
      --device cuda                                                   # MiniMax-M3's geometry

Both are plain PyTorch: the masked one's work grows as queries x T, like the dense kernel's but without its tiling,
the gathered one's as queries x topk x block (plus the gathers); the indexer scores every visible key of every deep
query (O(T^2) by design). A fused block-sparse kernel is the GPU follow-up this benchmark will measure.

Legend: T = tokens, N = query heads, K = key heads, H = head dim.
"""

from __future__ import annotations

import argparse
import json
import types

import torch
from _timing import median_ms


def build(args):
    from forge_megatron.mcore.block_sparse import BlockSparseAttention

    config = types.SimpleNamespace(attention_dropout=0.0, softmax_scale=None, kv_channels=args.head_dim,
                                   num_attention_heads=args.heads,
                                   hidden_size=args.hidden, num_query_groups=args.kv_heads,
                                   tensor_model_parallel_size=1, sequence_parallel=False,
                                   params_dtype=torch.float32)
    rotated = args.head_dim // 2
    inv_freq = 1.0 / (5e6 ** (torch.arange(0, rotated, 2).float() / rotated))
    module = BlockSparseAttention(config, layer_number=1, index_heads=args.kv_heads, index_head_dim=args.index_head_dim,
                                  block_size=args.block, topk_blocks=args.topk, local_blocks=1, inv_freq=inv_freq)
    return module.to(args.device)


def kept_mask(module, x, positions):
    """[K, T, T] reference of the keys each query keeps on a chain, from the indexer's scores (no chunks)."""
    T, B = x.shape[0], module.block_size
    keys = module.indexer.keys(x, positions)
    q = module.indexer.queries(x, positions, slice(0, module.indexer.heads))
    scores = torch.einsum("qkd,td->kqt", q, keys)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    blocks = (T + B - 1) // B
    padded = torch.nn.functional.pad(scores, (0, blocks * B - T), value=float("-inf"))
    block_scores = padded.view(*scores.shape[:2], blocks, B).amax(-1)
    own = positions // B
    for back in range(module.local_blocks):
        block_scores.scatter_(-1, (own - back).clamp(min=0)[None, :, None].expand(scores.shape[0], -1, 1),
                              float("inf"))
    top, chosen = block_scores.topk(min(module.topk_blocks, blocks), dim=-1)
    kept = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, chosen, top > float("-inf"))
    return kept.repeat_interleave(B, dim=-1)[..., :T] & causal


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--block", type=int, default=32, help="positions per block (MiniMax-M3: 128)")
    p.add_argument("--topk", type=int, default=8, help="blocks each query keeps (MiniMax-M3: 16)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--index-head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    from forge_megatron.kernels.tree_attention import tree_attention
    from forge_megatron.mcore import block_sparse

    torch.manual_seed(0)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    T, N, K, H = args.tokens, args.heads, args.kv_heads, args.head_dim
    module = build(args)
    q = torch.randn(T, N, H, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(T, K, H, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(T, K, H, device=dev, dtype=dtype, requires_grad=True)
    x = torch.randn(T, args.hidden, device=dev, dtype=dtype)
    sub_end = torch.full((T,), T, dtype=torch.int32, device=dev)  # one chain
    positions = torch.arange(T, device=dev)
    do = torch.randn(T, N, H, device=dev, dtype=dtype)
    deep_from = args.topk * args.block

    def timed(fn):
        return median_ms(fn, args.repeats, dev)

    def dense():
        torch.autograd.backward(tree_attention(q, k, v, sub_end, softmax_scale=module.softmax_scale), do)

    def sparse(gather):
        def run():
            block_sparse.GATHER_KEYS = gather
            torch.autograd.backward(module._attend(q, k, v, x, sub_end, positions, None), do)
        return run

    rows = torch.arange(min(deep_from, T), T, device=dev)

    def indexer():
        from forge_megatron.mcore.block_sparse import CHUNK_ELEMENTS

        keys = module.indexer.keys(x, positions)
        chunk = max(1, CHUNK_ELEMENTS // max(1, N * T))
        for a in range(0, rows.numel(), chunk):
            r = rows[a:a + chunk]
            module._select(r, x[r], keys[:int(r[-1]) + 1], sub_end[:int(r[-1]) + 1], positions, slice(0, K))

    with torch.no_grad():  # correctness: a dense softmax masked to the kept blocks, against both ways of attending
        keep = kept_mask(module, x.float(), positions).repeat_interleave(N // K, dim=0)  # [N, T, T]
        s = torch.einsum("qnh,tnh->nqt", q.float(), k.float().repeat_interleave(N // K, dim=1)) * module.softmax_scale
        ref = torch.einsum("nqt,tnh->qnh", s.masked_fill(~keep, float("-inf")).softmax(-1),
                           v.float().repeat_interleave(N // K, dim=1))
        diff = 0.0
        for gather in (False, True):
            block_sparse.GATHER_KEYS = gather
            diff = max(diff, (module._attend(q, k, v, x, sub_end, positions, None).float() - ref).abs().max().item())
    result = {"tokens": T, "block": args.block, "topk": args.topk, "heads": N, "kv_heads": K, "device": dev.type,
              "dtype": args.dtype, "sparse_rows": max(T - deep_from, 0) / T, "dense_ms": round(timed(dense), 2),
              "masked_ms": round(timed(sparse(False)), 2), "gathered_ms": round(timed(sparse(True)), 2),
              "indexer_ms": round(timed(indexer), 2) if rows.numel() else 0.0, "max_abs_diff": diff}
    block_sparse.GATHER_KEYS = None
    result["masked_over_dense"] = round(result["masked_ms"] / result["dense_ms"], 3)
    result["gathered_over_dense"] = round(result["gathered_ms"] / result["dense_ms"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
