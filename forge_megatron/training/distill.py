"""On-policy distillation in the trainer (``--teacher-hf-checkpoint``): a frozen teacher scores the student's samples.

The student samples as in RL (the gateway records its tokens and logprobs); every step, a frozen teacher model, any
size or family the bridge reads with the student's tokenizer, runs forward-only over the step's prefix trees (the
same micro-batches, the same tree attention: a shared prompt is scored once for the whole group) and gives each
sampled token its log-probability ``teacher_logp``. The loss (algo/losses.py) then trains on the per-token advantage

    A_t = distill_outcome_coef * A_outcome + distill_coef * (teacher_logp_t - old_logp_t)

the negative of the sampled reverse KL(pi_old || pi_teacher) at each token: the policy gradient moves the student
toward the teacher on the student's own samples, where it makes its mistakes (Agarwal et al. 2024, GKD; Thinking
Machines 2025, "On-Policy Distillation"). With ``--distill-outcome-coef 0`` no verifier or reward is needed; with
both, the verifier's reward and the teacher's guidance add up. The metrics gain ``distill_reverse_kl`` (the mean of
``old_logp - teacher_logp`` over the trained tokens, which training drives down) and ``distill_teacher_logp``.

The teacher is built as the KL reference is (:func:`trainer.build_reference_model`) but from its own configuration:
the policy's TP / PP / VPP / EP / CP layout applies to it, so its heads must divide by TP and its layers split over
the pipeline stages like the policy's. Its weights load from the HF checkpoint at every start (it never trains, so
a resumed run needs nothing from the trainer checkpoint); ``--teacher-offload`` keeps them in host memory between
its passes. A vision-language policy takes a vision-language teacher of its family (the same image token, merge
and tower kind): the teacher runs its own frozen tower on the batch's pictures, its features kept apart from the
policy's.
"""

from __future__ import annotations

import copy
import os

