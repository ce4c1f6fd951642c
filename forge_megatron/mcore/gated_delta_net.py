"""Gated DeltaNet layers (Qwen3.5 / Qwen3-Next linear attention) inside Megatron-Core, trained on prefix trees.

:class:`TreeGatedDeltaNet` takes a transformer layer's ``self_attention`` slot (same call, returns
``(output, bias)``). Given :class:`~forge_megatron.mcore.tree_attention.TreePackedSeqParams` it runs the short
convolution and the gated delta rule along every root-to-leaf path of the prefix forest
(:mod:`forge_megatron.kernels.gated_delta`), so a merged tree trains exactly as its samples would alone; without
packed params each batch row is one causal sequence (conversion checks, evaluation).

Parameters, in a layout tensor parallelism splits by whole key-head groups (H / Hk value heads per key head,
Qwen3.5's grouping) so a TP rank's contiguous slice of every tensor is its own heads:

- ``in_proj`` (column-parallel): per key-head group ``[q (dk) | k (dk) | v (r dv) | z (r dv) | b (r) | a (r)]``,
  r = H / Hk (transformers' ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` regrouped by the bridge);
- ``conv1d_weight`` [C, K], its channels per group ``[q | k | v]`` (HF's depthwise ``conv1d.weight`` [C, 1, K]);
- ``A_log``, ``dt_bias`` [H] per value head (beta = ``beta_scale`` * sigmoid(b): OLMo Hybrid's 2 lets the state
  transition I - beta k k^T have negative eigenvalues); ``norm_weight`` [dv], the gated RMSNorm's, whole on every rank (each
  rank's heads use all of it: its gradient is all-reduced over TP in the backward);
- ``out_proj`` (row-parallel) [D, H dv].

Context parallelism (CP = C): a CP rank holds zig-zag chunks of the tree's tokens, but the recurrence needs whole
paths. Heads are independent, so the layer trades tokens for heads as tree attention's a2a mode does
(mcore/context_parallel.py): after ``in_proj`` one all-to-all gives every rank all tokens (back in DFS order) of
1/C of its key-head groups, the convolution, the recurrence and the gated norm run on those with their slices of
``conv1d_weight``, ``A_log`` and ``dt_bias``, and one all-to-all returns the rank's tokens of every head before
``out_proj``. C must divide the key heads per TP rank. Each rank's gradients reach only its slices; Megatron sums
gradients over the data-parallel-with-CP group, which completes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from forge_megatron.kernels import gated_delta as gd


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: ModuleSpec | type = None
    out_proj: ModuleSpec | type = None


def group_width(config) -> int:
    """Rows of ``in_proj`` per key-head group."""
    r = config.linear_num_value_heads // config.linear_num_key_heads
    return 2 * config.linear_key_head_dim + 2 * r * config.linear_value_head_dim + 2 * r


def conv_group_width(config) -> int:
    """Convolution channels per key-head group (q, k and its value heads)."""
    r = config.linear_num_value_heads // config.linear_num_key_heads
    return 2 * config.linear_key_head_dim + r * config.linear_value_head_dim


class TreeGatedDeltaNet(MegatronModule):
    """A Gated DeltaNet token mixer over prefix forests; hidden states [s, b, D] -> ([s, b, D], bias)."""

    chunk = 64  # the recurrence's chunk (kernels/gated_delta.py)
    tp_split = ("conv1d_weight", "A_log", "dt_bias")  # its own parameters TP splits along dim 0 (by heads)

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int | None = None,
                 pg_collection=None, cp_comm_type=None, beta_scale: float = 1.0, norm_epsilon: float | None = None):
        super().__init__(config=config)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.layer_number = layer_number
        tp_group, self.tp_group, tp = tensor_parallel_group(pg_collection)
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        if nv % nk or nk % tp:
            raise ValueError(f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk}), "
                             f"and that of the tensor-parallel size ({tp})")
        self.dk, self.dv, self.kernel = config.linear_key_head_dim, config.linear_value_head_dim, \
            config.linear_conv_kernel_dim
        self.r, self.nk_local = nv // nk, nk // tp
        self.nv_local = self.nk_local * self.r
        self.conv_group = conv_group_width(config)
        cp = config.context_parallel_size
        if self.nk_local % cp:
            raise ValueError(f"context parallelism {cp} splits the Gated DeltaNet's key heads per tensor-parallel rank "
                             f"({self.nk_local} = linear_num_key_heads {nk} / TP {tp}) across CP ranks: CP must "
                             "divide them")
        # the gated norm's epsilon (OLMo Hybrid's is its own) and the write strength's scale (spec params)
        self.eps = config.layernorm_epsilon if norm_epsilon is None else norm_epsilon
        self.beta_scale = float(beta_scale)
        self._build_projections(config, submodules, tp_group, nk * group_width(config), nv * self.dv)
        self.conv1d_weight = self._conv_weight(config, nk * conv_group_width(config), tp)
        dtype = config.params_dtype
        self.A_log = torch.nn.Parameter(torch.empty(self.nv_local, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.nv_local, dtype=dtype))
        with torch.no_grad():  # Qwen3.5's initialisation: A uniform in (0, 16), dt_bias ones
            self.A_log.copy_(torch.empty(self.nv_local).uniform_(1e-2, 16).log())
            self.dt_bias.fill_(1.0)
        for p in (self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.norm_weight = torch.nn.Parameter(torch.ones(self.dv, dtype=dtype))

    def _build_projections(self, config, submodules, tp_group, in_rows: int, out_cols: int) -> None:
        """``in_proj`` (column-parallel, hidden -> ``in_rows``) and ``out_proj`` (row-parallel, ``out_cols`` ->
        hidden), Megatron's linears without biases (this mixer's and its subclasses')."""
        kwargs = dict(config=config, init_method=config.init_method, bias=False, is_expert=False)
        if tp_group is not None:
            kwargs["tp_group"] = tp_group
        self.in_proj = build_module(submodules.in_proj, config.hidden_size, in_rows, gather_output=False,
                                    skip_bias_add=False, tp_comm_buffer_name="fc1", **kwargs)
        self.out_proj = build_module(submodules.out_proj, out_cols, config.hidden_size, input_is_parallel=True,
                                     skip_bias_add=True, tp_comm_buffer_name="fc2",
                                     **{**kwargs, "init_method": config.output_layer_init_method})

    def _conv_weight(self, config, channels: int, tp: int) -> torch.nn.Parameter:
        """This TP rank's rows [channels / tp, kernel] of the depthwise convolution's weight, initialised uniform in
        +-1 / sqrt(kernel) as the whole tensor would be."""
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

        weight = torch.nn.Parameter(torch.empty(channels // tp, self.kernel, dtype=config.params_dtype))
        _initialize_affine_weight_cpu(weight, channels, self.kernel, channels // tp, 0,
                                      lambda w: torch.nn.init.uniform_(w, -self.kernel ** -0.5, self.kernel ** -0.5),
                                      params_dtype=config.params_dtype)
        return weight

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):

        from forge_megatron.mcore import context_parallel as cpm

        proj, _ = self.in_proj(hidden_states)  # [s, b, nk_local * group]
        s, b = proj.shape[:2]
        x = proj.transpose(0, 1).reshape(s * b, self.nk_local, -1)  # token b * s + i: row b's sequence in order
        # this rank's tokens of every key-head group -> every token (DFS order) of 1/C of them under CP
        x, rank = cpm.layer_tokens_to_heads(x, packed_seq_params, "Gated DeltaNet")
        T, nk = x.shape[0], x.shape[1]  # the key-head groups this rank runs
        # this rank's slices of the per-head parameters (all of them without CP)
        heads = slice(rank * nk * self.r, (rank + 1) * nk * self.r)
        conv_rows = slice(rank * nk * self.conv_group, (rank + 1) * nk * self.conv_group)
        rv = self.r * self.dv
        q, k, v, z, beta_in, a = x.split([self.dk, self.dk, rv, rv, self.r, self.r], dim=-1)
        plan = self._plan(packed_seq_params, s, b, proj.device, T)

        qkv = torch.cat([q, k, v], dim=-1).reshape(T, -1)
        qkv = gd.tree_causal_conv(qkv, self.conv1d_weight[conv_rows].to(qkv.dtype), plan, silu=True)
        q, k, v = qkv.reshape(T, nk, -1).split([self.dk, self.dk, rv], dim=-1)
        decay, beta = gd.gate_and_decay(a.reshape(T, nk * self.r), beta_in.reshape(T, nk * self.r),
                                        self.A_log[heads], self.dt_bias[heads])
        if self.beta_scale != 1.0:  # OLMo Hybrid's allow_neg_eigval: beta in (0, 2)
            beta = beta * self.beta_scale
        # the recurrence and the gated norm keep only their inputs for the backward and run again there (their fp32
        # intermediates come to several times the layer's input; benchmarks/gated_delta.py, docs/prefix_tree.md);
        # under Megatron's full recomputation the whole layer reruns before its backward anyway
        recompute = self.config.recompute_granularity != "full"
        o = gd.tree_gated_delta_rule(q, k, v.reshape(T, nk * self.r, self.dv), decay, beta, plan, recompute=recompute)
        z = z.reshape(T, nk * self.r, self.dv).contiguous()  # its own copy: the projection's output can go
        return self._normed_output(gated_rms_norm, o, z, recompute, nk, b, s)

    def _normed_output(self, norm, o, gate, recompute: bool, heads: int, b: int, s: int):
        """The gated ``norm`` of the recurrence's output ``o`` [T, .., d] (recomputed in the backward with
        ``recompute``), back to this rank's tokens under CP (``heads``: the head groups this rank ran), through
        ``out_proj``."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        from forge_megatron.mcore import context_parallel as cpm

        # the norm's weight is shared by every head of every TP rank: its gradient is summed over TP
        weight = copy_to_tensor_model_parallel_region(self.norm_weight)
        o = recomputed(norm, o, gate, weight, self.eps, recompute=recompute)
        o = cpm.layer_heads_to_tokens(o.reshape(o.shape[0], heads, -1))  # back to this rank's tokens under CP
        return self.out_proj(o.reshape(b, s, -1).transpose(0, 1))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's dist-checkpoint view: the convolution and the per-head decay parameters split over TP along
        dim 0 (the default would call them replicated), the gated norm's weight replicated, the linears their own."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, \
            make_sharded_tensors_for_checkpoint, sharded_state_dict_default

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {name: 0 for name in self.tp_split},
                                                  sharded_offsets, tp_group=self.tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                  tp_group=self.tp_group))
        return out

    def _plan(self, packed_seq_params, s: int, b: int, device, T: int) -> gd.RecurrencePlan:
        """The recurrence plan of the ``T`` tokens this rank runs: causal rows, or the (whole padded) tree."""
        from forge_megatron.mcore import context_parallel as cpm
        from forge_megatron.mcore.tree_attention import TreePackedSeqParams

        if packed_seq_params is None:  # every layer of a forward asks for the same one: built once
            return _chain_plan(s, b, self.kernel, torch.device(device), self.chunk)
        if not isinstance(packed_seq_params, TreePackedSeqParams):
            raise ValueError("Gated DeltaNet layers take TreePackedSeqParams (a prefix tree) or no packed params "
                             f"(causal rows), got {type(packed_seq_params).__name__}")
        if b != 1 or packed_seq_params.position_ids.numel() != s:
            raise ValueError(f"a tree is one sequence of {packed_seq_params.position_ids.numel()} tokens; got "
                             f"hidden states [{s}, {b}]")
        # every linear-attention layer of the micro-batch shares one plan
        key = ("gated_delta_plan", self.kernel, self.chunk)
        cache = packed_seq_params.__dict__.setdefault("_recurrence_plans", {})
        if key not in cache:
            depth = packed_seq_params.position_ids.to(device)
            C, _, group = cpm.cp_world()
            if C > 1:  # this rank's shard of the depths -> the whole padded tree's, in DFS order
                depth = cpm.gather_tree(depth, group)
            if depth.numel() != T:
                raise ValueError(f"the tree has {depth.numel()} tokens, the layer runs {T}")
            cache[key] = gd.plan_tree(depth, self.kernel, self.chunk)
        return cache[key]


@functools.lru_cache(maxsize=8)
def _chain_plan(s: int, b: int, kernel: int, device: torch.device, chunk: int = 64) -> gd.RecurrencePlan:
    """The plan of ``b`` causal rows of ``s`` tokens (conversion checks, evaluation): read-only, so shared."""
    return gd.plan_chains(s, b, kernel, chunk=chunk, device=device)


def tensor_parallel_group(pg_collection):
    """(the group Megatron handed in ``pg_collection``, or None; the tensor-parallel group, that one or the global
    one; its size)."""
    from megatron.core import parallel_state as ps

    handed = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if handed is not None:
        return handed, handed, handed.size()
    return None, ps.get_tensor_model_parallel_group(check_initialized=False), \
        ps.get_tensor_model_parallel_world_size()


def recomputed(fn, *args, recompute: bool):
    """``fn(*args)``, under a non-reentrant activation checkpoint when ``recompute`` and autograd records: only the
    inputs wait for the backward, which runs ``fn`` again."""
    if recompute and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm over each head's last dim, in transformers' order: normalise in fp32, weight in the input dtype,
    then the SiLU gate of ``z`` in fp32; the result in o's dtype."""
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return ((weight * normed) * F.silu(z.float())).to(o.dtype)


def gated_delta_net_spec(beta_scale: float = 1.0, norm_epsilon: float | None = None):
    """The ``self_attention`` spec of a Gated DeltaNet layer (Megatron's local linears); ``beta_scale`` multiplies
    the write strength sigmoid(b) (OLMo Hybrid: 2), ``norm_epsilon`` is the gated norm's (None: the layer norms')."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ModuleSpec(module=TreeGatedDeltaNet,
                      submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                      params={"beta_scale": beta_scale, "norm_epsilon": norm_epsilon})


def is_gated_delta_net(attn_spec) -> bool:
    """A linear-attention mixer's spec (Gated DeltaNet, or Kimi Delta Attention: mcore/kimi_delta.py)."""
    module = getattr(attn_spec, "module", None)
    return isinstance(module, type) and issubclass(module, TreeGatedDeltaNet)
