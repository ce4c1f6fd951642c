"""KTO on prefix trees (``forge-kto``): alignment from unpaired binary feedback, each answer marked good or bad.

Kahneman-Tversky Optimization (Ethayarajh et al., 2024) needs no pairs: an example is one prompt and one answer
labelled *desirable* or *undesirable*, which is what an RL run's scored episodes are (above or below their group's
mean: ``forge-pool-export --kto``) and what thumbs-up / thumbs-down feedback is. With ``logp(x)`` the sum of the
policy's log-probabilities over an example's trained tokens (its answer), ``ref(x)`` the reference's (the starting
checkpoint, scored once before the first step) and ``r(x) = logp(x) - ref(x)``::

    z0 = max(0, mean_j [logp(x'_j) - ref(x'_j)])                  (detached; 0 with --no-kl, which makes this
                                                                   APO-zero's unpaired loss)
    desirable:    L = w_D (1 - sigmoid(beta (r(x) - z0)))
    undesirable:  L = w_U (1 - sigmoid(beta (z0 - r(x))))
    loss = mean over the batch's examples

``z0`` is the reference point: an estimate of the KL divergence between the policy and the reference, from
*mismatched* examples ``x'_j``, example j's prompt with another example's answer (a fixed derangement drawn from the
seed, so that the reference scores them once). A mismatched example shares its prompt with its own example, so in a
prefix tree it is one more branch on that prompt: the prompt is computed once for both. ``w_D`` and ``w_U``
(``--desirable-weight``, ``--undesirable-weight``) balance the two kinds; the paper suggests
``w_D n_D / (w_U n_U)`` in [1, 4/3], which is printed at start-up. An example counts as right when its side of the
reference point agrees with its label (``accuracy``); ``margin`` is the mean of ``beta (r - z0)``, signed by the label.

Here ``z0`` is the mean over each forward (the whole batch unless ``--micro-batch-size`` splits it); the Megatron
trainer's ``--kto-data`` takes it over the whole batch on every data-parallel rank (training/offline.py). A held-out
set's is taken over the whole set, whatever its batches, in both.

Data (``--data``, ``--eval-data``): JSON lines, one example each, in one of four forms::

    {"prompt": [messages], "completion": ANSWER, "label": true, "tools": [...]}
    {"messages": [whole conversation], "label": false}
    {"input_ids": [...], "loss_mask": [...], "label": true}
    {"prompt": [messages], "chosen": ANSWER, "rejected": ANSWER}      (a preference pair: two examples)

ANSWER as forge-dpo's (text, one assistant message or a list continuing the prompt); whole conversations train every
assistant turn; a pair (any of forge-dpo's forms) gives a desirable and an undesirable example. Vision-language
checkpoints take image parts in user messages as forge-sft does (files read, ``--train-vision-tower`` too); a
mismatched sample keeps its prompt's images and takes those of the other example's answer (later user turns).

Legend: N = examples of a batch, S = samples (the N examples, then their N mismatched ones).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass, field

import torch

from forge_megatron.training import preference, sft

Sample = tuple  # (input ids, loss mask, images)


@dataclass
class Example:
    """A rendered example; ``prompt_images``: how many of its images lie before its answer; ``kl``: its mismatched
    sample (its prompt, another example's answer); ``ref``: the reference model's (logp(sample), logp(kl)), set before
    training."""

    sample: Sample
    desirable: bool
    prompt_images: int = 0
    kl: Sample | None = None
    ref: tuple[float, float] | None = field(default=None, repr=False)


# ---------------------------------------------------------------------------------------------------- data
def load_examples(path: str) -> list[dict]:
    """The KTO records of a JSONL file (see the module docstring), checked; image parts given as files read."""
    from forge_megatron.utils.jsonl import read_records

    records, base = [], os.path.dirname(os.path.abspath(path))
    for where, record in read_records(path):
        check_example(record, where)
        for key in ("prompt", "completion", "messages", "chosen", "rejected"):
            if isinstance(record.get(key), list):
                sft._read_image_files(record[key], base, f"{where}: {key}")
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no examples")
    return records


def check_example(record, where: str) -> None:
    """ValueError naming ``where`` unless ``record`` is an example (or a preference pair) in one of the forms."""
    if isinstance(record, dict) and "chosen" in record and "rejected" in record:
        if "label" in record or "completion" in record:
            raise ValueError(f"{where}: a preference pair (chosen, rejected) takes no label or completion")
        preference.check_pair(record, where)
        return
    if not isinstance(record, dict) or not isinstance(record.get("label"), bool):
        raise ValueError(f"{where}: each line needs a 'label' (true: desirable, false: undesirable), or 'chosen' and "
                         "'rejected' (a pair)")
    forms = [k for k in ("completion", "messages", "input_ids") if k in record]
    if len(forms) != 1:
        raise ValueError(f"{where}: give exactly one of 'prompt' + 'completion', 'messages', or 'input_ids' + "
                         f"'loss_mask' (got {', '.join(forms) or 'none'})")
    if forms == ["input_ids"]:
        if "prompt" in record or "tools" in record:
            raise ValueError(f"{where}: token examples take no prompt or tools (the ids hold the whole sequence)")
        sft.check_token_sample(record, where)
        return
    if forms == ["messages"]:
        if "prompt" in record:
            raise ValueError(f"{where}: a whole conversation ('messages') takes no 'prompt'")
        messages = record["messages"]
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise ValueError(f"{where}: messages must be a non-empty list of messages")
    else:
        prompt = record.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
            raise ValueError(f"{where}: prompt must be a non-empty list of messages")
        messages = preference._side_messages(record["completion"], f"{where}: completion")
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn to score")


def render_records(tokenizer, records: list[dict], max_length: int | None = None, what: str = "example",
                   processor=None) -> list[Example]:
    """Checked records -> :class:`Example` s (a pair record gives two; ``processor``: the checkpoint's image
    processor, for image parts); longer than ``max_length`` left out (counted)."""
    out, dropped, vocab = [], 0, sft.vocabulary_size(tokenizer)
    for i, record in enumerate(records):
        try:
            examples = _render(tokenizer, record, processor)
        except ValueError as exc:
            raise ValueError(f"{what} {i}: {exc}") from None
        for e in examples:
            top = max(e.sample[0])
            if top >= vocab:
                raise ValueError(f"{what} {i}: token id {top} is outside the tokenizer's vocabulary ({vocab})")
            if max_length is not None and len(e.sample[0]) > max_length:
                dropped += 1
                continue
            out.append(e)
    if dropped:
        print(f"[kto] {dropped} {what}(s) longer than --max-length {max_length} left out", flush=True)
    if not out:
        raise ValueError(f"no {what}s left to train on")
    return out


def _image_parts(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image_url")


def _images_before_answer(prompt: list[dict] | None, messages: list[dict]) -> int:
    """How many images precede the first trained token: the prompt's, or (a whole conversation) those of the
    messages before its first assistant turn (images come in user messages only)."""
    if prompt is not None:
        return _image_parts(prompt)
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    return _image_parts(messages[:first])


def _render(tokenizer, record: dict, processor=None) -> list[Example]:
    if "chosen" in record:
        pair = preference.render_pair(tokenizer, record, processor)
        if isinstance(record["chosen"], dict) and "input_ids" in record["chosen"]:  # token pairs: no images
            return [Example(pair.chosen, True), Example(pair.rejected, False)]
        prompt = record.get("prompt")
        return [Example(side, good, _images_before_answer(prompt, preference._side_messages(record[key], key)))
                for side, good, key in ((pair.chosen, True, "chosen"), (pair.rejected, False, "rejected"))]
    label = record["label"]
    if "input_ids" in record:
        return [Example((list(record["input_ids"]), list(record["loss_mask"]), []), label)]
    if "messages" in record:
        ids, mask, images = sft.render(tokenizer, record["messages"], record.get("tools"), processor)
        before = _images_before_answer(None, record["messages"])
    else:
        prompt, tools = record["prompt"], record.get("tools")
        start = len(preference._prompt_ids(tokenizer, prompt, tools, processor))
        ids, mask, images = sft.render(
            tokenizer, prompt + preference._side_messages(record["completion"], "completion"), tools, processor)
        mask, before = [0] * start + mask[start:], _image_parts(prompt)
    if not any(mask[1:]):
        raise ValueError("no assistant token after the prompt")
    return [Example((ids, mask, images), label, before)]


def answer_start(sample: Sample) -> int:
    """Where a sample's answer begins: its first trained token (at least 1: the first token is never trained)."""
    mask = sample[1]
    return next(i for i in range(1, len(mask)) if mask[i])


def mismatched(prompt_of: Example, answer_of: Example) -> Sample:
    """``prompt_of``'s prompt followed by ``answer_of``'s answer (its trained and untrained tokens from its first
    trained one on), with the prompt's images and the answer's."""
    (ids_a, _, images_a), (ids_b, mask_b, images_b) = prompt_of.sample, answer_of.sample
    a, b = answer_start(prompt_of.sample), answer_start(answer_of.sample)
    return (list(ids_a[:a]) + list(ids_b[b:]), [0] * a + list(mask_b[b:]),
            list(images_a[:prompt_of.prompt_images]) + list(images_b[answer_of.prompt_images:]))


def attach_mismatched(examples: list[Example], seed: int) -> None:
    """Give every example its mismatched sample: along a cycle through a seeded shuffle of the examples, each takes
    the next one's answer (never its own)."""
    if len(examples) < 2:
        raise ValueError("the KL estimate pairs each prompt with another example's answer: it needs at least two "
                         "examples (or --no-kl)")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    for k, i in enumerate(order):
        examples[i].kl = mismatched(examples[i], examples[order[(k + 1) % len(order)]])


def weight_balance(examples: list[Example], desirable_weight: float, undesirable_weight: float) -> float | None:
    """``w_D n_D / (w_U n_U)`` (None without undesirable examples)."""
    n_d = sum(e.desirable for e in examples)
    n_u = len(examples) - n_d
    return desirable_weight * n_d / (undesirable_weight * n_u) if n_u else None


def balance_note(examples: list[Example], desirable_weight: float, undesirable_weight: float) -> str:
    n_d = sum(e.desirable for e in examples)
    ratio = weight_balance(examples, desirable_weight, undesirable_weight)
    line = f"{n_d} desirable, {len(examples) - n_d} undesirable examples"
    if ratio is None or n_d == 0:
        return line + ": only one kind, so the loss only pushes one way"
    line += f"; w_D n_D / (w_U n_U) = {ratio:.2f}"
    if not 1.0 <= ratio <= 4 / 3 + 1e-9:
        line += " (the KTO paper suggests 1 to 4/3: weigh the kinds to match)"
    return line


# ---------------------------------------------------------------------------------------------------- loss
def kto_losses(logratio_N: torch.Tensor, desirable_N: torch.Tensor, kl: torch.Tensor | float, beta: float,
               desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Each example's KTO loss from its log-ratio ``logp - ref`` and the (detached) reference point ``kl``."""
    x = beta * (logratio_N - kl)
    return torch.where(desirable_N, desirable_weight * (1 - torch.sigmoid(x)),
                       undesirable_weight * (1 - torch.sigmoid(-x)))


def kl_estimate(kl_logratio_N: torch.Tensor) -> torch.Tensor:
    """KTO's reference point from the mismatched samples' log-ratios: their mean, at least 0, detached."""
    return kl_logratio_N.detach().mean().clamp(min=0)


def kto_metrics(logratio_N: torch.Tensor, desirable_N: torch.Tensor, kl, beta: float,
                per_kind: bool = False) -> dict:
    """Means over the examples: ``accuracy`` (the label's side of the reference point), ``margin`` (``beta (r - z0)``
    signed by the label); ``kl``: the reference point; ``per_kind``: each kind's mean implicit reward ``beta r`` too
    (for a whole set: a mean over a kind does not add up over micro-batches as the others do)."""
    signed = torch.where(desirable_N, 1.0, -1.0) * beta * (logratio_N.detach() - kl)
    out = {"accuracy": (signed > 0).float().mean().item(), "margin": signed.mean().item(), "kl": float(kl)}
    reward = beta * logratio_N.detach()
    for name, which in (("desirable_reward", desirable_N), ("undesirable_reward", ~desirable_N)):
        if per_kind and bool(which.any()):
            out[name] = reward[which].mean().item()
    return out


def kto_examples_loss(model, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                      kl: bool = True, reference_point: float | None = None, processor=None):
    """``examples -> (KTO loss, metrics)`` of a tree GPTModel against the examples' ``ref``: the examples and their
    mismatched samples in one forest (``kl``), the reference point their estimate; without, only the examples run
    and the reference point is ``reference_point`` (default 0)."""

    def step_loss(micro: list[Example]):
        n = len(micro)
        samples = [e.sample for e in micro] + ([e.kl for e in micro] if kl else [])
        sums_S, _ = preference.response_logprobs(model, sft.batch_layout(samples, processor), samples)
        ref_S = torch.tensor([e.ref[0] for e in micro] + ([e.ref[1] for e in micro] if kl else []),
                             dtype=sums_S.dtype, device=sums_S.device)
        logratio_S = sums_S - ref_S
        z0 = kl_estimate(logratio_S[n:]) if kl else logratio_S.new_tensor(float(reference_point or 0.0))
        desirable_N = torch.tensor([e.desirable for e in micro], device=sums_S.device)
        loss = kto_losses(logratio_S[:n], desirable_N, z0, beta, desirable_weight, undesirable_weight).mean()
        return loss, kto_metrics(logratio_S[:n], desirable_N, z0, beta)

    return step_loss


@torch.no_grad()
def held_out_reference_point(model, examples: list[Example], batch_size: int, processor=None) -> float:
    """The reference point of a whole set of examples (a held-out set: the same whatever its batches), from their
    mismatched samples, ``batch_size`` to a forest."""
    total = 0.0
    for i in range(0, len(examples), batch_size):
        micro = examples[i:i + batch_size]
        samples = [e.kl for e in micro]
        sums_S, _ = preference.response_logprobs(model, sft.batch_layout(samples, processor), samples)
        total += float(sums_S.sum()) - sum(e.ref[1] for e in micro)
    return max(0.0, total / len(examples))


@torch.no_grad()
def evaluate(model, examples: list[Example], batch_size: int, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, kl: bool = True, processor=None) -> dict:
    """The loss and metrics (each kind's implicit reward too) of a held-out set, as one batch: its reference point
    taken over the whole set, its examples scored ``batch_size`` to a forest."""
    z0 = held_out_reference_point(model, examples, batch_size, processor) if kl else 0.0
    logratios = []
    for i in range(0, len(examples), batch_size):
        micro = examples[i:i + batch_size]
        samples = [e.sample for e in micro]
        sums_S, _ = preference.response_logprobs(model, sft.batch_layout(samples, processor), samples)
        logratios.append(sums_S - sums_S.new_tensor([e.ref[0] for e in micro]))
    logratio_N = torch.cat(logratios)
    desirable_N = torch.tensor([e.desirable for e in examples], device=logratio_N.device)
    loss = kto_losses(logratio_N, desirable_N, z0, beta, desirable_weight, undesirable_weight).mean().item()
    return {"loss": loss, **kto_metrics(logratio_N, desirable_N, z0, beta, per_kind=True), "examples": len(examples)}


@torch.no_grad()
def set_reference(model, examples: list[Example], batch_size: int, processor=None) -> None:
    """Set every example's ``ref`` to ``model``'s log-probabilities of it and of its mismatched sample (when it has
    one; 0.0 otherwise), ``batch_size`` examples to a forest."""
    for i in range(0, len(examples), batch_size):
        micro = examples[i:i + batch_size]
        kl = [e.kl for e in micro if e.kl is not None]
        samples = [e.sample for e in micro] + kl
        sums_S = preference.response_logprobs(model, sft.batch_layout(samples, processor), samples)[0].tolist()
        kl_sums = iter(sums_S[len(micro):])
        for e, s in zip(micro, sums_S):
            e.ref = (s, next(kl_sums) if e.kl is not None else 0.0)


# ------------------------------------------------------------------------------------------------ the run
def run_kto(hf_dir: str, records: list[dict], out_dir: str, steps: int | None = None, epochs: float = 1.0,
            lr: float = 1e-6, batch_size: int = 16, micro_batch_size: int | None = None, beta: float = 0.1,
            desirable_weight: float = 1.0, undesirable_weight: float = 1.0, kl: bool = True,
            eval_records: list[dict] | None = None, max_length: int | None = None, seed: int = 0,
            log_every: int = 25, train_vision_tower: bool = False) -> dict:
    """KTO from ``hf_dir`` (also the reference) on example records; exports the policy to ``out_dir``. Returns
    ``{"steps", "history", "eval_before", "eval_after", "balance"}``."""
    from transformers import AutoTokenizer

    from forge_megatron.mcore import parallel

    if beta <= 0:
        raise ValueError("--beta must be positive")
    if desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError("--desirable-weight and --undesirable-weight must be positive")
    parallel.initialize(seed=seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        processor = sft._image_processor(hf_dir)
        examples = render_records(tokenizer, records, max_length=max_length, processor=processor)
        held_out = render_records(tokenizer, eval_records, what="eval example", processor=processor) \
            if eval_records else []
        if kl:
            attach_mismatched(examples, seed)
            if held_out:
                attach_mismatched(held_out, seed + 1)
        print(f"[kto] {balance_note(examples, desirable_weight, undesirable_weight)}", flush=True)
        images = any(e.sample[2] for e in examples + held_out)
        model, bridge = sft.build_model(hf_dir, processor, images, train_vision_tower)
        size = micro_batch_size or batch_size
        t0 = time.time()
        set_reference(model, examples + held_out, size, processor)  # the reference: the starting model, scored once
        print(f"[kto] reference log-probabilities of {len(examples) + len(held_out)} examples"
              f"{' and their mismatched answers' if kl else ''} ({time.time() - t0:.0f}s)", flush=True)
        step_loss = kto_examples_loss(model, beta, desirable_weight, undesirable_weight, kl, processor=processor)
        weights = (beta, desirable_weight, undesirable_weight, kl, processor)
        before = evaluate(model, held_out, size, *weights) if held_out else None
        n = preference._steps(steps, epochs, len(examples), batch_size)
        history = preference.train(list(model.parameters()), step_loss, examples, n, lr, batch_size,
                                   micro_batch_size, seed, log_every, "kto")
        after = evaluate(model, held_out, size, *weights) if held_out else None
        if held_out:
            print(f"[kto] held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
                  f"({len(held_out)} examples)", flush=True)
        sft.export_hf(model, bridge, hf_dir, out_dir)
        return {"steps": n, "history": history, "eval_before": before, "eval_after": after,
                "balance": weight_balance(examples, desirable_weight, undesirable_weight)}
    finally:
        parallel.destroy()


def main(argv: list[str] | None = None) -> int:
    """``forge-kto``: KTO on examples labelled desirable or undesirable."""
    p = preference._parser("forge-kto", __doc__, 1e-6)
    helps = {"data": "JSONL of KTO examples (forms: see above)",
             "eval_data": "held-out examples: loss and accuracy before and after training",
             "batch_size": "examples per optimizer step", "max_length": "leave out longer examples (tokens)",
             "epochs": "passes over the examples (default 1)",
             "micro_batch_size": "examples per forward (one prefix forest; the KL estimate is per forward)"}
    for action in p._actions:  # (the shared parser's help speaks of pairs)
        action.help = helps.get(action.dest, action.help)
    p.add_argument("--beta", type=float, default=0.1, help="beta: the implicit reward's scale (default 0.1)")
    p.add_argument("--desirable-weight", type=float, default=1.0,
                   help="w_D, the desirable examples' loss weight (default 1)")
    p.add_argument("--undesirable-weight", type=float, default=1.0,
                   help="w_U, the undesirable examples' loss weight (default 1; the paper suggests w_D n_D / "
                        "(w_U n_U) in [1, 4/3])")
    p.add_argument("--train-vision-tower", action="store_true",
                   help="vision-language checkpoints: train the vision tower too (exported as trained)")
    p.add_argument("--no-kl", action="store_true",
                   help="reference point 0 instead of the KL estimate from mismatched answers (which then are not "
                        "scored: fewer tokens per step)")
    args = p.parse_args(argv)
    preference._check(p, args)
    if args.beta <= 0:
        p.error("--beta must be positive")
    if args.desirable_weight <= 0 or args.undesirable_weight <= 0:
        p.error("--desirable-weight and --undesirable-weight must be positive")
    data, held = _load(p, args.data, "--data"), _load(p, args.eval_data, "--eval-data")
    try:
        result = run_kto(args.hf_checkpoint, data, args.out, args.steps, args.epochs, args.lr, args.batch_size,
                         args.micro_batch_size, args.beta, args.desirable_weight, args.undesirable_weight,
                         not args.no_kl, held, args.max_length, args.seed, args.log_every, args.train_vision_tower)
    except ValueError as exc:
        p.error(str(exc))
    summary = preference._summary(result, args.out)
    summary["balance"] = result["balance"]
    print(json.dumps(summary), flush=True)
    return 0


def _load(p: argparse.ArgumentParser, path: str | None, flag: str) -> list[dict] | None:
    if path is None:
        return None
    try:
        return load_examples(path)
    except (OSError, ValueError) as exc:
        p.error(f"{flag}: {exc}")
