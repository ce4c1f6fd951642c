"""ERNIE 4.5's MoE router (``Ernie4_5_MoeForCausalLM``), which Megatron's routers cannot express.

Per token, with z the router logits (computed in fp32) and b the checkpoint's ``e_score_correction_bias``:

    p = softmax(z) over all experts
    S = the k experts with the largest p + b          (the bias steers the choice only: aux-loss-free balancing)
    w_e = p_e / max(sum_{e' in S} p_e', 1e-12)        for e in S, 0 elsewhere

Megatron's softmax score function takes no expert bias (it allows one with the sigmoid only), so
:class:`ErnieRouter` replaces :meth:`TopKRouter.routing` and keeps the bias as a buffer ``expert_bias`` [E] (fp32,
frozen: RL does not rebalance), where the bridge maps ``mlp.moe_statics.e_score_correction_bias`` [1, E]. Routing
replay (mcore/routing_replay.py) replaces the choice S exactly as it does Megatron's. No auxiliary loss is computed.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.moe.router import TopKRouter

NORM_MIN = 1e-12
"""The floor of the renormalising sum (ERNIE 4.5's ``moe_norm_min``; the bridge refuses other values)."""


def biased_softmax_topk(router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax probabilities of ``logits`` [T, E] (fp32) and the ``router.topk`` experts each token takes by
    probability plus ``router.expert_bias`` (selection only), or those routing replay dictates."""
    p = torch.softmax(logits.float(), dim=-1)
    choose = p + router.expert_bias.float()

    def topk(scores, k, num_groups=None, group_topk=None):
        return torch.topk(scores, k=k, dim=1)

    if router.router_replay is None:
        return p, topk(choose, router.topk)[1]
    return p, router.router_replay.get_replay_topk(choose, router.topk, None, None, topk)[1]

class ErnieRouter(TopKRouter):
    """Megatron's top-k router with ERNIE 4.5's choice and weights (module docstring)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if getattr(config, "moe_aux_loss_coeff", 0.0):
            raise ValueError("ERNIE 4.5's router computes no auxiliary load-balancing loss: set moe_aux_loss_coeff 0")
        del self.expert_bias  # (Megatron's attribute, None without its own expert bias)
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32))

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        logits = logits.view(-1, self.config.num_moe_experts)
        p, chosen = biased_softmax_topk(self, logits)
        w = p.gather(1, chosen)
        w = w / w.sum(dim=-1, keepdim=True).clamp(min=NORM_MIN)
        probs = torch.zeros_like(p).scatter(1, chosen, w).type_as(logits)
        routing_map = torch.zeros_like(p, dtype=torch.bool).scatter(1, chosen, True)
        return probs, routing_map


def with_router(spec):
    """``spec`` (a layer or block spec) with every MoE layer's router an :class:`ErnieRouter`."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[with_router(s) for s in spec.layer_specs])
    mlp = spec.submodules.mlp
    if not isinstance(getattr(mlp, "submodules", None), MoESubmodules):
        return spec  # (a dense layer)
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, router=ErnieRouter))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
