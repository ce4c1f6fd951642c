"""Mamba-2 layers (Granite 4.0-H's state space mixers) inside Megatron-Core, trained on prefix trees.

:class:`TreeMamba2Mixer` takes a transformer layer's ``self_attention`` slot as the Gated DeltaNet does
(mcore/gated_delta_net.py: the same plan of the forest, the same short convolution along every token's ancestors,
the same context-parallel trade of tokens for heads). Its recurrence is Mamba-2's state space duality, which is the
gated rule without the delta correction (kernels/gated_delta.py, ``delta=False``): per head, with the state S a
[N, P] matrix,

    S_i = exp(dt_i A) S_parent(i) + dt_i B_i x_i^T          y_i = S_i^T C_i + D x_i

(dt = softplus(dt_raw + dt_bias) clamped to ``time_step_limit``, A = -exp(A_log); B and C shared by the heads of a
group), so a merged tree trains exactly as its samples alone. Then y * silu(z) is RMS-normalised per group of
channels (fp32) and weighted, and ``out_proj`` returns to the hidden size.

Parameters, grouped so that tensor parallelism splits whole groups (G groups of r = H / G heads of P channels;
N = ``d_state``; TP must divide G, as Megatron's own Mamba mixer requires):

- ``in_proj`` (column-parallel): per group ``[z (r P) | x (r P) | B (N) | C (N) | dt (r)]`` (HF's ``in_proj`` holds
  [z | x | B | C | dt] over all groups; the bridge regroups it);
- ``conv1d_weight`` [C, K] and ``conv1d_bias`` [C], channels per group ``[x | B | C]`` (HF's depthwise Conv1d);
- ``A_log``, ``dt_bias``, ``D`` [H] per head; ``norm_weight`` [H P] per channel (each rank its groups');
- ``out_proj`` (row-parallel) [D, H P].

Legend: T = tree tokens, G = groups, H = heads, P = head dim, N = state size, K = conv kernel, C = conv channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forge_megatron.kernels import gated_delta as gd
from forge_megatron.mcore.gated_delta_net import GatedDeltaNetSubmodules, TreeGatedDeltaNet, recomputed, \
    tensor_parallel_group


def group_width(config) -> int:
    """Rows of ``in_proj`` per group: z and x (r P each), B and C (N each), dt (r)."""
    r = config.linear_num_value_heads // config.linear_num_key_heads
    return 2 * r * config.linear_value_head_dim + 2 * config.linear_key_head_dim + r


def conv_group_width(config) -> int:
    """Convolution channels per group: x (r P), B and C (N each)."""
    r = config.linear_num_value_heads // config.linear_num_key_heads
    return r * config.linear_value_head_dim + 2 * config.linear_key_head_dim


class TreeMamba2Mixer(TreeGatedDeltaNet):
    """A Mamba-2 token mixer over prefix forests; hidden states [s, b, D] -> ([s, b, D], bias)."""

    tp_split = ("conv1d_weight", "conv1d_bias", "A_log", "dt_bias", "D", "norm_weight")

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int | None = None,
                 pg_collection=None, cp_comm_type=None, conv_bias: bool = True,
                 dt_limit: tuple[float, float] | None = None, norm_epsilon: float | None = None,
                 gated_norm: bool = True, in_scale: float | None = None,
                 segment_scales: tuple[float, float, float, float, float] | None = None):
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        MegatronModule.__init__(self, config=config)
        self.layer_number = layer_number
        tp_group, self.tp_group, tp = tensor_parallel_group(pg_collection)
        G, H = config.linear_num_key_heads, config.linear_num_value_heads
        if H % G or G % tp:
            raise ValueError(f"Mamba-2: heads ({H}) must be a multiple of groups ({G}), and the groups of the "
                             f"tensor-parallel size ({tp}): TP splits whole groups (Granite 4.0-H has 1: TP 1)")
        self.N, self.P, self.kernel = config.linear_key_head_dim, config.linear_value_head_dim, \
            config.linear_conv_kernel_dim
        self.r, self.nk_local = H // G, G // tp
        self.nv_local = self.nk_local * self.r
        self.conv_group = conv_group_width(config)
        cp = config.context_parallel_size
        if self.nk_local % cp:
            raise ValueError(f"context parallelism {cp} splits the Mamba-2 groups per tensor-parallel rank "
                             f"({self.nk_local} = groups {G} / TP {tp}) across CP ranks: CP must divide them")
        self.eps = config.layernorm_epsilon if norm_epsilon is None else norm_epsilon
        self.dt_limit = None if dt_limit is None or tuple(dt_limit) == (0.0, float("inf")) else \
            (float(dt_limit[0]), float(dt_limit[1]))
        self._build_projections(config, submodules, tp_group, G * group_width(config), H * self.P)
        channels, dtype = G * self.conv_group, config.params_dtype
        self.conv1d_weight = self._conv_weight(config, channels, tp)
        self.conv1d_bias = torch.nn.Parameter(torch.zeros(channels // tp, dtype=dtype)) if conv_bias else None
        self.A_log = torch.nn.Parameter(torch.empty(self.nv_local, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.nv_local, dtype=dtype))
        self.D = torch.nn.Parameter(torch.ones(self.nv_local, dtype=dtype))
        # (Falcon-H1 without mamba_rms_norm: y * silu(z) unnormed, no weight)
        self.norm_weight = torch.nn.Parameter(torch.ones(self.nv_local * self.P, dtype=dtype)) if gated_norm else None
        # Falcon-H1's muP multipliers: the input's, and one per in_proj segment [z, x, B, C, dt] (None: 1)
        self.in_scale = None if in_scale in (None, 1, 1.0) else float(in_scale)
        self.segment_scales = None if segment_scales is None or all(float(x) == 1.0 for x in segment_scales) else \
            tuple(float(x) for x in segment_scales)
        with torch.no_grad():  # Mamba-2's initialisation: A = 1 .. H
            first = torch.distributed.get_rank(self.tp_group) * self.nv_local if tp > 1 else 0
            self.A_log.copy_(torch.arange(first + 1, first + self.nv_local + 1, dtype=torch.float32).log())
        for p in (self.conv1d_bias, self.A_log, self.dt_bias, self.D, self.norm_weight):
            if p is not None:
                set_tensor_model_parallel_attributes(p, True, 0, 1)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
        from forge_megatron.mcore import context_parallel as cpm

        if self.in_scale is not None:
            hidden_states = hidden_states * self.in_scale
        proj, _ = self.in_proj(hidden_states)  # [s, b, groups_local * width]
        s, b = proj.shape[:2]
        x = proj.transpose(0, 1).reshape(s * b, self.nk_local, -1)
        # this rank's tokens of every group -> every token (DFS order) of 1/C of them under CP
        x, rank = cpm.layer_tokens_to_heads(x, packed_seq_params, "Mamba-2")
        T, g = x.shape[0], x.shape[1]
        heads = slice(rank * g * self.r, (rank + 1) * g * self.r)
        conv_rows = slice(rank * g * self.conv_group, (rank + 1) * g * self.conv_group)
        rP = self.r * self.P
        z, xs, Bm, Cm, dt = x.split([rP, rP, self.N, self.N, self.r], dim=-1)
        if self.segment_scales is not None:  # (Falcon-H1: HF's in_proj output times its mup_vector)
            z, xs, Bm, Cm, dt = (t * c for t, c in zip((z, xs, Bm, Cm, dt), self.segment_scales))
        plan = self._plan(packed_seq_params, s, b, proj.device, T)

        xbc = torch.cat([xs, Bm, Cm], dim=-1).reshape(T, -1)
        bias = None if self.conv1d_bias is None else self.conv1d_bias[conv_rows].to(xbc.dtype)
        xbc = gd.tree_causal_conv(xbc, self.conv1d_weight[conv_rows].to(xbc.dtype), plan, bias=bias, silu=True)
        xs, Bm, Cm = xbc.reshape(T, g, -1).split([rP, self.N, self.N], dim=-1)
        xs = xs.reshape(T, g * self.r, self.P)
        cd = torch.float64 if xs.dtype == torch.float64 else torch.float32
        step = F.softplus(dt.reshape(T, g * self.r).to(cd) + self.dt_bias[heads].to(cd))
        if self.dt_limit is not None:
            step = step.clamp(*self.dt_limit)
        decay = -self.A_log[heads].to(cd).exp() * step
        recompute = self.config.recompute_granularity != "full"
        y = gd.tree_gated_delta_rule(Cm, Bm, xs, decay, step, plan, scale=1.0, l2norm=False, recompute=recompute,
                                     delta=False)
        y = y.to(cd) + self.D[heads].to(cd)[:, None] * xs.to(cd)  # the skip connection
        if self.norm_weight is None:  # (Falcon-H1: the gate alone, as transformers computes it)
            o = y.float().reshape(T, -1) * F.silu(z.float().reshape(T, -1))
        else:
            weight = self.norm_weight[heads.start * self.P:heads.stop * self.P]
            o = recomputed(grouped_gated_rms_norm, y, z.reshape(T, g, rP), weight, self.eps, g, recompute=recompute)
        o = o.to(hidden_states.dtype)
        o = cpm.layer_heads_to_tokens(o.reshape(T, g, -1))  # back to this rank's tokens of every head under CP
        return self.out_proj(o.reshape(b, s, -1).transpose(0, 1))


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                           groups: int) -> torch.Tensor:
    """Mamba-2's gated norm (norm_before_gate False), as transformers computes it: y * silu(z) in fp32, RMS-normalised
    over each group's channels, times ``weight`` (one per channel); y [T, H, P], z [T, G, r P] -> [T, H P]."""
    T = y.shape[0]
    h = y.float().reshape(T, groups, -1) * F.silu(z.float())
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * h.reshape(T, -1)


def mamba2_spec(conv_bias: bool = True, dt_limit=None, norm_epsilon: float | None = None, **extra):
    """The ``self_attention`` spec of a Mamba-2 layer (Megatron's local linears); ``extra``: Falcon-H1's
    ``gated_norm`` / ``in_scale`` / ``segment_scales``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TreeMamba2Mixer,
                      submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                      params={"conv_bias": conv_bias, "dt_limit": dt_limit, "norm_epsilon": norm_epsilon, **extra})
