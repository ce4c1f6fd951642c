"""The Megatron trainer's offline modes: data from files in place of the data pool's batches.

``scripts/train_forge.py`` with ``--sft-data`` (supervised fine-tuning: forge-sft's data), ``--preference-data``
(DPO / IPO / SimPO: forge-dpo's pairs), ``--preference-data --reward-model`` (a Bradley-Terry reward model: forge-rm's
pairs) or ``--kto-data`` (KTO: forge-kto's examples) trains with every parallel layout, checkpoint and exit mechanism
of an RL run, but reads its batches here instead of from a pool: no pool, engines, gateway or weight sync
(docs/training.md, "Offline training at scale").

Batch ``k`` holds items ``k P .. (k + 1) P - 1`` of the epochs' shuffled orders (a new order every epoch, from the
seed), so a run resumed at iteration ``k`` trains what an uninterrupted one would. Each item becomes
:class:`~forge_megatron.middleware.batch.TrainSample` of its own group (its position in that sequence), which the
trainer keeps on one DP rank and, when it fits the token budget, in one micro-batch. The losses below return sums
over a micro-batch; the trainer divides them by the whole batch's count (tokens or pairs) over the DP ranks, so the
gradients do not depend on how the batch is split.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from forge_megatron.training import kto, sft
from forge_megatron.training.preference import (
    bt_pair_losses, implicit_rewards, load_pairs, pair_losses, render_pairs,
)


class _EpochFeed:
    """Items in epochs of shuffled orders, ``per_step`` of them a batch (see the module docstring)."""

    def __init__(self, items: list, per_step: int, seed: int):
        self.items, self.per_step, self.seed = items, per_step, seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # (one epoch at a time)
        return self._orders[epoch]

    def epochs(self, iterations: int) -> float:
        return iterations * self.per_step / len(self.items)

    def positions(self, iteration: int):
        """(position k in the sequence of items, item index) of the items of (0-based) ``iteration``."""
        for k in range(iteration * self.per_step, (iteration + 1) * self.per_step):
            epoch, i = divmod(k, len(self.items))
            yield k, self._order(epoch)[i]

    def batch(self, iteration: int):
        """The TrainBatch of (0-based) ``iteration``."""
        return self._batch(iteration, self.positions(iteration), {"epoch": self.epochs(iteration)})

    def eval_batches(self, min_items: int = 1):
        """Every item once, in file order, ``per_step`` to a batch (a last batch of fewer than ``min_items``, e.g.
        the DP ranks, joins the one before): a held-out set's batches (``--offline-eval-data``)."""
        n, size = len(self.items), self.per_step
        if n < min_items:
            raise ValueError(f"--offline-eval-data: {n} item(s) for {min_items} data-parallel ranks: each needs one")
        starts = list(range(0, n, size))
        if len(starts) > 1 and n - starts[-1] < min_items:
            starts.pop()
        for j, a in enumerate(starts):
            b = starts[j + 1] if j + 1 < len(starts) else n
            yield self._batch(-1 - j, ((k, k) for k in range(a, b)), {})

    def _batch(self, batch_id: int, positions, metrics: dict):
        raise NotImplementedError


def _sample(ids, mask, images, group: int, episode: str, domain: str, advantage: float = 1.0, reward: float = 0.0):
    from forge_megatron.middleware.batch import TrainSample

    n = len(ids)
    return TrainSample(tokens=np.asarray(ids, dtype=np.int32), loss_mask=np.asarray(mask, dtype=np.uint8),
                       rollout_logprobs=np.zeros(n, np.float32), policy_versions=np.zeros(n, np.int32),
                       advantages=np.full(n, advantage, np.float32), sample_weight=1.0, group_index=group,
                       episode_id=episode, domain=domain, reward=reward, images=list(images) or None)


