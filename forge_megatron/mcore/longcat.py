"""LongCat-Flash (Meituan; ``LongcatFlashForCausalLM``): two attention + MLP sublayers per layer, a shortcut-connected
MoE with zero-computation experts, and multi-latent attention with LoRA-rank scales.

One LongCat layer, x its input (every norm an RMSNorm, every attention DeepSeek-V3's multi-latent attention):

    h1  = x  + attn_0(norm_0(x))
    y   = norm'_0(h1)
    h2  = h1 + mlp_0(y)                    s = MoE(y)     (routed and identity experts)
    h3  = h2 + attn_1(norm_1(h2))
    out = h3 + mlp_1(norm'_1(h3)) + s

Megatron builds it as two of its layers, 2i and 2i+1 (``GPTConfig.shortcut_moe``; ``num_layers`` counts these, twice
the checkpoint's ``num_layers``): layer 2i is a pre-norm layer whose MLP is :class:`ShortcutMoE` (the routed experts
beside the dense mlp_0, which sits in Megatron's shared-expert slot so that TP, SP, EP and recomputation treat it as any
shared expert), layer 2i+1 a pre-norm layer with the dense mlp_1. The MoE's output s crosses from one to the other
*beside the hidden states*: layer 2i hands on [h2 | s] (2 x hidden channels) and layer 2i+1 splits it and adds s to its
output. Carried in the activation rather than a side store, s stays right under every recomputation (whole layers, the
MLP, the MoE) and across the checkpoint boundaries of full recomputation; a pipeline stage (and a virtual chunk) must
hold whole pairs (:func:`finish` checks; the trainer refuses such layouts up front).

The router (:class:`ZeroExpertRouter`), per token, with z the logits over the N routed and Z zero-computation
("identity") experts, computed in fp32, and b the checkpoint's ``e_score_correction_bias`` (frozen: RL does not
rebalance):

    p = softmax(z) over all N + Z experts
    S = the k experts with the largest p + b                 (the bias steers the choice only)
    w_e = p_e * routed_scaling_factor                          for e in S (not renormalised)

An identity expert's output is its input: a token's identity weights add w_id * y (w_id their sum), and its routing map
holds only its routed experts, fewer than k where it chose identities (Megatron's dropless dispatchers take any number
per token; the fused TE permutation, which assumes k, is refused). Routing replay (mcore/routing_replay.py) replays the
choice S over all N + Z experts; its recorded column is the checkpoint's layer (:attr:`ShortcutLayer.replay_column`).

Multi-latent attention: LongCat multiplies the query (both parts) after its up projection by sqrt(D / q_lora_rank), and
the key/value latent after its norm by sqrt(D / kv_lora_rank) (so the keys' unrotated part and the values), and its latent
norms have transformers' default epsilon (1e-6) beside the layer norms' ``rms_norm_eps``: :func:`finish` hooks the scales
onto the query up projection's and the latent norm's outputs (on the fused norm + up projection's output under
Transformer Engine: the same by linearity) and sets the latent norms' epsilon (``GPTConfig.mla_latent_scales``,
``mla_latent_norm_epsilon``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from forge_megatron.mcore.ernie import biased_softmax_topk


class ZeroExpertRouter(TopKRouter):
    """Megatron's top-k router with LongCat-Flash's choice, weights and zero-computation experts (module docstring).
    ``weight`` has a row per routed and per identity expert; ``expert_bias`` [N + Z] is a frozen fp32 buffer;
    :attr:`identity_weight` [tokens, 1] is the last routing's summed identity weights (read by :class:`ShortcutMoE`
    in the same forward)."""

    def __init__(self, config, *args, zero_experts: int = 0, **kwargs):
        super().__init__(config, *args, **kwargs)
        if getattr(config, "moe_aux_loss_coeff", 0.0):
            raise ValueError("LongCat-Flash's router computes no auxiliary load-balancing loss: set moe_aux_loss_coeff 0")
        if getattr(config, "moe_router_num_groups", None):
            raise ValueError("LongCat-Flash's router chooses among all experts: no expert groups (moe_router_num_groups)")
        if zero_experts < 0:
            raise ValueError(f"zero_experts must be >= 0, got {zero_experts}")
        self.zero_experts = int(zero_experts)
        total = config.num_moe_experts + self.zero_experts
        if self.topk > total:
            raise ValueError(f"moe_router_topk ({self.topk}) > routed + identity experts ({total})")
        self.weight = torch.nn.Parameter(torch.empty((total, config.hidden_size), dtype=torch.float32))
        self.reset_parameters()  # (Megatron's init, dtype and sequence-parallel marking of the new rows)
        del self.expert_bias  # (Megatron's attribute: None without its own expert bias)
        self.register_buffer("expert_bias", torch.zeros(total, dtype=torch.float32))
        self.identity_weight: torch.Tensor | None = None

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        routed = self.config.num_moe_experts
        logits = logits.view(-1, self.weight.shape[0])
        p, chosen = biased_softmax_topk(self, logits)
        w = p.gather(1, chosen)
        scale = self.config.moe_router_topk_scaling_factor
        if scale:
            w = w * scale
        full = torch.zeros_like(p).scatter(1, chosen, w)
        self.identity_weight = full[:, routed:].sum(dim=-1, keepdim=True)
        probs = full[:, :routed].type_as(logits).contiguous()
        routing_map = torch.zeros_like(p, dtype=torch.bool).scatter(1, chosen, True)[:, :routed].contiguous()
        return probs, routing_map


class ShortcutMoE(MoELayer):
    """Layer 2i's MLP: the dense MLP (Megatron's shared-expert slot) and the routed + identity experts on the same
    input. Returns [dense | shortcut] (2 x hidden channels) for :class:`ShortcutLayer`, which adds the first half to
    its residual and hands the second on. The identity experts' share is added where the routed experts' output is
    made, inside the (possibly recomputed) MoE forward."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if not self.use_shared_expert:
            raise ValueError("LongCat-Flash's MoE layer needs its dense MLP in the shared-expert slot "
                             "(moe_shared_expert_intermediate_size)")
        if self.shared_expert_overlap:
            raise ValueError("LongCat-Flash's dense MLP runs beside the MoE, not inside its dispatcher: turn "
                             "moe_shared_expert_overlap off")
        if getattr(config, "moe_permute_fusion", False) or config.moe_token_dispatcher_type not in ("alltoall",
                                                                                                     "allgather"):
            raise ValueError("LongCat-Flash routes a token to fewer than k experts where it chose identity experts: "
                             "use the alltoall or allgather token dispatcher without the fused permutation "
                             f"(moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}, moe_permute_fusion="
                             f"{getattr(config, 'moe_permute_fusion', False)})")
        self._identity: torch.Tensor | None = None

    def route(self, hidden_states, padding_mask=None):
        probs, routing_map = super().route(hidden_states, padding_mask)
        w = self.router.identity_weight.view(*hidden_states.shape[:-1], 1)
        self._identity = (hidden_states * w).to(hidden_states.dtype)  # (in fp32 then cast, as transformers does)
        return probs, routing_map

    def shared_experts_compute(self, hidden_states):
        return None  # the dense MLP's output goes to the residual now, not into the MoE's output (forward)

    def postprocess(self, output, shared_expert_output):
        output = super().postprocess(output, None)
        identity, self._identity = self._identity, None
        return output + identity

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise ValueError("LongCat-Flash's MoE layer does not run in pieces (partial CUDA graphs)")
        routed, _ = super().forward(hidden_states, padding_mask=padding_mask)
        dense = MoELayer.shared_experts_compute(self, hidden_states)  # (recomputed when the config says so)
        return torch.cat([dense, routed], dim=-1), None


