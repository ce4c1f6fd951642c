"""The agent-RL training loop on Megatron-Core: pool -> prefix trees -> Megatron schedules -> CISPO -> optimizer ->
weight sync -> checkpoint.

One iteration:
  1. wait   rank 0 pulls ``train_batch_groups`` groups from the data pool over ZeroMQ and broadcasts the batch
            (msgpack header + raw arrays, never pickle) to every rank; the groups are split over the DP ranks by
            estimated compute (``--dp-balance``, :mod:`forge_megatron.training.balance`)
  2. pack   the rank's samples are packed into micro-batches of at most ``--tree-token-budget`` unique tokens and
            each micro-batch becomes one prefix forest (``--no-tree-merging``: one sample per micro-batch);
  3. f/b    Megatron's ``get_forward_backward_func`` runs the micro-batches (PP schedules included); per sample the
            loss is ``algo.policy_loss`` over next-token logprobs, with pi_old = the rollout logprobs recorded by
            the engines (fully async) or a no-grad recompute pass (``--old-logprobs recompute``). With the default
            token-mean normalisation the loss of the whole rank batch is exact across micro-batches:
                L = sum_mb sum_{i in mb} w_i sum_t m_it l_it / sum_{batch} m      (Megatron divides by #mb, we undo it)
  4. step   Megatron's optimizer (Adam; distributed optimizer on GPUs) and LR scheduler;
  5. sync   every ``--weight-sync-interval`` steps the new weights go to the engines and the policy version
            (gateway, pool) increments;
  6. save   every ``--save-interval`` steps a checkpoint, then the pool commits the batches it contains (with
            ``--async-save`` written in the background and committed once every rank has written it).
Metrics per step go to the JSONL file / tensorboard / wandb (:mod:`forge_megatron.training.metrics`).

Legend: M = next-token targets of the samples of a micro-batch, S = samples, S1 = S + 1, L = one sample's tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from forge_megatron.training import arguments
from forge_megatron.training.checkpoint import (
    AsyncCheckpointSaver, latest_iteration, load_checkpoint, load_hf_weights, save_checkpoint, saved_meta,
)
from forge_megatron.training.metrics import (
    EvalFeed, MetricsWriter, batch_metrics, combine_micro_batch_metrics, combine_update_metrics,
)

log = logging.getLogger("forge.trainer")


# ------------------------------------------------------------------------------------------- micro-batches
@dataclass
class RankBatch:
    """The samples this rank trains on in one iteration, as micro-batches, plus the batch-level normaliser."""

    micro_batches: list
    num_loss_tokens: float  # loss tokens of this rank's share
    samples: list
    batch_id: int
    pool_metrics: dict = field(default_factory=dict)
    global_loss_tokens: float | None = None  # loss tokens of the whole batch, over every DP rank
    dp_size: int = 1
    global_sample_weight: float | None = None  # sum of the sample weights of the whole batch, over every DP rank
    dp_loads: list = field(default_factory=list)  # estimated compute of every DP rank's share (training.balance)
    overlong_samples: int = 0  # samples of the whole batch left out for exceeding the token budget
    dp_split_groups: int = 0  # groups whose episodes were dealt to several DP ranks (training.balance)


def _targets(arr: np.ndarray) -> torch.Tensor:
    """Per-token array of one sample [L] -> values at its next-token targets [L-1]."""
    return torch.from_numpy(np.ascontiguousarray(arr[1:]))


def _images_of(samples: list) -> list | None:
    """Every sample's images (``TrainSample.images``), or None when no sample has any."""
    images = [getattr(s, "images", None) or [] for s in samples]
    return images if any(images) else None


def with_image_inputs(samples: list, vision) -> list:
    """``samples`` with their encoded images made into multimodal.ImageInput patches by ``vision`` (the checkpoint's
    multimodal.images.ImageProcessor; images already ImageInput pass as they are)."""
    from forge_megatron.multimodal import ImageInput

    if _images_of(samples) is None:
        return samples
    if vision is None:
        from forge_megatron.multimodal.families import SUPPORTED

        raise ValueError(f"samples with images, but the model takes none (training on images is supported for "
                         f"{SUPPORTED} vision-language checkpoints)")
    out = []
    for s in samples:
        images = getattr(s, "images", None)
        if images and not all(isinstance(x, ImageInput) for x in images):
            if not hasattr(vision, "image_input"):
                raise ValueError("encoded images need the checkpoint's image processor (its preprocessor_config.json)")
            s = dataclasses.replace(s, images=[vision.image_input(x) for x in images])
        out.append(s)
    return out


def _drop_image_mismatches(samples: list, spec, batch_id) -> list:
    """``samples`` less those whose prompt's image tokens do not match their images (logged): training them would
    stop every restart of the run at this batch."""
    from forge_megatron.multimodal.families import split_runs

    kept = []
    for s in samples:
        try:
            split_runs(s.tokens, [im.grid_thw for im in getattr(s, "images", None) or ()], spec, s.loss_mask)
        except ValueError as exc:
            log.warning("batch %s: a sample of episode %s left out: %s", batch_id, s.episode_id, exc)
            continue
        kept.append(s)
    if not kept:
        raise RuntimeError(f"batch {batch_id}: no sample of this DP rank has image tokens matching its images")
    return kept


def micro_batch_of(samples: list, domains: list[str], routing_replay: bool = False, split: bool = False,
                   vision=None):
    """One ``TreeMicroBatch``: the prefix forest of ``samples`` and their per-target loss inputs (and, with
    ``routing_replay``, the tree tokens' recorded experts: mcore/routing_replay.py; ``split`` merges prefixes only
    where the recorded experts agree). Samples with images (``TrainSample.images``) need the model's ``vision``
    spec (a multimodal.VisionSpec, or the ImageProcessor that encodes them: :func:`with_image_inputs`): the tree
    merges them only where their images agree too (multimodal/tree.py)."""
    from forge_megatron.mcore.forward import TreeMicroBatch
    from forge_megatron.tree import build_tree

    samples = with_image_inputs(samples, vision)
    images = _images_of(samples)
    if images is not None:
        vision = getattr(vision, "spec", vision)
        if routing_replay and split:
            raise ValueError("--routing-replay-split with images is not supported: merge by tokens and images")
        from forge_megatron.multimodal import build_vision_tree

        layout = build_vision_tree([s.tokens.astype(np.int64) for s in samples], images, vision,
                                   samples_sampled=[s.loss_mask for s in samples])
    elif routing_replay and split:
        from forge_megatron.mcore.routing_replay import split_tree

        layout = split_tree([s.tokens for s in samples], [getattr(s, "routed_experts", None) for s in samples])
    else:
        layout = build_tree([s.tokens.astype(np.int64) for s in samples])
    lengths_S = torch.tensor([len(s.tokens) - 1 for s in samples], dtype=torch.int64)
    extras = {
        "loss_mask_M": torch.cat([_targets(s.loss_mask).float() for s in samples]),
        "rollout_logp_M": torch.cat([_targets(s.rollout_logprobs).float() for s in samples]),
        "policy_versions_M": torch.cat([_targets(s.policy_versions).long() for s in samples]),
        "advantages_M": torch.cat([_targets(s.advantages).float() for s in samples]),
        "cu_seqlens_S1": torch.cat([torch.zeros(1, dtype=torch.int64), lengths_S.cumsum(0)]),
        "sample_weight_S": torch.tensor([s.sample_weight for s in samples], dtype=torch.float32),
        "domain_ids_S": torch.tensor([domains.index(s.domain) for s in samples], dtype=torch.int64),
        "group_S": torch.tensor([s.group_index for s in samples], dtype=torch.int64),
        "reward_S": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        # the segment's return (a critic's value target, --critic); the episode's reward where the pool sent none
        "return_S": torch.tensor([s.reward if getattr(s, "segment_return", None) is None else s.segment_return
                                  for s in samples], dtype=torch.float32),
    }
    if any(getattr(s, "call_rewards", None) for s in samples):  # rewards of single calls: a critic's GAE reads them
        rewards_M = torch.zeros_like(extras["loss_mask_M"])
        for start, s in zip(extras["cu_seqlens_S1"].tolist(), samples):
            for p, r in s.call_rewards or ():
                rewards_M[start + p - 1] += r  # (token p is the target of position p - 1)
        extras["call_reward_M"] = rewards_M
    extras.update(_recorded_teacher(samples, extras["loss_mask_M"], extras["cu_seqlens_S1"]))
    routing, stats = None, {}
    if routing_replay:
        from forge_megatron.mcore.routing_replay import tree_routing

        routing = tree_routing(layout, [getattr(s, "routed_experts", None) for s in samples], stats)
    return TreeMicroBatch(layout=layout, extras=extras, routing=routing, routing_stats=stats)


def _recorded_teacher(samples: list, loss_mask_M: torch.Tensor, cu_seqlens_S1: torch.Tensor) -> dict:
    """A served teacher's recordings of ``samples`` (the gateway's --teacher-urls / --teacher-topk) as micro-batch
    extras: ``teacher_logp_M`` (its logprobs of the targets; with ``teacher_mask_M`` when some samples have none:
    episodes recorded before the gateway had a teacher) and, for the samples with a top-k, ``distill_index_X`` (their
    trained targets, one per sampled token in order) with ``teacher_topk_ids_XK`` / ``teacher_topk_logp_XK``."""
    extras = {}
    teacher = [getattr(s, "teacher_logprobs", None) for s in samples]
    if any(t is not None for t in teacher):
        extras["teacher_logp_M"] = torch.cat([_targets(t).float() if t is not None else
                                              torch.zeros(len(s.tokens) - 1) for s, t in zip(samples, teacher)])
        if not all(t is not None for t in teacher):
            extras["teacher_mask_M"] = torch.cat([torch.full((len(s.tokens) - 1,), float(t is not None))
                                                  for s, t in zip(samples, teacher)])
    tops = [(i, s) for i, s in enumerate(samples) if getattr(s, "teacher_topk_ids", None) is not None]
    if tops:
        index, ids, logp = [], [], []
        for i, s in tops:
            lo, hi = int(cu_seqlens_S1[i]), int(cu_seqlens_S1[i + 1])
            trained = lo + torch.nonzero(loss_mask_M[lo:hi]).flatten()
            if s.teacher_topk_ids.shape[0] != trained.numel():
                raise ValueError(f"sample {s.episode_id} carries {s.teacher_topk_ids.shape[0]} rows of teacher top-k "
                                 f"for {trained.numel()} trained tokens")
            index.append(trained)
            ids.append(torch.from_numpy(np.asarray(s.teacher_topk_ids, dtype=np.int64)))
            logp.append(torch.from_numpy(np.asarray(s.teacher_topk_logprobs, dtype=np.float32)))
        extras.update(distill_index_X=torch.cat(index), teacher_topk_ids_XK=torch.cat(ids),
                      teacher_topk_logp_XK=torch.cat(logp))
    return extras


