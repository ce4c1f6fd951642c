"""Kimi Delta Attention (Kimi Linear's linear-attention layers) inside Megatron-Core, trained on prefix trees.

KDA is the gated delta rule of Gated DeltaNet (mcore/gated_delta_net.py) with a decay per key *channel* rather than
per head, so the state forgets each key direction at its own rate (kernels/gated_delta.py runs both along every
root-to-leaf path of the forest). Per head h of H (key and value heads alike, d channels each):

    q, k, v = SiLU(depthwise causal conv of width K over the token's ancestors)    (q, k L2-normalised, q / sqrt(d))
    g       = -exp(A_log_h) * softplus(f_b(f_a(x))_h + dt_bias_h)          [d]: the log decay of each key channel
    beta    = sigmoid(b(x)_h)
    o       = RMSNorm(rule(q, k, v, g, beta)) * weight * sigmoid(g_b(g_a(x))_h)                 (eps: rms_norm_eps)

``f_a`` and ``g_a`` are low-rank down projections [d, D] shared by every head, ``f_b`` and ``g_b`` their up
projections [H d, d]. :class:`TreeKimiDeltaAttention` takes a transformer layer's ``self_attention`` slot. Parameters,
laid out so a TP rank's contiguous slice of each is its own heads:

- ``in_proj`` (column-parallel): per head ``[q (d) | k (d) | v (d) | b (1)]`` (HF's ``q_proj``, ``k_proj``,
  ``v_proj``, ``b_proj`` regrouped by the bridge);
- ``gate_down`` (column-parallel, output gathered): ``[f_a; g_a]`` [2 d, D]. Every rank needs the whole latent for
  its heads: the split projection's outputs are all-gathered (TP must divide 2 d) and their gradient, which each
  rank computes for its own heads only, is all-reduced before the gather's backward takes this rank's slice;
- ``f_b_weight``, ``g_b_weight`` [H d, d], ``dt_bias`` [H d], ``A_log`` [H], ``conv1d_weight`` [3 H d, K] (per
  head ``[q | k | v]``): split over TP by heads;
- ``norm_weight`` [d], the gated norm's, whole on every rank (its gradient all-reduced over TP);
- ``out_proj`` (row-parallel) [D, H d].

Context parallelism trades tokens for heads as the Gated DeltaNet does: after the projections, one all-to-all gives
every CP rank all tokens of 1/C of its heads (each head's q, k, v, b, f and gate rows travel together), and one
returns them. The recurrence runs in chunks of 16 tokens (its terms inside a chunk are C x C x d per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from forge_megatron.kernels import gated_delta as gd
from forge_megatron.mcore.gated_delta_net import TreeGatedDeltaNet, recomputed, tensor_parallel_group

CHUNK = 16  # the recurrence's chunk (kernels/gated_delta.py: a decay per channel makes a chunk's terms C x C x d)


@dataclass
class KimiDeltaSubmodules:
    in_proj: ModuleSpec | type = None
    gate_down: ModuleSpec | type = None
    out_proj: ModuleSpec | type = None


class TreeKimiDeltaAttention(TreeGatedDeltaNet):
    """Kimi Delta Attention over prefix forests; hidden states [s, b, D] -> ([s, b, D], bias) (module docstring).
    Shares the Gated DeltaNet layer's plans, CP exchange and checkpoint layout; the model config's linear_* sizes
    give H (``linear_num_key_heads`` = ``linear_num_value_heads``) and d (both head dims)."""

    chunk = CHUNK
    tp_split = ("conv1d_weight", "A_log", "dt_bias", "f_b_weight", "g_b_weight")

    def __init__(self, config, submodules: KimiDeltaSubmodules, layer_number: int | None = None,
                 pg_collection=None, cp_comm_type=None):
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu, \
            set_tensor_model_parallel_attributes
        from megatron.core.transformer.module import MegatronModule

        MegatronModule.__init__(self, config=config)  # (not the Gated DeltaNet's: its parameters differ)
        self.layer_number = layer_number
        tp_group, self.tp_group, tp = tensor_parallel_group(pg_collection)
        heads, d = config.linear_num_value_heads, config.linear_value_head_dim
        if config.linear_num_key_heads != heads or config.linear_key_head_dim != d:
            raise ValueError("Kimi Delta Attention has as many key as value heads, of one size: linear_num_key_heads "
                             f"{config.linear_num_key_heads} / linear_key_head_dim {config.linear_key_head_dim} vs "
                             f"{heads} / {d}")
        if heads % tp or (2 * d) % tp:
            raise ValueError(f"tensor parallelism {tp} must divide the Kimi Delta Attention heads ({heads}) and twice "
                             f"their size ({2 * d}: the gates' shared down projections)")
        cp = config.context_parallel_size
        self.d, self.kernel, self.nk_local = d, config.linear_conv_kernel_dim, heads // tp
        if self.nk_local % cp:
            raise ValueError(f"context parallelism {cp} splits the Kimi Delta Attention heads per tensor-parallel rank "
                             f"({self.nk_local} = {heads} / TP {tp}) across CP ranks: CP must divide them")
        self.eps = config.layernorm_epsilon
        linear_kwargs = dict(config=config, init_method=config.init_method, bias=False, is_expert=False)
        if tp_group is not None:
            linear_kwargs["tp_group"] = tp_group
        self.in_proj = build_module(submodules.in_proj, config.hidden_size, heads * (3 * d + 1),
                                    gather_output=False, skip_bias_add=False, tp_comm_buffer_name="fc1",
                                    **linear_kwargs)
        self.gate_down = build_module(submodules.gate_down, config.hidden_size, 2 * d, gather_output=True,
                                      skip_bias_add=False, tp_comm_buffer_name="fc1", **linear_kwargs)
        self.out_proj = build_module(submodules.out_proj, heads * d, config.hidden_size,
                                     input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="fc2",
                                     **{**linear_kwargs, "init_method": config.output_layer_init_method})
        dtype = config.params_dtype

        def split_param(rows: int, cols: int | None, init):
            shape = (rows // tp,) if cols is None else (rows // tp, cols)
            p = torch.nn.Parameter(torch.empty(*shape, dtype=dtype))
            if cols is None:
                with torch.no_grad():
                    init(p)
                set_tensor_model_parallel_attributes(p, True, 0, 1)
            else:
                _initialize_affine_weight_cpu(p, rows, cols, rows // tp, 0, init, params_dtype=dtype)
            return p

        self.f_b_weight = split_param(heads * d, d, config.init_method)
        self.g_b_weight = split_param(heads * d, d, config.init_method)
        self.conv1d_weight = split_param(heads * 3 * d, self.kernel, lambda w: torch.nn.init.uniform_(
            w, -self.kernel ** -0.5, self.kernel ** -0.5))
        # FLA's initialisation: A uniform in (1, 16), dt = softplus^-1 of log-uniform (1e-3, 1e-1)
        self.A_log = split_param(heads, None, lambda p: p.copy_(torch.empty(p.shape).uniform_(1, 16).log()))
        self.dt_bias = split_param(heads * d, None, lambda p: p.copy_(
            (lambda dt: dt + torch.log(-torch.expm1(-dt)))(torch.empty(p.shape).uniform_(-6.9, -2.3).exp())))
        self.norm_weight = torch.nn.Parameter(torch.ones(d, dtype=dtype))

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        from forge_megatron.mcore import context_parallel as cpm

        d, nk = self.d, self.nk_local
        proj, _ = self.in_proj(hidden_states)  # [s, b, nk * (3d + 1)]
        down, _ = self.gate_down(hidden_states)  # [s, b, 2d], whole on every TP rank
        down = copy_to_tensor_model_parallel_region(down)  # each rank's heads' gradient, summed over TP
        f = F.linear(down[..., :d], self.f_b_weight)
        gate = F.linear(down[..., d:], self.g_b_weight)
        s, b = proj.shape[:2]
        x = torch.cat([proj.reshape(s, b, nk, 3 * d + 1), f.reshape(s, b, nk, d), gate.reshape(s, b, nk, d)], -1)
        x = x.transpose(0, 1).reshape(s * b, nk, 5 * d + 1)  # token b * s + i: row b's sequence in order
        # this rank's tokens of every head -> every token (DFS order) of 1/C of them under CP
        x, rank = cpm.layer_tokens_to_heads(x, packed_seq_params, "Kimi Delta Attention")
        T, n = x.shape[0], x.shape[1]  # the heads this rank runs
        heads = slice(rank * n, (rank + 1) * n)
        qkv, beta_in, f, gate = x.split([3 * d, 1, d, d], dim=-1)
        plan = self._plan(packed_seq_params, s, b, proj.device, T)
        qkv = gd.tree_causal_conv(qkv.reshape(T, -1), self.conv1d_weight[rank * n * 3 * d:(rank + 1) * n * 3 * d]
                                  .to(qkv.dtype), plan, silu=True)
        q, k, v = qkv.reshape(T, n, 3 * d).split([d, d, d], dim=-1)
        recompute = self.config.recompute_granularity != "full"
        # the decays (fp32, one per channel) are computed inside the recomputed region: the backward keeps the
        # gate's bf16 input, not the decays and softplus's fp32 in- and outputs (the copies free x)
        o = recomputed(_kda_rule, q, k, v, f.contiguous(), beta_in.squeeze(-1).contiguous(), self.A_log[heads],
                       self.dt_bias.reshape(-1, d)[heads], plan, recompute=recompute)
        return self._normed_output(sigmoid_gated_rms_norm, o, gate.contiguous(), recompute, n, b, s)


def _kda_rule(q, k, v, f, b, A_log, dt_bias, plan) -> torch.Tensor:
    """The forget gate's log decays g = -exp(A_log) softplus(f + dt_bias) [T, H, d] and beta = sigmoid(b) [T, H]
    (fp32, fp64 for fp64 inputs), then the rule along the forest's paths."""
    cd = torch.float64 if v.dtype == torch.float64 else torch.float32
    decay = -A_log.to(cd).exp()[:, None] * F.softplus(f.to(cd) + dt_bias.to(cd))
    return gd.tree_gated_delta_rule(q, k, v, decay, b.to(cd).sigmoid(), plan, recompute=False)


def sigmoid_gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Kimi Linear's gated RMSNorm over each head's last dim, all in fp32 (its weight too), the gate a sigmoid;
    the result in o's dtype."""
    of = o.float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * torch.sigmoid(gate.float())).to(o.dtype)


def kimi_delta_spec():
    """The ``self_attention`` spec of a Kimi Delta Attention layer (Megatron's local linears)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ModuleSpec(module=TreeKimiDeltaAttention,
                      submodules=KimiDeltaSubmodules(in_proj=ColumnParallelLinear, gate_down=ColumnParallelLinear,
                                                     out_proj=RowParallelLinear))
