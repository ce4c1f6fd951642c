"""MoE routers Megatron's cannot express: ERNIE 4.5's, Kolibri 1's and DeepSeek-V2's group-limited greedy one.

Per token, with z the router logits (computed in fp32) and b the checkpoint's ``e_score_correction_bias``:

    p = softmax(z) over all experts
    S = the k experts with the largest p + b          (the bias steers the choice only: aux-loss-free balancing)
    w_e = p_e / max(sum_{e' in S} p_e', 1e-12)        for e in S, 0 elsewhere

Megatron's softmax score function takes no expert bias (it allows one with the sigmoid only), so
:class:`ErnieRouter` replaces :meth:`TopKRouter.routing` and keeps the bias as a buffer ``expert_bias`` [E] (fp32,
frozen: RL does not rebalance), where the bridge maps ``mlp.moe_statics.e_score_correction_bias`` [1, E]. Routing
replay (mcore/routing_replay.py) replaces the choice S exactly as it does Megatron's. No auxiliary loss is computed.

Kolibri 1 (``Kolibri1ForCausalLM``, Aleph Alpha) chooses on the logits themselves and weights by their sigmoid:

    S = the k experts with the largest z + b
    w_e = sigmoid(z_e), divided by sum_{e' in S} sigmoid(z_e') where the config says ``norm_topk_prob``

Megatron's sigmoid score function adds its expert bias to sigmoid(z) instead, which ranks experts differently (a bias
moves a saturated sigmoid less than a logit), so :class:`LogitBiasRouter` replaces the routing the same way, the bias
a buffer ``expert_bias`` (the bridge maps the release's ``moe.router.expert_bias``).

DeepSeek-V2 / V2.5 (236B: ``topk_method: group_limited_greedy``) limit each token to a few groups of experts, a group
scored by its best expert:

    p = softmax(z) over all experts (fp32), in G groups of E / G
    the ``topk_group`` groups with the largest max_{e in group} p_e; S = the k best p among their experts
    w_e = p_e * routed_scaling_factor          (not renormalised)

Megatron's grouped routing scores a group by the sum of its top (k / topk_group) experts (DeepSeek-V3's rule), so
:class:`GroupLimitedGreedyRouter` replaces the routing (no bias; routing replay replaces S as above).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.moe.router import TopKRouter

NORM_MIN = 1e-12
"""The floor of the renormalising sum (ERNIE 4.5's ``moe_norm_min``; the bridge refuses other values)."""


def _choose(router, scores: torch.Tensor, topk=None) -> torch.Tensor:
    """The ``router.topk`` experts [T, k] with the largest ``scores`` [T, E] (or those ``topk(scores, k)`` picks), or
    those routing replay dictates."""

    def largest(scores, k, num_groups=None, group_topk=None):
        return torch.topk(scores, k=k, dim=1)

    topk = topk or largest
    if router.router_replay is None:
        return topk(scores, router.topk)[1]
    return router.router_replay.get_replay_topk(scores, router.topk, None, None, topk)[1]


def biased_softmax_topk(router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax probabilities of ``logits`` [T, E] (fp32) and the ``router.topk`` experts each token takes by
    probability plus ``router.expert_bias`` (selection only), or those routing replay dictates."""
    p = torch.softmax(logits.float(), dim=-1)
    return p, _choose(router, p + router.expert_bias.float())


class _ForgeRouter(TopKRouter):
    """Megatron's top-k router whose :meth:`routing` a subclass replaces; no auxiliary loss."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if getattr(config, "moe_aux_loss_coeff", 0.0):
            raise ValueError(f"{type(self).__name__} computes no auxiliary load-balancing loss: set moe_aux_loss_coeff "
                             "0")

    def _dispatch(self, logits: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor):
        """(probs, routing_map) [T, E] from each token's ``chosen`` experts and their weights ``w`` [T, k]."""
        probs = torch.zeros(logits.shape, dtype=w.dtype, device=w.device).scatter(1, chosen, w).type_as(logits)
        routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=w.device).scatter(1, chosen, True)
        return probs, routing_map


class _BiasRouter(_ForgeRouter):
    """:class:`_ForgeRouter` with a frozen fp32 ``expert_bias`` buffer of its own."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        del self.expert_bias  # (Megatron's attribute, None without its own expert bias)
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32))


class ErnieRouter(_BiasRouter):
    """Megatron's top-k router with ERNIE 4.5's choice and weights (module docstring)."""

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        logits = logits.view(-1, self.config.num_moe_experts)
        p, chosen = biased_softmax_topk(self, logits)
        w = p.gather(1, chosen)
        return self._dispatch(logits, chosen, w / w.sum(dim=-1, keepdim=True).clamp(min=NORM_MIN))


class LogitBiasRouter(_BiasRouter):
    """Megatron's top-k router with Kolibri 1's choice (logits plus the bias) and weights (the chosen logits'
    sigmoids, renormalised over the k when ``renormalise``: the config's ``norm_topk_prob``); module docstring."""

    renormalise = True

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        logits = logits.view(-1, self.config.num_moe_experts)
        z = logits.float()
        chosen = _choose(self, z + self.expert_bias.float())
        w = torch.sigmoid(z.gather(1, chosen))
        return self._dispatch(logits, chosen, w / w.sum(dim=-1, keepdim=True) if self.renormalise else w)


class LogitBiasRouterKeepingWeights(LogitBiasRouter):
    """:class:`LogitBiasRouter` whose weights are the chosen sigmoids as they are (``norm_topk_prob`` false)."""

    renormalise = False


class GroupLimitedGreedyRouter(_ForgeRouter):
    """DeepSeek-V2's ``group_limited_greedy`` routing over ``groups`` groups of experts, ``kept`` of them per token
    (module docstring); the weights times Megatron's ``moe_router_topk_scaling_factor``. Built by
    :func:`group_limited_greedy`."""

    groups = 1
    kept = 1

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        e = self.config.num_moe_experts
        logits = logits.view(-1, e)
        p = torch.softmax(logits.float(), dim=-1)
        groups, kept = self.groups, self.kept

        def topk(scores, k, num_groups=None, group_topk=None):
            best = scores.view(-1, groups, e // groups).amax(dim=-1)  # a group scored by its best expert
            chosen_groups = torch.topk(best, k=kept, dim=-1).indices
            allowed = torch.zeros_like(best, dtype=torch.bool).scatter(1, chosen_groups, True)
            masked = scores.masked_fill(~allowed.repeat_interleave(e // groups, dim=1), 0.0)
            return torch.topk(masked, k=k, dim=1)

        chosen = _choose(self, p, topk)
        w = p.gather(1, chosen) * (self.config.moe_router_topk_scaling_factor or 1.0)
        return self._dispatch(logits, chosen, w)


def group_limited_greedy(groups: int, kept: int) -> type:
    """A :class:`GroupLimitedGreedyRouter` class over ``groups`` groups keeping ``kept`` (what MoELayer builds)."""
    if groups < 1 or not 1 <= kept <= groups:
        raise ValueError(f"group-limited greedy routing keeps 1 to {groups} of {groups} groups, got {kept}")
    return type(f"GroupLimitedGreedyRouter{groups}of{kept}", (GroupLimitedGreedyRouter,),
                {"groups": groups, "kept": kept, "__doc__": GroupLimitedGreedyRouter.__doc__})


def with_router(spec, router=ErnieRouter):
    """``spec`` (a layer or block spec) with every MoE layer's router a ``router`` (:class:`ErnieRouter`,
    :class:`LogitBiasRouter`, :func:`group_limited_greedy`'s)."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[with_router(s, router) for s in spec.layer_specs])
    mlp = spec.submodules.mlp
    if not isinstance(getattr(mlp, "submodules", None), MoESubmodules):
        return spec  # (a dense layer)
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, router=router))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