def rank_batch(batch, token_budget: int, merging: bool, dp_rank: int, dp_size: int, domains: list[str],
               balance: str = "cost", hidden_size: int = 1, interleaved_pp: int | None = None,
               routing_replay: bool = False, routing_split: bool = False, overlong: str = "drop",
               vision=None) -> RankBatch:
    """Split a pool batch over DP ranks by group and pack this rank's share into micro-batches.

    ``balance``: ``cost`` gives each DP rank groups of near-equal estimated compute (:mod:`training.balance`, with
    the model's ``hidden_size``), dealing the episodes of a group that costs more than a rank's share to several
    ranks; ``cost-groups`` keeps groups whole; ``round-robin`` deals them in index order. Every rank computes the
    same split.
    ``domains`` (the names behind the per-domain metric ids) grows with new domains in batch order, which is the
    same on every rank. ``interleaved_pp`` (the PP size, for the interleaved schedule) makes the number of
    micro-batches a multiple of it (splitting the largest ones); with PP = 2 it also pads every micro-batch to the
    longest one (:func:`interleaved_needs_fixed_length`). ``routing_replay`` attaches the samples' recorded experts
    to the micro-batches; ``routing_split`` also packs and merges them only where those records agree.
    ``overlong``: a sample longer than ``token_budget`` cannot fit in any micro-batch; ``drop`` leaves it out (on
    every rank alike, counted in ``overlong_samples``, warned about), ``error`` raises. A crash here would come back
    with the same batch after every restart, so ``drop`` is the default.
    """
    from forge_megatron.training.balance import assign_episodes
    from forge_megatron.tree import pack_micro_batches

    domains.extend(sorted({s.domain for s in batch.samples} - set(domains)))
    trainable = [s for s in batch.samples if len(s.tokens) >= 2]
    too_long = [s for s in trainable if len(s.tokens) > token_budget]
    if too_long:
        longest = max(len(s.tokens) for s in too_long)
        if overlong == "error":
            raise ValueError(f"batch {batch.batch_id}: {len(too_long)} sample(s) longer than --tree-token-budget "
                             f"{token_budget} (the longest has {longest} tokens); raise the budget or use "
                             "--overlong-samples drop")
        if dp_rank == 0:
            log.warning("batch %d: %d sample(s) longer than --tree-token-budget %d (up to %d tokens) left out of "
                        "training; raise the budget to the gateway's context length to train them",
                        batch.batch_id, len(too_long), token_budget, longest)
        trainable = [s for s in trainable if len(s.tokens) <= token_budget]
    by_group: dict = {}
    for s in trainable:
        by_group.setdefault(s.group_index, {}).setdefault(s.episode_id, []).append(s.tokens)
    groups = sorted(set(s.group_index for s in batch.samples))
    parts, loads = assign_episodes(by_group, dp_size, balance, hidden_size, merging)
    whole = {u.group for u in parts[dp_rank] if u.episodes is None}
    pieces = {(u.group, e) for u in parts[dp_rank] if u.episodes is not None for e in u.episodes}
    samples = [s for s in trainable if s.group_index in whole or (s.group_index, s.episode_id) in pieces]
    split_groups = len({u.group for part in parts for u in part if u.episodes is not None})
    if not samples:
        raise RuntimeError(f"DP rank {dp_rank} got no trainable samples from batch {batch.batch_id} "
                           f"({len(groups)} groups for {dp_size} DP ranks, {len(too_long)} sample(s) over the token "
                           "budget left out): raise --train-batch-groups or --tree-token-budget")
    samples = with_image_inputs(samples, vision)  # this DP rank's only
    if vision is not None:
        samples = _drop_image_mismatches(samples, getattr(vision, "spec", vision), batch.batch_id)
    if merging:
        seqs = [s.tokens for s in samples]
        if routing_replay and routing_split:  # the budget counts the tree that will be built
            from forge_megatron.mcore.routing_replay import routing_keys

            seqs = routing_keys(seqs, [getattr(s, "routed_experts", None) for s in samples])
        elif vision is not None and _images_of(samples) is not None:  # likewise: images merge only when equal
            from forge_megatron.multimodal.tree import sample_keys

            seqs = sample_keys(seqs, _images_of(samples), getattr(vision, "spec", vision),
                               [s.loss_mask for s in samples])[0]
        parts = pack_micro_batches(seqs, token_budget, keys=[s.group_index for s in samples])
    else:
        parts = [[i] for i in range(len(samples))]
    if interleaved_pp:
        parts = split_to_multiple(parts, interleaved_pp, batch.batch_id)
    mbs = [micro_batch_of([samples[i] for i in part], domains, routing_replay, routing_split, vision)
           for part in parts]
    if interleaved_pp and interleaved_needs_fixed_length(interleaved_pp):
        length = max(mb.layout.unique_tokens for mb in mbs)
        for mb in mbs:
            mb.pad_tokens = length - mb.layout.unique_tokens
            mb.layout, mb.fixed_length = mb.layout.padded(length), True
    num_loss_tokens = float(sum(mb.extras["loss_mask_M"].sum() for mb in mbs))
    sample_weight = float(sum(mb.extras["sample_weight_S"].double().sum() for mb in mbs))
    global_tokens, global_weight = _sum_over_dp([num_loss_tokens, sample_weight], dp_size)
    return RankBatch(mbs, num_loss_tokens, samples, batch.batch_id, batch.metrics, global_loss_tokens=global_tokens,
                     dp_size=dp_size, global_sample_weight=global_weight, dp_loads=loads,
                     overlong_samples=len(too_long), dp_split_groups=split_groups)


PER_UPDATE_KEYS = ("loss", "pg_loss", "kl", "ratio_mean", "ppo_kl", "clip_frac_low", "clip_frac_high", "num_tokens")
"""With several updates per step, each one's terms listed in the metrics (``ppo/per_update``, JSONL)."""


def merge_rank_batches(rbs: list[RankBatch]) -> RankBatch:
    """One step's mini-batches (--ppo-mini-batches) as one rank batch, for its metrics: micro-batches, samples and
    counts together, every DP rank's estimated compute summed."""
    if len(rbs) == 1:
        return rbs[0]

    def total(name):
        values = [getattr(rb, name) for rb in rbs]
        return None if any(v is None for v in values) else float(sum(values))

    return RankBatch([mb for rb in rbs for mb in rb.micro_batches], float(sum(rb.num_loss_tokens for rb in rbs)),
                     [s for rb in rbs for s in rb.samples], rbs[0].batch_id, rbs[0].pool_metrics,
                     global_loss_tokens=total("global_loss_tokens"), dp_size=rbs[0].dp_size,
                     global_sample_weight=total("global_sample_weight"),
                     dp_loads=[float(sum(loads)) for loads in zip(*(rb.dp_loads for rb in rbs))],
                     overlong_samples=sum(rb.overlong_samples for rb in rbs),
                     dp_split_groups=sum(rb.dp_split_groups for rb in rbs))


def batch_kl(update: dict, rb: RankBatch) -> float:
    """An update's ``ppo_kl`` over the whole mini-batch: this rank's token mean (its metrics, every pipeline stage's
    after :func:`pipeline_loss_metrics`; the CP ranks compute the same) weighted by its tokens, summed over DP."""
    kl, n = _sum_over_dp([update.get("ppo_kl", 0.0) * update.get("num_tokens", 0.0), update.get("num_tokens", 0.0)],
                         rb.dp_size)
    return kl / max(n, 1e-12)


def whiten_advantages(rbs: list[RankBatch], sum_over_dp) -> dict:
    """--whiten-advantages without a critic: the pool's advantages of every trained token of the step's rank batches
    whitened over the whole batch, every DP rank's tokens (zero mean, unit variance: REINFORCE++'s normalisation
    across the batch instead of within each group). Every rank holds its micro-batches' whole extras (context
    parallelism shards the compute, not them), so the DP group is what holds other tokens. Returns the mean and
    standard deviation they had (``advantages/raw_mean``, ``advantages/raw_std``)."""
    micro_batches = [mb for rb in rbs for mb in rb.micro_batches]
    sums = torch.zeros(3, dtype=torch.float64)  # trained tokens, sum A, sum A^2
    for mb in micro_batches:
        m, a = mb.extras["loss_mask_M"].double(), mb.extras["advantages_M"].double()
        sums += torch.stack([m.sum(), (m * a).sum(), (m * a * a).sum()])
    n, s, s2 = sum_over_dp(sums.tolist(), rbs[0].dp_size)
    n = max(n, 1.0)
    mean = s / n
    std = max(s2 / n - mean * mean, 0.0) ** 0.5
    for mb in micro_batches:
        x = mb.extras
        x["advantages_M"] = ((x["advantages_M"] - mean) / (std + 1e-8) * x["loss_mask_M"]).float()
    return {"advantages/raw_mean": mean, "advantages/raw_std": std}


def combine_critic_updates(updates: list[dict]) -> dict:
    """The critic's metrics over one step's updates: the value loss and clip fraction token-weighted, the gradient
    norm their mean, ``update_ok`` when every update stepped, ``update_s`` their sum."""
    if not updates:
        return {}
    weights = [u.pop("critic/num_tokens") for u in updates]
    out = {"critic/grad_norm": float(np.mean([u["critic/grad_norm"] for u in updates])),
           "critic/update_ok": all(u["critic/update_ok"] for u in updates),
           "critic/update_s": float(sum(u["critic/update_s"] for u in updates))}
    for key in ("critic/vf_loss", "critic/vf_clip_frac"):
        if key in updates[0]:
            out[key] = float(np.average([u[key] for u in updates], weights=weights)) if sum(weights) > 0 else \
                float(np.mean([u[key] for u in updates]))
    return out


def interleaved_needs_fixed_length(pp: int) -> bool:
    """With PP = 2 a stage's previous and next stage are the same rank, and megatron-core's exchange of variable
    shapes (batched, one tag) then mixes up the two directions: the interleaved schedule needs one length per step.
    With PP >= 3 the neighbours differ and variable lengths are exchanged safely (no padding compute)."""
    return pp == 2


def split_to_multiple(parts: list[list[int]], multiple: int, batch_id=None) -> list[list[int]]:
    """Split the micro-batches holding most samples in two (order kept) until their number is a multiple of
    ``multiple``: Megatron's interleaved schedule runs micro-batches in groups of PP."""
    parts = [list(p) for p in parts]
    while len(parts) % multiple:
        i = max(range(len(parts)), key=lambda j: (len(parts[j]), -j))
        if len(parts[i]) < 2:
            raise ValueError(f"the interleaved pipeline needs a multiple of {multiple} micro-batches, but this rank's "
                             f"share of batch {batch_id} has only {sum(map(len, parts))} samples in {len(parts)} "
                             f"micro-batches: raise --train-batch-groups or lower --tree-token-budget")
        half = (len(parts[i]) + 1) // 2
        parts[i:i + 1] = [parts[i][:half], parts[i][half:]]
    return parts


def _sum_over_dp(values: list[float], dp_size: int) -> list[float]:
    """Sums of ``values`` over the data-parallel ranks (DP ranks hold different groups of one batch)."""
    if dp_size == 1 or not dist.is_initialized():
        return list(values)
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.parallel import comm_device

    group = ps.get_data_parallel_group()
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, group=group)
    return t.cpu().tolist()


def batch_loss_config(loss_cfg, rb: RankBatch):
    """CISPO's token mean over the *whole batch* as a constant normaliser on every rank.

    L = (1/G) sum over all G loss tokens of the batch. Megatron's DDP averages gradients over the D data-parallel
    ranks, so rank r contributes (D/G) sum over its own tokens: normaliser G/D. Dividing by the rank's own count
    instead would weight the ranks' tokens unequally whenever their token counts differ.
    With ``constant`` the user's divisor C plays the role of G (rank normaliser C / D). ``seq_mean`` likewise divides by
    the batch's summed sample weight W (rank normaliser W / D) instead of each micro-batch's own.
    """
    from dataclasses import replace

    if loss_cfg.norm == "constant":
        return replace(loss_cfg, norm_constant=loss_cfg.norm_constant / rb.dp_size)
    if loss_cfg.norm == "seq_mean":
        weight = rb.global_sample_weight if rb.global_sample_weight is not None else float(
            sum(mb.extras["sample_weight_S"].double().sum() for mb in rb.micro_batches))
        if weight <= 0:
            raise ValueError(f"batch {rb.batch_id}: sample weights sum to {weight}: the seq_mean normaliser is 0")
        return replace(loss_cfg, norm_constant=weight / rb.dp_size)
    if loss_cfg.norm != "token_mean":
        return loss_cfg
    total = rb.global_loss_tokens if rb.global_loss_tokens is not None else rb.num_loss_tokens
    return replace(loss_cfg, norm="constant", norm_constant=max(total, 1.0) / rb.dp_size)


def forward_backward(ddp, rb: RankBatch, loss_cfg, domains: list[str], fused_logprobs: bool = True,
                     head_dtype: torch.dtype | None = None, policy_version: int | None = None,
                     temperature: float = 1.0, forward_only: bool = False) -> list[dict]:
    """Forward and backward of every micro-batch through Megatron's schedule; per-micro-batch loss metrics.

    ``fused_logprobs``: the output layer is fused into the logprobs (no [tokens, vocabulary] logits at any time,
    mcore.forward.output_layer_deferred); otherwise Megatron's output layer makes the logits and they are scored
    chunk by chunk. ``head_dtype`` (fused only): the output layer's matmul dtype (``torch.float32``: fp32 LM head).
    ``policy_version``: the version of the weights being trained; tokens it sampled get the ``onpolicy/...``
    training/inference mismatch metrics. ``temperature``: tokens are scored under softmax(logits / temperature)
    (``--rollout-temperature``). ``forward_only``: the loss and its metrics without a backward (a critic's warm-up
    steps)."""
    from forge_megatron.algo.losses import policy_loss
    from forge_megatron.mcore.forward import make_tree_forward_step

    num_mb = len(rb.micro_batches)
    cfg = batch_loss_config(loss_cfg, rb)
    # Under context parallelism every CP rank computes this same loss (logp_M is summed over the CP group) and
    # back-propagates only into its own token shard; DDP averages over the DP x CP ranks and Megatron's schedule
    # multiplies each micro-batch loss by the CP size, so the shards' gradients add up (tested against one rank).

    def loss_fn(logp_M, entropy_M, mb, topk_logp_XK=None):
        x = {k: v.to(logp_M.device) for k, v in mb.extras.items()}
        old = x.get("old_logp_M", x["rollout_logp_M"])
        loss, metrics = policy_loss(
            logp_M, old, x["advantages_M"], x["loss_mask_M"], x["cu_seqlens_S1"], cfg,
            rollout_logp_M=x["rollout_logp_M"], entropy_M=entropy_M, sample_weight_S=x["sample_weight_S"],
            domain_ids_S=x["domain_ids_S"], domain_names=domains, ref_logp_M=x.get("ref_logp_M"),
            teacher_logp_M=x.get("teacher_logp_M"), teacher_topk_logp_XK=x.get("teacher_topk_logp_XK"),
            topk_logp_XK=topk_logp_XK, distill_index_X=x.get("distill_index_X"),
            teacher_mask_M=x.get("teacher_mask_M"),
            on_policy_M=None if policy_version is None else x["policy_versions_M"] == policy_version)
        # A batch-wide normaliser: undo Megatron's division of each micro-batch loss by the micro-batch count.
        return loss * (num_mb if cfg.norm_constant is not None else 1), metrics

    dense = loss_cfg.distill_kl != "sampled"  # the student's logprobs of the teacher's top-k tokens too
    return run_schedule(ddp, rb, make_tree_forward_step(loss_fn, with_entropy=loss_cfg.entropy_coef > 0,
                                                        fused_output=fused_logprobs, head_dtype=head_dtype,
                                                        temperature=temperature,
                                                        topk_key="teacher_topk_ids_XK" if dense else None),
                        forward_only=forward_only)


OFFLINE_MODES = ("sft", "dpo", "rm", "kto")


