"""PPO with a learned critic (``--critic``): a value model trained beside the policy, token-level GAE advantages.

The pool's group advantages give every trained token of a segment one number. With ``--critic`` the trainer also
holds a value model, a sequence-classification network (a transformer and a linear head of one output, read at every
position instead of the last: :func:`forge_megatron.mcore.forward.values_from_hidden`) initialised from
``--critic-hf-checkpoint`` (default: the policy's checkpoint, its head drawn new; a reward model's checkpoint
starts from its head), and each step:

1. runs the critic forward-only over the step's prefix trees (the same micro-batches as the policy: a shared prompt
   is computed once for the whole group) for the value of every trained token;
2. replaces each micro-batch's advantages by GAE along the trained tokens of each sample, toward the segment's return
   from the pool (algo/value.py), whitened over the batch (every data-parallel rank's tokens);
3. trains the critic on the squared error toward those targets (its own Megatron optimizer, ``--critic-lr``;
   one update per policy update: one per step, or one per mini-batch and epoch with ``--ppo-mini-batches`` /
   ``--ppo-epochs``, clipped around the step's first values with ``--value-clip``), each before the policy's update
   on the same mini-batch, unless the step is one of the first ``--critic-warmup-iters`` where the policy waits for
   the critic to learn.

The critic takes the policy's TP / PP / VPP / EP / CP layout and precision flags (its heads must divide by TP and
its layers split over the pipeline stages like the policy's) but never LoRA (a LoRA policy's critic trains all of
its weights), QAT or a vision tower: a vision-language policy is refused. Its checkpoint is saved with the policy's
under ``<save>/critic`` (the same iteration numbers, ``--keep-checkpoints`` + 1 of them; written before the
policy's, so a complete policy checkpoint always has its critic) and resumed from there; ``forge-convert trainer-to-hf`` exports it as the reward-model checkpoint it is
(``<Family>ForSequenceClassification``). A run resumed from a checkpoint saved without a critic starts the critic
from its HF checkpoint (logged).

Metrics (``critic/...``, over the batch's trained tokens): ``value_mean``, ``return_mean``, ``advantage_mean`` and
``advantage_std`` (before whitening), ``explained_variance`` (1 - Var(R - V) / Var(R) of the values the advantages
came from), ``vf_loss``, ``grad_norm``, ``lr``, ``update_ok`` (and ``vf_clip_frac`` with ``--value-clip``).
"""

from __future__ import annotations

import copy
import os
import time

import torch

__all__ = ["Critic", "CRITIC_DIR"]

CRITIC_DIR = "critic"
"""The critic's checkpoints live in this directory under the policy's --save / --load."""