class SftFeed(_EpochFeed):
    """Batches of conversations or token samples (forge-sft's ``--data`` forms: ``sft.load_chats``) for the trainer's
    ``--sft-data``, each rendered with the checkpoint's chat template (or taken as given) to one sample whose loss
    mask is what :func:`tree_sft_loss` trains. Samples longer than ``token_budget`` are left out (counted)."""

    def __init__(self, path: str, hf_dir: str, per_step: int, token_budget: int, seed: int = 0, processor=None,
                 log=print):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        chats = sft.load_chats(path)
        samples = [(c["input_ids"], c["loss_mask"], []) if "input_ids" in c else
                   sft.render(tokenizer, c["messages"], c.get("tools"), processor) for c in chats]
        sft.check_vocabulary(tokenizer, [ids for ids, _, _ in samples])
        kept = [s for s in samples if len(s[0]) <= token_budget and any(s[1][1:])]
        if len(kept) < len(samples):
            log(f"--sft-data: {len(samples) - len(kept)} sample(s) longer than --tree-token-budget {token_budget} "
                "(or training no token) left out")
        if not kept:
            raise ValueError(f"--sft-data {path}: no sample fits --tree-token-budget {token_budget}")
        super().__init__(kept, per_step, seed)

    def _batch(self, batch_id: int, positions, metrics: dict):
        from forge_megatron.middleware.batch import TrainBatch

        samples, groups = [], []
        for k, i in positions:
            samples.append(_sample(*self.items[i], group=k, episode=f"sample-{i}", domain="sft"))
            groups.append(k)
        return TrainBatch(batch_id=batch_id, samples=samples, group_indices=groups, metrics=metrics)


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PreferenceFeed(_EpochFeed):
    """Batches of preference pairs (forge-dpo's ``--data`` forms) for the trainer's ``--preference-data`` (DPO, or a
    reward model with ``--reward-model``). Each pair is two samples of one group, so that the trainer keeps them on
    one DP rank and in one micro-batch: the chosen side with advantage +1 on every token and the rejected one -1, the
    pair's margin as the chosen one's reward, what :func:`tree_dpo_loss` and :func:`tree_bradley_terry_loss` read.
    Pairs whose tree (both sides, their shared prefix once) exceeds ``token_budget`` cannot share a micro-batch and
    are left out (counted)."""

    def __init__(self, path: str, hf_dir: str, pairs_per_step: int, token_budget: int, seed: int = 0,
                 processor=None, log=print):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        pairs = render_pairs(tokenizer, load_pairs(path), processor)
        kept = [p for p in pairs
                if len(p.chosen[0]) + len(p.rejected[0]) - shared_prefix(p.chosen[0], p.rejected[0]) <= token_budget]
        if len(kept) < len(pairs):
            log(f"--preference-data: {len(pairs) - len(kept)} pair(s) whose tree is longer than --tree-token-budget "
                f"{token_budget} left out")
        if not kept:
            raise ValueError(f"--preference-data {path}: no pair fits --tree-token-budget {token_budget}")
        super().__init__(kept, pairs_per_step, seed)

    @property
    def pairs(self) -> list:
        return self.items

    def _batch(self, batch_id: int, positions, metrics: dict):
        from forge_megatron.middleware.batch import TrainBatch

        samples, groups = [], []
        for k, i in positions:
            pair = self.items[i]
            groups.append(k)
            samples += [_sample(*pair.chosen, group=k, episode=f"pair-{i}-chosen", domain="preference",
                                reward=pair.margin),  # (the reward model's margin: tree_bradley_terry_loss)
                        _sample(*pair.rejected, group=k, episode=f"pair-{i}-rejected", domain="preference",
                                advantage=-1.0)]
        return TrainBatch(batch_id=batch_id, samples=samples, group_indices=groups, metrics=metrics)