def offline_loss_count(rb: RankBatch, mode: str, args) -> float:
    """What an offline mode's loss is a mean over, for the whole batch: trained tokens (``sft``), pairs (``dpo``,
    ``rm``: two samples each) or examples (``kto``: two samples each with the mismatched ones, else one). Every
    sample weighs 1, so the counts follow from the summed sample weight."""
    if mode == "sft":
        return rb.global_loss_tokens if rb.global_loss_tokens is not None else rb.num_loss_tokens
    weight = rb.global_sample_weight if rb.global_sample_weight is not None else len(rb.samples)
    return weight if mode == "kto" and args.kto_no_kl else weight / 2


def offline_forward_backward(ddp, rb: RankBatch, mode: str, args, fused_logprobs: bool = True,
                             head_dtype: torch.dtype | None = None, forward_only: bool = False) -> list[dict]:
    """The forward and backward of an offline mode (training/offline.py) through Megatron's schedule: ``sft``
    (``--sft-data``: the trained tokens' NLL; with a teacher's top-k in the extras, ``--teacher-hf-checkpoint
    --distill-kl``, supervised distillation: :func:`offline.tree_sft_distill_loss`), ``dpo`` (``--preference-data``:
    DPO / IPO / SimPO, the reference's logprobs already in the extras), ``rm`` (``--reward-model``: Bradley-Terry on
    the score head) or ``kto`` (``--kto-data``: the reference's logprobs and the batch's reference point ``kto_kl``
    in the extras). Each micro-batch's summed loss is divided by the whole batch's count
    (:func:`offline_loss_count`), over the D data-parallel ranks that DDP averages; Megatron's division by the
    micro-batch count is undone as in :func:`forward_backward`. Scored at temperature 1: the model's own
    distribution. ``args``: the ``--dpo-*``, ``--simpo-gamma``, ``--rm-center-coef`` and ``--kto-*`` values."""
    from forge_megatron.mcore.forward import make_score_forward_step, make_tree_forward_step
    from forge_megatron.training.offline import (
        tree_bradley_terry_loss, tree_dpo_loss, tree_kto_loss, tree_sft_distill_loss, tree_sft_loss,
    )

    if mode not in OFFLINE_MODES:
        raise ValueError(f"offline mode {mode!r}: one of {OFFLINE_MODES}")
    num_mb = len(rb.micro_batches)
    norm = max(offline_loss_count(rb, mode, args), 1.0) / rb.dp_size

    def scaled(total, metrics):
        loss = total / norm
        metrics["loss"] = loss.item()
        return loss * num_mb, metrics

    if mode == "rm":
        step = make_score_forward_step(
            lambda scores_S, mb: scaled(*tree_bradley_terry_loss(scores_S, mb.extras, args.rm_center_coef)))
    else:
        # supervised distillation: the trainer's teacher gave its top-k at the trained tokens (--distill-kl)
        distil = mode == "sft" and all("teacher_topk_ids_XK" in mb.extras for mb in rb.micro_batches)

        def loss_fn(logp_M, entropy_M, mb, topk_logp_XK=None):
            x = {k: v.to(logp_M.device) for k, v in mb.extras.items()}
            if mode == "sft" and topk_logp_XK is not None:
                return scaled(*tree_sft_distill_loss(logp_M, x, topk_logp_XK, args.distill_kl,
                                                     args.distill_outcome_coef, args.distill_coef,
                                                     args.distill_jsd_beta))
            if mode == "sft":
                return scaled(*tree_sft_loss(logp_M, x))
            if mode == "kto":
                return scaled(*tree_kto_loss(logp_M, x, args.kto_beta, args.kto_desirable_weight,
                                             args.kto_undesirable_weight))
            return scaled(*tree_dpo_loss(logp_M, x, args.dpo_beta, args.dpo_loss, args.dpo_label_smoothing,
                                         args.dpo_sft_coef, args.simpo_gamma))

        step = make_tree_forward_step(loss_fn, fused_output=fused_logprobs, head_dtype=head_dtype,
                                      topk_key="teacher_topk_ids_XK" if distil else None)
    return run_schedule(ddp, rb, step, forward_only=forward_only)


def kto_reference_point(rbs: list[RankBatch], dp_size: int) -> float:
    """KTO's reference point ``z0 = max(0, mean log-ratio of the mismatched samples)`` over the rank batches ``rbs``
    (every micro-batch, every data-parallel rank): a training batch, or a whole held-out set. From the policy's
    ``kto_policy_logp_M`` (a forward-only pass on the step's start weights) and the reference's ``ref_logp_M``; set as
    ``extras["kto_kl"]`` of every micro-batch and returned. The last pipeline stage holds the logprobs; the others,
    which compute no loss, sum nothing."""
    from forge_megatron.training.offline import kto_mismatched_logratios

    total, count = 0.0, 0.0
    for mb in (mb for rb in rbs for mb in rb.micro_batches):
        if "kto_policy_logp_M" in mb.extras:
            r = kto_mismatched_logratios(mb.extras["kto_policy_logp_M"], mb.extras)
            total, count = total + float(r.sum()), count + r.numel()
    total, count = _sum_over_dp([total, count], dp_size)
    z0 = max(0.0, total / count) if count else 0.0
    for mb in (mb for rb in rbs for mb in rb.micro_batches):
        mb.extras["kto_kl"] = torch.tensor(z0, dtype=torch.float64)
    return z0