class _QuietUnknownMLP(logging.Filter):
    def filter(self, record):
        return not str(record.getMessage()).startswith("Unknown MLP type")


class ShortcutLayer(TransformerLayer):
    """A Megatron layer of a LongCat pair: the first (its MLP a :class:`ShortcutMoE`) outputs [hidden | shortcut],
    the second takes that, runs on the hidden half and adds the shortcut to its output."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
        # Megatron's layer warns of any MLP class but its own (and builds it with the default process groups, which
        # it would pass to a MoELayer anyway): quiet for ours
        quiet = _QuietUnknownMLP()
        logger = logging.getLogger(TransformerLayer.__module__)
        logger.addFilter(quiet)
        try:
            super().__init__(config, submodules, layer_number, *args, **kwargs)
        finally:
            logger.removeFilter(quiet)
        self.opens = isinstance(self.mlp, ShortcutMoE)
        if self.opens != ((self.layer_number - 1) % 2 == 0):
            raise ValueError(f"LongCat-Flash layer {self.layer_number}: the MoE layers of a pair must be the "
                             "odd-numbered ones (Megatron layers 2i; moe_layer_freq [1, 0, 1, 0, ...])")
        self.replay_column = (self.layer_number - 1) // 2  # the checkpoint's layer (routing replay's column)

    def forward(self, *args, **kwargs):
        if self.opens:
            return super().forward(*args, **kwargs)
        if "hidden_states" in kwargs:
            wide = kwargs.pop("hidden_states")
        else:
            wide, args = args[0], args[1:]
        width = self.config.hidden_size
        if wide.shape[-1] != 2 * width:
            raise RuntimeError(f"LongCat-Flash layer {self.layer_number} takes [hidden | shortcut] ({2 * width} "
                               f"channels) from layer {self.layer_number - 1}, got {wide.shape[-1]}: a pipeline "
                               "stage must hold whole pairs of layers")
        hidden, shortcut = wide.split(width, dim=-1)
        output, context = super().forward(hidden.contiguous(), *args, **kwargs)
        return output + shortcut, context

    def _forward_post_mlp(self, mlp_output_with_bias, residual):
        if not self.opens:
            return super()._forward_post_mlp(mlp_output_with_bias, residual)
        wide, bias = mlp_output_with_bias
        recompute_norm = self.recompute_pre_mlp_layernorm
        if recompute_norm:  # (both halves were made from the norm's output: recompute it on the whole's gradient)
            self.pre_mlp_norm_checkpoint.discard_output_and_register_recompute(wide)
        dense, shortcut = wide.split(self.config.hidden_size, dim=-1)
        self.recompute_pre_mlp_layernorm = False
        try:
            hidden = super()._forward_post_mlp((dense, bias), residual)
        finally:
            self.recompute_pre_mlp_layernorm = recompute_norm
        return torch.cat([hidden, shortcut], dim=-1)


def shortcut_spec(spec, zero_experts: int):
    """``spec`` (a block spec of this stage's layers, MoE and dense alternating) with every layer a
    :class:`ShortcutLayer`, every MoE layer a :class:`ShortcutMoE` routed by a :class:`ZeroExpertRouter`."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    def one(layer):
        mlp = layer.submodules.mlp
        if isinstance(getattr(mlp, "submodules", None), MoESubmodules):
            router = functools.partial(ZeroExpertRouter, zero_experts=zero_experts)
            mlp = dataclasses.replace(mlp, module=ShortcutMoE,
                                      submodules=dataclasses.replace(mlp.submodules, router=router))
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))
        return dataclasses.replace(layer, module=ShortcutLayer)

    if not hasattr(spec, "layer_specs"):
        raise ValueError("LongCat-Flash's layers are built from a block spec (MoE and dense layers alternating)")
    return dataclasses.replace(spec, layer_specs=[one(s) for s in spec.layer_specs])


