"""Preference training on prefix trees: Bradley-Terry reward models (``forge-rm``) and DPO (``forge-dpo``).

Both learn from pairs: one prompt, a preferred (*chosen*) and a dispreferred (*rejected*) continuation. The two
sides of a pair share their prompt, and pairs of one task share it with each other, so a batch is one prefix forest
(docs/prefix_tree.md): every shared prompt token is computed once, and the result equals scoring each side alone.
Single rank (TP = PP = 1, as forge-sft), CPU or one GPU; both export a HF checkpoint. For models beyond one GPU the
Megatron trainer trains the same losses on the same data with every parallel layout (``--preference-data
[--reward-model]``, training/offline.py).

**Reward model** (``forge-rm``): the score of a sequence is a linear head on the final hidden state (after the
final norm) of its last token, as transformers' ``*ForSequenceClassification`` and SGLang's ``/classify`` read it:
``r(x) = w . h_last(x)``. The Bradley-Terry loss, over the P pairs of a batch::

    L = mean_p [ -log sigmoid(r(c_p) - r(r_p) - margin_p) + center_coef * (r(c_p) + r(r_p))^2 ]

(``margin``: an optional per-pair field of the data, 0 without; ``--center-coef`` keeps scores near 0, which a
sum-free loss leaves undetermined). Starts from a causal LM (the head drawn at random, std ``initializer_range``)
or from a sequence-classification checkpoint (a reward model trained further; one label). The export is
``<Family>ForSequenceClassification`` (the language model's tensors, ``score.weight``; no LM head), which
forge-engine and SGLang (``--is-embedding``) serve on ``/classify`` for the rollout side's ``--verifier rm``
(agents/reward_model.py). Text only.

**DPO** (``forge-dpo``): with ``logp(x)`` the sum of the policy's log-probabilities over a side's trained tokens (its
loss mask: the answer after the prompt), ``n(x)`` their number and ``ref`` the starting checkpoint's ``logp``, scored
once before the first step::

    delta = [logp(c) - ref(c)] - [logp(r) - ref(r)]
    sigmoid:  L = -(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)     (eps: --label-smoothing)
    ipo:      L = (delta - 1 / (2 beta))^2
    simpo:    L = -(1 - eps) log sigmoid(m - gamma) - eps log sigmoid(gamma - m),        (--simpo-gamma; no reference)
              m = beta logp(c) / n(c) - beta logp(r) / n(r)
    + sft_coef * (mean NLL of the chosen side's trained tokens)                            (--sft-coef)

The implicit reward of a side is ``beta [logp(x) - ref(x)]`` (SimPO: ``beta logp(x) / n(x)``); a pair is counted
right when its chosen side's is the larger. Tokens that both sides share cancel in ``delta``. Vision-language checkpoints take image parts as forge-sft
does. The export is the policy (a causal LM) for the engines.

Data (``--data``, ``--eval-data``): JSON lines, one pair each, in one of three forms::

    {"prompt": [messages], "chosen": ANSWER, "rejected": ANSWER, "tools": [...], "margin": 0.5}
    {"chosen": [whole conversation], "rejected": [whole conversation]}
    {"chosen": {"input_ids": [...], "loss_mask": [...]}, "rejected": {...}}

where ANSWER is the assistant's text, one assistant message, or a list of messages continuing the prompt (tool
calls and their results, ending with the assistant's turn). Rendered with the checkpoint's chat template; the loss
mask covers the assistant turns after the prompt (whole conversations: all assistant turns). Token pairs are
trained as given: ``forge-pool-export --pairs`` writes them from an RL run's scored groups (a group's best episode
against its worst, the next best against the next worst, ...).

Legend: P = pairs of a batch, S = samples (2P: chosen, rejected, chosen, ...), M = next-token targets, H = hidden.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forge_megatron.training import sft

Sample = tuple  # (input ids, loss mask, images): sft.render's


@dataclass
class Pair:
    """A rendered preference pair; ``ref``: the reference model's (logp(chosen), logp(rejected)) for DPO."""

    chosen: Sample
    rejected: Sample
    margin: float = 0.0
    ref: tuple[float, float] | None = field(default=None, repr=False)


