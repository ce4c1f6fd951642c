"""Tree attention inside Megatron-Core: a ``core_attention`` module, its packed-sequence params, layer specs
and rotary embeddings taken by tree depth.

A micro-batch of samples merged into a prefix forest (forge_megatron.tree) runs through a standard Megatron
``GPTModel`` as ONE sequence of T unique tokens (batch 1) in DFS pre-order. Three things change:

1. Attention mask: key j is visible to query i  <=>  j <= i < sub_end[j]  (j is an ancestor of i or i).
   :class:`TreeAttention` replaces ``DotProductAttention`` (same constructor and forward signature) and calls
   ``forge_megatron.kernels.tree_attention.tree_attention`` on the tree metadata it finds in
   :class:`TreePackedSeqParams`: o_i = sum_{j visible} softmax_j(scale * q_i . k_j) v_j.
2. Positions: token i sits at position depth(i) in every sample containing it, so RoPE must rotate it by
   depth, not by its packed offset i. :func:`use_depth_rope` installs a forward pre-hook on the model's
   decoder that replaces the rotary table Megatron built for offsets 0..T-1 by ``table[position_ids]``
   ([T, 1, 1, dim]); every pipeline stage has its own decoder and rotary module, so every stage applies it.
3. Nothing else: linear layers, norms and MoE routing act per token and see each unique token once.

gpt-oss attention: Megatron's ``softmax_type="learnable"`` (a sink logit per head, the parameter
``core_attention.softmax_offset`` as in Megatron's DotProductAttention; "off-by-one": a zero logit) and sliding
windows (``window_size=(W - 1, 0)`` on the layers ``window_attn_skip_freq`` selects) go to the kernels as sinks and a
window by depth (each sample's own window: kernels/tree_attention/ops.py).

Multi-latent attention (DeepSeek-V3 / Kimi-K2, ``GPTConfig.kv_lora_rank``) rotates inside each attention layer with
its own rotary module, so :func:`use_depth_rope` indexes each layer's table by depth instead (a hook on the layer
reads the packed params, one on its rotary module returns ``table[position_ids]``). Given packed-sequence params,
Megatron's MLA hands core attention [T, heads, dim] (no batch dim), keys of qk_head_dim + qk_pos_emb_head_dim
channels and values of v_head_dim: the kernels take value heads of their own size (the CUDA kernel excepted, which
the automatic choice then passes over).

DeepSeek sparse attention layers (DeepSeek-V3.2, GLM-5: mcore/dsa.py) keep their own core attention, which takes the
tree from the same packed params (its indexer chooses each token's keys among its ancestors).

Context parallelism (CP > 1): each CP rank holds a contiguous shard of the padded tree and TreeAttention trades
tokens for heads around the kernel (forge_megatron.mcore.context_parallel); ``sub_end`` is then the whole padded
tree and ``position_ids`` this rank's shard.

The packed params keep ``qkv_format="sbhd"`` on purpose: Megatron's SelfAttention then keeps q/k/v as
[s, b, heads, dim] with b == 1 and applies RoPE in the plain (non-"thd") path, which indexes the rotary table
by row; the depth-indexed table makes row i carry depth(i).

Legend: T = tree tokens (the packed sequence), N = query heads per TP rank, K = key/value heads per TP rank,
H = head dim, P = rotary table rows (max depth + 1), D = rotary dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from forge_megatron.mcore.block_sparse import BlockSparseAttention
from forge_megatron.mcore.dsa import SparseTreeAttention
from forge_megatron.mcore.model import GPTConfig, build_gpt, layer_spec


@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """Megatron packed-sequence params carrying a prefix-forest layout for :class:`TreeAttention`.

    Attributes (besides PackedSeqParams'):
        sub_end: int32 [T], exclusive end of each token's subtree in DFS order (the whole mask).
        position_ids: int64 [T], depth of each token (its RoPE position).
        backend: tree-attention backend name passed to the dispatcher (None = its default choice).
        vision: for a tree with images, this rank's :class:`~forge_megatron.mcore.vision.VisionShard` (mcore/vision.py).
        key_end: int32 [T] or None, like sub_end the whole (padded) tree's: bidirectional blocks, the tokens of each of
            Gemma 3's images seeing each other (kernels/tree_attention/ops.py).
        key_end_sliding_only: key_end applies to the sliding-window layers only (Gemma 4: its global layers stay
            causal over images).
    ``max_seqlen_q``/``max_seqlen_kv`` are max depth + 1 (the longest sample), which is the rotary table
    length Megatron asks for. Under context parallelism (CP = C) ``sub_end`` covers the whole tree padded to a
    multiple of C and ``position_ids`` only this rank's T_pad / C tokens.
    """

    sub_end: torch.Tensor = None
    position_ids: torch.Tensor = None
    backend: str | None = None
    vision: object = None
    key_end: torch.Tensor = None
    key_end_sliding_only: bool = False

    def __post_init__(self):
        if self.sub_end is None or self.position_ids is None:
            raise ValueError("TreePackedSeqParams needs sub_end and position_ids (build it with tree_packed_seq_params)")
        T, Tl = self.sub_end.numel(), self.position_ids.numel()
        if self.sub_end.dim() != 1 or self.position_ids.dim() != 1 or (Tl and T % Tl) or (Tl == 0 and T):
            raise ValueError(
                f"sub_end and position_ids must be 1-D, of the same length (or, under context parallelism, "
                f"position_ids one CP shard of sub_end), got {tuple(self.sub_end.shape)} and "
                f"{tuple(self.position_ids.shape)}"
            )


def tree_packed_seq_params(layout, backend: str | None = None, device=None,
                           multiple: int | None = None) -> TreePackedSeqParams:
    """Packed-sequence params for a ``forge_megatron.tree.TreeLayout`` (tensors moved to ``device``).

    The tree is padded to a multiple of ``multiple`` (default ``context_parallel.default_multiple``; see
    ``context_parallel.seq_multiple``); under context parallelism ``position_ids`` is this CP rank's zig-zag chunks
    of the padded tree."""
    from forge_megatron.mcore.context_parallel import cp_world, default_multiple, pad_sub_end, pad_zeros, take_shard

    sub_end_T = layout.sub_end.to(device=device, dtype=torch.int32)
    position_ids_T = layout.position_ids.to(device=device, dtype=torch.int64)
    longest = int(position_ids_T.max()) + 1 if position_ids_T.numel() else 1
    cp, rank, _ = cp_world()
    multiple = multiple or default_multiple(cp)
    if multiple > 1:
        position_ids_T = take_shard(pad_zeros(position_ids_T, multiple), cp, rank, multiple)
        sub_end_T = pad_sub_end(sub_end_T, multiple)
    vision = key_end_T = None
    if getattr(layout, "vision", None) is not None:
        from forge_megatron.mcore.vision import VisionShard

        vision = VisionShard.of(layout.vision, device, multiple)
        if layout.vision.spec.bidirectional:  # each image's tokens see each other (Gemma 3; Gemma 4's sliding layers)
            from forge_megatron.kernels.tree_attention.ops import block_key_end

            image_T = torch.zeros(sub_end_T.numel(), dtype=torch.bool, device=sub_end_T.device)
            image_T[:layout.vision.rows_T.numel()] = layout.vision.rows_T.to(sub_end_T.device) >= 0
            key_end_T = block_key_end(image_T, sub_end_T)
    return TreePackedSeqParams(
        qkv_format="sbhd", max_seqlen_q=longest, max_seqlen_kv=longest,
        sub_end=sub_end_T, position_ids=position_ids_T, backend=backend, vision=vision, key_end=key_end_T,
        key_end_sliding_only=key_end_T is not None and layout.vision.spec.bidirectional == "sliding",
    )


class TreeAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron's SelfAttention that attends over a prefix forest.

    Inputs as for ``DotProductAttention``: query [T, 1, N, H], key/value [T, 1, K, H] (heads already split
    per TP rank; GQA handled by the kernel), ``packed_seq_params`` a :class:`TreePackedSeqParams`.
    ``attention_mask`` must be None: the mask is ``sub_end``. Output [T, 1, N * H].
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None, softcap: float | None = None, chunk: int | None = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"TreeAttention does not support attention dropout; set attention_dropout=0 (got {dropout})")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if softmax_scale is None:  # Megatron passes config.softmax_scale (YaRN sets it: mcore/rope.py)
            softmax_scale = getattr(config, "softmax_scale", None) or config.kv_channels ** -0.5
        self.softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type  # context parallelism: a2a, all_gather or None/auto (context_parallel.py)
        self.window = _layer_window(config, self.layer_number)
        self.softcap = softcap  # Gemma 2's soft-capped scores (the causal spec's CausalCoreAttention param)
        self.chunk = chunk  # Llama 4's chunked attention (likewise)
        softmax_type = getattr(config, "softmax_type", "vanilla")
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        if softmax_type == "learnable":  # gpt-oss sinks: split over TP by heads like the query heads
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset.data)
            else:
                torch.nn.init.zeros_(self.softmax_offset)
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype), persistent=False)
        elif softmax_type == "vanilla":
            self.softmax_offset = None
        else:
            raise ValueError(f"TreeAttention: softmax_type {softmax_type!r} is not supported (vanilla, off-by-one, "
                             "learnable)")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not isinstance(packed_seq_params, TreePackedSeqParams):
            raise TypeError(
                "TreeAttention needs packed_seq_params=TreePackedSeqParams (see tree_packed_seq_params(layout)), "
                f"got {type(packed_seq_params).__name__}"
            )
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("TreeAttention takes its mask from sub_end: pass attention_mask=None and no attention_bias")
        from forge_megatron.mcore.context_parallel import cp_world, tree_attention_cp

        if query.dim() == 3:  # multi-latent attention drops the batch dim when given packed-sequence params
            query, key, value = query[:, None], key[:, None], value[:, None]
        T, b = query.shape[:2]
        cp = cp_world()[0]
        if b != 1 or T * cp != packed_seq_params.sub_end.numel():
            shard = f" / {cp} CP ranks" if cp > 1 else ""
            raise ValueError(
                f"TreeAttention expects query [T, 1, heads, dim] with T = {packed_seq_params.sub_end.numel()} tree "
                f"tokens{shard}, got {tuple(query.shape)}"
            )
        o_TNH = tree_attention_cp(
            query[:, 0], key[:, 0], value[:, 0], packed_seq_params.sub_end,
            softmax_scale=self.softmax_scale, backend=packed_seq_params.backend, comm_type=self.cp_comm_type,
            sinks=self.softmax_offset, window=self.window, key_end_T=self._key_end(packed_seq_params),
            softcap=self.softcap, chunk=self.chunk,
        )
        return o_TNH.reshape(T, 1, -1)


    def _key_end(self, params):
        """The packed params' bidirectional blocks if they apply to this layer (Gemma 4: sliding-window layers only)."""
        if params.key_end is None or (params.key_end_sliding_only and not self.window):
            return None
        return params.key_end


def _layer_window(config, layer_number: int) -> int:
    """The sliding window (in positions: a query sees itself and the window - 1 before it) of this layer, 0 for
    none, from Megatron's ``window_size=(left, right)`` and ``window_attn_skip_freq``."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window_size = getattr(config, "window_size", None)
    if not is_layer_window_attention(window_size, getattr(config, "window_attn_skip_freq", None), layer_number):
        return 0
    left, right = window_size
    if right != 0:
        raise ValueError(f"TreeAttention: window_size {tuple(window_size)} looks ahead; only causal windows (left, 0)")
    return 0 if left < 0 else left + 1


# ------------------------------------------------------------------------------------------------ specs
def tree_layer_spec(cfg: GPTConfig, use_te: bool = False, vp_stage: int | None = None):
    """``layer_spec(cfg, use_te, vp_stage)`` with every self-attention's core_attention swapped for TreeAttention.

    Works on a single layer ModuleSpec (dense or MoE) and on a block spec holding ``layer_specs``.
    """
    return swap_core_attention(layer_spec(cfg, use_te=use_te, vp_stage=vp_stage))


def swap_core_attention(spec):
    """A copy of a Megatron layer (or block) spec whose self-attention uses TreeAttention; the input is untouched."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[swap_core_attention(s) for s in spec.layer_specs])
    from forge_megatron.mcore.gated_delta_net import is_gated_delta_net

    layer_subs = spec.submodules
    attn = getattr(layer_subs, "self_attention", None)
    if is_gated_delta_net(attn):  # a linear-attention layer follows the tree by itself (packed params)
        return spec
    from megatron.core.transformer.identity_op import IdentityOp

    if attn is IdentityOp:  # (Nemotron-H's MLP-only layers: no attention)
        return spec
    if attn is None or not dataclasses.is_dataclass(getattr(attn, "submodules", None)) \
            or not hasattr(attn.submodules, "core_attention"):
        raise TypeError(f"cannot find self_attention.submodules.core_attention in layer spec {spec!r}")
    core = attn.submodules.core_attention
    if getattr(core, "module", None) in (SparseTreeAttention, BlockSparseAttention):
        return spec  # DeepSeek's and MiniMax-M3's sparse attention follow the tree by themselves
    # (Gemma 2's cap, Llama 4's chunks: the causal core attention's params carried over)
    params = {k: v for k, v in (getattr(core, "params", None) or {}).items() if k in ("softcap", "chunk")}
    tree_core = ModuleSpec(module=TreeAttention, params=params) if params else TreeAttention
    tree_attn = dataclasses.replace(
        attn,
        params={**attn.params, "attn_mask_type": AttnMaskType.arbitrary},
        submodules=dataclasses.replace(attn.submodules, core_attention=tree_core),
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer_subs, self_attention=tree_attn))