class Critic:
    """This rank's chunks of the value model, their DDP wrappers, its optimizer and LR scheduler."""

    def __init__(self, args, policy_bridge, model_config, build_model_and_optimizer):
        """``model_config(args, bridge)`` and ``build_model_and_optimizer(args, cfg)`` are the trainer's."""
        from forge_megatron.bridge import Bridge
        from forge_megatron.bridge.families import load_hf_config, reward_labels, reward_model_config
        from forge_megatron.training.distill import check_same_tokenizer

        self.dir = getattr(args, "critic_hf_checkpoint", None) or args.hf_checkpoint
        where = f"--critic-hf-checkpoint {self.dir}" if getattr(args, "critic_hf_checkpoint", None) else \
            f"--critic (from --hf-checkpoint {self.dir})"
        if policy_bridge.family.multimodal:
            raise ValueError("--critic: the policy is a vision-language model; the value model reads text only")
        if not os.path.isfile(os.path.join(self.dir, "config.json")):
            raise ValueError(f"{where} has no config.json (an HF model directory)")
        vocab = None
        if os.path.abspath(self.dir) != os.path.abspath(args.hf_checkpoint):
            vocab = check_same_tokenizer(args.hf_checkpoint, self.dir, "--critic-hf-checkpoint", "critic",
                                         "the critic values the policy's token ids")
        try:
            hf = reward_model_config(load_hf_config(self.dir))
            if reward_labels(hf) != 1:
                raise ValueError(f"it has {reward_labels(hf)} labels; a value model has one")
            self.bridge = Bridge(hf)
            if vocab is not None and self.bridge.cfg.vocab_size < vocab:
                raise ValueError(f"its vocabulary has {self.bridge.cfg.vocab_size} rows, the tokenizer {vocab} tokens")
            # the job's parallelism and precision, the critic's checkpoint for its architecture, its own learning rate
            cargs = copy.copy(args)
            cargs.num_layers, cargs.hf_checkpoint = None, self.dir
            cargs.lr = args.critic_lr if args.critic_lr is not None else args.lr
            cargs.min_lr = args.min_lr * cargs.lr / args.lr if args.lr else 0.0
            cargs.lora_rank, cargs.vision_lr = None, None
            cargs.moe_router_bias_update_rate, cargs.dsa_indexer_loss_coeff = None, 0.0
            if getattr(args, "longrope_factors", None) and "longrope" not in str(self.bridge.cfg.rope_scaling):
                cargs.longrope_factors = None  # (a critic of another RoPE: the flag names the policy's)
            if not self.bridge.cfg.num_moe_experts:
                cargs.expert_tensor_parallel_size = None
            self.cfg = model_config(cargs, self.bridge)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        self.args = cargs
        self.chunks, self.ddp, self.optimizer, self.scheduler = build_model_and_optimizer(cargs, self.cfg)
        self.gamma, self.lam = args.gae_gamma, args.gae_lambda
        self.whiten = args.whiten_advantages
        self.warmup = args.critic_warmup_iters
        self.clip = getattr(args, "value_clip", None)
        self.stepped = False  # an update of this iteration stepped (the LR schedule advances once per iteration)

    # -- weights ------------------------------------------------------------------------------------------
    def init_from_hf(self, log, why: str = "") -> None:
        from forge_megatron.training.checkpoint import load_hf_weights

        load_hf_weights(self.chunks, self.bridge, self.dir)
        self.optimizer.reload_model_params()  # (--bf16: the fp32 masters from these weights, as the policy's)
        params = sum(p.numel() for c in self.chunks for p in c.parameters())
        log(f"critic initialised from HF checkpoint {self.dir}{why} ({self.cfg.num_layers} layers, hidden "
            f"{self.cfg.hidden_size}; {params:,} parameters on this rank, lr {self.args.lr:g})")

    def resume(self, root: str, iteration: int, log) -> None:
        """The critic saved with the policy's checkpoint ``iteration``; from its HF checkpoint if there is none."""
        from forge_megatron.training.checkpoint import load_checkpoint, saved_iterations

        critic_root = os.path.join(root, CRITIC_DIR)
        if iteration not in saved_iterations(critic_root):
            self.init_from_hf(log, f" (the checkpoint {root} iteration {iteration} holds no critic)")
            return
        load_checkpoint(critic_root, iteration, self.ddp, self.optimizer, self.scheduler, log)
        log(f"critic resumed from {critic_root} at iteration {iteration}")

    def save(self, root: str, iteration: int, keep: int | None) -> None:
        """Written before the policy's checkpoint of ``iteration``; with --keep-checkpoints K one more than K kept, so
        that the critic of the policy's newest complete checkpoint survives a save cut short after the critic's."""
        from forge_megatron.training.checkpoint import save_checkpoint

        save_checkpoint(os.path.join(root, CRITIC_DIR), iteration, self.ddp, self.optimizer, self.scheduler,
                        {"critic": True}, meta={"hf_config": self.bridge.hf_config,
                                                "hf_checkpoint": os.path.abspath(self.dir), "critic": True},
                        keep=None if keep is None else keep + 1)

    def gather_params(self) -> None:
        """Whole parameters after a step with --overlap-param-gather (the critic does not overlap the gather)."""
        for ddp in self.ddp:
            if ddp.ddp_config.overlap_param_gather:
                ddp.start_param_sync(force_sync=True)

    # -- one step -----------------------------------------------------------------------------------------
    def advantages(self, rbs: list, run_schedule, sum_over_dp) -> dict:
        """The critic's values of every trained token of the rank batches ``rbs`` (one step's mini-batches:
        ``old_values_M``), GAE advantages in place of the pool's (``advantages_M``, whitened over all of them with
        --whiten-advantages) and value targets (``returns_M``) on the last pipeline stage's micro-batches; returns
        the step's statistics (on every rank). All of it before any update: every mini-batch's values come from the
        critic of the step's start."""
        from forge_megatron.algo.value import gae_advantages
        from forge_megatron.mcore.forward import make_value_forward_step

        def keep(values_M, mb):
            mb.extras["old_values_M"] = values_M.detach()
            return values_M.sum() * 0.0, {}

        with torch.no_grad():
            for rb in rbs:
                run_schedule(self.ddp, rb, make_value_forward_step(keep), forward_only=True)
        # over the trained tokens: n, sum V, sum R, sum R^2, sum (R - V), sum (R - V)^2, sum A, sum A^2
        sums = torch.zeros(8, dtype=torch.float64)
        micro_batches = [mb for rb in rbs for mb in rb.micro_batches]
        for mb in micro_batches:
            x = mb.extras
            if "old_values_M" not in x:  # not the last pipeline stage: no loss here
                continue
            v = x["old_values_M"]  # (on the device the critic ran on: GAE runs there)
            adv, ret = gae_advantages(v, x["loss_mask_M"], x["cu_seqlens_S1"], x["return_S"], self.gamma, self.lam,
                                      x.get("call_reward_M"))
            m, vd, rd, ad = x["loss_mask_M"].to(v.device).double(), v.double(), ret.double(), adv.double()
            sums += torch.stack([m.sum(), (m * vd).sum(), (m * rd).sum(), (m * rd * rd).sum(), (m * (rd - vd)).sum(),
                                 (m * (rd - vd) ** 2).sum(), (m * ad).sum(), (m * ad * ad).sum()]).cpu()
            x["advantages_M"], x["returns_M"] = adv.cpu(), ret.cpu()
        n, v, r, r2, e, e2, a, a2 = _batch_sums(sums, rbs[0].dp_size, sum_over_dp)
        n = max(n, 1.0)

        def var(s, s2):
            return max(s2 / n - (s / n) ** 2, 0.0)

        a_std = var(a, a2) ** 0.5
        if self.whiten:
            for mb in micro_batches:
                x = mb.extras
                if "returns_M" in x:
                    x["advantages_M"] = (x["advantages_M"] - a / n) / (a_std + 1e-8) * x["loss_mask_M"]
        r_var = var(r, r2)
        return {"critic/value_mean": v / n, "critic/return_mean": r / n, "critic/advantage_mean": a / n,
                "critic/advantage_std": a_std,
                "critic/explained_variance": 1.0 - var(e, e2) / r_var if r_var > 0 else 0.0}

    def update(self, rb, run_schedule, sum_over_dp) -> dict:
        """One optimizer step of the critic on the value loss (token mean over the rank batch's trained tokens, every
        DP rank's) toward ``returns_M``, clipped around ``old_values_M`` with --value-clip; its metrics (the LR
        scheduler advances once per iteration: :meth:`step_scheduler`)."""
        from forge_megatron.algo.value import value_clip_count, value_loss
        from forge_megatron.mcore.forward import make_value_forward_step

        t0 = time.perf_counter()
        num_mb = len(rb.micro_batches)
        total = rb.global_loss_tokens if rb.global_loss_tokens is not None else rb.num_loss_tokens
        norm = max(total, 1.0) / rb.dp_size  # (DDP averages the gradients over the DP ranks)
        parts = []  # per micro-batch: summed loss, tokens, clipped tokens (on the device: no sync in the schedule)

        def loss_fn(values_M, mb):
            x = mb.extras
            mask, ret = x["loss_mask_M"].to(values_M.device), x["returns_M"].to(values_M.device)
            old = x["old_values_M"].to(values_M.device) if self.clip is not None else None
            loss = value_loss(values_M, ret, mask, old, self.clip)
            clipped = value_clip_count(values_M, ret, mask, old, self.clip) if self.clip is not None else \
                torch.zeros((), device=values_M.device)
            parts.append(torch.stack([loss.detach(), mask.sum(), clipped]).double())
            return loss / norm * num_mb, {}  # (Megatron divides each micro-batch's loss by their count)

        for chunk in self.ddp:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        run_schedule(self.ddp, rb, make_value_forward_step(loss_fn))
        ok, grad_norm, _ = self.optimizer.step()
        self.stepped = self.stepped or bool(ok)
        self.gather_params()
        sums = torch.stack(parts).sum(0).cpu() if parts else torch.zeros(3, dtype=torch.float64)
        loss, n, clipped = _batch_sums(sums, rb.dp_size, sum_over_dp)
        out = {"critic/vf_loss": loss / max(n, 1.0), "critic/grad_norm": float(grad_norm or 0.0),
               "critic/update_ok": bool(ok), "critic/update_s": time.perf_counter() - t0, "critic/num_tokens": n}
        if self.clip is not None:
            out["critic/vf_clip_frac"] = clipped / max(n, 1.0)
        return out

    def step_scheduler(self) -> float:
        """Once per iteration, after its updates: the LR schedule advances when one of them stepped (as the
        policy's); the learning rate."""
        if self.stepped:
            self.scheduler.step(increment=1)
        self.stepped = False
        return self.scheduler.get_lr(self.optimizer.param_groups[0])


def _batch_sums(sums: torch.Tensor, dp_size: int, sum_over_dp) -> list[float]:
    """This rank's ``sums`` over the batch: summed over the data-parallel ranks and the pipeline stages (only the
    last stage has values; the others add zeros), the same on every rank. Under context parallelism every CP rank
    already holds every token's values: the DP group (not DP x CP) is what holds other tokens."""
    return _over_pipeline(torch.tensor(sum_over_dp(sums.tolist(), dp_size), dtype=torch.float64)).tolist()


def _over_pipeline(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the pipeline stages (only the last one has the values): every stage gets the batch's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.parallel import comm_device

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return t
    group = ps.get_pipeline_model_parallel_group()
    t = t.to(comm_device(group))
    dist.all_reduce(t, group=group)
    return t.cpu()
