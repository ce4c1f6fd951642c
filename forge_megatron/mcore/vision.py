"""Images in a tree-packed Megatron GPTModel: vision features in place of image tokens, DeepStack, 3-D mRoPE.

A micro-batch whose tree has images (``TreeLayout.vision``, multimodal/tree.py) carries them in its packed params
(``TreePackedSeqParams.vision``: this rank's :class:`VisionShard`). :func:`install` puts three hooks on a model stage:

1. on the decoder (before it runs): the rotary table becomes the mRoPE angles of the tokens' three positions
   (multimodal/qwen_vl.py ``mrope_angles``; text alone gives the depth table's values), and on the first pipeline
   stage the image tokens' embeddings are replaced by the vision tower's merged features;
2. after each of the first ``spec.deepstack_layers`` layers (Qwen3-VL's DeepStack): that layer's features are added
   to the image tokens' hidden states.

The vision tower is the checkpoint's own (a frozen transformers module, ``qwen_vl.load_vision_tower``, made on first
use by the ``tower`` callable), run once per micro-batch on its distinct images under ``no_grad``: every rank that
needs the features computes them (the tower is small beside the language model); the result is kept on the
micro-batch's VisionTree, so activation recomputation and the forward-only passes reuse it. Replacing and adding are
out of place, so gradients flow to the language model as in transformers' ``Qwen3VLModel``; the tower is not trained.

Sequence parallelism: the decoder's input and the layers' outputs are this TP rank's slice of the (CP-local) tokens,
so each hook takes that slice of the rows. Context parallelism: the shard holds this CP rank's zig-zag tokens.

Legend: T = tree tokens (padded, this CP rank's), N = image tokens of the micro-batch's images, H = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forge_megatron.multimodal.qwen_vl import VisionSpec, encode_images, mrope_angles


@dataclass
class VisionShard:
    """The vision inputs of this rank's tokens of a tree: feature rows (-1: text) and mRoPE positions per token,
    and the micro-batch's VisionTree (its images and, once computed, their features)."""

    rows_T: torch.Tensor
    positions_T3: torch.Tensor
    tree: object

    @classmethod
    def of(cls, tree, device, multiple: int) -> "VisionShard":
        from forge_megatron.mcore.context_parallel import cp_world, padded_length, take_shard

        cp, rank, _ = cp_world()
        rows_T, positions_T3 = tree.rows_T, tree.positions_T3
        if multiple > 1:
            extra = padded_length(rows_T.numel(), multiple) - rows_T.numel()
            rows_T = torch.cat([rows_T, rows_T.new_full((extra,), -1)])
            positions_T3 = torch.cat([positions_T3, positions_T3.new_zeros(extra, 3)])
            rows_T = take_shard(rows_T, cp, rank, multiple)
            positions_T3 = take_shard(positions_T3, cp, rank, multiple)
        return cls(rows_T.to(device), positions_T3.to(device), tree)

    def features(self, tower, device) -> tuple[torch.Tensor, list]:
        """(merged features [N, H], DeepStack features) of the micro-batch's images, computed on first use."""
        tree = self.tree
        if tree.features is None:
            if tree.num_images == 0:
                tree.features = (None, [])
            else:
                merged, deepstack = encode_images(tower(), tree.pixel_values, tree.grid_thw)
                if deepstack and len(deepstack) < tree.spec.deepstack_layers:
                    raise ValueError(f"the vision tower gave {len(deepstack)} DeepStack features for "
                                     f"{tree.spec.deepstack_layers} layers")
                tree.features = (merged.to(device), [d.to(device) for d in deepstack])
        return tree.features


def _local_rows(rows_T: torch.Tensor, config, length: int) -> torch.Tensor:
    """The rows of this TP rank's slice of the tokens (sequence parallelism) or all of them."""
    if rows_T.numel() == length:
        return rows_T
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if not getattr(config, "sequence_parallel", False) or rows_T.numel() != length * tp:
        raise ValueError(f"{rows_T.numel()} tokens' vision rows for hidden states of {length} tokens")
    rank = ps.get_tensor_model_parallel_rank()
    return rows_T[rank * length:(rank + 1) * length]


def _put(hidden_T1H: torch.Tensor, rows_T: torch.Tensor, values_NH: torch.Tensor, add: bool) -> torch.Tensor:
    """``hidden`` with the rows of image tokens replaced by (or, with ``add``, plus) their feature rows; out of place."""
    idx = torch.nonzero(rows_T >= 0).squeeze(1)
    if idx.numel() == 0:
        return hidden_T1H
    values = values_NH[rows_T[idx]].to(hidden_T1H.dtype)[:, None, :]
    return hidden_T1H.index_put((idx,), values, accumulate=add)


def install(model, spec: VisionSpec, tower) -> list:
    """Make a tree GPTModel stage (``build_tree_gpt``) take images (see the module docstring); ``tower``: a callable
    returning the frozen vision tower (called on the first micro-batch with images). Returns the hook handles."""
    if getattr(model.config, "multi_latent_attention", False):
        raise ValueError("images with multi-latent attention are not supported")
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("images need a model with rotary position embeddings (mRoPE)")
    decoder = model.decoder
    config = model.config

    def before_decoder(module, args, kwargs):
        vision = getattr(kwargs.get("packed_seq_params"), "vision", None)
        if vision is None:
            return None
        if kwargs.get("rotary_pos_emb") is not None:
            kwargs["rotary_pos_emb"] = mrope_angles(rotary, vision.positions_T3, spec)
        hidden = kwargs.get("hidden_states")
        if module.pre_process and hidden is not None:
            if hasattr(hidden, "unwrap"):
                hidden = hidden.unwrap()
            merged, _ = vision.features(tower, hidden.device)
            if merged is not None:
                hidden = _put(hidden, _local_rows(vision.rows_T, config, hidden.shape[0]), merged, add=False)
            kwargs["hidden_states"] = hidden
        return args, kwargs

    handles = [decoder.register_forward_pre_hook(before_decoder, with_kwargs=True)]

    def deepstack(module, args, kwargs, output):
        vision = getattr(kwargs.get("packed_seq_params"), "vision", None)
        if vision is None:
            return None
        hidden, context = output
        _, stack = vision.features(tower, hidden.device)
        if not stack:
            return None
        rows = _local_rows(vision.rows_T, config, hidden.shape[0])
        return _put(hidden, rows, stack[module.layer_number - 1], add=True), context

    for layer in decoder.layers:
        if layer.layer_number - 1 < spec.deepstack_layers:  # global layer numbers (1-based)
            handles.append(layer.register_forward_hook(deepstack, with_kwargs=True))
    return handles