def _scale_output(scale: float):
    def hook(module, args, output):
        if isinstance(output, tuple):  # (a Megatron linear: output, bias)
            return (output[0] * scale, *output[1:])
        return output * scale

    return hook


def _set_eps(module, eps: float, what: str) -> None:
    if not hasattr(module, "eps"):
        raise ValueError(f"{what} ({type(module).__name__}) has no epsilon to set")
    module.eps = eps


def finish(model, cfg) -> None:
    """After building ``model`` (a stage of a LongCat-Flash GPTModel): check that it holds whole pairs of layers, and
    give its multi-latent attention LongCat's latent scales and latent norms' epsilon (module docstring)."""
    from megatron.core.transformer.identity_op import IdentityOp

    layers = list(model.decoder.layers)
    if cfg.shortcut_moe and layers:
        numbers = [layer.layer_number for layer in layers]
        if numbers[0] % 2 == 0 or len(numbers) % 2:
            raise ValueError(f"LongCat-Flash: this pipeline piece holds Megatron layers {numbers[0]}..{numbers[-1]}; "
                             "each layer of the checkpoint is two Megatron layers that must stay together, so every "
                             "pipeline stage (and virtual chunk) must begin at an odd-numbered layer and hold an even "
                             "number of them")
    q_scale, kv_scale = cfg.mla_latent_scales or (1.0, 1.0)
    eps = cfg.mla_latent_norm_epsilon
    for layer in layers:
        attn = layer.self_attention
        if q_scale != 1.0:
            attn.linear_q_up_proj.register_forward_hook(_scale_output(q_scale))
        kv_norm = attn.kv_layernorm
        fused = isinstance(kv_norm, IdentityOp)  # (Transformer Engine: the norm inside the up projection)
        if kv_scale != 1.0:
            (attn.linear_kv_up_proj if fused else kv_norm).register_forward_hook(_scale_output(kv_scale))
        if eps is not None:
            q_norm = attn.q_layernorm
            _set_eps(attn.linear_q_up_proj if isinstance(q_norm, IdentityOp) else q_norm, eps, "the query latent norm")
            _set_eps(attn.linear_kv_up_proj if fused else kv_norm, eps, "the key/value latent norm")