def run_schedule(ddp, rb: RankBatch, forward_step, forward_only: bool = False) -> list[dict]:
    """Megatron's forward(-backward) schedule over the rank batch's micro-batches; ``ddp`` is the list of DDP model
    chunks from :func:`build_model_and_optimizer` (pipelined when PP > 1, interleaved with several chunks)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from forge_megatron.mcore import routing_replay

    routing_replay.reset(ddp)  # no recomputation queue left over from an earlier run (e.g. a forward-only pass)
    # every chunk reads the micro-batches (the tree's mask and depths are needed in every stage's attention)
    data = [iter(rb.micro_batches) for _ in ddp] if len(ddp) > 1 else iter(rb.micro_batches)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=list(ddp),
        num_microbatches=len(rb.micro_batches), seq_length=max(mb.layout.unique_tokens for mb in rb.micro_batches),
        micro_batch_size=1, forward_only=forward_only)


# -------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Owns the model, optimizer, pool connection and weight syncer of one rank."""

    def __init__(self, args: argparse.Namespace):
        from megatron.core import parallel_state as ps

        from forge_megatron.bridge import Bridge
        from forge_megatron.mcore import parallel

        self.args = args
        # offline modes (training/offline.py): batches from a file, not the pool
        self.preference = getattr(args, "preference_data", None) is not None  # DPO / a reward model on pairs
        self.sft = getattr(args, "sft_data", None) is not None  # supervised fine-tuning
        self.kto = getattr(args, "kto_data", None) is not None  # KTO on examples labelled good or bad
        # (KTO's reference point from its mismatched samples, unless --kto-no-kl)
        self.kto_kl = self.kto and not getattr(args, "kto_no_kl", False)
        self.offline = self.preference or self.sft or self.kto
        self.train_tower = bool(getattr(args, "train_vision_tower", False))
        self.reward_model = self.preference and bool(getattr(args, "reward_model", False))
        source = args.hf_checkpoint
        if self.reward_model:  # the checkpoint made a sequence classifier: a score head, no LM head
            from forge_megatron.bridge.families import load_hf_config, reward_labels, reward_model_config

            source = reward_model_config(load_hf_config(args.hf_checkpoint))
            if reward_labels(source) != 1:
                raise ValueError(f"--reward-model: {args.hf_checkpoint} has {reward_labels(source)} labels; "
                                 "Bradley-Terry training takes one")
        # a frozen reference policy: the KL term's (--rl-kl-coef > 0), DPO's / IPO's (not SimPO's, not a reward
        # model's) or KTO's
        self.needs_reference = arguments.uses_reference_policy(args)
        try:  # with --train-vision-tower the tower's tensors are the model's too
            self.bridge = Bridge(source, vision_tower=self.train_tower)
        except ValueError as exc:
            if not self.train_tower:
                raise
            raise ValueError(f"--train-vision-tower: {exc}") from exc
        parallel.initialize(arguments.parallel_config(args, self.bridge.cfg.num_layers), seed=args.seed)
        self.rank = dist.get_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.cfg = model_config(args, self.bridge)
        self.loss_cfg = arguments.loss_config(args)
        mini = getattr(args, "ppo_mini_batches", 1)
        if mini > 1 and arguments.train_batch_groups(args) < mini * self.dp_size:
            raise ValueError(f"--ppo-mini-batches {mini} with {self.dp_size} data-parallel ranks needs at least "
                             f"{mini * self.dp_size} groups per batch (every rank trains on every mini-batch), "
                             f"--train-batch-groups is {arguments.train_batch_groups(args)}")
        if arguments.updates_per_iteration(args) > 1 and self.rank == 0:
            self._log(f"{arguments.updates_per_iteration(args)} optimizer steps per batch (--ppo-mini-batches {mini} "
                      f"x --ppo-epochs {getattr(args, 'ppo_epochs', 1)}), pi_old from "
                      + ("a forward pass before the first (--old-logprobs recompute)"
                         if args.old_logprobs == "recompute" else "the engines' logprobs (--old-logprobs rollout)"))
        if self.rank == 0:
            self._log_memory_plan()
        self.domains = sorted(args.domain_ratios)
        # model chunks (one per virtual pipeline stage; one without interleaving) and their DDP wrappers
        tower = self.bridge.hf_config if self.train_tower else None
        self.chunks, self.ddp, self.optimizer, self.scheduler = build_model_and_optimizer(args, self.cfg, tower)
        if self.rank == 0 and getattr(args, "overlap_grad_reduce", False):
            buckets = sum(len(b.buckets) for d in self.ddp for b in [*d.buffers, *d.expert_parallel_buffers])
            self._log(f"--overlap-grad-reduce: {buckets} gradient bucket(s) on rank 0, each reduced over DP as soon as "
                      "the backward has filled it")
        if self.rank == 0 and getattr(args, "overlap_param_gather", False):
            groups = sum(len(d.bucket_groups) + len(d.expert_parallel_bucket_groups) for d in self.ddp)
            self._log(f"--overlap-param-gather: {groups} parameter bucket group(s) on rank 0, each all-gathered in the "
                      "next forward (right after the step when the weights are synced or saved)")
        qat = arguments.int4_qat_config(args)
        if qat is not None:  # --int4-qat: the policy computes with the int4 rounding the engines serve
            from forge_megatron.mcore import int4_qat

            rounded = int4_qat.install(self.bridge, self.chunks, qat)
            if self.rank == 0:
                self._log(f"--int4-qat: {len(rounded)} weight(s) on rank 0 computed with their int4 rounding (group "
                          f"{qat.group}), straight-through gradients to the full-precision weights")
        # The frozen reference policy (the KL term's, DPO's): same layout, no gradients, no optimizer.
        # A LoRA run's reference, the checkpoint's model, is the policy with its adapters off (no second copy)
        self.lora_reference = self.needs_reference and arguments.lora_reference(args)
        if self.lora_reference and self.rank == 0:
            self._log("reference: the policy with its LoRA adapters off (the checkpoint's model; no copy of the "
                      "weights)")
        self.ref_chunks = build_reference_model(self.cfg, tower) \
            if self.needs_reference and not self.lora_reference else None
        if qat is not None and self.ref_chunks is not None:  # the KL's reference rounded as the policy is
            int4_qat.install(self.bridge, self.ref_chunks, qat)
        self.ref_offload = None  # --ref-offload: HostOffload of ref_chunks, made once their weights are loaded
        self.teacher = None  # --teacher-hf-checkpoint: on-policy distillation (training/distill.py)
        if getattr(args, "teacher_hf_checkpoint", None):
            from forge_megatron.training.distill import Teacher

            self.teacher = Teacher(args, self.bridge, model_config, build_reference_model)
        self.critic = None  # --critic: PPO's learned value function (training/critic.py)
        if getattr(args, "critic", False):
            from forge_megatron.training.critic import Critic

            self.critic = Critic(args, self.bridge, model_config, build_model_and_optimizer)
        self.critic_metrics: dict = {}  # this step's (set by forward_backward)
        if getattr(args, "routing_replay", False):
            from forge_megatron.mcore import routing_replay

            if not self.bridge.cfg.num_moe_experts:
                raise ValueError("--routing-replay needs a MoE model (the HF config has no experts)")
            routing_replay.install(self.chunks)
            if self.ref_chunks is not None:  # the reference scores the sampled tokens through the same experts
                routing_replay.install(self.ref_chunks)
        self.vision = self._install_vision()
        self.iteration, self.policy_version, self.last_batch_id = 0, 0, None
        self.params_gathered = True  # False between an optimizer step and the all-gather --overlap-param-gather defers
        self.saved_at: int | None = None  # the iteration of the newest checkpoint this run wrote or resumed from
        self.started = time.monotonic()
        self.stop_reason: str | None = None  # this rank's: an exit signal, --exit-duration-in-mins
        self.stopping = False  # agreed by every rank: save and stop after this iteration
        self.watch_stop = bool(getattr(args, "exit_signal_handler", False) or
                               getattr(args, "exit_duration_in_mins", None) or getattr(args, "exit_file", None))
        self.exit_file = getattr(args, "exit_file", None) if self.rank == 0 else None
        if self.exit_file and os.path.exists(self.exit_file):
            os.remove(self.exit_file)
            self._log(f"--exit-file {self.exit_file} was there before the start (left from an earlier run?): removed")
        if getattr(args, "exit_signal_handler", False):
            name = getattr(args, "exit_signal", "SIGTERM")
            signal.signal(getattr(signal, name), lambda *_: setattr(self, "stop_reason", f"exit signal {name}"))
        self.saver = AsyncCheckpointSaver() if getattr(args, "async_save", False) else None  # every rank: a group
        self.pool = self._pool_client() if self.rank == 0 and not self.offline else None
        self.feed = self._offline_feed() if self.rank == 0 and self.offline else None
        self.eval_feed = self._offline_feed(args.offline_eval_data) \
            if self.rank == 0 and getattr(args, "offline_eval_data", None) else None
        self.syncer = make_syncer(args, self.bridge) if args.weight_sync_transport != "none" else None
        self.writer = MetricsWriter(args) if self.rank == 0 else None
        self.evals = EvalFeed(args.gateway_url, os.environ.get("FORGE_ADMIN_TOKEN")) \
            if self.rank == 0 and args.gateway_url else None
        context = self.bridge.cfg.max_position_embeddings
        if args.tree_token_budget < context:  # the gateway lets a segment grow up to the context length
            fate = "an error" if getattr(args, "overlong_samples", "drop") == "error" else "left out"
            self._log(f"note: --tree-token-budget {args.tree_token_budget} is below the model's context length "
                      f"{context}; longer samples are {fate} (--overlong-samples; counted as overlong_samples)")
        self._resume_or_init()

    # -- set-up ------------------------------------------------------------------------------------------
    def _install_vision(self):
        """A vision-language checkpoint whose images the trainer takes (multimodal/families.py): the model chunks (and
        the reference's) put the images' features and mRoPE positions into their forward (mcore/vision.py); the
        frozen vision tower is loaded on the first micro-batch with images (with --train-vision-tower the first
        model piece's own trains, mcore.vision.attach_tower). Returns the checkpoint's ImageProcessor
        (multimodal/images.py: the pool's encoded images become patches with it); None (samples with images are
        refused) for a text model or another vision-language family."""
        if not self.bridge.family.multimodal:
            return None
        from forge_megatron.multimodal import vision_spec

        try:
            spec = vision_spec(self.bridge.hf_config)
        except ValueError as e:
            self._log(f"note: {e}; samples with images will be refused")
            return None
        from forge_megatron.mcore import vision
        from forge_megatron.weight_sync.gather import unwrap

        def loader(path: str, tower_spec=spec):
            tower = {}

            def load():
                if "module" not in tower:
                    from forge_megatron.multimodal import load_vision_tower

                    param = next(unwrap(self.chunks[0]).parameters())
                    tower["module"] = load_vision_tower(path, tower_spec, dtype=param.dtype, device=param.device)
                    self._log(f"vision tower of {path} loaded (frozen, "
                              f"{sum(p.numel() for p in tower['module'].parameters()) / 1e6:.1f}M parameters)")
                return tower["module"]
            return load

        if self.teacher is not None:  # a vision-language teacher runs its own frozen tower, its features apart
            for chunk in self.teacher.chunks:
                vision.install(unwrap(chunk), self.teacher.spec, loader(self.teacher.dir, self.teacher.spec),
                               key="teacher")
        if self.train_tower:  # the first piece's own (mcore.vision.attach_tower), loaded with the language model
            self._install_trained_tower(spec)
        else:
            policy = loader(self.args.hf_checkpoint)
            for chunk in self.chunks:
                vision.install(unwrap(chunk), spec, policy)
            # a reference from another checkpoint runs that checkpoint's tower, its features kept apart
            ref_dir = getattr(self.args, "ref_hf_checkpoint", None)
            other = ref_dir and os.path.realpath(ref_dir) != os.path.realpath(self.args.hf_checkpoint)
            for chunk in self.ref_chunks or []:
                vision.install(unwrap(chunk), spec, loader(ref_dir) if other else policy,
                               key="reference" if other else "frozen")
        from forge_megatron.multimodal.images import ImageProcessor

        try:
            return ImageProcessor(self.args.hf_checkpoint, self.bridge.hf_config)
        except ValueError as e:  # no preprocessor_config.json, or one that disagrees with the model
            self._log(f"note: {e}; samples with encoded images will be refused")
            return spec

    def _install_trained_tower(self, spec) -> None:
        """--train-vision-tower: the policy's chunks run the first piece's tower with gradients, the reference's its
        own frozen copy (features kept apart by key)."""
        from forge_megatron.mcore import vision
        from forge_megatron.weight_sync.gather import unwrap

        for key, chunks in (("policy", self.chunks), ("reference", self.ref_chunks or [])):
            for chunk in chunks:
                vision.install(unwrap(chunk), spec, key=key, trained=True)
        own = getattr(unwrap(self.chunks[0]), vision.TOWER, None)
        if own is not None:
            n = sum(p.numel() for p in own.parameters())
            trained = sum(p.numel() for p in own.parameters() if p.requires_grad)
            part = "" if trained == n else f", {trained / 1e6:.2f}M of them trained (--vision-trainable)"
            self._log(f"vision tower trained with the language model ({n / 1e6:.1f}M parameters on the first "
                      f"pipeline stage{part})")

    def _log_memory_plan(self) -> None:
        """What forge-plan says this layout puts on each GPU (parameters exactly, memory roughly), in the log."""
        from forge_megatron.bridge import Bridge
        from forge_megatron.training import plan

        a = self.args
        try:
            result = plan.plan(self.bridge, dist.get_world_size(), a.tensor_model_parallel_size,
                               a.pipeline_model_parallel_size, a.expert_model_parallel_size, a.context_parallel_size,
                               arguments.virtual_pipeline_size(a, self.bridge.cfg.num_layers), a.bf16,
                               a.use_distributed_optimizer, self.needs_reference,
                               a.tree_token_budget,
                               a.recompute_granularity, bool(getattr(a, "sequence_parallel", False)),
                               etp=getattr(a, "expert_tensor_parallel_size", None),
                               # a trained tower's parameters (its activations, measured, are forge-plan's)
                               **({"vision_trainable": getattr(a, "vision_trainable", None),
                                   "image_token_fraction": 0.0} if self.bridge.vision_tower else {}),
                               lora=arguments.lora_config(a), lora_reference_copy=not arguments.lora_reference(a),
                               teacher=Bridge(a.teacher_hf_checkpoint) if getattr(a, "teacher_hf_checkpoint", None)
                               else None,
                               critic=plan.critic_bridge(getattr(a, "critic_hf_checkpoint", None) or a.hf_checkpoint)
                               if getattr(a, "critic", False) else None)
        except Exception as exc:  # noqa: BLE001 - a report, never a reason to stop
            log.warning("memory plan unavailable: %s", exc)
            return
        for r in result["ranks"]:
            static = r["weights_gib"] + r["grads_gib"] + r["optimizer_gib"] + r["reference_gib"] + \
                r.get("teacher_gib", 0.0) + r.get("critic_gib", 0.0)
            lora = f", {r['params_lora']:,} of them LoRA adapters (the rest frozen)" if "params_lora" in r else ""
            self._log(f"memory plan, pipeline rank {r['pp_rank']}: {r['params_dense'] + r['params_expert']:,} "
                      f"parameters per GPU ({r['params_expert']:,} in experts{lora}), {static:.2f} GiB of weights, "
                      f"gradients and optimizer state, about {r['activations_gib_estimate']:.2f} GiB of "
                      "activations (forge-plan" + ("; the vision tower's not included: forge-plan "
                                                   "--train-vision-tower estimates them"
                                                   if self.bridge.vision_tower and r["pp_rank"] == 0 else "") + ")")

    def _offline_feed(self, held_out: str | None = None):
        """The batches of --sft-data, --preference-data or --kto-data (training/offline.py), or of the ``held_out``
        file of --offline-eval-data in the same form; made on rank 0."""
        from forge_megatron.training.offline import KtoFeed, PreferenceFeed, SftFeed

        per_step = arguments.train_batch_groups(self.args)
        if self.kto:  # (a held-out set's mismatched answers drawn with a seed of their own)
            feed = KtoFeed(held_out or self.args.kto_data, self.args.hf_checkpoint, per_step,
                           self.args.tree_token_budget, self.args.seed + (held_out is not None),
                           kl=self.kto_kl, processor=self.vision, log=self._log)
        elif held_out is not None:
            cls = SftFeed if self.sft else PreferenceFeed
            feed = cls(held_out, self.args.hf_checkpoint, per_step, self.args.tree_token_budget, self.args.seed,
                       self.vision, log=self._log)
        if held_out is not None:
            self._log(f"--offline-eval-data {held_out}: {len(feed.items)} held-out items, evaluated every "
                      f"{self.args.offline_eval_interval or self.args.train_iters} iterations")
            return feed
        if self.kto:
            from forge_megatron.training.kto import balance_note

            balance = balance_note(feed.items, self.args.kto_desirable_weight, self.args.kto_undesirable_weight)
            self._log(f"--kto-data {self.args.kto_data}: {len(feed.items)} examples, {per_step} per step: "
                      f"{feed.epochs(self.args.train_iters):.2f} epoch(s) over {self.args.train_iters} iterations "
                      f"(KTO, beta {self.args.kto_beta:g}; {balance})")
            return feed
        if self.sft:
            feed = SftFeed(self.args.sft_data, self.args.hf_checkpoint, per_step, self.args.tree_token_budget,
                           self.args.seed, self.vision, log=self._log)
            self._log(f"--sft-data {self.args.sft_data}: {len(feed.items)} samples, {per_step} per step: "
                      f"{feed.epochs(self.args.train_iters):.2f} epoch(s) over {self.args.train_iters} iterations")
            return feed
        pairs = per_step
        feed = PreferenceFeed(self.args.preference_data, self.args.hf_checkpoint, pairs, self.args.tree_token_budget,
                              self.args.seed, self.vision, log=self._log)
        what = "a Bradley-Terry reward model" if self.reward_model else \
            f"DPO {self.args.dpo_loss}, beta {self.args.dpo_beta:g}"
        self._log(f"--preference-data {self.args.preference_data}: {len(feed.pairs)} pairs, {pairs} per step: "
                  f"{feed.epochs(self.args.train_iters):.2f} epoch(s) over {self.args.train_iters} iterations "
                  f"({what})")
        return feed

    def _pool_client(self):
        from forge_megatron.middleware.transport import PoolClient

        return PoolClient(self.args.pool_addr, timeout_s=30.0, retries=20)

    def _resume_or_init(self) -> None:
        if self.ref_chunks is not None:  # always the given checkpoint, also on resume: the reference never moves
            ref = self.args.ref_hf_checkpoint or self.args.hf_checkpoint
            load_hf_weights(self.ref_chunks, self.bridge, ref)
            term = "DPO" if self.preference else "KTO" if self.kto else "KL"
            self._log(f"reference model for the {term} term loaded from {ref}")
            if getattr(self.args, "ref_offload", False):
                from forge_megatron.training.offload import HostOffload

                self.ref_offload = HostOffload(self.ref_chunks)
                self._log(f"reference model offloaded to host memory ({self.ref_offload.nbytes / 2**20:.1f} MiB "
                          "on this rank; on the device only for its forward pass)")
        if self.teacher is not None:  # never trained: from its HF checkpoint at every start
            self.teacher.load(self._log)
            if getattr(self.args, "teacher_offload", False):
                self.teacher.offload_to_host(self._log)
        iteration = latest_iteration(self.args.load)
        if iteration is None:
            load_hf_weights(self.chunks, self.bridge, self.args.hf_checkpoint)
            # With --bf16 Megatron's optimizer keeps fp32 master copies made when it was built (from Megatron's own
            # init); without this the first step would write those back over the HF weights. No-op in fp32.
            self.optimizer.reload_model_params()
            self._log(f"initialised from HF checkpoint {self.args.hf_checkpoint}")
            if self.critic is not None:
                self.critic.init_from_hf(self._log)
        else:
            meta = saved_meta(self.args.load, iteration) or {}
            saved_tower = bool(meta.get("vision_tower", False))
            trainable = getattr(self.args, "vision_trainable", "*")
            if saved_tower and self.train_tower and (meta.get("vision_trainable") or "*") != trainable:
                raise ValueError(f"checkpoint {self.args.load} iteration {iteration} was saved with "
                                 f"--vision-trainable {meta.get('vision_trainable') or '*'!r} (its optimizer holds "
                                 f"state for those parameters only), this run asks for {trainable!r}: resume with the "
                                 "same globs")
            if saved_tower and not self.train_tower:
                raise ValueError(f"checkpoint {self.args.load} iteration {iteration} was saved with "
                                 "--train-vision-tower (its model holds the trained vision tower, which a frozen tower "
                                 "would replace by the HF checkpoint's): resume with it, or export the checkpoint "
                                 "(forge-convert trainer-to-hf) and start from the export")
            if self.train_tower and not saved_tower:
                state = self._unfreeze_tower(iteration)
            else:
                if arguments.lora_config(self.args) is not None:  # its checkpoints hold the adapters alone, the
                    from forge_megatron.convert.trainer_checkpoint import lora_base  # frozen weights: the base's

                    lora_base([meta], self.args.hf_checkpoint)  # (refused unless the run trained over it)
                    load_hf_weights(self.chunks, self.bridge, self.args.hf_checkpoint)
                state = load_checkpoint(self.args.load, iteration, self.ddp, self.optimizer, self.scheduler,
                                        self._log)
            self.iteration, self.policy_version = state["iteration"], state["policy_version"]
            self.saved_at = self.iteration
            self.last_batch_id = state["last_batch_id"]
            self._log(f"resumed from {self.args.load} at iteration {iteration} (policy version "
                      f"{self.policy_version}, last batch {self.last_batch_id})")
            if self.critic is not None:
                self.critic.resume(self.args.load, iteration, self._log)
        if self.pool is not None:
            arguments.check_pool_config(self.args, self.pool.metrics().get("config", {}))
            requeued = self.pool.requeue_uncommitted()
            self.pool.set_policy_version(self.policy_version)
            if requeued:
                self._log(f"pool re-serves {len(requeued)} delivered-but-uncommitted groups")
        if self.rank == 0 and self.args.gateway_url:
            self._check_gateway()
        if iteration is not None and self.syncer is not None:
            self._sync()  # the engines may still serve weights newer than this checkpoint

    def _hf_fingerprint(self) -> str:
        if getattr(self, "_fingerprint", None) is None:
            from forge_megatron.convert.checkpoint import weights_fingerprint

            self._fingerprint = weights_fingerprint(self.args.hf_checkpoint)
        return self._fingerprint

    def _unfreeze_tower(self, iteration: int) -> dict:
        """Resume checkpoint ``iteration`` of a run whose vision tower was frozen with --train-vision-tower: the
        language model and its optimizer state as saved (resharded by name), the tower from --hf-checkpoint (what
        the frozen run encoded with) with fresh optimizer state."""
        from forge_megatron.convert.checkpoint import HFReader
        from forge_megatron.convert.trainer_checkpoint import read_rank_metadata
        from forge_megatron.training.reshard import load_resharded

        reader = HFReader(self.args.hf_checkpoint)

        def weights(name: str):
            return self.bridge.from_hf(name, reader.get(self.bridge.hf_names(name)))

        self._log(f"checkpoint {self.args.load} iteration {iteration} was saved with the vision tower frozen: it "
                  f"trains from here (--train-vision-tower), starting from {self.args.hf_checkpoint}'s weights with "
                  "fresh optimizer state")
        return load_resharded(self.args.load, iteration, list(self.ddp), self.optimizer, self.scheduler,
                              read_rank_metadata(self.args.load, iteration), fresh=(self.bridge, weights))

    def _check_gateway(self) -> None:
        """The gateway must sample training calls at this trainer's --rollout-temperature (a gateway that cannot be
        reached now is only warned about: weight sync will find it, or say so)."""
        from forge_megatron.agents.gateway_api import GatewayClient

        try:
            state = GatewayClient(self.args.gateway_url, os.environ.get("FORGE_ADMIN_TOKEN"), timeout_s=10.0).state()
        except Exception as exc:  # noqa: BLE001 - unreachable or refusing: not a reason to stop here
            log.warning("could not read %s/forge/admin/state to check its sampling temperature: %s",
                        self.args.gateway_url, exc)
            return
        arguments.check_gateway_config(self.args, state.get("config", {}))

    def _log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[forge-train] {message}", flush=True)

    # -- one iteration -----------------------------------------------------------------------------------
    def next_batch(self):
        """Rank 0 waits for the pool's batch; every rank gets a copy (wire format over the process group). None on
        every rank when rank 0 was told to stop while waiting (an exit signal, --exit-duration-in-mins)."""
        batch = None
        if self.feed is not None:
            batch = self.feed.batch(self.iteration)
        elif self.rank == 0:
            groups = arguments.train_batch_groups(self.args)
            deadline = time.monotonic() + self.args.batch_timeout_s
            while batch is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no batch of {groups} groups from {self.args.pool_addr} within "
                                       f"{self.args.batch_timeout_s:.0f}s (are rollouts running?)")
                batch = self.pool.get_batch(groups, timeout_s=min(left, 2.0 if self.watch_stop else 20.0))
                if batch is None and self._stop_asked():  # a batch that is there is trained (and saved) first
                    break
        return broadcast_batch(batch)

    def _stop_asked(self) -> bool:
        """This rank was told to stop: an exit signal came, --exit-duration-in-mins has passed, or (rank 0) the
        --exit-file exists."""
        minutes = getattr(self.args, "exit_duration_in_mins", None)
        if self.stop_reason is None and minutes and time.monotonic() - self.started >= 60 * minutes:
            self.stop_reason = f"--exit-duration-in-mins {minutes:g}"
        if self.stop_reason is None and self.exit_file and os.path.exists(self.exit_file):
            self.stop_reason = f"--exit-file {self.exit_file}"
        return self.stop_reason is not None

    def _agree_to_stop(self) -> bool:
        """Whether any rank was told to stop (one all-reduce when an exit signal or duration is configured)."""
        if not self.watch_stop:
            return False
        from forge_megatron.mcore.parallel import comm_device

        flag = torch.tensor([int(self._stop_asked())], dtype=torch.int32, device=comm_device())
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _reference_logprobs(self, rbs: list[RankBatch]) -> None:
        """The reference policy's logprobs (the KL term's, DPO's, KTO's) as ``ref_logp_M`` of every micro-batch of the
        rank batches ``rbs`` (an offloaded reference comes to the device once for all of them)."""
        if self.ref_chunks is not None:
            with self.ref_offload.resident() if self.ref_offload is not None else contextlib.nullcontext():
                for rb in rbs:
                    self._forward_only_logprobs(self.ref_chunks, rb, "ref_logp_M")
        elif self.lora_reference:
            from forge_megatron.mcore import lora

            with lora.disabled(self.chunks):
                for rb in rbs:
                    self._forward_only_logprobs(self.ddp, rb, "ref_logp_M")

    @property
    def offline_mode(self) -> str | None:
        """``sft``, ``dpo``, ``rm`` or ``kto`` (training/offline.py); None for RL."""
        if not self.offline:
            return None
        return "sft" if self.sft else "kto" if self.kto else "rm" if self.reward_model else "dpo"

    def _prepare(self, rbs: list[RankBatch]) -> None:
        """The forward-only passes the updates read, over every mini-batch on the weights of the step's start (before
        its first update): pi_old (--old-logprobs recompute), the reference's logprobs, a teacher's."""
        if self.args.old_logprobs == "recompute":
            for rb in rbs:
                self._forward_only_logprobs(self.ddp, rb, "old_logp_M")
        if self.kto_kl:  # KTO's reference point: the policy's KL on mismatched answers
            for rb in rbs:
                self._forward_only_logprobs(self.ddp, rb, "kto_policy_logp_M")
        self._reference_logprobs(rbs)
        if self.kto_kl:
            for rb in rbs:  # (each update's batch its own)
                kto_reference_point([rb], self.dp_size)
        if self.teacher is not None:
            self._teacher_pass(rbs)
        elif getattr(self.args, "teacher_from_gateway", False):
            for rb in rbs:
                self._recorded_teacher_check(rb)

    def forward_backward(self, rb: RankBatch, first: bool = True, forward_only: bool = False) -> list[dict]:
        """One update's forward and backward over the prepared ``rb``; ``first``: the step's first update (the only
        one on the weights that sampled the on-policy tokens: the ``onpolicy/...`` metrics)."""
        if self.cfg.dsa_indexer_loss_coeff:
            from forge_megatron.mcore import dsa

            dsa.set_indexer_loss_scale(1.0 / len(rb.micro_batches))  # as Megatron scales its auxiliary losses
        if self.offline:
            return offline_forward_backward(self.ddp, rb, self.offline_mode, self.args, self.args.fused_logprobs,
                                            self.head_dtype)
        return forward_backward(self.ddp, rb, self.loss_cfg, self.domains, self.args.fused_logprobs,
                                self.head_dtype, self.policy_version if first else None, self.temperature,
                                forward_only=forward_only)

    def _mini_batches(self, batch) -> list:
        """The batch's groups shuffled into --ppo-mini-batches sub-batches of near-equal group counts (the same on
        every rank, and for the same groups after a restart: seeded by --seed and the group indices)."""
        m = getattr(self.args, "ppo_mini_batches", 1)
        if m == 1:
            return [batch]
        groups = sorted({s.group_index for s in batch.samples})
        if len(groups) < m:
            self._log(f"batch {batch.batch_id}: {len(groups)} groups for --ppo-mini-batches {m}: {len(groups)} "
                      "mini-batches")
            m = len(groups)
        order = np.random.default_rng([self.args.seed, *groups]).permutation(groups)
        parts = [set(part.tolist()) for part in np.array_split(order, m)]
        return [dataclasses.replace(batch, samples=[s for s in batch.samples if s.group_index in part],
                                    group_indices=sorted(part)) for part in parts]

    def _update_order(self, n: int, batch, epoch: int) -> list[int]:
        """The mini-batches' order in --ppo-epochs pass ``epoch``: as drawn in the first, reshuffled after."""
        if epoch == 0 or n == 1:
            return list(range(n))
        groups = sorted({s.group_index for s in batch.samples})
        return np.random.default_rng([self.args.seed, epoch, *groups]).permutation(n).tolist()

    @torch.no_grad()
    def offline_eval(self) -> dict:
        """``--offline-eval-data``: a forward-only pass over the held-out file in batches of the training size (rank
        0 reads it, every rank gets each batch as in :meth:`next_batch`); ``val/loss`` (the mean over its pairs, or
        its trained tokens for SFT) and the mode's means (``val/accuracy``, ``val/margin``), summed over the
        data-parallel ranks. KTO's reference point is the whole held-out set's (whatever its batches)."""
        from megatron.core import parallel_state as ps

        from forge_megatron.mcore.parallel import comm_device
        from forge_megatron.training.metrics import combine_micro_batch_metrics

        t0 = time.perf_counter()
        kind = self.offline_mode
        batches = iter(self.eval_feed.eval_batches(self.dp_size)) if self.eval_feed is not None else None
        sums = torch.zeros(5, dtype=torch.float64)  # loss x count, count, accuracy x n, margin x n, n
        balance = "cost-groups" if self.args.dp_balance == "cost" else self.args.dp_balance
        def score(rb: RankBatch) -> torch.Tensor:
            m = combine_micro_batch_metrics(pipeline_loss_metrics(offline_forward_backward(
                self.ddp, rb, kind, self.args, self.args.fused_logprobs, self.head_dtype, forward_only=True)))
            # this rank's loss is its items' summed loss over count / D: times that, its sum (the ranks' add up)
            count = offline_loss_count(rb, kind, self.args) / self.dp_size
            n = m.get(f"{kind}/num_pairs", m.get(f"{kind}/num_examples", 0.0))
            return torch.tensor([m["loss"] * count, count, m.get(f"{kind}/accuracy", 0.0) * n,
                                 m.get(f"{kind}/margin", 0.0) * n, n], dtype=torch.float64)

        held = []  # (KTO: every batch waits for the reference point of the whole held-out set)
        while True:
            batch = broadcast_batch(next(batches, None) if batches is not None else None)
            if batch is None:
                break
            rb = rank_batch(batch, self.args.tree_token_budget, self.args.tree_merging, self.dp_rank, self.dp_size,
                            self.domains, balance, self.cfg.hidden_size,
                            interleaved_pp=self.pp_size if len(self.chunks) > 1 else None, vision=self.vision)
            self._reference_logprobs([rb])
            if self.teacher is not None:  # supervised distillation: the held-out loss has the teacher's term too
                self._teacher_pass([rb])
            if self.kto_kl:
                self._forward_only_logprobs(self.ddp, rb, "kto_policy_logp_M")
                held.append(rb)
            else:
                sums += score(rb)
        if self.kto_kl:
            kto_reference_point(held, self.dp_size)
            for rb in held:
                sums += score(rb)
        if self.dp_size > 1:
            group = ps.get_data_parallel_group()
            sums = sums.to(comm_device(group))
            dist.all_reduce(sums, group=group)
        loss_x, count, acc_x, margin_x, n = sums.cpu().tolist()
        out = {"val/loss": loss_x / max(count, 1e-12), "val/eval_s": time.perf_counter() - t0}
        if kind != "sft":
            out.update({"val/accuracy": acc_x / max(n, 1e-12), "val/margin": margin_x / max(n, 1e-12)})
        return out

    def _indexer_loss_metrics(self) -> dict:
        """``dsa_indexer_kl``: the mean indexer loss (KL, before the coefficient) of this step's layers and
        micro-batches, over the pipeline stages and data-parallel ranks (TP ranks compute the same values)."""
        from megatron.core import parallel_state as ps

        from forge_megatron.mcore import dsa
        from forge_megatron.mcore.parallel import comm_device

        losses = dsa.pop_indexer_losses()
        t = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
        if dist.is_initialized():
            for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
                t = t.to(comm_device(group))
                dist.all_reduce(t, group=group)
        total, count = t.cpu().tolist()
        return {"dsa_indexer_kl": total / count} if count else {}

    @property
    def temperature(self) -> float:
        """The rollouts' sampling temperature the tokens are scored at; 1 (the model's own distribution) offline."""
        return 1.0 if self.offline else float(getattr(self.args, "rollout_temperature", 1.0))

    @property
    def head_dtype(self) -> torch.dtype | None:
        return torch.float32 if getattr(self.args, "fp32_lm_head", False) else None

    def _teacher_pass(self, rbs: list[RankBatch]) -> None:
        """Distillation (--teacher-hf-checkpoint): the teacher's logprobs of the sampled tokens on every micro-batch
        of the rank batches ``rbs``, and with --distill-kl forward|reverse|jsd its top-k tokens at the trained
        positions (an offloaded teacher comes to the device once for all of them)."""
        for mb in (mb for rb in rbs for mb in rb.micro_batches):  # (it scores every sample, whatever was recorded)
            mb.extras.pop("teacher_mask_M", None)
        with self.teacher.resident():
            for rb in rbs:
                if self.teacher.topk is None:
                    self._forward_only_logprobs(self.teacher.chunks, rb, "teacher_logp_M")
                else:
                    self._teacher_topk(rb)

    def _recorded_teacher_check(self, rb: RankBatch) -> None:
        """--teacher-from-gateway: every micro-batch gets the served teacher's recordings it needs, empty where its
        samples have none (episodes recorded before the gateway had --teacher-urls / --teacher-topk: they train on
        their outcome advantages alone, which the log says with the count), the top-k cut to --distill-topk."""
        dense, k = self.loss_cfg.distill_kl != "sampled", getattr(self.args, "distill_topk", 32)
        scored = trained = 0.0
        for mb in rb.micro_batches:
            x = mb.extras
            mask = x["loss_mask_M"]
            trained += float(mask.sum())
            if "teacher_logp_M" not in x:  # none of its samples were scored
                x["teacher_logp_M"], x["teacher_mask_M"] = torch.zeros_like(mask), torch.zeros_like(mask)
            if not dense:
                scored += float((mask * x.get("teacher_mask_M", torch.ones_like(mask))).sum())
                continue
            ids = x.get("teacher_topk_ids_XK")
            if ids is None:
                x.update(distill_index_X=torch.zeros(0, dtype=torch.long), teacher_topk_logp_XK=torch.zeros(0, k),
                         teacher_topk_ids_XK=torch.zeros(0, k, dtype=torch.long))
            elif ids.shape[1] < k:
                raise ValueError(f"batch {rb.batch_id}: the samples carry the teacher's top {ids.shape[1]} tokens, "
                                 f"fewer than --distill-topk {k}: start the gateway with --teacher-topk {k}")
            else:
                x["teacher_topk_ids_XK"] = ids[:, :k]
                x["teacher_topk_logp_XK"] = x["teacher_topk_logp_XK"][:, :k]
            scored += x["distill_index_X"].numel()
        if scored < trained:
            what = "top-k (the gateway's --teacher-topk)" if dense else "logprobs (the gateway's --teacher-urls)"
            self._log(f"batch {rb.batch_id}: {trained - scored:.0f} of {trained:.0f} trained tokens carry no served "
                      f"teacher {what}: episodes recorded before the gateway had a teacher; they train without the "
                      "teacher's term")

    def _teacher_topk(self, rb: RankBatch) -> None:
        """The teacher's logprobs of the sampled tokens (``teacher_logp_M``) and, at the trained positions
        (``distill_index_X``), its --distill-topk most likely tokens and their logprobs (``teacher_topk_ids_XK``,
        ``teacher_topk_logp_XK``) on every micro-batch of ``rb``, in one forward-only pass."""
        from forge_megatron.mcore.forward import make_tree_teacher_step

        def keep(logp_M, index_X, ids_XK, logp_XK, mb):
            mb.extras.update(teacher_logp_M=logp_M.detach(), distill_index_X=index_X, teacher_topk_ids_XK=ids_XK,
                             teacher_topk_logp_XK=logp_XK)
            return logp_M.sum() * 0.0, {}

        with torch.no_grad():
            run_schedule(self.teacher.chunks, rb, make_tree_teacher_step(
                keep, self.teacher.topk, vocab_limit=self.teacher.vocab, fused_output=self.args.fused_logprobs,
                head_dtype=self.head_dtype, temperature=self.temperature), forward_only=True)

    @torch.no_grad()
    def _forward_only_logprobs(self, chunks, rb: RankBatch, key: str) -> None:
        """Per-target logprobs of ``chunks`` (the policy for pi_old, or the reference model) stored as
        ``mb.extras[key]`` on every micro-batch of ``rb``, through a forward-only schedule."""
        from forge_megatron.mcore.forward import make_tree_forward_step

        # Only the last pipeline stage computes the loss, and it is also the stage whose forward-only pass stores
        # the logprobs on its micro-batches here: nothing has to travel between stages.
        def keep(logp_M, entropy_M, mb):
            mb.extras[key] = logp_M.detach()
            return logp_M.sum() * 0.0, {}

        with torch.no_grad():
            run_schedule(chunks, rb, make_tree_forward_step(keep, fused_output=self.args.fused_logprobs,
                                                            head_dtype=self.head_dtype, temperature=self.temperature),
                         forward_only=True)

    def train_step(self) -> dict | None:
        """One iteration; None when the trainer was told to stop while waiting for its batch."""
        t0 = time.perf_counter()
        batch = self.next_batch()
        if batch is None:
            self.stopping = True
            return None
        t1 = time.perf_counter()
        # (offline: each item's samples stay together, a preference pair's two sides on one DP rank)
        balance = "cost-groups" if self.offline and self.args.dp_balance == "cost" else self.args.dp_balance
        parts = self._mini_batches(batch)
        rbs = [rank_batch(part, self.args.tree_token_budget, self.args.tree_merging, self.dp_rank, self.dp_size,
                          self.domains, balance, self.cfg.hidden_size,
                          interleaved_pp=self.pp_size if len(self.chunks) > 1 else None,
                          routing_replay=getattr(self.args, "routing_replay", False),
                          routing_split=getattr(self.args, "routing_replay_split", False),
                          overlong=getattr(self.args, "overlong_samples", "drop"), vision=self.vision)
               for part in parts]
        self._prepare(rbs)
        if getattr(self.args, "routing_replay", False):
            from forge_megatron.mcore import routing_replay

            routing_replay.read_counts(self.chunks)  # the routing metrics count the training passes only
        if self.cfg.dsa_indexer_loss_coeff:
            from forge_megatron.mcore import dsa

            dsa.pop_indexer_losses()  # (likewise)
        self.critic_metrics, critic_updates, warming = {}, [], False
        if self.critic is None and getattr(self.args, "whiten_advantages", False) and not self.offline:
            self.critic_metrics = whiten_advantages(rbs, _sum_over_dp)  # (REINFORCE++'s batch normalisation)
        if self.critic is not None:  # GAE advantages from the critic's values of the step's start
            self.critic_metrics = self.critic.advantages(rbs, run_schedule, _sum_over_dp)
            warming = self.iteration < self.critic.warmup  # --critic-warmup-iters: the policy waits for the critic
        updates, oks, norms, vision_norms, log = [], [], [], [], []
        target_kl, stopped_at = getattr(self.args, "ppo_target_kl", None), None
        for epoch in range(getattr(self.args, "ppo_epochs", 1)):
            if stopped_at is not None:
                break
            for k in self._update_order(len(rbs), batch, epoch):
                log.append({"groups": list(getattr(parts[k], "group_indices", []))})
                if self.critic is not None:
                    critic_updates.append(self.critic.update(rbs[k], run_schedule, _sum_over_dp))
                    log[-1]["critic/vf_loss"] = critic_updates[-1]["critic/vf_loss"]
                if warming and epoch > 0:  # (warming up, the policy's loss is measured once per mini-batch)
                    continue
                for chunk in self.ddp:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                updates.append(combine_micro_batch_metrics(pipeline_loss_metrics(
                    self.forward_backward(rbs[k], first=not updates, forward_only=warming))))
                log[-1].update({key: updates[-1][key] for key in PER_UPDATE_KEYS if key in updates[-1]})
                if warming:
                    continue
                if target_kl is not None and len(updates) > 1 and batch_kl(updates[-1], rbs[k]) > target_kl:
                    stopped_at = len(updates) - 1  # --ppo-target-kl: this update and the rest are not taken
                    log[-1]["stopped"] = True
                    break
                if self.train_tower:
                    vision_norms.append(self._vision_grad_norm())
                ok, grad_norm, _ = self.optimizer.step()
                self.params_gathered = not self.ddp[0].ddp_config.overlap_param_gather
                oks.append(bool(ok))
                norms.append(float(grad_norm or 0.0))
                log[-1].update(grad_norm=norms[-1], update_ok=oks[-1])
        if any(oks):  # (the LR schedule advances once per iteration, whatever the updates in it)
            self.scheduler.step(increment=1)
        if self.critic is not None:
            self.critic_metrics.update(combine_critic_updates(critic_updates), **{
                "critic/lr": self.critic.step_scheduler(), "critic/warmup": float(warming)})
        ok, grad_norm = bool(oks) and all(oks), float(np.mean(norms)) if norms else 0.0
        t2 = time.perf_counter()
        rb = merge_rank_batches(rbs)
        # staleness w.r.t. the weights trained
        metrics = batch_metrics(rb, [combine_update_metrics(updates, len(rbs))],
                                self.policy_version)
        if len(rbs) > 1 and len(rb.dp_loads) > 1:  # each update waits for its slowest DP rank
            metrics["dp_load_imbalance"] = sum(max(r.dp_loads) for r in rbs) / max(
                sum(float(np.mean(r.dp_loads)) for r in rbs), 1e-12)
        if arguments.updates_per_iteration(self.args) > 1:  # (the list goes to the JSONL metrics only)
            metrics.update({"ppo/updates": float(sum(oks)), "ppo/per_update": log})
            if target_kl is not None:
                metrics["ppo/early_stop"] = float(stopped_at is not None)
        if self.offline:  # files' samples have no rewards, no sampling policy, no clipping
            metrics = {k: v for k, v in metrics.items() if not (
                k in ("episodes", "clip_frac_high") or k.endswith(("reward_mean", "success_rate"))
                or k.startswith("staleness_"))}
        if getattr(self.args, "routing_replay", False):
            metrics.update(self._routing_metrics(rb))
        if self.cfg.dsa_indexer_loss_coeff:
            metrics.update(self._indexer_loss_metrics())
        if vision_norms:
            metrics["grad_norm_vision"] = float(np.mean(vision_norms))
        metrics.update(self.critic_metrics)
        self.iteration += 1
        self.last_batch_id = batch.batch_id
        sync_s = 0.0
        if self.syncer is not None and not warming and self.iteration % self.args.weight_sync_interval == 0:
            sync_s = self._sync()
        self.stopping = self._agree_to_stop()
        ckpt_s = self._maybe_save()
        metrics.update(iteration=self.iteration, policy_version=self.policy_version, grad_norm=float(grad_norm or 0.0),
                       update_ok=bool(ok), lr=self.scheduler.get_lr(self.optimizer.param_groups[0]),
                       wait_s=t1 - t0, forward_backward_s=t2 - t1, sync_s=sync_s, checkpoint_s=ckpt_s,
                       tokens_per_s=metrics["total_tokens"] / max(t2 - t1, 1e-9))
        metrics.update({f"pool/{k}": v for k, v in batch.metrics.items() if isinstance(v, (int, float))})
        metrics["group_indices"] = list(batch.group_indices)
        if self.evals is not None:  # held-out evaluations published since the last step (agents/evaluate.py)
            metrics.update(self.evals.poll())
        interval = getattr(self.args, "offline_eval_interval", None) or self.args.train_iters
        if getattr(self.args, "offline_eval_data", None) and (
                self.iteration % interval == 0 or self.iteration == self.args.train_iters or self.stopping):
            metrics.update(self.offline_eval())
        if self.writer is not None:
            self.writer.write(self.iteration, metrics)
        return metrics

    def _vision_grad_norm(self) -> float:
        """The trained vision tower's gradient norm (before clipping; a part of grad_norm), from this step's reduced
        gradients, summed over the ranks that hold them: TP rank 0 of the first stage, each data-parallel (x CP) rank
        its shard with the distributed optimizer, else data-parallel rank 0 all of it. A collective on every rank."""
        from megatron.core import parallel_state as ps

        from forge_megatron.mcore import vision
        from forge_megatron.mcore.parallel import comm_device
        from forge_megatron.training.reshard import owned_grad_slices
        from forge_megatron.weight_sync.gather import unwrap

        own = getattr(unwrap(self.chunks[0]), vision.TOWER, None)
        total = torch.zeros(1, dtype=torch.float64)
        if own is not None and ps.get_tensor_model_parallel_rank() == 0:
            trained = [p for p in own.parameters() if p.requires_grad]
            slices = owned_grad_slices(self.optimizer, trained)
            if slices is None:  # not sharded: data-parallel rank 0 counts the whole gradients
                slices = [p.main_grad for p in trained] if ps.get_data_parallel_rank(with_context_parallel=True) == 0 \
                    else []
            for g in slices:
                total += g.double().pow(2).sum().cpu()
        total = total.to(comm_device())
        dist.all_reduce(total)
        return float(total.sqrt().item())

    def _routing_metrics(self, rb: RankBatch) -> dict:
        """Rollout routing replay, over every rank: the share of (token, MoE layer) rows replayed from the engine's
        record whose expert set the trainer's router would have chosen differently (what replay removes); and, on
        this rank, the share of shared-prefix tree tokens whose samples recorded different experts (only one set can
        be replayed for them)."""
        from forge_megatron.mcore import routing_replay
        from forge_megatron.mcore.parallel import comm_device

        counts = torch.tensor(routing_replay.read_counts(self.chunks), dtype=torch.float64, device=comm_device())
        # every rank's own tokens (without sequence parallelism TP replicas count theirs too: the ratio is unchanged)
        dist.all_reduce(counts)
        rows, mismatched = counts.tolist()
        shared = sum(mb.routing_stats.get("shared", 0) for mb in rb.micro_batches)
        conflicts = sum(mb.routing_stats.get("conflicts", 0) for mb in rb.micro_batches)
        return {"routing_replayed_rows": rows, "routing_mismatch": mismatched / rows if rows else 0.0,
                "routing_prefix_conflicts": conflicts / shared if shared else 0.0}

    def _gather_params(self) -> None:
        """With --overlap-param-gather the step leaves each rank's parameters whole only in its own slice: the other
        slices are all-gathered bucket by bucket in the next forward. Anything that reads whole parameters before
        then (the weight sync, a checkpoint) gathers them here first, synchronously (the next forward then finds its
        buckets gathered and waits for nothing)."""
        if not self.params_gathered:
            for ddp in self.ddp:
                ddp.start_param_sync(force_sync=True)
            self.params_gathered = True

    def _sync(self) -> float:
        t0 = time.perf_counter()
        self._gather_params()
        report = self.syncer.sync(self.chunks, self.policy_version + 1)
        if report.policy_version is not None:
            self.policy_version = report.policy_version
        if self.pool is not None:
            self.pool.set_policy_version(self.policy_version)
        return time.perf_counter() - t0

    def _exiting(self) -> bool:
        """--exit-interval reached before --train-iters, or every rank agreed to stop: stop after this iteration."""
        a = self.args
        return self.stopping or (
            bool(a.exit_interval) and self.iteration % a.exit_interval == 0 and self.iteration < a.train_iters)

    def _maybe_save(self) -> float:
        """Save at --save-interval, the last iteration and --exit-interval; the seconds training waited for it (with
        --async-save: for the copy to host memory, and for an earlier save still being written). Publishes a
        background save every rank has finished writing."""
        a = self.args
        if a.save is None or self.saved_at == self.iteration or self.iteration == 0 or not (
                self.iteration % (a.save_interval or a.train_iters) == 0 or self.iteration == a.train_iters
                or self._exiting()):
            if self.saver is not None:
                self.saver.poll()
            return 0.0
        self.saved_at = self.iteration
        t0 = time.perf_counter()
        self._gather_params()
        extra = {"policy_version": self.policy_version, "last_batch_id": self.last_batch_id}
        meta = {"hf_config": self.bridge.hf_config, "hf_checkpoint": os.path.abspath(a.hf_checkpoint),
                "policy_version": self.policy_version, "vision_tower": self.train_tower,
                "vision_trainable": getattr(a, "vision_trainable", "*") if self.train_tower else None}
        if arguments.lora_config(a) is not None:  # its rank files leave the frozen weights to --hf-checkpoint
            meta["hf_fingerprint"] = self._hf_fingerprint()
        iteration, batch_id = self.iteration, self.last_batch_id
        if self.critic is not None:  # first (and at once, also with --async-save): a published policy checkpoint
            self.critic.save(a.save, iteration, getattr(a, "keep_checkpoints", None))  # always has its critic

        def commit() -> None:
            if self.pool is not None and batch_id is not None:
                self.pool.commit(up_to_batch_id=batch_id)
            self._log(f"checkpoint iteration {iteration} saved to {a.save}; pool committed up to batch {batch_id}")

        if self.saver is None:
            save_checkpoint(a.save, iteration, self.ddp, self.optimizer, self.scheduler, extra, meta=meta,
                            keep=getattr(a, "keep_checkpoints", None))
            commit()
        else:
            copy_s = self.saver.save(a.save, iteration, self.ddp, self.optimizer, self.scheduler, extra, meta=meta,
                                     keep=getattr(a, "keep_checkpoints", None), on_published=commit)
            self._log(f"checkpoint iteration {iteration}: state copied to host memory in {copy_s:.2f}s, written in "
                      "the background")
        return time.perf_counter() - t0

    def run(self) -> None:
        while self.iteration < self.args.train_iters:
            m = self.train_step()
            if m is None:  # told to stop while waiting for a batch: the last iteration's checkpoint, if not saved
                self._maybe_save()
            elif self.rank == 0 and (self.iteration % self.args.log_interval == 0 or self.iteration == 1):
                self._log(progress_line(m))
            if self.stopping:
                self._log(f"{self.stop_reason or 'another rank was told to stop'}: stopping after iteration "
                          f"{self.iteration}" + (" (checkpoint saved)" if self.saved_at == self.iteration else ""))
                break
            if self._exiting():
                self._log(f"--exit-interval {self.args.exit_interval}: stopping after iteration {self.iteration}")
                break
        self.close()

    def close(self) -> None:
        if self.saver is not None:
            self.saver.poll(block=True)  # the last checkpoint is published (latest, pool commit) before exiting
        if self.writer is not None:
            self.writer.close()
        if self.syncer is not None:
            self.syncer.close()
        if self.pool is not None:
            self.pool.close()
        from forge_megatron.mcore import parallel

        parallel.destroy()