# ---------------------------------------------------------------------------------------------------- data
def load_pairs(path: str) -> list[dict]:
    """The preference pairs of a JSONL file (see the module docstring), checked; image parts given as files read."""
    from forge_megatron.utils.jsonl import read_records

    pairs = []
    base = os.path.dirname(os.path.abspath(path))
    for where, record in read_records(path):
        check_pair(record, where)
        for key in ("prompt", "chosen", "rejected"):
            if isinstance(record.get(key), list):
                sft._read_image_files(record[key], base, f"{where}: {key}")
        pairs.append(record)
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


def check_pair(record: dict, where: str) -> None:
    """ValueError naming ``where`` unless ``record`` is a pair in one of the three forms."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise ValueError(f"{where}: each line needs 'chosen' and 'rejected'")
    margin = record.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"{where}: margin must be a finite number")
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, dict) and "input_ids" in chosen or isinstance(rejected, dict) and "input_ids" in rejected:
        if "prompt" in record or "tools" in record:
            raise ValueError(f"{where}: token pairs take no prompt or tools (the ids hold the whole sequence)")
        for key in ("chosen", "rejected"):
            sft.check_token_sample(record[key] if isinstance(record[key], dict) else {}, f"{where}: {key}")
        if chosen["input_ids"] == rejected["input_ids"]:
            raise ValueError(f"{where}: chosen and rejected are the same tokens")
        return
    prompt = record.get("prompt")
    if prompt is not None and not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        raise ValueError(f"{where}: prompt must be a non-empty list of messages")
    for key in ("chosen", "rejected"):
        side = record[key]
        if prompt is None and not (isinstance(side, list) and side):
            raise ValueError(f"{where}: without a prompt, {key} must be a whole conversation (a list of messages)")
        messages = _side_messages(side, f"{where}: {key}")
        if not any(m.get("role") == "assistant" for m in messages):
            raise ValueError(f"{where}: {key} has no assistant turn to score")
    if _side_messages(chosen, where) == _side_messages(rejected, where):
        raise ValueError(f"{where}: chosen and rejected are the same")


def _side_messages(side, where: str) -> list[dict]:
    if isinstance(side, str):
        return [{"role": "assistant", "content": side}]
    if isinstance(side, dict):
        side = [side]
    if not (isinstance(side, list) and side and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    for m in side)):
        raise ValueError(f"{where}: must be a string, a message or a list of messages (each with a role)")
    return side


def render_pair(tokenizer, record: dict, processor=None) -> Pair:
    """A checked pair record -> :class:`Pair` of token samples (see the module docstring for the loss masks)."""
    margin = float(record.get("margin", 0.0))
    if isinstance(record["chosen"], dict) and "input_ids" in record["chosen"]:
        return Pair(*((list(record[k]["input_ids"]), list(record[k]["loss_mask"]), []) for k in ("chosen", "rejected")),
                    margin=margin)
    prompt, tools = record.get("prompt"), record.get("tools")
    start = len(_prompt_ids(tokenizer, prompt, tools, processor)) if prompt is not None else 0  # (both sides')
    sides = []
    for key in ("chosen", "rejected"):
        messages = (prompt or []) + _side_messages(record[key], key)
        ids, mask, images = sft.render(tokenizer, messages, tools, processor)
        if prompt is not None:
            mask = [0] * start + mask[start:]
            if not any(mask[1:]):
                raise ValueError(f"{key}: no assistant token after the prompt")
        sides.append((ids, mask, images))
    return Pair(*sides, margin=margin)


def _prompt_ids(tokenizer, prompt: list[dict], tools, processor) -> list[int]:
    """The ids of ``prompt`` and the generation prompt after it (images expanded)."""
    images = []
    if any(isinstance(m.get("content"), list) for m in prompt):
        placeholder = processor.placeholder(tokenizer) if processor is not None else ""
        prompt, images = sft._inline_images(prompt, processor, placeholder or "")
    ids = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    return processor.expand(ids, images) if images else ids


def render_pairs(tokenizer, records: list[dict], processor=None, max_length: int | None = None,
                 what: str = "pair") -> list[Pair]:
    """Rendered pairs; those with a side longer than ``max_length`` tokens left out (counted on stdout)."""
    pairs, dropped, vocab = [], 0, sft.vocabulary_size(tokenizer)
    for i, record in enumerate(records):
        try:
            pair = render_pair(tokenizer, record, processor)
        except ValueError as exc:
            raise ValueError(f"{what} {i}: {exc}") from None
        if pair.chosen[0] == pair.rejected[0]:
            raise ValueError(f"{what} {i}: chosen and rejected render to the same tokens")
        top = max(max(pair.chosen[0]), max(pair.rejected[0]))
        if top >= vocab:
            raise ValueError(f"{what} {i}: token id {top} is outside the tokenizer's vocabulary ({vocab})")
        if max_length is not None and max(len(pair.chosen[0]), len(pair.rejected[0])) > max_length:
            dropped += 1
            continue
        pairs.append(pair)
    if dropped:
        print(f"[preference] {dropped} {what}(s) longer than --max-length {max_length} left out", flush=True)
    if not pairs:
        raise ValueError(f"no {what}s left to train on")
    return pairs


def _samples(pairs: list[Pair]) -> list[Sample]:
    return [s for p in pairs for s in (p.chosen, p.rejected)]


# ---------------------------------------------------------------------------------------------- the models
def response_logprobs(model, layout, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log-probabilities over each sample's trained tokens [S], their counts [S]) from one tree forward."""
    from forge_megatron.mcore.forward import tree_logprobs

    logp_M, _ = tree_logprobs(model, layout)
    mask_M = torch.cat([torch.tensor(mask[1:], dtype=logp_M.dtype) for _, mask, _ in samples]).to(logp_M.device)
    counts_S = torch.tensor([len(ids) - 1 for ids, _, _ in samples], device=logp_M.device)
    sample_M = torch.repeat_interleave(torch.arange(len(samples), device=logp_M.device), counts_S)
    sums_S = logp_M.new_zeros(len(samples)).index_add(0, sample_M, logp_M * mask_M)
    return sums_S, logp_M.new_zeros(len(samples)).index_add(0, sample_M, mask_M)


