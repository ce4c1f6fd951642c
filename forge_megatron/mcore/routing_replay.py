"""Rollout routing replay (R3) for MoE models: the trainer routes each token to the experts the rollout engine used.

Why: an MoE router's top-k is discontinuous, so the small numerical differences between the inference engine
and the trainer (kernels, precision, batch shapes) flip expert choices for some tokens, and the trainer then
scores the sampled tokens with a different network from the one that sampled them: importance ratios drift for
reasons that have nothing to do with the policy's change, and MoE RL destabilises. SGLang records every token's
top-k experts per layer (``--enable-return-routed-experts``); the gateway keeps them per segment
(``Segment.routed_experts``, int8/int16 [L, layers, topk], -1 where nothing was recorded) and the trainer replays
them.

How, on a tree-packed micro-batch:

- :func:`tree_routing`: every tree token takes the routing of the first sample row that recorded one (samples
  sharing a prefix share those tokens; with one policy version their rows agree, otherwise the first in the batch
  wins). Tokens without a recorded row (the last token of a sample, padding) keep -1.
- :class:`TreeRoutingReplay` replaces Megatron's ``TopKRouter.router_replay`` (megatron-core >= 0.16 calls it for
  the top-k of every routed forward): rows with recorded experts use them, and their routing weights are the
  router's own scores at those experts (so the router still learns); rows with -1 use the router's own top-k.
- Megatron's pipeline schedules run forwards and backwards of different micro-batches interleaved. The forward
  step sets each chunk's routers to its micro-batch's rows; activation recomputation re-runs a layer's forward
  inside the backward, in the order the micro-batches went forward, so every forward also queues its rows and a
  forward run while the schedule is in its backward phase takes the oldest queued rows (Megatron's own replay does
  the same). :func:`reset` empties the queues at the start of each schedule run.
- Under context parallelism each rank routes its own shard of the padded tree: the rows are padded and sliced the
  same way.

The replay also counts how often the router's own top-k set differs from the replayed one (``mismatch``): the
training/inference routing mismatch that R3 removes, per (token, layer).

Prefix merging runs one forward per shared token, so where the samples through a token recorded different experts
(engines routing one prompt differently from request to request, or samples of different policy versions) only one
record can be replayed. With ``split`` (trainer ``--routing-replay-split``) the trie is built on (token, expert set)
keys instead (:func:`routing_keys`, :func:`split_tree`): samples share a prefix only as far as their records agree,
so every sample is scored through exactly its own engine's experts, at the cost of the merging lost where they
disagree.

Legend: T tree tokens (padded to the micro-batch's length), L model layers, K experts per token (top-k).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class TreeRoutingReplay:
    """Stands in for Megatron's ``RouterReplay`` on one router (see the module docstring)."""

    def __init__(self, layer: int):
        self.layer = layer  # global (0-based) layer number: the column of the recorded rows
        self.target: torch.Tensor | None = None  # int64 [tokens, K] of the micro-batch going forward; -1 rows: own
        self.queued: deque = deque()  # targets of forwarded micro-batches, for recomputation in the backward
        self.in_backward = False
        # [rows replayed, of which the router's own top-k set differed] since the last read; kept on the device so
        # that counting never waits for the GPU (read once per step by read_counts)
        self.counts: torch.Tensor | None = None

    def set_target(self, target: torch.Tensor | None) -> None:
        self.target = target
        self.queued.append(target)
        self.in_backward = False

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.queued.popleft() if self.in_backward and self.queued else self.target
        if target is None:
            return probs, own
        if target.shape != own.shape:
            raise RuntimeError(f"routing replay: layer {self.layer + 1} routes {tuple(own.shape)} tokens x experts but "
                               f"{tuple(target.shape)} were recorded (set_micro_batch must be given the padding multiple "
                               "the model inputs were built with)")
        target = target.to(own.device)
        recorded = (target >= 0).all(dim=-1, keepdim=True)
        if not self.in_backward:  # count each token once, not again when recomputed
            differs = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1, keepdim=True)
            step = torch.stack([recorded.sum(), (differs & recorded).sum()])
            self.counts = step if self.counts is None else self.counts + step
        idx = torch.where(recorded, target.to(own.dtype), own)
        return scores.gather(1, idx), idx


