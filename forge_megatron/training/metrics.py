"""Per-step training metrics and where they go: a JSONL file, tensorboard (``--tensorboard-dir``, if installed) and
Weights & Biases (``--wandb-project``, if installed), the same flags as Megatron-LM.

Per step (rank 0's DP share of the batch):
  reward_mean, success_rate (reward > 0) overall and ``<domain>/reward_mean``, ``<domain>/success_rate`` per domain,
  computed once per episode (an episode's segments share its reward);
  loss terms combined over micro-batches so that they do not depend on the micro-batching
  (:func:`combine_micro_batch_metrics`: ``loss``, ``pg_loss``, ``entropy`` summed as shares of the batch,
  ``clip_frac_low/high``, ``ratio_mean`` ... token-weighted, ``ratio_max`` the maximum; per-domain
  ``<domain>/<term>`` from ``algo.policy_loss``);
  staleness_mean / staleness_max: policy version now minus the version that sampled each trained token;
  total_tokens (what unmerged training would process) vs unique_tokens (what the trees hold) and their ratio;
  with images (vision-language models), ``images`` (the distinct images this rank's trees encoded, each once per
  micro-batch) and ``image_tokens`` (their tree tokens);
  the time split wait / forward-backward / sync / checkpoint and tokens/s (added by the trainer);
  ``eval/*`` when a held-out evaluation was published to the gateway since the last step (:class:`EvalFeed`).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict

import numpy as np


def _episode_rewards(samples) -> dict[str, tuple[str, float]]:
    return {s.episode_id: (s.domain, float(s.reward)) for s in samples}


def reward_metrics(samples) -> dict[str, float]:
    episodes = _episode_rewards(samples)
    out: dict[str, float] = {}
    by_domain: dict[str, list[float]] = defaultdict(list)
    for domain, reward in episodes.values():
        by_domain[domain].append(reward)
    all_rewards = [r for rs in by_domain.values() for r in rs]
    for prefix, rewards in [("", all_rewards)] + [(f"{d}/", rs) for d, rs in sorted(by_domain.items())]:
        out[f"{prefix}reward_mean"] = float(np.mean(rewards))
        out[f"{prefix}success_rate"] = float(np.mean([r > 0 for r in rewards]))
    out["episodes"] = float(len(episodes))
    return out


def staleness_metrics(samples, policy_version: int) -> dict[str, float]:
    lags = np.concatenate([policy_version - s.policy_versions[s.loss_mask.astype(bool)] for s in samples])
    if lags.size == 0:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": float(lags.mean()), "staleness_max": float(lags.max())}


BATCH_SHARES = ("loss", "pg_loss", "kl", "entropy", "distill_loss")
"""Loss terms that ``algo.policy_loss`` reduces with the whole batch's normaliser in the trainer: each micro-batch
reports its share, so the rank's value is their sum."""


def combine_micro_batch_metrics(dicts: list[dict]) -> dict[str, float]:
    """One rank's metrics from its micro-batches' ``policy_loss`` metrics, independent of how the batch was split:
    batch-normalised loss terms and token counts add up, maxima take the maximum, and every other term (token means:
    ratios, clip fractions, per-domain means) is averaged weighted by the tokens it was taken over (``num_tokens``,
    or ``<domain>/num_tokens`` for ``<domain>/...``)."""
    keys = list(dict.fromkeys(k for d in dicts for k, v in d.items() if isinstance(v, (int, float))))
    out = {}
    for key in keys:
        present = [d for d in dicts if isinstance(d.get(key), (int, float))]
        values = [float(d[key]) for d in present]
        prefix, _, term = key.rpartition("/")
        if term in BATCH_SHARES or term in ("num_tokens", "num_pairs", "num_examples"):
            out[key] = float(np.sum(values))
        elif term.endswith("_max"):
            out[key] = float(np.max(values))
        elif term.endswith("_min"):
            out[key] = float(np.min(values))
        else:
            count_key = f"{prefix}/num_tokens" if prefix else "num_tokens"
            for count in ("num_pairs", "num_examples"):  # (DPO's: means over pairs; KTO's: over examples)
                if prefix and any(f"{prefix}/{count}" in d for d in present):
                    count_key = f"{prefix}/{count}"
            weights = [float(d.get(count_key, 1.0)) for d in present]
            out[key] = float(np.average(values, weights=weights)) if sum(weights) > 0 else float(np.mean(values))
    return out


