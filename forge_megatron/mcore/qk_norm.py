"""Query/key RMSNorm over all heads of a token at once (MiniMax-M2's ``qk_norm_type: per_layer``).

Qwen3 and GLM normalise each head of q and k separately (Megatron's ``qk_layernorm``: a norm of ``head_dim``
channels). MiniMax-M2 normalises a token's whole query projection (N x H channels) and its whole key projection
(G x H) with one root-mean-square each, then scales by a weight of that full width:

    q' = w_q * q / sqrt(mean(q ** 2 over all N x H channels) + eps)        (k alike with G x H and w_k)

Under tensor parallelism a rank holds N / TP query heads and G / TP key heads, so the mean needs the other ranks'
squares: each rank sums its own, one all-reduce over the TP group adds them (its backward all-reduces the
gradients, since every rank's output depends on every rank's squares), and each rank scales its heads by their
slice of the weight. The weight itself is kept whole on every TP rank, like Megatron's per-head q/k norms: Megatron's
``finalize_model_grads`` sums the gradients of every parameter named ``q_layernorm`` / ``k_layernorm`` over the TP
group, which for a whole weight of which each rank touches only its slice gives every rank the full gradient (a
TP-sharded weight would have its different slices' gradients added together). Key heads replicated over TP ranks
(TP > G) would be counted more than once; the bridge refuses that layout (MiniMax-M2 has 8 key heads: TP <= 8).

Megatron's ``SelfAttention`` builds ``q_layernorm`` / ``k_layernorm`` with ``hidden_size = head_dim`` and calls
them on [s, b, heads, head_dim]; :class:`QueryNormAllHeads` / :class:`KeyNormAllHeads` take that signature and read
the head counts from the config. Computed in fp32 and cast back before the weight, as HF's RMSNorm does.
"""

from __future__ import annotations

import torch


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group, forward and backward (each rank's output depends on every rank's input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _NormAllHeads(torch.nn.Module):
    """RMSNorm over every head of one token; this rank holds ``heads / TP`` of them (see the module docstring)."""

    kind = ""  # "query" or "key"

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        from megatron.core import parallel_state as ps

        heads = config.num_attention_heads if self.kind == "query" else config.num_query_groups
        tp = ps.get_tensor_model_parallel_world_size()
        if heads % tp:
            raise ValueError(f"a {self.kind} RMSNorm over all heads needs the tensor-parallel size ({tp}) to divide "
                             f"the {self.kind} heads ({heads}): replicated key heads are not supported")
        self.head_dim, self.local_heads, self.width = hidden_size, heads // tp, heads * hidden_size
        self.first = ps.get_tensor_model_parallel_rank() * self.local_heads * hidden_size  # this rank's slice
        self.eps = eps
        self.tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        self.weight = torch.nn.Parameter(torch.ones(self.width, dtype=config.params_dtype))  # whole (see above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != (self.local_heads, self.head_dim):
            raise ValueError(f"{type(self).__name__}: expected [..., {self.local_heads}, {self.head_dim}], "
                             f"got {tuple(x.shape)}")
        dtype = x.dtype
        x32 = x.float()
        squares = x32.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp_group is not None:
            squares = _AllReduceSum.apply(squares, self.tp_group)
        normed = (x32 * torch.rsqrt(squares / self.width + self.eps)).to(dtype)
        weight = self.weight[self.first:self.first + self.local_heads * self.head_dim]
        return weight.view(self.local_heads, self.head_dim) * normed


class QueryNormAllHeads(_NormAllHeads):
    """``q_layernorm`` over all query heads (weight [N x H], this rank's [N / TP x H])."""

    kind = "query"


class KeyNormAllHeads(_NormAllHeads):
    """``k_layernorm`` over all key heads (weight [G x H], this rank's [G / TP x H])."""

    kind = "key"


class _PostRopeNorm(torch.nn.Module):
    """A per-head RMSNorm (weight [head_dim], as Megatron's ``q_layernorm``) applied to the queries or keys *after*
    RoPE (Hunyuan: ``query_layernorm`` / ``key_layernorm`` follow the rotation). Megatron's SelfAttention calls its
    q/k norms before the rotation: there this module passes its input through, and the core attention (which
    receives the rotated queries and keys) calls :meth:`normalize` first (:func:`link_post_rope_norms`). Its name stays ``q_layernorm`` /
    ``k_layernorm``, so Megatron sums its gradients over the tensor-parallel ranks as it does every q/k norm's
    (each TP rank's heads give a part). fp32 inside, cast back before the weight, as HF's RMSNorm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # (before RoPE: nothing; see normalize)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return self.weight * normed


class QueryNormAfterRope(_PostRopeNorm):
    """``q_layernorm`` applied after RoPE (see :class:`_PostRopeNorm`)."""


class KeyNormAfterRope(_PostRopeNorm):
    """``k_layernorm`` applied after RoPE (see :class:`_PostRopeNorm`)."""


def link_post_rope_norms(model) -> int:
    """Make every self-attention's core attention (the tree attention, Megatron's dot-product attention, any other)
    apply that attention's after-RoPE q/k norms to the rotated queries and keys it receives: its forward wrapped on the
    instance, the norms held by the closure, not as submodules (their weights stay where the state dict names them).
    Returns the attentions linked."""
    linked = 0
    for module in model.modules():
        q, k = getattr(module, "q_layernorm", None), getattr(module, "k_layernorm", None)
        if isinstance(q, QueryNormAfterRope) and isinstance(k, KeyNormAfterRope):
            core = module.core_attention
            inner = core.forward

            def forward(query, key, value, *args, _inner=inner, _q=q, _k=k, **kwargs):
                return _inner(_q.normalize(query), _k.normalize(key), value, *args, **kwargs)

            core.forward = forward  # (an instance attribute shadows the class's forward)
            linked += 1
    return linked
