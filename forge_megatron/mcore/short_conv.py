"""LFM2's gated short convolutions inside Megatron-Core, trained on prefix trees.

:class:`TreeShortConv` takes a transformer layer's ``self_attention`` slot as the Gated DeltaNet does
(mcore/gated_delta_net.py). Per channel c, with ``in_proj`` giving B, C and x:

    y_c = C_c * conv_c(B * x)        (a depthwise causal convolution of ``conv_L_cache`` taps, an optional bias)

and ``out_proj`` back to the hidden size. There is no state beyond the convolution's window, so the only change a
prefix tree needs is that the window reads a token's nearest *ancestors* rather than the previous tokens of the
packed sequence (kernels/gated_delta.tree_causal_conv), which makes a merged tree train exactly as its samples alone.

Parameters, laid out so that tensor parallelism splits whole channels: ``in_proj`` (column-parallel) holds per
channel its B, C and x rows (HF's ``conv.in_proj`` holds all B rows, then all C, then all x; the bridge interleaves
them), ``conv1d_weight`` [D, K] and ``conv1d_bias`` [D] per channel, ``out_proj`` (row-parallel) [D, D]. Context
parallelism trades tokens for channels (every rank every token of 1 / CP of its channels), as the Gated DeltaNet
trades them for heads.
"""

from __future__ import annotations

import torch

from forge_megatron.kernels import gated_delta as gd
from forge_megatron.mcore.gated_delta_net import GatedDeltaNetSubmodules, TreeGatedDeltaNet, tensor_parallel_group


class TreeShortConv(TreeGatedDeltaNet):
    """An LFM2 gated short-convolution mixer over prefix forests; hidden states [s, b, D] -> ([s, b, D], bias)."""

    tp_split = ("conv1d_weight", "conv1d_bias")

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int | None = None,
                 pg_collection=None, cp_comm_type=None, conv_bias: bool = False):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.transformer.module import MegatronModule

        MegatronModule.__init__(self, config=config)
        self.layer_number = layer_number
        tp_group, self.tp_group, tp = tensor_parallel_group(pg_collection)
        D, cp = config.hidden_size, config.context_parallel_size
        if D % (tp * cp):
            raise ValueError(f"LFM2's short convolutions split their {D} channels over TP x CP ({tp} x {cp})")
        self.kernel, self.channels_local = config.linear_conv_kernel_dim, D // tp
        self._build_projections(config, submodules, tp_group, 3 * D, D)
        dtype = config.params_dtype
        self.conv1d_weight = self._conv_weight(config, D, tp)
        self.conv1d_bias = torch.nn.Parameter(torch.zeros(self.channels_local, dtype=dtype)) if conv_bias else None
        if self.conv1d_bias is not None:
            set_tensor_model_parallel_attributes(self.conv1d_bias, True, 0, 1)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
        from forge_megatron.mcore import context_parallel as cpm

        proj, _ = self.in_proj(hidden_states)  # [s, b, channels_local * 3]: per channel B, C, x
        s, b = proj.shape[:2]
        x = proj.transpose(0, 1).reshape(s * b, self.channels_local, 3)
        # this rank's tokens of every channel -> every token (DFS order) of 1/C of them under CP
        x, rank = cpm.layer_tokens_to_heads(x, packed_seq_params, "short-convolution")
        T, n = x.shape[0], x.shape[1]
        rows = slice(rank * n, (rank + 1) * n)
        Bg, Cg, xs = x.unbind(-1)
        plan = self._plan(packed_seq_params, s, b, proj.device, T)
        bias = None if self.conv1d_bias is None else self.conv1d_bias[rows].to(xs.dtype)
        conv = gd.tree_causal_conv((Bg * xs).contiguous(), self.conv1d_weight[rows].to(xs.dtype), plan, bias=bias)
        y = Cg * conv
        y = cpm.layer_heads_to_tokens(y.reshape(T, n, 1))  # back to this rank's tokens of every channel under CP
        return self.out_proj(y.reshape(b, s, -1).transpose(0, 1))


def short_conv_spec(conv_bias: bool = False):
    """The ``self_attention`` spec of an LFM2 short-convolution layer (Megatron's local linears)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TreeShortConv,
                      submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                      params={"conv_bias": conv_bias})