FIRST_UPDATE_PREFIXES = ("rollout_", "onpolicy/")
"""Training/inference mismatch terms: measured on the weights that sampled the batch, i.e. its first update."""


def combine_update_metrics(updates: list[dict], first_pass: int | None = None) -> dict[str, float]:
    """One step's metrics from its optimizer updates' (``--ppo-mini-batches`` x ``--ppo-epochs``; each combined over
    its micro-batches by :func:`combine_micro_batch_metrics`): every update's loss terms are means over its own
    tokens, so they and the token means average weighted by the tokens they were taken over; token counts are the
    batch's (summed over the ``first_pass`` updates of the first pass over the mini-batches; default all); maxima and minima span the updates; the mismatch terms
    (``rollout_*``, ``onpolicy/*``) are the first update's, the only one on the sampling weights. One update: its
    metrics as they are."""
    if len(updates) <= 1:
        return dict(updates[0]) if updates else {}
    out = combine_micro_batch_metrics(updates)
    weights = [float(u.get("num_tokens", 0.0)) for u in updates]
    for key in list(out):
        term = key.rpartition("/")[2]
        if key.startswith(FIRST_UPDATE_PREFIXES):
            if key in updates[0]:
                out[key] = float(updates[0][key])
            else:
                del out[key]
        elif term in BATCH_SHARES and sum(weights) > 0:  # a domain absent from an update had no share there
            out[key] = float(sum(w * float(u.get(key, 0.0)) for w, u in zip(weights, updates)) / sum(weights))
        elif term in ("num_tokens", "num_pairs", "num_examples"):
            out[key] = float(sum(float(u.get(key, 0.0)) for u in updates[:first_pass]))
    return out


def batch_metrics(rank_batch, micro_batch_metrics: list[dict], policy_version: int) -> dict:
    """Everything except timings for one step (see the module docstring)."""
    total = sum(mb.layout.total_tokens for mb in rank_batch.micro_batches)
    pad = sum(getattr(mb, "pad_tokens", 0) for mb in rank_batch.micro_batches)  # fixed-length pipelines only
    unique = sum(mb.layout.unique_tokens for mb in rank_batch.micro_batches) - pad
    out = {"samples": len(rank_batch.samples), "micro_batches": len(rank_batch.micro_batches),
           "total_tokens": int(total), "unique_tokens": int(unique), "merge_ratio": total / max(unique, 1),
           "loss_tokens": rank_batch.num_loss_tokens, "batch_id": rank_batch.batch_id,
           "overlong_samples": getattr(rank_batch, "overlong_samples", 0)}
    if pad:
        out["pad_tokens"] = int(pad)  # computed but not real: the interleaved pipeline's fixed length (PP = 2)
    visions = [mb.layout.vision for mb in rank_batch.micro_batches if getattr(mb.layout, "vision", None) is not None]
    if visions:
        out["images"] = sum(v.num_images for v in visions)
        out["image_tokens"] = sum(int((v.rows_T >= 0).sum()) for v in visions)
    if len(getattr(rank_batch, "dp_loads", [])) > 1:
        from forge_megatron.training.balance import imbalance

        out["dp_load_imbalance"] = imbalance(rank_batch.dp_loads)  # slowest DP rank's estimated compute / mean
        out["dp_split_groups"] = getattr(rank_batch, "dp_split_groups", 0)  # groups dealt to several DP ranks
    out.update(reward_metrics(rank_batch.samples))
    out.update(staleness_metrics(rank_batch.samples, policy_version))
    out.update(combine_micro_batch_metrics(micro_batch_metrics))  # empty on non-last pipeline stages
    out.setdefault("loss", float("nan"))
    out.setdefault("clip_frac_high", float("nan"))
    return out