class KtoFeed(_EpochFeed):
    """Batches of KTO examples (forge-kto's ``--data`` forms) for the trainer's ``--kto-data``. Each example is a group
    of its own: its sample, with advantage +1 on every token when desirable and -1 when not, and (``kl``) its
    mismatched sample (its prompt, another example's answer: ``kto.attach_mismatched``) with advantage 0, what
    :func:`tree_kto_loss` and the trainer's reference point read. The two share the prompt, so they are one tree in
    one micro-batch; examples whose tree exceeds ``token_budget`` are left out (counted) and the mismatched answers
    drawn again among the rest."""

    def __init__(self, path: str, hf_dir: str, per_step: int, token_budget: int, seed: int = 0, kl: bool = True,
                 processor=None, log=print):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        examples = kto.render_records(tokenizer, kto.load_examples(path), processor=processor)
        kept = [e for e in examples if len(e.sample[0]) <= token_budget]
        while kl and len(kept) >= 2:
            kto.attach_mismatched(kept, seed)
            fits = [e for e in kept if len(e.sample[0]) + len(e.kl[0]) - shared_prefix(e.sample[0], e.kl[0])
                    <= token_budget]
            if len(fits) == len(kept):
                break
            kept = fits
        if len(kept) < len(examples):
            log(f"--kto-data: {len(examples) - len(kept)} example(s) whose tree (with its mismatched answer) is "
                f"longer than --tree-token-budget {token_budget} left out")
        if len(kept) < (2 if kl else 1):
            raise ValueError(f"--kto-data {path}: {len(kept)} example(s) fit --tree-token-budget {token_budget}"
                             + ("; the KL estimate needs two (or --kto-no-kl)" if kl else ""))
        self.kl = kl
        super().__init__(kept, per_step, seed)

    def _batch(self, batch_id: int, positions, metrics: dict):
        from forge_megatron.middleware.batch import TrainBatch

        samples, groups = [], []
        for k, i in positions:
            example = self.items[i]
            groups.append(k)
            samples.append(_sample(*example.sample, group=k, episode=f"example-{i}", domain="kto",
                                   advantage=1.0 if example.desirable else -1.0))
            if self.kl:
                samples.append(_sample(*example.kl, group=k, episode=f"example-{i}-mismatched", domain="kto",
                                       advantage=0.0))
        return TrainBatch(batch_id=batch_id, samples=samples, group_indices=groups, metrics=metrics)


def _sample_sums(values_M: torch.Tensor, extras: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(each sample's sum of ``values_M`` over its trained targets [S], each sample's sign: its advantage [S])."""
    cu = extras["cu_seqlens_S1"].to(values_M.device)
    S = cu.numel() - 1
    sample_M = torch.repeat_interleave(torch.arange(S, device=values_M.device), cu[1:] - cu[:-1])
    mask_M = extras["loss_mask_M"].to(values_M.device, values_M.dtype)
    sums_S = values_M.new_zeros(S).index_add(0, sample_M, values_M * mask_M)
    return sums_S, extras["advantages_M"].to(values_M.device)[cu[:-1]]


def kto_mismatched_logratios(policy_logp_M: torch.Tensor, extras: dict) -> torch.Tensor:
    """The log-ratios ``logp - ref`` (sums over the trained targets) of a micro-batch's mismatched samples (advantage
    0, :class:`KtoFeed`), from the policy's ``policy_logp_M`` and ``extras["ref_logp_M"]``."""
    ref_M = extras["ref_logp_M"].to(policy_logp_M.device, policy_logp_M.dtype)
    sums_S, sign_S = _sample_sums(policy_logp_M.detach() - ref_M, extras)
    return sums_S[sign_S == 0]