def _unwrap(model):
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def moe_routers(model) -> list[tuple[int, object]]:
    """(recorded column, TopKRouter) of every MoE layer of a model chunk: the global 0-based layer number, or the
    layer's ``replay_column`` where its checkpoint counts layers otherwise (LongCat-Flash: Megatron layers 2i and
    2i+1 are the engine's layer i)."""
    out = []
    for layer in _unwrap(model).decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((getattr(layer, "replay_column", layer.layer_number - 1), router))
    return out


def install(models) -> int:
    """Give every MoE router of ``models`` (a rank's model chunks) a :class:`TreeRoutingReplay`; returns how many."""
    count = 0
    for model in models:
        for layer, router in moe_routers(model):
            if not hasattr(router, "router_replay"):
                raise RuntimeError("routing replay needs megatron-core >= 0.16 (TopKRouter.router_replay)")
            if getattr(router.config, "moe_router_fusion", False):
                raise ValueError("routing replay does not work with the fused router (moe_router_fusion)")
            router.router_replay = TreeRoutingReplay(layer)
            count += 1
    return count


def _replays(model) -> list[TreeRoutingReplay]:
    return [r.router_replay for _, r in moe_routers(model) if isinstance(r.router_replay, TreeRoutingReplay)]


def reset(models) -> None:
    """Before a schedule run: no rows left queued by an earlier run (a forward-only pass queues and never pops)."""
    for model in models:
        for replay in _replays(model):
            replay.target, replay.in_backward = None, False
            replay.queued.clear()


