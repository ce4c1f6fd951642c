"""Lightning attention (MiniMax-Text-01 / MiniMax-M1's linear-attention layers) inside Megatron-Core, on prefix trees.

A lightning layer is linear attention with a fixed decay per head: per head h, with the state S a [d, d] matrix,

    q, k, v = silu(qkv_proj(x)) split per head          S_i = exp(-s_h) S_parent(i) + k_i v_i^T
    o_i = S_i^T q_i                                      y = out_proj(sigmoid(output_gate(x)) * RMSNorm(o))

(no query scaling, no key normalisation, no short convolution). The decay rate of head h in layer l (0-based, of L)
is ``s_h = b ** (h + 1) * (1 - l / (L - 1 + 1e-5) + 1e-5)`` with ``b = 2 ** (-8 / H)``, computed in fp32 as
transformers computes it, and is no parameter: a checkpoint may hold it as buffers (``slope_rate``, ``query_decay``,
``key_decay``, ``diagonal_decay``, which the bridge leaves out; transformers and the engines rebuild them from the
config). The recurrence is the gated rule without the delta correction (kernels/gated_delta.py, ``delta=False``)
with the log decay -s_h at every token and a write strength of 1, run along every root-to-leaf path of the forest,
so a merged tree trains exactly as its samples alone; the RMSNorm spans all heads of a token (H d channels), so under
tensor parallelism each rank adds its heads' squares and one all-reduce over the TP group completes the mean.

Parameters, per head ``[q | k | v]`` in ``qkv_proj`` so that a TP rank's rows are its heads as they lie on disk:

- ``in_proj`` (column-parallel) [3 H d, D] (HF's ``self_attn.qkv_proj``);
- ``gate_proj`` (column-parallel) [H d, D] (HF's ``self_attn.output_gate``);
- ``norm_weight`` [H d], whole on every TP rank (each rank weights its heads' slice; the gradient is summed over TP);
- ``out_proj`` (row-parallel) [D, H d].

Context parallelism trades tokens for heads as the Gated DeltaNet does (mcore/gated_delta_net.py): C must divide the
heads per TP rank; the norm and the gate run after the heads come back to their tokens.

Legend: T = tree tokens, H = heads, d = head dim, D = hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forge_megatron.kernels import gated_delta as gd
from forge_megatron.mcore.gated_delta_net import GatedDeltaNetSubmodules, TreeGatedDeltaNet, tensor_parallel_group


def slope_rates(heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """The decay rate per head of 0-based layer ``layer`` of ``num_layers`` [heads], fp32, as transformers computes
    it (MiniMax's original code and SGLang divide by ``num_layers - 1`` without the 1e-5: 1e-7 apart at 80 layers)."""
    base = 1 / (2 ** (8 / heads))
    exponent = torch.arange(heads) + 1
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return base ** exponent * factor


class TreeLightningAttention(TreeGatedDeltaNet):
    """A lightning-attention token mixer over prefix forests; hidden states [s, b, D] -> ([s, b, D], bias)."""

    tp_split = ()  # (norm_weight is whole on every TP rank)

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int | None = None,
                 pg_collection=None, cp_comm_type=None, norm_epsilon: float | None = None):
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.transformer.spec_utils import build_module

        MegatronModule.__init__(self, config=config)
        if layer_number is None:
            raise ValueError("a lightning-attention layer needs its layer number (its decay rates depend on it)")
        self.layer_number = layer_number
        tp_group, self.tp_group, tp = tensor_parallel_group(pg_collection)
        H, d = config.linear_num_value_heads, config.linear_value_head_dim
        if config.linear_num_key_heads != H or config.linear_key_head_dim != d:
            raise ValueError("lightning attention has as many key heads as value heads, of one size: "
                             f"got {config.linear_num_key_heads} x {config.linear_key_head_dim} and {H} x {d}")
        if H % tp:
            raise ValueError(f"lightning attention: the tensor-parallel size ({tp}) must divide the heads ({H})")
        self.H, self.d, self.kernel = H, d, 1  # (no short convolution: the plan needs no ancestors)
        self.h_local = H // tp
        cp = config.context_parallel_size
        if self.h_local % cp:
            raise ValueError(f"context parallelism {cp} splits the lightning-attention heads per tensor-parallel rank "
                             f"({self.h_local} = {H} heads / TP {tp}) across CP ranks: CP must divide them")
        self.eps = config.layernorm_epsilon if norm_epsilon is None else norm_epsilon
        self._build_projections(config, submodules, tp_group, 3 * H * d, H * d)
        kwargs = dict(config=config, init_method=config.init_method, bias=False, is_expert=False)
        if tp_group is not None:
            kwargs["tp_group"] = tp_group
        self.gate_proj = build_module(submodules.in_proj, config.hidden_size, H * d, gather_output=False,
                                      skip_bias_add=False, tp_comm_buffer_name=None, **kwargs)
        self.norm_weight = torch.nn.Parameter(torch.ones(H * d, dtype=config.params_dtype))
        self.tp_rank = torch.distributed.get_rank(self.tp_group) if tp > 1 else 0
        # this rank's heads' rates, a plain tensor (not a buffer: a bf16 cast of the module must not round them)
        rates = slope_rates(H, layer_number - 1, config.num_layers)
        self._rates = rates[self.tp_rank * self.h_local:(self.tp_rank + 1) * self.h_local].clone()

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        from forge_megatron.mcore import context_parallel as cpm
        from forge_megatron.mcore.qk_norm import _AllReduceSum

        proj, _ = self.in_proj(hidden_states)  # [s, b, h_local * 3d]
        gate, _ = self.gate_proj(hidden_states)  # [s, b, h_local * d]
        s, b = proj.shape[:2]
        x = proj.transpose(0, 1).reshape(s * b, self.h_local, 3 * self.d)  # token b * s + i
        # this rank's tokens of every head -> every token (DFS order) of 1/C of them under CP
        x, rank = cpm.layer_tokens_to_heads(x, packed_seq_params, "lightning-attention")
        T, h = x.shape[0], x.shape[1]
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        q, k, v = F.silu(x.to(cd)).split(self.d, dim=-1)
        plan = self._plan(packed_seq_params, s, b, proj.device, T)
        decay = -self._rates[rank * h:(rank + 1) * h].to(device=x.device, dtype=cd)
        recompute = self.config.recompute_granularity != "full"
        o = gd.tree_gated_delta_rule(q, k, v, decay.expand(T, h), torch.ones(T, h, dtype=cd, device=x.device), plan,
                                     scale=1.0, l2norm=False, recompute=recompute, delta=False)  # [T, h, d]
        o = cpm.layer_heads_to_tokens(o)  # back to this rank's tokens of every head under CP
        o = o.reshape(s * b, self.h_local * self.d)
        # RMSNorm over all H d channels of a token: this rank's squares, summed over TP
        squares = o.pow(2).sum(-1, keepdim=True)
        if self.tp_group is not None and torch.distributed.get_world_size(self.tp_group) > 1:
            squares = _AllReduceSum.apply(squares, self.tp_group)
        normed = o * torch.rsqrt(squares / (self.H * self.d) + self.eps)
        width = self.h_local * self.d
        weight = copy_to_tensor_model_parallel_region(self.norm_weight)[self.tp_rank * width:(self.tp_rank + 1) * width]
        gate = gate.transpose(0, 1).reshape(s * b, width)
        y = (weight.to(cd) * normed) * torch.sigmoid(gate.to(cd))
        return self.out_proj(y.to(hidden_states.dtype).reshape(b, s, -1).transpose(0, 1))


def lightning_spec(norm_epsilon: float | None = None):
    """The ``self_attention`` spec of a lightning-attention layer (Megatron's local linears); ``norm_epsilon`` is its
    output norm's (None: the layer norms')."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TreeLightningAttention,
                      submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                      params={"norm_epsilon": norm_epsilon})