def progress_line(m: dict) -> str:
    """One console line per step; the training/inference mismatch (``rollout_kl``), the routing mismatch, the reverse
    KL to a distillation teacher, the images encoded and a held-out evaluation published since the last step show
    when they were measured."""
    if "val/loss" in m:  # --offline-eval-data: appended to the mode's line
        held = f" | val loss {m['val/loss']:.4f}" + (f" acc {m['val/accuracy']:.3f}" if "val/accuracy" in m else "")
        return progress_line({k: v for k, v in m.items() if not k.startswith("val/")}) + held
    if "sft/nll" in m:  # --sft-data (with a teacher: supervised distillation)
        teacher = (f" | nll {m['sft/nll']:.4f} teacher rkl {m['sft/distill_reverse_kl']:.3f} fkl "
                   f"{m['sft/distill_forward_kl']:.3f}" if "sft/distill_reverse_kl" in m else "")
        return (f"iter {m['iteration']} | loss {m['loss']:.4f}{teacher} | epoch {m.get('pool/epoch', 0.0):.2f} | "
                f"tokens {m['total_tokens']} (unique {m['unique_tokens']}, trained {m['sft/num_tokens']:.0f}) | fb "
                f"{m['forward_backward_s']:.1f}s")
    for kind in ("dpo", "rm", "kto"):  # --preference-data, --kto-data
        if f"{kind}/accuracy" in m:
            return (f"iter {m['iteration']} | loss {m['loss']:.4f} | accuracy {m[kind + '/accuracy']:.3f} | margin "
                    f"{m[kind + '/margin']:.3f} | epoch {m.get('pool/epoch', 0.0):.2f} | tokens {m['total_tokens']} "
                    f"(unique {m['unique_tokens']}) | fb {m['forward_backward_s']:.1f}s")
    mismatch = f" | rollout_kl {m['rollout_kl']:.2e}" if "rollout_kl" in m else ""
    if "routing_mismatch" in m:
        mismatch += f" routing {m['routing_mismatch']:.3f}"
    if "distill_reverse_kl" in m:  # --teacher-hf-checkpoint
        mismatch += f" | teacher rkl {m['distill_reverse_kl']:.3f}"
        if "distill_forward_kl" in m:  # (--distill-kl forward|reverse|jsd: both over the teacher's top-k)
            mismatch += f" fkl {m['distill_forward_kl']:.3f} top-k mass {m['distill_topk_mass']:.2f}"
    if "critic/vf_loss" in m:  # --critic
        mismatch += (f" | critic vf {m['critic/vf_loss']:.4f} ev {m['critic/explained_variance']:.2f}"
                     + (" (warm-up)" if m.get("critic/warmup") else ""))
    if "ppo/updates" in m:  # --ppo-mini-batches / --ppo-epochs
        mismatch += f" | updates {m['ppo/updates']:.0f}"
    held_out = f" | eval pass@1 {m['eval/pass@1']:.2f} (v{m['eval/policy_version']:.0f})" \
        if "eval/pass@1" in m and "eval/policy_version" in m else ""
    images = f", {m['images']} images" if "images" in m else ""
    return (f"iter {m['iteration']} | reward {m['reward_mean']:.3f} | success {m['success_rate']:.2f} | "
            f"loss {m['loss']:.4f} | clip_hi {m['clip_frac_high']:.3f}{mismatch} | tokens {m['total_tokens']} "
            f"(unique {m['unique_tokens']}{images}) | wait {m['wait_s']:.1f}s fb {m['forward_backward_s']:.1f}s "
            f"sync {m['sync_s']:.1f}s | v{m['policy_version']}{held_out}")