__all__ = ["Teacher", "check_same_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_same_tokenizer(policy_dir: str, teacher_dir: str, flag: str = "--teacher-hf-checkpoint",
                         role: str = "teacher", use: str = "on-policy distillation scores the policy's token ids with "
                                                           "the teacher") -> int:
    """Raise ValueError unless the teacher's (or, named by ``flag`` / ``role`` / ``use``, another model's: a critic)
    tokenizer maps every token to the same id as the policy's (the teacher scores the policy's token ids: another
    vocabulary would score other words, silently). Returns the vocabulary size."""
    from transformers import AutoTokenizer

    if not any(os.path.exists(os.path.join(teacher_dir, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"{flag} {teacher_dir} has no tokenizer files: the {role} must share the "
                         "policy's tokenizer, and that is checked against them (copy the policy's tokenizer there if "
                         f"the {role} was trained with it)")
    vocabs = []
    for what, d in (("policy", policy_dir), (role, teacher_dir)):
        try:
            vocabs.append(AutoTokenizer.from_pretrained(d).get_vocab())
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise ValueError(f"the {what}'s tokenizer in {d} does not load: {exc}") from exc
    policy, teacher = vocabs
    if policy != teacher:
        differ = sorted(k for k in set(policy) | set(teacher) if policy.get(k) != teacher.get(k))
        raise ValueError(f"{flag} {teacher_dir}: its tokenizer is not the policy's ({len(teacher)} "
                         f"vs {len(policy)} tokens, {len(differ)} differ, e.g. {differ[:3]}): {use}, so both must use "
                         "one vocabulary")
    return len(policy)


class Teacher:
    """This rank's chunks of the frozen teacher, its bridge and its model config."""

    def __init__(self, args, policy_bridge, model_config, build_chunks):
        """``model_config(args, bridge)`` and ``build_chunks(cfg)`` are the trainer's (a Megatron config from a
        bridge with the job's flags; frozen model chunks in the job's layout)."""
        from megatron.core import parallel_state as ps

        from forge_megatron.bridge import Bridge
        from forge_megatron.mcore.parallel import _SPLIT, pipeline_chunks

        self.dir = args.teacher_hf_checkpoint
        where = f"--teacher-hf-checkpoint {self.dir}"
        if not os.path.isfile(os.path.join(self.dir, "config.json")):
            raise ValueError(f"{where} has no config.json (an HF model directory)")
        self.vocab = check_same_tokenizer(args.hf_checkpoint, self.dir)
        try:
            self.bridge = Bridge(self.dir)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        self.spec = self._vision_spec(policy_bridge, where)
        cfg = self.bridge.cfg
        if cfg.vocab_size < self.vocab:
            raise ValueError(f"{where}: its vocabulary has {cfg.vocab_size} rows, the tokenizer {self.vocab} tokens")
        self.topk = args.distill_topk if getattr(args, "distill_kl", "sampled") != "sampled" else None
        if self.topk is not None and self.topk > self.vocab:
            raise ValueError(f"--distill-topk {self.topk} is more than the {self.vocab} tokens of the tokenizer")
        try:
            pipeline_chunks(cfg.num_layers, ps.get_pipeline_model_parallel_world_size(),
                            ps.get_virtual_pipeline_model_parallel_world_size(), *_SPLIT)
            tp = ps.get_tensor_model_parallel_world_size()
            for name, n in (("attention heads", cfg.num_attention_heads),
                            ("key-value heads", cfg.num_query_groups or cfg.num_attention_heads)):
                if n % tp:
                    raise ValueError(f"its {n} {name} do not split over --tensor-model-parallel-size {tp}")
            # the job's flags for its parallelism and precision, the teacher's checkpoint for its architecture (the
            # network flags describe the policy), nothing that trains
            targs = copy.copy(args)
            targs.num_layers, targs.hf_checkpoint = None, self.dir
            targs.moe_router_bias_update_rate, targs.dsa_indexer_loss_coeff = None, 0.0
            targs.recompute_granularity = None
            targs.longrope_factors = None  # (its own engine's default: the flag names the policy's)
            if not cfg.num_moe_experts:
                targs.expert_tensor_parallel_size = None
            self.cfg = model_config(targs, self.bridge)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        self.chunks = build_chunks(self.cfg)
        self.offload = None

    def _vision_spec(self, policy_bridge, where: str):
        """None for a text teacher of a text policy; the teacher's VisionSpec when both are vision-language models
        that read images alike (the batches' images are laid out with the policy's processor: same image token,
        merge and kind of tower); anything else refused."""
        policy_vl, teacher_vl = policy_bridge.family.multimodal, self.bridge.family.multimodal
        if policy_vl != teacher_vl:
            what = ("the policy", "the teacher") if policy_vl else ("the teacher", "the policy")
            raise ValueError(f"{where}: {what[0]} takes images and {what[1]} does not: a vision-language policy "
                             "needs a vision-language teacher of its family (and a text policy a text teacher)")
        if not policy_vl:
            return None
        from forge_megatron.multimodal import vision_spec

        try:
            policy, teacher = vision_spec(policy_bridge.hf_config), vision_spec(self.bridge.hf_config)
        except ValueError as exc:  # a family whose images the trainer does not take
            raise ValueError(f"{where}: {exc}") from exc
        for name in ("kind", "image_token_id", "merge", "interleaved", "bidirectional", "row_breaks"):
            if getattr(policy, name) != getattr(teacher, name):
                raise ValueError(f"{where}: its images are read otherwise than the policy's ({name} "
                                 f"{getattr(teacher, name)!r}, the policy's {getattr(policy, name)!r}): the batches' "
                                 "images are laid out with the policy's processor")
        return teacher

    def load(self, log) -> None:
        """The teacher's weights from its HF checkpoint (every start: it never trains); with ``--teacher-offload``
        then moved to host memory."""
        from forge_megatron.training.checkpoint import load_hf_weights

        load_hf_weights(self.chunks, self.bridge, self.dir)
        params = sum(p.numel() for c in self.chunks for p in c.parameters())
        log(f"teacher for on-policy distillation loaded from {self.dir} ({self.bridge.family.name}, "
            f"{self.cfg.num_layers} layers, hidden {self.cfg.hidden_size}; {params:,} parameters on this rank)")

    def offload_to_host(self, log) -> None:
        from forge_megatron.training.offload import HostOffload

        self.offload = HostOffload(self.chunks)
        log(f"teacher offloaded to host memory ({self.offload.nbytes / 2**20:.1f} MiB on this rank; on the device "
            "only for its forward pass)")

    def resident(self):
        """Context in which the teacher's weights are on the device."""
        import contextlib

        return self.offload.resident() if self.offload is not None else contextlib.nullcontext()