def bt_pair_losses(chosen_P: torch.Tensor, rejected_P: torch.Tensor, margin_P: torch.Tensor,
                   center_coef: float = 0.0) -> torch.Tensor:
    """The Bradley-Terry loss of each pair (with its margin and the centring term)."""
    loss_P = -F.logsigmoid(chosen_P - rejected_P - margin_P)
    return loss_P + center_coef * (chosen_P + rejected_P) ** 2 if center_coef else loss_P


def bradley_terry_loss(chosen_P: torch.Tensor, rejected_P: torch.Tensor, margin_P: torch.Tensor,
                       center_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    diff_P = chosen_P - rejected_P
    loss = bt_pair_losses(chosen_P, rejected_P, margin_P, center_coef).mean()
    return loss, {"accuracy": (diff_P > 0).float().mean().item(), "margin": diff_P.mean().item(),
                  "chosen": chosen_P.mean().item(), "rejected": rejected_P.mean().item()}


LOSSES = ("sigmoid", "ipo", "simpo")


def implicit_rewards(sums_S: torch.Tensor, counts_S: torch.Tensor, ref_S: torch.Tensor | None, beta: float,
                     kind: str = "sigmoid") -> torch.Tensor:
    """Each side's implicit reward: ``beta (logp - ref)`` (DPO, IPO), or ``beta logp / tokens`` (SimPO: the mean
    log-probability of its trained tokens, no reference)."""
    if kind == "simpo":
        return beta * sums_S / counts_S.clamp(min=1)
    return beta * (sums_S - ref_S)


def pair_losses(margin_P: torch.Tensor, beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0,
                gamma: float = 0.0) -> torch.Tensor:
    """Each pair's loss from its implicit-reward margin (chosen minus rejected, :func:`implicit_rewards`): DPO
    (``sigmoid``, with conservative label smoothing), IPO, or SimPO (``sigmoid`` of the margin less ``gamma``)."""
    if kind == "ipo":
        return (margin_P / beta - 1 / (2 * beta)) ** 2
    if kind not in LOSSES:
        raise ValueError(f"unknown preference loss {kind!r} ({', '.join(LOSSES)})")
    z = margin_P - gamma if kind == "simpo" else margin_P
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def dpo_loss(policy_c: torch.Tensor, policy_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
             beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The DPO (``sigmoid``, with conservative label smoothing) or IPO loss of P pairs from the sides' summed
    log-probabilities, and its metrics (implicit rewards ``beta * (logp - ref)``)."""
    reward_c, reward_r = beta * (policy_c - ref_c), beta * (policy_r - ref_r)
    return _pair_loss(reward_c, reward_r, beta, kind, label_smoothing)


def _pair_loss(reward_c: torch.Tensor, reward_r: torch.Tensor, beta: float, kind: str, label_smoothing: float = 0.0,
               gamma: float = 0.0) -> tuple[torch.Tensor, dict]:
    margin_P = reward_c - reward_r
    loss = pair_losses(margin_P, beta, kind, label_smoothing, gamma).mean()
    margin_P, reward_c, reward_r = margin_P.detach(), reward_c.detach(), reward_r.detach()
    return loss, {"accuracy": (margin_P > 0).float().mean().item(), "margin": margin_P.mean().item(),
                  "chosen": reward_c.mean().item(), "rejected": reward_r.mean().item()}


def reward_model_loss(rm: "RewardModel", center_coef: float = 0.0):
    """``pairs -> (Bradley-Terry loss, metrics)`` of a :class:`RewardModel`: both sides of every pair in one tree."""

    def step_loss(micro: list[Pair]):
        scores_S = rm.scores(_samples(micro))
        margin_P = torch.tensor([p.margin for p in micro], dtype=scores_S.dtype, device=scores_S.device)
        return bradley_terry_loss(scores_S[0::2], scores_S[1::2], margin_P, center_coef)

    return step_loss


def dpo_pairs_loss(model, processor, beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0,
                   sft_coef: float = 0.0, gamma: float = 0.0):
    """``pairs -> (DPO / IPO / SimPO loss, metrics)`` of a tree GPTModel (DPO and IPO against the pairs' reference
    log-probabilities, ``Pair.ref``); ``sft_coef`` adds the chosen sides' mean per-token NLL."""

    def step_loss(micro: list[Pair]):
        samples = _samples(micro)
        sums_S, counts_S = response_logprobs(model, sft.batch_layout(samples, processor), samples)
        ref_S = None if kind == "simpo" else \
            torch.tensor([p.ref for p in micro], dtype=sums_S.dtype, device=sums_S.device).reshape(-1)
        rewards_S = implicit_rewards(sums_S, counts_S, ref_S, beta, kind)
        value, metrics = _pair_loss(rewards_S[0::2], rewards_S[1::2], beta, kind, label_smoothing, gamma)
        if sft_coef:
            nll = -(sums_S[0::2] / counts_S[0::2].clamp(min=1)).mean()
            value = value + sft_coef * nll
            metrics["chosen_nll"] = nll.item()
        return value, metrics

    return step_loss


@torch.no_grad()
def set_reference(model, pairs: list[Pair], batch_size: int, processor=None) -> None:
    """Set every pair's ``ref`` to ``model``'s log-probabilities of its two sides (trees of ``batch_size`` pairs)."""
    for i in range(0, len(pairs), batch_size):
        micro = pairs[i:i + batch_size]
        samples = _samples(micro)
        sums_S, _ = response_logprobs(model, sft.batch_layout(samples, processor), samples)
        for p, c, r in zip(micro, sums_S[0::2].tolist(), sums_S[1::2].tolist()):
            p.ref = (c, r)


class RewardModel:
    """A reward model on one rank: the tree GPTModel of ``hf_dir`` made a sequence classifier (the bridge's reward
    mode, ``bridge.families.reward_model_config``: a score head on the last hidden state, the LM head never made),
    from a causal LM (the head drawn anew) or a one-label sequence-classification checkpoint."""

    def __init__(self, hf_dir: str):
        from forge_megatron.bridge.families import load_hf_config, reward_labels, reward_model_config

        self.hf_dir = hf_dir
        config = reward_model_config(load_hf_config(hf_dir))
        if reward_labels(config) != 1:
            raise ValueError(f"{hf_dir}: a reward model of {reward_labels(config)} labels; Bradley-Terry training "
                             "takes one")
        self.model, self.bridge = sft.build_model(hf_dir, None, False, hf_config=config)

    def parameters(self):
        return list(self.model.parameters())

    def scores(self, samples: list[Sample]) -> torch.Tensor:
        """[S] scores of token samples (one tree)."""
        from forge_megatron.mcore.forward import tree_scores

        return tree_scores(self.model, sft.batch_layout(samples))[:, 0]

    def export(self, out_dir: str) -> None:
        """Write the ``*ForSequenceClassification`` checkpoint with ``hf_dir``'s tokenizer files."""
        sft.export_hf(self.model, self.bridge, self.hf_dir, out_dir)


# ------------------------------------------------------------------------------------------- the training loop
def _batches(n: int, batch_size: int, steps: int, seed: int):
    """``steps`` lists of indices: epochs of a shuffled order, cut into batches (the last of an epoch may be short)."""
    rng, out = random.Random(seed), []
    while len(out) < steps:
        order = list(range(n))
        rng.shuffle(order)
        out += [order[i:i + batch_size] for i in range(0, n, batch_size)]
    return out[:steps]


def _micro(batch: list, micro_batch_size: int | None):
    size = micro_batch_size or len(batch)
    return [batch[i:i + size] for i in range(0, len(batch), size)]


def train(params: list, step_loss, pairs: list[Pair], steps: int, lr: float, batch_size: int,
          micro_batch_size: int | None = None, seed: int = 0, log_every: int = 25, tag: str = "rm",
          warmup_steps: int | None = None) -> list[dict]:
    """AdamW over ``steps`` batches of pairs; ``step_loss(pairs) -> (loss, metrics)`` per micro-batch (losses are
    means over its pairs, weighted by its share of the batch). Returns the metrics of every step."""
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = warmup_steps if warmup_steps is not None else max(1, min(20, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / max(steps, 1)))
    history, t0 = [], time.time()
    for step, batch in enumerate(_batches(len(pairs), batch_size, steps, seed)):
        opt.zero_grad()
        totals: dict[str, float] = {}
        for micro in _micro([pairs[i] for i in batch], micro_batch_size):
            share = len(micro) / len(batch)
            loss, metrics = step_loss(micro)
            (loss * share).backward()
            for k, v in {"loss": loss.item(), **metrics}.items():
                totals[k] = totals.get(k, 0.0) + v * share
        totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        sched.step()
        history.append(totals)
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == steps:
            print(f"[{tag}] step {step + 1}/{steps} loss {totals['loss']:.4f} accuracy {totals['accuracy']:.3f} "
                  f"margin {totals['margin']:.3f} ({time.time() - t0:.0f}s)", flush=True)
    return history


@torch.no_grad()
def evaluate(step_loss, pairs: list[Pair], batch_size: int) -> dict:
    """Pair-weighted means of ``step_loss``'s loss and metrics over ``pairs`` (no gradients)."""
    totals: dict[str, float] = {}
    for i in range(0, len(pairs), batch_size):
        micro = pairs[i:i + batch_size]
        loss, metrics = step_loss(micro)
        for k, v in {"loss": loss.item(), **metrics}.items():
            totals[k] = totals.get(k, 0.0) + v * len(micro) / len(pairs)
    totals["pairs"] = len(pairs)
    return totals


def _steps(args_steps: int | None, epochs: float, n: int, batch_size: int) -> int:
    if args_steps is not None:
        return args_steps
    return max(1, math.ceil(epochs * n / batch_size))


def run_reward_model(hf_dir: str, records: list[dict], out_dir: str, steps: int | None = None, epochs: float = 1.0,
                     lr: float = 1e-5, batch_size: int = 16, micro_batch_size: int | None = None,
                     center_coef: float = 0.0, eval_records: list[dict] | None = None, max_length: int | None = None,
                     seed: int = 0, log_every: int = 25) -> dict:
    """Train a Bradley-Terry reward model from ``hf_dir`` on pair records, export it to ``out_dir``; returns
    ``{"steps", "history", "eval_before", "eval_after"}`` (eval: None without ``eval_records``)."""
    from transformers import AutoTokenizer

    from forge_megatron.mcore import parallel

    parallel.initialize(seed=seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        pairs = render_pairs(tokenizer, records, max_length=max_length)
        held_out = render_pairs(tokenizer, eval_records, what="eval pair") if eval_records else None
        if any(s[2] for p in pairs + (held_out or []) for s in (p.chosen, p.rejected)):
            raise ValueError("reward models are trained on text: a pair has images")
        rm = RewardModel(hf_dir)
        step_loss = reward_model_loss(rm, center_coef)
        eval_size = micro_batch_size or batch_size
        before = evaluate(step_loss, held_out, eval_size) if held_out else None
        n = _steps(steps, epochs, len(pairs), batch_size)
        history = train(rm.parameters(), step_loss, pairs, n, lr, batch_size, micro_batch_size, seed, log_every, "rm")
        after = evaluate(step_loss, held_out, eval_size) if held_out else None
        if held_out:
            print(f"[rm] held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
                  f"({len(held_out)} pairs)", flush=True)
        rm.export(out_dir)
        return {"steps": n, "history": history, "eval_before": before, "eval_after": after}
    finally:
        parallel.destroy()


def run_dpo(hf_dir: str, records: list[dict], out_dir: str, steps: int | None = None, epochs: float = 1.0,
            lr: float = 1e-6, batch_size: int = 16, micro_batch_size: int | None = None, beta: float = 0.1,
            loss: str = "sigmoid", label_smoothing: float = 0.0, sft_coef: float = 0.0,
            eval_records: list[dict] | None = None, max_length: int | None = None, seed: int = 0,
            log_every: int = 25, train_vision_tower: bool = False, gamma: float = 0.0) -> dict:
    """DPO or IPO from ``hf_dir`` on pair records, the reference being ``hf_dir`` itself, or SimPO (no reference;
    ``gamma``: its target margin); exports the policy to ``out_dir``. Returns ``{"steps", "history", "eval_before",
    "eval_after"}``."""
    from transformers import AutoTokenizer

    from forge_megatron.mcore import parallel

    if beta <= 0:
        raise ValueError("--beta must be positive")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError("--label-smoothing must be in [0, 0.5)")
    parallel.initialize(seed=seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        processor = sft._image_processor(hf_dir)
        pairs = render_pairs(tokenizer, records, processor, max_length=max_length)
        held_out = render_pairs(tokenizer, eval_records, processor, what="eval pair") if eval_records else []
        images = any(s[2] for p in pairs + held_out for s in (p.chosen, p.rejected))
        model, bridge = sft.build_model(hf_dir, processor, images, train_vision_tower)
        size = micro_batch_size or batch_size
        if loss != "simpo":
            t0 = time.time()
            set_reference(model, pairs + held_out, size, processor)  # the reference: the starting model, scored once
            print(f"[dpo] reference log-probabilities of {len(pairs) + len(held_out)} pairs "
                  f"({time.time() - t0:.0f}s)", flush=True)
        step_loss = dpo_pairs_loss(model, processor, beta, loss, label_smoothing, sft_coef, gamma)
        before = evaluate(step_loss, held_out, size) if held_out else None
        n = _steps(steps, epochs, len(pairs), batch_size)
        history = train(list(model.parameters()), step_loss, pairs, n, lr, batch_size, micro_batch_size, seed,
                        log_every, "dpo")
        after = evaluate(step_loss, held_out, size) if held_out else None
        if held_out:
            print(f"[dpo] held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
                  f"({len(held_out)} pairs)", flush=True)
        sft.export_hf(model, bridge, hf_dir, out_dir)
        return {"steps": n, "history": history, "eval_before": before, "eval_after": after}
    finally:
        parallel.destroy()


# ----------------------------------------------------------------------------------------------------- CLI
def _parser(prog: str, description: str, lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True, help="the starting checkpoint (a local HF directory)")
    p.add_argument("--data", required=True, help="JSONL of preference pairs (forms: see above)")
    p.add_argument("--eval-data", default=None, help="held-out pairs: loss and accuracy before and after training")
    p.add_argument("--out", required=True, help="output HF directory (replaced)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the pairs (default 1)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (instead of --epochs)")
    p.add_argument("--lr", type=float, default=lr,
                   help=f"peak learning rate (default {lr:g}, for billion-parameter models; tiny ones want ~1e-3), "
                        "warmed up over min(20, steps / 10) steps, then decayed linearly to a tenth")
    p.add_argument("--batch-size", type=int, default=16, help="pairs per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="pairs per forward (one prefix forest); gradients accumulate over the batch")
    p.add_argument("--max-length", type=int, default=None, help="leave out pairs with a longer side (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    return p


def _check(p: argparse.ArgumentParser, args) -> None:
    for name in ("batch_size", "micro_batch_size", "steps", "max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.epochs <= 0:
        p.error("--epochs must be positive")


def _load(p: argparse.ArgumentParser, path: str | None, flag: str) -> list[dict] | None:
    if path is None:
        return None
    try:
        return load_pairs(path)
    except (OSError, ValueError) as exc:
        p.error(f"{flag}: {exc}")


def main_rm(argv: list[str] | None = None) -> int:
    """``forge-rm``: train a Bradley-Terry reward model."""
    p = _parser("forge-rm", __doc__, 1e-5)
    p.add_argument("--center-coef", type=float, default=0.0,
                   help="weight of the (r(chosen) + r(rejected))^2 term that keeps scores centred (default 0)")
    args = p.parse_args(argv)
    _check(p, args)
    result = run_reward_model(args.hf_checkpoint, _load(p, args.data, "--data"), args.out, args.steps, args.epochs,
                              args.lr, args.batch_size, args.micro_batch_size, args.center_coef,
                              _load(p, args.eval_data, "--eval-data"), args.max_length, args.seed, args.log_every)
    print(json.dumps(_summary(result, args.out)), flush=True)
    return 0


def main_dpo(argv: list[str] | None = None) -> int:
    """``forge-dpo``: DPO / IPO / SimPO on preference pairs."""
    p = _parser("forge-dpo", __doc__, 1e-6)
    p.add_argument("--beta", type=float, default=0.1,
                   help="beta (default 0.1: DPO's KL coefficient; SimPO's reward scale is larger, ~2)")
    p.add_argument("--loss", choices=LOSSES, default="sigmoid",
                   help="sigmoid: DPO (default); ipo: (delta - 1/(2 beta))^2; simpo: SimPO, length-normalised and "
                        "reference-free (no reference pass)")
    p.add_argument("--simpo-gamma", type=float, default=0.5, help="SimPO's target reward margin (default 0.5)")
    p.add_argument("--label-smoothing", type=float, default=0.0,
                   help="conservative DPO: the chance a pair's label is flipped (sigmoid loss; default 0)")
    p.add_argument("--sft-coef", type=float, default=0.0,
                   help="weight of the chosen side's NLL added to the loss (default 0)")
    p.add_argument("--train-vision-tower", action="store_true",
                   help="vision-language checkpoints: train the vision tower too (exported as trained)")
    args = p.parse_args(argv)
    _check(p, args)
    if args.beta <= 0:
        p.error("--beta must be positive")
    if not 0 <= args.label_smoothing < 0.5:
        p.error("--label-smoothing must be in [0, 0.5)")
    result = run_dpo(args.hf_checkpoint, _load(p, args.data, "--data"), args.out, args.steps, args.epochs, args.lr,
                     args.batch_size, args.micro_batch_size, args.beta, args.loss, args.label_smoothing,
                     args.sft_coef, _load(p, args.eval_data, "--eval-data"), args.max_length, args.seed,
                     args.log_every, args.train_vision_tower, args.simpo_gamma)
    print(json.dumps(_summary(result, args.out)), flush=True)
    return 0


def _summary(result: dict, out: str) -> dict:
    last = result["history"][-1]
    return {"out": out, "steps": result["steps"], "final": {k: round(v, 6) for k, v in last.items()},
            "eval_before": result["eval_before"], "eval_after": result["eval_after"]}