# ---------------------------------------------------------------------------------------- building blocks
def _router(cfg) -> tuple:
    """What the Megatron router flags can say about a config: score function, expert bias, top-k scaling, groups."""
    return (cfg.extra.get("moe_router_score_function", "softmax"),
            bool(cfg.extra.get("moe_router_enable_expert_bias", False)),
            cfg.extra.get("moe_router_topk_scaling_factor"),
            cfg.extra.get("moe_router_num_groups"), cfg.extra.get("moe_router_group_topk"))


def _check_sparse_attention_layout(args: argparse.Namespace, cfg) -> None:
    """DeepSeek sparse attention (mcore/dsa.py): no core-attention-only recomputation (the indexer needs the layer's
    input), and under pipeline parallelism no stage (or virtual chunk) that begins with a GLM "shared" layer, whose
    selection comes from the full layer before it."""
    name = args.hf_checkpoint
    if args.recompute_granularity == "selective":
        raise ValueError(f"{name} has DeepSeek sparse attention: --recompute-granularity selective recomputes core "
                         "attention without the layer's input its indexer needs; use --recompute-granularity full")
    if cfg.dsa_shared_layers and args.pipeline_model_parallel_size > 1:
        chunks = arguments.parallel_config(args, cfg.num_layers).layer_chunks(cfg.num_layers)
        starts = [r.start for r in chunks[1:] if cfg.dsa_shared_layers[r.start]]
        if starts:
            raise ValueError(f"{name}: a pipeline stage would begin at layer {starts[0]}, which reuses the indexer "
                             "selection of an earlier layer (GLM's shared indexer layers); choose a pipeline layout "
                             "whose stages begin at layers with their own indexer (--decoder-first-pipeline-num-layers"
                             " / --decoder-last-pipeline-num-layers move the boundaries)")