EVAL_KEYS = ("policy_version", "finished", "mean_reward", "completion_tokens_mean", "duration_s_mean", "wall_s")


def eval_metrics(result: dict) -> dict[str, float]:
    """``eval/*`` metrics of one published evaluation result (agents/evaluate.py): pass@k and the EVAL_KEYS, overall
    and per domain (``eval/<domain>/pass@1``); missing or None values are left out."""
    def numbers(record: dict, prefix: str) -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in record.items()
                if (k.startswith("pass@") or k in EVAL_KEYS) and isinstance(v, (int, float)) and not isinstance(v, bool)}

    out = numbers(result, "eval/")
    for domain, record in (result.get("domains") or {}).items():
        if isinstance(record, dict):
            out.update(numbers(record, f"eval/{domain}/"))
    return out


class EvalFeed:
    """Polls the gateway for evaluation results published since the last poll (``GET /forge/evals``); the trainer
    logs the newest with its step. An unreachable gateway costs a warning, never the step. A gateway that restarted
    (another ``gateway`` instance id in the answer) numbers its results from 1 again: they are read from the first."""

    def __init__(self, gateway_url: str, token: str | None = None, timeout_s: float = 2.0):
        self.url, self.token, self.timeout_s = gateway_url.rstrip("/"), token, timeout_s
        self.last_id = 0
        self.gateway: str | None = None  # the gateway instance the ids belong to
        self._warned = False

    def _fetch(self, after: int) -> dict:
        import urllib.request

        req = urllib.request.Request(f"{self.url}/forge/evals?after={after}")
        if self.token:
            req.add_header("X-Forge-Admin-Token", self.token)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())

    def poll(self) -> dict[str, float]:
        try:
            answer = self._fetch(self.last_id)
            if answer.get("gateway") != self.gateway:
                if self.gateway is not None and self.last_id:  # a restarted gateway numbers results from 1 again
                    logging.getLogger("forge.train").info("the gateway at %s restarted: reading its evaluation "
                                                          "results from the first", self.url)
                    self.last_id = 0
                    answer = self._fetch(0)
                self.gateway = answer.get("gateway")
            evals = answer["evals"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not self._warned:
                logging.getLogger("forge.train").warning("cannot read evaluation results from %s: %s", self.url, exc)
                self._warned = True
            return {}
        if not evals:
            return {}
        self.last_id = max(e["id"] for e in evals)
        return eval_metrics(max(evals, key=lambda e: e["id"]))


class MetricsWriter:
    """Fans one metrics dict per step out to JSONL / tensorboard / wandb, whichever the flags ask for."""

    def __init__(self, args):
        self.jsonl = None
        if args.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_jsonl)), exist_ok=True)
            self.jsonl = open(args.metrics_jsonl, "a")
        self.tb = _tensorboard(args.tensorboard_dir)
        self.wandb = _wandb(args)

    def write(self, step: int, metrics: dict) -> None:
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        if self.jsonl is not None:  # JSONL also keeps lists (e.g. the group indices trained on)
            lists = {k: v for k, v in metrics.items() if isinstance(v, list)}
            self.jsonl.write(json.dumps({"step": step, **numbers, **lists}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k, float(v), step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _tensorboard(log_dir: str | None):
    if not log_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError(f"--tensorboard-dir needs the tensorboard package: pip install tensorboard ({exc})") from None
    return SummaryWriter(log_dir=log_dir)


def _wandb(args):
    if not args.wandb_project:
        return None
    try:
        import wandb
    except ImportError:
        raise RuntimeError("--wandb-project needs the wandb package: pip install wandb") from None
    return wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None, config=vars(args))