def tree_kto_loss(logp_M: torch.Tensor, extras: dict, beta: float, desirable_weight: float = 1.0,
                  undesirable_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The summed KTO loss of the examples of one trainer micro-batch (not yet divided by the batch's example count)
    and their metrics (means over the examples, under ``kto/``). ``extras``: ``loss_mask_M``, ``ref_logp_M``,
    ``advantages_M`` (+1 on a desirable example, -1 on an undesirable one, 0 on a mismatched sample, which adds no
    loss), ``cu_seqlens_S1`` and ``kto_kl``, the batch's reference point (0 when absent: ``--kto-no-kl``)."""
    ref_M = extras["ref_logp_M"].to(logp_M.device, logp_M.dtype)
    logratio_S, sign_S = _sample_sums(logp_M - ref_M, extras)
    examples = sign_S != 0
    z0 = float(extras["kto_kl"]) if "kto_kl" in extras else 0.0
    logratio_N, desirable_N = logratio_S[examples], sign_S[examples] > 0
    loss_N = kto.kto_losses(logratio_N, desirable_N, z0, beta, desirable_weight, undesirable_weight)
    means = kto.kto_metrics(logratio_N, desirable_N, z0, beta)
    metrics = {"kto/accuracy": means["accuracy"], "kto/margin": means["margin"], "kto/kl_estimate": z0}
    metrics["kto/num_examples"] = float(examples.sum())
    return loss_N.sum(), metrics


def pair_index(extras: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sample indices of the pairs of a trainer micro-batch, pair by pair: a pair's two samples
    share ``group_S``, the chosen one has advantage +1 (``advantages_M`` at its first target), the rejected -1.
    RuntimeError when the micro-batch does not hold whole pairs."""
    cu = extras["cu_seqlens_S1"].to(device)
    sign_S, group_S = extras["advantages_M"].to(device)[cu[:-1]], extras["group_S"].to(device)
    order = torch.argsort(group_S * 2 + (sign_S < 0).long())
    c, r = order[0::2], order[1::2]
    if order.numel() % 2 or not (torch.equal(group_S[c], group_S[r]) and bool((sign_S[c] > 0).all()) and
                                 bool((sign_S[r] < 0).all())):
        raise RuntimeError("a micro-batch does not hold whole preference pairs (a chosen and a rejected sample per "
                           "group): raise --tree-token-budget")
    return c, r


def tree_bradley_terry_loss(scores_S: torch.Tensor, extras: dict, center_coef: float = 0.0) -> tuple[torch.Tensor,
                                                                                                     dict]:
    """The summed Bradley-Terry loss of the pairs of one trainer micro-batch (not yet divided by the batch's pair
    count) from its samples' scores, and their metrics; a pair's margin is its chosen sample's ``reward_S``."""
    c, r = pair_index(extras, scores_S.device)
    margin_P = extras["reward_S"].to(scores_S.device, scores_S.dtype)[c]
    loss_P = bt_pair_losses(scores_S[c], scores_S[r], margin_P, center_coef)
    diff_P = (scores_S[c] - scores_S[r]).detach()
    return loss_P.sum(), {"rm/num_pairs": float(c.numel()), "rm/accuracy": (diff_P > 0).float().mean().item(),
                          "rm/margin": diff_P.mean().item(), "rm/chosen": scores_S[c].mean().item(),
                          "rm/rejected": scores_S[r].mean().item()}


def tree_dpo_loss(logp_M: torch.Tensor, extras: dict, beta: float, kind: str = "sigmoid",
                  label_smoothing: float = 0.0, sft_coef: float = 0.0, gamma: float = 0.0) -> tuple[torch.Tensor,
                                                                                                   dict]:
    """The summed DPO / IPO / SimPO loss of the pairs of one trainer micro-batch (not yet divided by the batch's pair
    count) and their metrics. ``extras``: the micro-batch's ``loss_mask_M``, ``ref_logp_M`` (the reference's
    forward-only pass; not for SimPO), ``advantages_M`` (+1 on a chosen side, -1 on a rejected one),
    ``cu_seqlens_S1`` and ``group_S`` (a pair's two samples share their group). A pair split over micro-batches is
    an error."""
    cu = extras["cu_seqlens_S1"].to(logp_M.device)
    S = cu.numel() - 1
    sample_M = torch.repeat_interleave(torch.arange(S, device=logp_M.device), cu[1:] - cu[:-1])
    mask_M = extras["loss_mask_M"].to(logp_M.dtype)
    policy_S = logp_M.new_zeros(S).index_add(0, sample_M, logp_M * mask_M)
    ref_S = None if kind == "simpo" else \
        logp_M.new_zeros(S).index_add(0, sample_M, extras["ref_logp_M"].to(logp_M.dtype) * mask_M)
    count_S = logp_M.new_zeros(S).index_add(0, sample_M, mask_M)
    c, r = pair_index(extras, logp_M.device)
    rewards_S = implicit_rewards(policy_S, count_S, ref_S, beta, kind)
    margin_P = rewards_S[c] - rewards_S[r]
    loss_P = pair_losses(margin_P, beta, kind, label_smoothing, gamma)
    if sft_coef:
        loss_P = loss_P - sft_coef * policy_S[c] / count_S[c].clamp(min=1)
    reward_c, reward_r = rewards_S[c].detach(), rewards_S[r].detach()
    metrics = {"dpo/num_pairs": float(c.numel()), "dpo/accuracy": (margin_P > 0).float().mean().item(),
               "dpo/margin": (reward_c - reward_r).mean().item(), "dpo/chosen_reward": reward_c.mean().item(),
               "dpo/rejected_reward": reward_r.mean().item()}
    return loss_P.sum(), metrics


def tree_sft_distill_loss(logp_M: torch.Tensor, extras: dict, topk_logp_XK: torch.Tensor, kind: str,
                          nll_coef: float, distill_coef: float, jsd_beta: float = 0.5) -> tuple[torch.Tensor, dict]:
    """Supervised distillation (``--sft-data`` with ``--teacher-hf-checkpoint --distill-kl forward|reverse|jsd``): the
    summed ``nll_coef * NLL + distill_coef * divergence`` over the micro-batch's trained tokens, the divergence
    between the student's and the teacher's next-token distributions over the teacher's top-k tokens and a rest
    bucket (``algo.losses.topk_kl`` / ``topk_jsd``: ``topk_logp_XK`` the student's logprobs of the teacher's tokens
    ``extras["teacher_topk_ids_XK"]``, the teacher's ``extras["teacher_topk_logp_XK"]``, at the trained targets in
    order); its metrics, the divergences' means under ``sft/``."""
    from forge_megatron.algo.losses import topk_jsd, topk_kl

    nll, metrics = tree_sft_loss(logp_M, extras)
    teacher_XK = extras["teacher_topk_logp_XK"].to(topk_logp_XK.device)
    if teacher_XK.shape != topk_logp_XK.shape or teacher_XK.shape[0] != int(metrics["sft/num_tokens"]):
        raise ValueError(f"the teacher's top-k {tuple(teacher_XK.shape)} and the student's {tuple(topk_logp_XK.shape)} "
                         f"must have one row per trained token ({int(metrics['sft/num_tokens'])})")
    forward_X, reverse_X = topk_kl(topk_logp_XK, teacher_XK)
    parts = {"forward": forward_X, "reverse": reverse_X}
    if kind == "jsd":
        parts["jsd"] = topk_jsd(topk_logp_XK, teacher_XK, jsd_beta)
    if kind not in parts:
        raise ValueError(f"supervised distillation takes a dense divergence (forward, reverse or jsd), got {kind!r}")
    n = max(forward_X.numel(), 1)
    metrics.update({f"sft/distill_{name}" + ("" if name == "jsd" else "_kl"): float(x.detach().sum()) / n
                    for name, x in parts.items()})
    metrics["sft/distill_topk_mass"] = float(teacher_XK.exp().sum(-1).sum()) / n
    return nll_coef * nll + distill_coef * parts[kind].sum(), metrics


def tree_sft_loss(logp_M: torch.Tensor, extras: dict) -> tuple[torch.Tensor, dict]:
    """The summed negative log-likelihood of one trainer micro-batch's trained tokens (``loss_mask_M``; not yet
    divided by the batch's trained-token count) and its metrics."""
    mask_M = extras["loss_mask_M"].to(logp_M.dtype)
    nll = -(logp_M * mask_M).sum()
    tokens = float(mask_M.sum())
    return nll, {"sft/num_tokens": tokens, "sft/nll": nll.item() / max(tokens, 1.0)}