def model_config(args: argparse.Namespace, bridge):
    """The HF checkpoint's architecture; Megatron's network flags, when given, must agree with it."""
    from dataclasses import replace

    cfg = bridge.cfg
    if args.num_layers is not None:
        flags = arguments.gpt_config(args, vocab_size=cfg.vocab_size)
        for name in ("multi_latent_attention", "kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                     "v_head_dim", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "head_dim", "qk_layernorm", "qk_layernorm_all_heads",
                     "add_qkv_bias", "num_moe_experts", "rotary_base", "rope_scaling", "rotary_percent",
                     "moe_shared_ffn_hidden_size", "moe_dense_layers", "router", "zero_centered_norm",
                     "attention_output_gate", "shared_expert_gate", "linear_attention", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel",
                     "sparse_attention", "dsa_index_heads", "dsa_index_head_dim", "dsa_index_topk"):
            if name in ("q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim") and \
                    not cfg.multi_latent_attention:
                continue  # MLA's sizes (kv_lora_rank is None without it: compared above)
            if name.startswith("linear_") and name != "linear_attention" and not cfg.hybrid:
                continue  # Gated DeltaNet sizes (linear_attention says whether there are such layers)
            if name.startswith("dsa_") and not cfg.sparse_attention:
                continue  # the indexer's sizes (sparse_attention says whether there is one)
            if name == "rope_scaling" and not args.use_rope_scaling and \
                    (cfg.rope_scaling or {}).get("rope_type") in ("yarn", "linear", "longrope"):
                continue  # no Megatron flag expresses these: the checkpoint's scaling is used
            if name == "router":
                said, has = _router(flags), _router(cfg)
            elif name == "shared_expert_gate":
                said, has = (bool(c.extra.get("moe_shared_expert_gate")) for c in (flags, cfg))
            elif name == "linear_attention":  # per layer: L(inear, Gated DeltaNet) or F(ull attention)
                said, has = ("".join("LF"[not x] for x in c.linear_attention) if c.hybrid else "all full attention"
                             for c in (flags, cfg))
            else:
                said, has = getattr(flags, name), getattr(cfg, name)
            if said != has:
                raise ValueError(f"{name}: the model flags say {said}, the HF checkpoint "
                                 f"{args.hf_checkpoint} has {has}")
    factors = getattr(args, "longrope_factors", None)
    if factors is not None:
        from forge_megatron.mcore import rope

        if rope.rope_type(cfg.rope_scaling) != "longrope":
            raise ValueError(f"--longrope-factors: {args.hf_checkpoint} has no longrope RoPE (its RoPE scaling: "
                             f"{rope.rope_type(cfg.rope_scaling)})")
        cfg = replace(cfg, rope_scaling={**cfg.rope_scaling, "longrope_factors": factors})
    extra = dict(cfg.extra)
    rate = getattr(args, "moe_router_bias_update_rate", None)
    if rate is not None:
        if not cfg.extra.get("moe_router_enable_expert_bias"):
            raise ValueError(f"--moe-router-bias-update-rate: {args.hf_checkpoint} has no router score-correction "
                             "bias (GLM-4.5-style sigmoid routers have one)")
        if rate < 0:
            raise ValueError(f"--moe-router-bias-update-rate must be >= 0, got {rate}")
        extra.update(moe_router_bias_update_rate=rate)
    if args.context_parallel_size > 1 and (cfg.hybrid or cfg.mamba_beside_attention) and \
            (cfg.linear_num_key_heads // args.tensor_model_parallel_size) % args.context_parallel_size:
        raise ValueError(f"{args.hf_checkpoint} has Gated DeltaNet (linear attention) layers: under context "
                         f"parallelism each CP rank runs the whole tree for its share of their key heads, so "
                         f"--context-parallel-size {args.context_parallel_size} must divide the key heads per "
                         f"tensor-parallel rank ({cfg.linear_num_key_heads} / {args.tensor_model_parallel_size})")
    coeff = getattr(args, "dsa_indexer_loss_coeff", 0.0) or 0.0
    if coeff and not cfg.sparse_attention:
        raise ValueError(f"--dsa-indexer-loss-coeff: {args.hf_checkpoint} has no DeepSeek sparse attention indexer")
    if cfg.block_sparse_layers and any(cfg.block_sparse_layers) and args.recompute_granularity == "selective":
        raise ValueError(f"{args.hf_checkpoint} has block-sparse attention (MiniMax-M3): --recompute-granularity "
                         "selective recomputes core attention without the layer's input its indexer needs; use "
                         "--recompute-granularity full")
    if cfg.shortcut_moe and args.pipeline_model_parallel_size > 1:  # (LongCat-Flash: mcore/longcat.py)
        chunks = arguments.parallel_config(args, cfg.num_layers).layer_chunks(cfg.num_layers)
        if any(r.start % 2 or len(r) % 2 for r in chunks):
            raise ValueError(f"{args.hf_checkpoint} (LongCat-Flash): each checkpoint layer is two Megatron layers "
                             "(--num-layers counts these) that one pipeline piece must hold together; this layout's "
                             f"pieces hold {[len(r) for r in chunks]} layers: give every stage (and virtual chunk) an "
                             "even number (--decoder-first/last-pipeline-num-layers, "
                             "--num-layers-per-virtual-pipeline-stage)")
    if cfg.sparse_attention:
        _check_sparse_attention_layout(args, cfg)
        if coeff < 0:
            raise ValueError(f"--dsa-indexer-loss-coeff must be >= 0, got {coeff}")
    if args.context_parallel_size > 1:
        from forge_megatron.mcore.context_parallel import resolve_comm_type

        tp = args.tensor_model_parallel_size
        comm = resolve_comm_type(getattr(args, "cp_comm_type", "auto"), cfg.num_attention_heads // tp,
                                 max(1, (cfg.num_query_groups or cfg.num_attention_heads) // tp),
                                 args.context_parallel_size)
        extra.update(cp_comm_type=comm)  # Megatron hands it to every layer's core attention (TreeAttention)
        log.info("context parallelism %d: attention %s (--cp-comm-type %s)", args.context_parallel_size,
                 "all_gather (DeepSeek sparse attention gathers the keys)" if cfg.sparse_attention else comm,
                 getattr(args, "cp_comm_type", "auto"))
    overrides = {"bf16": args.bf16, "params_dtype": torch.bfloat16 if args.bf16 else torch.float32}
    if cfg.sparse_attention:
        overrides["dsa_indexer_loss_coeff"] = coeff
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if etp is not None and etp != args.tensor_model_parallel_size and not cfg.num_moe_experts:
        raise ValueError(f"--expert-tensor-parallel-size {etp}: {args.hf_checkpoint} has no experts")
    if args.tensor_model_parallel_size > 1:
        if (bridge.family.gpt_oss or (cfg.num_moe_experts and cfg.add_bias_linear)) and etp != 1:
            raise ValueError(f"{args.hf_checkpoint} has experts with biases, which Megatron trains only without "
                             "expert tensor parallelism: with --tensor-model-parallel-size "
                             f"{args.tensor_model_parallel_size} add --expert-tensor-parallel-size 1")
        if cfg.num_moe_experts and not args.sequence_parallel:
            raise ValueError(f"{args.hf_checkpoint} is a MoE model: with --tensor-model-parallel-size "
                             f"{args.tensor_model_parallel_size} it needs --sequence-parallel (Megatron-Core's MoE "
                             "layer does not train under TP without it)")
        extra.update(sequence_parallel=args.sequence_parallel)
    if (arguments.virtual_pipeline_size(args, cfg.num_layers)
            and interleaved_needs_fixed_length(args.pipeline_model_parallel_size)):
        # Interleaved with PP = 2: the micro-batches of a step are padded to one length (rank_batch).
        extra.update(variable_seq_lengths=False)
    elif args.pipeline_model_parallel_size > 1:
        # tree micro-batches differ in length; Megatron accepts that only with the all-to-all MoE dispatcher
        extra.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if args.recompute_granularity is not None:  # Megatron's TransformerConfig checks the combination
        extra.update(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                     recompute_num_layers=args.recompute_num_layers)
    if extra != cfg.extra:
        overrides["extra"] = extra
    return replace(cfg, **overrides)


def build_model_and_optimizer(args: argparse.Namespace, cfg, tower_config: dict | None = None):
    """This rank's model chunks, their DDP wrappers, Megatron's optimizer and its LR scheduler. ``tower_config``: the
    HF config of a vision-language checkpoint whose vision tower trains (``--train-vision-tower``): the first model
    piece gets it as a submodule (mcore.vision.attach_tower) before DDP wraps it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.utils.env import has_cuda

    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = [build_tree_gpt(cfg) if vpp is None else build_tree_gpt(cfg, vp_stage=v) for v in range(vpp or 1)]
    if has_cuda():
        for chunk in chunks:
            chunk.cuda()
    _attach_tower(chunks, tower_config, bool(getattr(args, "recompute_vision_tower", False)),
                  getattr(args, "vision_trainable", "*"))
    from forge_megatron.training.arguments import lora_config

    lora = lora_config(args)
    if lora is not None:  # adapters beside the frozen weights: DDP and the optimizer see the adapters alone
        from forge_megatron.mcore.lora import install as install_lora

        adapted = install_lora(chunks, lora)
        if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
            kinds = sorted({n.rsplit(".", 1)[-1] for n in adapted})
            log.info("--lora-rank %d: %d linears of this stage adapted (%s), scaling %g; every other parameter "
                     "frozen", lora.rank, len(adapted), ", ".join(kinds), lora.scaling)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=args.use_distributed_optimizer,
                                               overlap_grad_reduce=getattr(args, "overlap_grad_reduce", False),
                                               overlap_param_gather=getattr(args, "overlap_param_gather", False),
                                               bucket_size=getattr(args, "ddp_bucket_size", None))
    # As Megatron-LM does: only the first chunk's gradient buckets are overlapped with the backward.
    ddp = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=v > 0)
           for v, chunk in enumerate(chunks)]
    opt_cfg = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                              adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                              clip_grad=args.clip_grad, bf16=args.bf16,
                              use_distributed_optimizer=args.use_distributed_optimizer,
                              overlap_param_gather=getattr(args, "overlap_param_gather", False))
    optimizer = get_megatron_optimizer(opt_cfg, ddp, config_overrides=_vision_lr_overrides(args, opt_cfg))
    # What Megatron-LM's training loop wires up: the schedules call these to reduce DP (and EP/TP-shared) grads
    # after the last micro-batch and to scale the loss for mixed precision.
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = finalize_model_grads
        chunk.config.no_sync_func = ddp[0].no_sync if len(ddp) == 1 else [d.no_sync for d in ddp]
        if ddp_config.overlap_grad_reduce:  # the pipeline schedules start each chunk's reduction when it is done
            chunk.config.grad_sync_func = ddp[0].start_grad_sync if len(ddp) == 1 else [d.start_grad_sync for d in ddp]
        chunk.config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.train_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant")
    return chunks, ddp, optimizer, scheduler


def _vision_lr_overrides(args: argparse.Namespace, opt_cfg):
    """Megatron's parameter-group overrides for ``--vision-lr`` (the tower's own peak and minimum learning rates,
    beside the standard no-weight-decay groups); None (Megatron's standard ones) without it."""
    vision_lr = getattr(args, "vision_lr", None)
    if vision_lr is None:
        return None
    try:
        from megatron.core.optimizer import get_standard_config_overrides
        from megatron.core.optimizer.optimizer_config import ParamKey
    except ImportError as exc:  # an older megatron-core
        raise ValueError(f"--vision-lr needs megatron-core's parameter-group overrides (0.16 and later): {exc}") \
            from exc

    overrides = get_standard_config_overrides(opt_cfg)
    min_lr = args.min_lr * vision_lr / args.lr if args.lr else 0.0
    overrides[ParamKey(attr="is_vision_tower")] = {"max_lr": vision_lr, "min_lr": min_lr}
    return overrides


def _attach_tower(chunks: list, tower_config: dict | None, recompute: bool = False, trainable: str = "*") -> None:
    if tower_config is not None and chunks[0].pre_process:
        from forge_megatron.mcore.vision import attach_tower

        attach_tower(chunks[0], tower_config, recompute, trainable)


def build_reference_model(cfg, tower_config: dict | None = None) -> list:
    """This rank's chunks of a frozen copy of the model (the KL reference): the policy's layout and chunking, in
    eval mode, no gradients (with ``tower_config``: the vision tower too, see :func:`build_model_and_optimizer`).
    Costs one more copy of the weights (no gradients, no optimizer state) and one forward-only pass per step."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.utils.env import has_cuda

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = [build_tree_gpt(cfg) if vpp is None else build_tree_gpt(cfg, vp_stage=v) for v in range(vpp or 1)]
    if has_cuda():
        for chunk in chunks:
            chunk.cuda()
    _attach_tower(chunks, tower_config)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def weight_sync_master_addr(flag: str) -> str:
    """--weight-sync-master-addr: as given, or with 'auto' this host's name. Called on every rank: each pipeline
    stage's lead hosts its stage's weight-update group, so with 'auto' each advertises its own node (with torchrun's
    c10d rendezvous rank 0 can be on any node, so a fixed address may point elsewhere; a lead that cannot listen on
    a fixed address uses the one it routes to the engines through)."""
    import socket

    return socket.gethostname() if flag == "auto" else flag


def weight_sync_config(args: argparse.Namespace):
    """``WeightSyncConfig`` from the --weight-sync-* flags."""
    from forge_megatron.weight_sync import WeightSyncConfig

    return WeightSyncConfig(engine_urls=args.engine_urls, transport=args.weight_sync_transport,
                            bucket_bytes=int(args.weight_sync_bucket_mb * (1 << 20)), gateway_url=args.gateway_url,
                            gateway_token=os.environ.get("FORGE_ADMIN_TOKEN"), disk_dir=args.weight_sync_dir,
                            master_addr=weight_sync_master_addr(args.weight_sync_master_addr),
                            pause_mode=args.weight_sync_pause_mode,
                            fp8=arguments.weight_sync_fp8(args.weight_sync_fp8),
                            int4=arguments.weight_sync_int4(getattr(args, "weight_sync_int4", None)),
                            lora=getattr(args, "weight_sync_lora", "merged"), hf_checkpoint=args.hf_checkpoint)


def make_syncer(args: argparse.Namespace, bridge):
    """The weight syncer of ``--weight-sync-transport`` (forge_megatron.weight_sync)."""
    from forge_megatron.weight_sync import WeightSyncer

    return WeightSyncer(weight_sync_config(args), bridge)


def pipeline_loss_metrics(mb_metrics: list[dict]) -> list[dict]:
    """Under PP only the last stage computes the loss: its combined metrics go to every stage (JSON, no pickle)."""
    from megatron.core import parallel_state as ps

    from forge_megatron.training.metrics import combine_micro_batch_metrics

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return mb_metrics
    from forge_megatron.mcore.parallel import comm_device

    group, last = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    dev = comm_device(group)
    payload = json.dumps(combine_micro_batch_metrics(mb_metrics)).encode() if ps.is_pipeline_last_stage() else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=last, group=group)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev) if payload
           else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
    dist.broadcast(buf, src=last, group=group)
    return [json.loads(buf.cpu().numpy().tobytes())]


def broadcast_batch(batch):
    """Rank 0's TrainBatch to every rank: wire frames (msgpack + raw arrays) as byte tensors, no pickle (on the
    GPU under NCCL, which takes no CPU tensors). Rank 0's None (stop: no batch) is None on every rank."""
    from forge_megatron.middleware.wire import batch_from_wire, batch_to_wire, pack, unpack

    if dist.get_world_size() == 1:
        return batch
    from forge_megatron.mcore.parallel import comm_device

    dev = comm_device()
    frames = [bytes(memoryview(f)) for f in pack(*batch_to_wire(batch))] \
        if dist.get_rank() == 0 and batch is not None else []
    sizes = torch.tensor([len(f) for f in frames] if frames else [], dtype=torch.int64, device=dev)
    count = torch.tensor([len(frames)], dtype=torch.int64, device=dev)
    dist.broadcast(count, src=0)
    if int(count.item()) == 0:
        return None
    if dist.get_rank() != 0:
        sizes = torch.zeros(int(count.item()), dtype=torch.int64, device=dev)
    dist.broadcast(sizes, src=0)
    out = []
    for i, n in enumerate(sizes.cpu().tolist()):
        buf = (torch.frombuffer(bytearray(frames[i]), dtype=torch.uint8).to(dev) if frames
               else torch.empty(n, dtype=torch.uint8, device=dev))
        dist.broadcast(buf, src=0)
        out.append(buf.cpu().numpy().tobytes())
    header, arrays = unpack(out, max_bytes=1 << 34)
    return batch_from_wire(header, arrays)


def train(args: argparse.Namespace) -> None:
    """Entry point of scripts/train_forge.py."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forge-train %(message)s")
    Trainer(args).run()