# ------------------------------------------------------------------------------------------------- RoPE
def use_depth_rope(model):
    """Make ``model`` (a GPTModel stage) rotate tree tokens by depth when given TreePackedSeqParams.

    Returns a handle whose ``remove()`` undoes it. Calls without TreePackedSeqParams are left untouched.
    """
    if getattr(model.config, "multi_latent_attention", False):
        return _use_depth_rope_mla(model)
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None or getattr(model, "position_embedding_type", None) != "rope":
        raise ValueError("use_depth_rope needs a GPTModel built with position_embedding_type='rope'")
    # Under context parallelism Megatron slices the rotary table zig-zag for this CP rank (sequence offsets); the
    # tree indexes the whole table by each local token's depth instead, so the module must return it unsliced.
    if hasattr(rotary, "cp_group"):
        rotary.cp_group = None

    def index_rope_by_depth(module, args, kwargs):
        params = kwargs.get("packed_seq_params")
        if not isinstance(params, TreePackedSeqParams) or kwargs.get("rotary_pos_emb") is None:
            return None
        table_P11D = rotary(int(params.max_seqlen_q))
        kwargs["rotary_pos_emb"] = table_P11D[params.position_ids.to(table_P11D.device)]  # [T, 1, 1, D]
        return args, kwargs

    return model.decoder.register_forward_pre_hook(index_rope_by_depth, with_kwargs=True)


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        for h in self.handles:
            h.remove()