def set_micro_batch(model, routing_TLK: torch.Tensor | None, num_tokens: int, multiple: int | None = None) -> None:
    """Before ``model``'s forward of a micro-batch of ``num_tokens`` tree tokens, padded to ``multiple`` (default
    ``context_parallel.default_multiple``; ``context_parallel.seq_multiple``): each router of the chunk gets its layer's rows (under CP this
    rank's shard, under sequence parallelism this TP rank's slice of it: the tokens its router sees); None routes
    every token by the router itself."""
    replays = _replays(model)
    if not replays:
        return
    local = None
    if routing_TLK is not None:
        from forge_megatron.mcore.context_parallel import cp_world, default_multiple, padded_length, take_shard

        cp, rank, _ = cp_world()
        multiple = multiple or default_multiple(cp)
        total = padded_length(num_tokens, multiple)
        if routing_TLK.shape[0] > total:
            raise ValueError(f"routing replay: {routing_TLK.shape[0]} recorded rows for {total} tree tokens")
        pad = routing_TLK.new_full((total - routing_TLK.shape[0], *routing_TLK.shape[1:]), -1)
        local = torch.cat([routing_TLK, pad])
        if cp > 1:
            local = take_shard(local, cp, rank, multiple)
        if getattr(model.config, "sequence_parallel", False):  # the router sees this TP rank's slice of the shard
            from megatron.core import parallel_state as ps

            tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            n = local.shape[0]
            local = local[tp_rank * n // tp:(tp_rank + 1) * n // tp]
        device = next(model.parameters()).device
        local = local.to(device=device, dtype=torch.int64)
    for replay in replays:
        if local is not None and replay.layer >= local.shape[1]:
            raise ValueError(f"routing replay: layer {replay.layer + 1} has no recorded column (rows have "
                             f"{local.shape[1]} layers)")
        replay.set_target(None if local is None else local[:, replay.layer].contiguous())


def after_forward(model) -> None:
    """After ``model``'s forward: what runs next (until the next forward) is the backward phase."""
    for replay in _replays(model):
        replay.in_backward = True


def read_counts(models) -> tuple[int, int]:
    """(rows replayed, rows whose own top-k differed) since the last read, over ``models``; resets the counts."""
    counts = []
    for model in models:
        for replay in _replays(model):
            if replay.counts is not None:
                counts.append(replay.counts)
                replay.counts = None
    if not counts:
        return 0, 0
    rows, mismatched = torch.stack(counts).sum(dim=0).tolist()  # one wait for the device
    return int(rows), int(mismatched)


def tree_routing(layout, routed: list, stats: dict | None = None) -> torch.Tensor | None:
    """int16 [T, L, K] routing of ``layout``'s tree tokens from its samples' rows (``routed``: one int8/int16 [L_s, L, K]
    array or None per sample, in the layout's sample order): each tree token takes the first recorded row (-1 rows
    do not count) in sample order; None when no sample has routing.

    ``stats`` (a dict, optional) gets ``shared``: tree tokens recorded by two samples or more, and ``conflicts``: those
    whose samples' rows disagree (as expert sets). One forward per shared token can replay only one of them, so a
    conflicting sample is scored through routing its engine did not use there."""
    shapes = {tuple(r.shape[1:]) for r in routed if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"routing replay: samples recorded different [layers, topk] shapes {sorted(shapes)}")
    shape = shapes.pop()
    nodes_P = layout.sample_nodes.cpu().numpy().astype(np.int64)
    lengths = np.diff(layout.sample_offsets.cpu().numpy())
    if len(routed) != len(lengths):
        raise ValueError(f"routing replay: {len(routed)} routing arrays for {len(lengths)} samples")
    for s, (r, n) in enumerate(zip(routed, lengths)):
        if r is not None and r.shape[0] != n:
            raise ValueError(f"routing replay: sample {s} has {n} tokens but {r.shape[0]} recorded rows")
    rows_P = np.concatenate([np.asarray(r, dtype=np.int16) if r is not None else np.full((n, *shape), -1, np.int16)
                             for r, n in zip(routed, lengths)])
    recorded_P = (rows_P >= 0).any(axis=(1, 2))  # dense layers' columns are -1 in a recorded row
    # First recorded row per tree token: sort by (node, unrecorded, position) and keep each node's first.
    order = np.lexsort((np.arange(nodes_P.size), ~recorded_P, nodes_P))
    nodes_sorted = nodes_P[order]
    first = order[np.r_[True, nodes_sorted[1:] != nodes_sorted[:-1]]]
    out = np.full((layout.unique_tokens, *shape), -1, np.int16)
    keep = first[recorded_P[first]]
    out[nodes_P[keep]] = rows_P[keep]
    if stats is not None:
        chosen_P = out[nodes_P]  # each sample token's tree row
        counted_P = recorded_P & (chosen_P >= 0).any(axis=(1, 2))
        differs_P = counted_P & (np.sort(rows_P, axis=-1) != np.sort(chosen_P, axis=-1)).any(axis=(1, 2))
        recorded_per_node = np.bincount(nodes_P[counted_P], minlength=layout.unique_tokens)
        stats["shared"] = stats.get("shared", 0) + int((recorded_per_node >= 2).sum())
        stats["conflicts"] = stats.get("conflicts", 0) + int(np.unique(nodes_P[differs_P]).size)
    return torch.from_numpy(out)


def routing_keys(tokens: list, routed: list) -> list[np.ndarray]:
    """Per sample, int64 keys that are equal exactly where (token id, recorded expert sets) are: a trie built on
    them merges two samples' prefixes only as far as their records agree. ``tokens``: token arrays; ``routed``:
    int8/int16 [L_s, L, K] arrays or None (unrecorded: -1). Expert order within a top-k does not matter."""
    shapes = {tuple(r.shape[1:]) for r in routed if r is not None}
    if len(shapes) > 1:
        raise ValueError(f"routing replay: samples recorded different [layers, topk] shapes {sorted(shapes)}")
    width = int(np.prod(shapes.pop())) if shapes else 0
    cols = []
    for t, r in zip(tokens, routed):
        t = np.asarray(t, dtype=np.int64)
        rows = (np.full((t.size, width), -1, np.int64) if r is None else
                np.sort(np.asarray(r, dtype=np.int64), axis=-1).reshape(t.size, width))
        cols.append(np.concatenate([t[:, None], rows], axis=1))
    _, ids = np.unique(np.concatenate(cols), axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    bounds = np.cumsum([0] + [c.shape[0] for c in cols])
    return [ids[lo:hi].astype(np.int64) for lo, hi in zip(bounds[:-1], bounds[1:])]


def split_tree(tokens: list, routed: list):
    """The prefix forest of ``tokens`` merged only where the recorded experts agree (see :func:`routing_keys`), with
    the real token ids in its layout."""
    from dataclasses import replace

    from forge_megatron.tree import build_tree

    layout = build_tree(routing_keys(tokens, routed))
    tokens_T = torch.empty_like(layout.tokens)
    tokens_T[layout.sample_nodes] = torch.from_numpy(np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens]))
    return replace(layout, tokens=tokens_T)