def _use_depth_rope_mla(model):
    """Depth RoPE for multi-latent attention: every layer asks its own rotary module for the table (of
    ``max_seqlen_q`` rows) and applies it to [T, heads, dim] tensors, so the module returns ``table[position_ids]``
    as [T, 1, D] while its layer runs with TreePackedSeqParams. The positions are read per layer call, so a layer
    recomputed in the backward pass (activation checkpointing) gets its own micro-batch's again."""
    handles = []
    for layer in model.decoder.layers:
        attention = layer.self_attention
        rotary = getattr(attention, "rotary_pos_emb", None)
        if rotary is None:  # a linear-attention layer beside the MLA ones (Kimi Linear)
            continue
        if hasattr(rotary, "cp_group"):
            rotary.cp_group = None  # as above: the whole table, indexed by depth
        positions = {}

        def read_params(module, args, kwargs, positions=positions):
            params = kwargs.get("packed_seq_params")
            positions["T"] = params.position_ids if isinstance(params, TreePackedSeqParams) else None

        def index_by_depth(module, args, table_P11D, positions=positions):
            position_ids = positions.get("T")
            if position_ids is None:
                return None
            return table_P11D[position_ids.to(table_P11D.device), 0]  # [T, 1, D]

        handles += [attention.register_forward_pre_hook(read_params, with_kwargs=True),
                    rotary.register_forward_hook(index_by_depth)]
    return _Handles(handles)


def build_tree_gpt(cfg: GPTConfig, use_te: bool = False, **kwargs):
    """``build_gpt`` with the tree layer spec and depth RoPE: this rank's stage of a tree-packed GPTModel."""
    model = build_gpt(cfg, spec=tree_layer_spec(cfg, use_te=use_te, vp_stage=kwargs.get("vp_stage")), **kwargs)
    use_depth_rope(model)
    return model
