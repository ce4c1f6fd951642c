"""Images in a tree-packed Megatron GPTModel: vision features in place of image tokens, DeepStack, 3-D mRoPE.

A micro-batch whose tree has images (``TreeLayout.vision``, multimodal/tree.py) carries them in its packed params
(``TreePackedSeqParams.vision``: this rank's :class:`VisionShard`). :func:`install` puts three hooks on a model stage:

1. on the decoder (before it runs): the rotary table becomes the mRoPE angles of the tokens' three positions
   (multimodal/families.py ``mrope_angles``; text alone gives the depth table's values; Gemma 3 / 4 and Mistral 3
   keep their 1-D table), and on the first pipeline stage the image tokens' embeddings are replaced by the vision
   tower's merged features (Gemma 3 / 4's image tokens also see each other: tree attention's ``key_end``, made by
   mcore/tree_attention.py from the vision tree);
2. after each of the first ``spec.deepstack_layers`` layers (Qwen3-VL's DeepStack): that layer's features are added
   to the image tokens' hidden states.

The vision tower is the checkpoint's own (a transformers module). Frozen (the default: ``families.load_vision_tower``,
made on first use by the ``tower`` callable) it runs once per micro-batch on its distinct images under ``no_grad``:
every rank that needs the features computes them (the tower is small beside the language model); the result is kept
on the micro-batch's VisionTree, so activation recomputation and the forward-only passes reuse it. Replacing and
adding are out of place, so gradients flow to the language model as in transformers' ``Qwen3VLModel``.

Trained (``--train-vision-tower``): :func:`attach_tower` makes the tower a submodule ``vision_tower`` of the first
model piece before Megatron's DDP wraps it, so its gradients are reduced over DP x CP, its weights are in the
optimizer, the checkpoints, the weight sync and the export (``Bridge(vision_tower=True)`` names them). Each training
forward runs it with gradients (forward-only passes still reuse no-grad features); the merged features enter the
embeddings, and the DeepStack features enter the first layers through leaves of their own whose gradients
(accumulated by the layers' backward, recomputed or not: Megatron's reentrant recomputation re-runs the hooks) are
handed to the tower's graph with the merged features' (:class:`_WithDeepStackGrads`), so the tower is back-propagated
once per micro-batch. The DeepStack layers must be on the first model piece.

Under TP and CP the images are shared out: each rank of the TP x CP group encodes its share of the micro-batch's
images (balanced by patches, :func:`deal_images`) and the features are all-gathered (:class:`_GatherImages`), so the
tower's work is divided by TP x CP rather than repeated. When the tower trains, the gather's backward hands each rank
its images' feature gradient (summed over the group where ranks hold parts of it: their own tokens' rows under
sequence parallelism and CP), Megatron's ``finalize_model_grads`` combines the TP ranks' tower gradients
(``average_gradients_across_tp_domain``, the gradient scaled by TP first) and DDP the CP ranks' with the language
model's. Every training forward makes each tower parameter, and the gathered features, part of
the loss (zeros where no image reached this rank), so Megatron's DDP sees a gradient for each (with
--overlap-grad-reduce it waits for them) and every rank of the group reaches the gather's backward collective.

Sequence parallelism: the decoder's input and the layers' outputs are this TP rank's slice of the (CP-local) tokens,
so each hook takes that slice of the rows. Context parallelism: the shard holds this CP rank's zig-zag tokens.

Legend: T = tree tokens (padded, this CP rank's), N = image tokens of the micro-batch's images, H = hidden size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from forge_megatron.bridge.mapping import VISION
from forge_megatron.multimodal.families import VisionSpec, encode_images, mrope_angles


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

    def features(self, tower, device, key: str = "frozen", config=None) -> tuple[torch.Tensor, list]:
        """(merged features [N, H], DeepStack features) of the micro-batch's images by ``tower`` (a callable giving
        the module), computed without gradients on first use and kept under ``key``. With the model's ``config``
        the images are shared out over TP x CP (:func:`_encode`)."""
        tree = self.tree
        if key not in tree.features:
            if tree.num_images == 0:
                tree.features[key] = (None, [])
            else:
                merged, deepstack = _encode(tower(), tree, config, device)
                tree.features[key] = (merged.to(device), [d.to(device) for d in deepstack])
        return tree.features[key]

    def live_features(self, module, device, key: str, config=None) -> tuple[torch.Tensor | None, list]:
        """A trained tower's forward (with gradients) on the micro-batch's images for the forward in progress: the
        merged features joined to the DeepStack leaves' gradients, and the leaves (kept for the DeepStack hooks of
        this forward and of its recomputation)."""
        tree = self.tree
        if tree.num_images == 0:
            tree.live[key] = (None, [])
            return tree.live[key]
        merged, deepstack = _encode(module, tree, config, device, grad=True)
        leaves = [d.detach().to(device).requires_grad_() for d in deepstack]
        merged = _WithDeepStackGrads.apply(leaves, merged.to(device), *deepstack) if leaves else merged.to(device)
        tree.live[key] = (merged, leaves)
        return tree.live[key]


def deal_images(grid_thw: torch.Tensor, parts: int) -> list[list[int]]:
    """The images (by number) each of ``parts`` ranks encodes: the largest first to the rank with the fewest patches
    so far (ties to the lowest rank), each rank's in image order. The same on every rank."""
    patches = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).tolist()
    load, out = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        load[r] += patches[i]
        out[r].append(i)
    return [sorted(x) for x in out]


def _share_group() -> tuple:
    """(group, TP, CP): the ranks that share out a micro-batch's images, this rank's TP x CP group (they all run the
    same micro-batches); (None, 1, 1) when it is this rank alone or Megatron is not initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 1, 1
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    if tp * cp == 1:
        return None, 1, 1
    group = ps.get_tensor_model_parallel_group() if cp == 1 else ps.get_tensor_and_context_parallel_group()
    return group, tp, cp


def _checked(deepstack: list, spec) -> list:
    if deepstack and len(deepstack) < spec.deepstack_layers:
        raise ValueError(f"the vision tower gave {len(deepstack)} DeepStack features for {spec.deepstack_layers} "
                         "layers")
    return deepstack


def _encode(module, tree, config, device, grad: bool = False) -> tuple[torch.Tensor, list]:
    """(merged, DeepStack) features of all of the tree's images. Under TP and CP (given the model's ``config``) the
    images are dealt out to the TP x CP ranks (:func:`deal_images`): each rank encodes its share and the features are
    all-gathered (:class:`_GatherImages`), so the tower's work is divided by TP x CP rather than repeated on every
    rank."""
    group, tp, cp = _share_group() if config is not None else (None, 1, 1)
    if group is None:
        merged, deepstack = encode_images(module, tree.pixel_values, tree.grid_thw, grad=grad)
        return merged, _checked(deepstack, tree.spec)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hidden_size = config.hidden_size
    grid = tree.grid_thw
    tokens = [tree.spec.tokens_per_image(g) for g in grid.tolist()]
    patches = (grid[:, 0] * grid[:, 1] * grid[:, 2]).tolist()
    token_start = [0, *itertools.accumulate(tokens)]
    patch_start = [0, *itertools.accumulate(patches)]
    dealt = deal_images(grid, world)
    rows = [torch.tensor([j for i in mine for j in range(token_start[i], token_start[i] + tokens[i])],
                         dtype=torch.int64) for mine in dealt]
    width = hidden_size * (1 + tree.spec.deepstack_layers)
    mine = dealt[rank]
    param = next(module.parameters())
    if mine:
        pixels = torch.cat([tree.pixel_values[patch_start[i]:patch_start[i] + patches[i]] for i in mine])
        merged, deepstack = encode_images(module, pixels, grid[mine], grad=grad)
        local = torch.cat([merged, *_checked(deepstack, tree.spec)[:tree.spec.deepstack_layers]], dim=1)
    else:  # fewer images than ranks: this one only takes part in the gather
        local = torch.zeros(0, width, dtype=param.dtype, device=param.device,
                            requires_grad=grad and torch.is_grad_enabled())
    if local.shape[1] != width:
        raise ValueError(f"the vision tower gives features of width {local.shape[1]}, the language model expects "
                         f"{hidden_size} x {1 + tree.spec.deepstack_layers}")
    full = _GatherImages.apply(local.to(device), rows, sum(tokens), group, tp, cp,
                               bool(getattr(config, "sequence_parallel", False)))
    parts = full.split(hidden_size, dim=1)
    return parts[0], list(parts[1:])


class _GatherImages(torch.autograd.Function):
    """The features of all images [N, C] from each rank's own images' rows [n_r, C] (an all-gather over the TP x CP
    group; ``rows[r]``: where rank r's rows go).

    Backward: this rank's rows of the features' gradient, which the ranks hold in parts: under sequence parallelism
    or CP each rank back-propagates its own tokens' rows (summed over the group: the whole gradient, or TP times it
    without sequence parallelism, where the TP ranks hold the same rows); without either each TP rank holds all of
    it. Scaled to TP times this rank's images' gradient: the tower's parameters are marked
    ``average_gradients_across_tp_domain`` (:func:`attach_tower`), so Megatron's average over TP is the TP ranks' sum,
    and DDP combines the CP ranks' as it does the language model's (each CP rank's gradient a part of the whole)."""

    @staticmethod
    def forward(ctx, local, rows, total, group, tp, cp, sequence_parallel):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        most = max(r.numel() for r in rows)
        padded = local.new_zeros(most, local.shape[1])
        padded[:local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        full = local.new_empty(total, local.shape[1])
        for r, where in enumerate(rows):
            full[where.to(full.device)] = parts[r][:where.numel()]
        ctx.group, ctx.own, ctx.tp, ctx.cp, ctx.sp = group, rows[rank], tp, cp, sequence_parallel
        return full

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.tp
        if ctx.sp or ctx.cp > 1:  # every rank comes here: the features are always used (see install's _touch)
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            scale = ctx.tp if ctx.sp else 1
        return grad[ctx.own.to(grad.device)] * scale, None, None, None, None, None, None


class _WithDeepStackGrads(torch.autograd.Function):
    """The merged features, unchanged; in the backward the DeepStack features get the gradients their leaves
    gathered. The merged features enter the embeddings, before the DeepStack layers, so their gradient comes after
    all of the layers' (recomputed ones included): the tower is then back-propagated once, with all of its outputs'
    gradients."""

    @staticmethod
    def forward(ctx, leaves, merged, *deepstack):
        ctx.leaves = leaves
        return merged.clone()

    @staticmethod
    def backward(ctx, grad):
        grads = []
        for leaf in ctx.leaves:
            grads.append(leaf.grad)  # None when no image row of this rank's tokens took it
            leaf.grad = None
        return (None, grad, *grads)


def _touch(module) -> torch.Tensor:
    """0, depending on every trained parameter of ``module``: each training forward gives each of them a gradient
    (zeros where no image of this rank's tokens reached it: a micro-batch without images, or an SP rank without image
    rows), as Megatron's DDP expects of every parameter it reduces (with --overlap-grad-reduce it starts a bucket's
    reduction once all of its parameters have one, as many as in the first step)."""
    return sum(p.view(-1)[0] for p in module.parameters() if p.requires_grad) * 0.0


def trainable_matches(names: list[str], patterns: str) -> set[str]:
    """The tower parameter names (as in the checkpoint, after ``model.visual.``) that ``patterns`` (comma-separated
    shell globs, e.g. ``merger.*,deepstack_merger_list.*``) select; ValueError naming a glob that selects none."""
    import fnmatch

    chosen = set()
    for glob in filter(None, (g.strip() for g in patterns.split(","))):
        hits = fnmatch.filter(names, glob)
        if not hits:
            raise ValueError(f"--vision-trainable {glob!r} matches none of the vision tower's parameters (e.g. "
                             f"{', '.join(names[:4])}, ...; names as in the checkpoint after model.visual.)")
        chosen.update(hits)
    if not chosen:
        raise ValueError(f"--vision-trainable {patterns!r} names no parameters")
    return chosen


def attach_tower(model, hf_config, recompute: bool = False, trainable: str = "*") -> None:
    """Make the checkpoint's vision tower a trainable submodule ``vision_tower`` of ``model`` (the first model
    piece, before DDP wraps it), in the model's dtype and device; its weights are loaded through the bridge with the
    language model's (``Bridge(vision_tower=True)``). Under TP each rank encodes its share of the images
    (:class:`_GatherImages`): its parameters are marked for Megatron's average of their gradients over TP.
    ``recompute``: its blocks keep only their inputs for the backward and run again there (transformers' activation
    checkpointing, non-reentrant), for micro-batches of many or large images. ``trainable``: the parameters that
    train (:func:`trainable_matches`; the others stay the checkpoint's: no gradients, no optimizer state)."""
    from forge_megatron.multimodal.families import build_vision_tower

    if not model.pre_process:
        raise ValueError("the vision tower goes on the first model piece (pre_process)")
    param = next(model.parameters())
    tower = build_vision_tower(hf_config, dtype=param.dtype, device=param.device)
    names = [n for n, _ in tower.named_parameters()]
    chosen = trainable_matches(names, trainable)
    for name, p in tower.named_parameters():
        p.requires_grad_(name in chosen)
        p.average_gradients_across_tp_domain = True
        p.is_vision_tower = True  # (--vision-lr: its own parameter group)
    if recompute:
        tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.add_module(TOWER, tower)


TOWER = VISION[:-1]  # the submodule's name: its parameters are the bridge's vision_tower.* names


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


def install(model, spec: VisionSpec, tower=None, key: str = "frozen", trained: bool = False) -> list:
    """Make a tree GPTModel stage (``build_tree_gpt``) take images (see the module docstring); ``tower``: a callable
    returning the frozen vision tower (called on the first micro-batch with images), its features kept under ``key``
    (towers that differ need keys that differ). ``trained``: the model pieces of this rank hold a trained tower
    (:func:`attach_tower`): the first piece's is run with gradients in each training forward; the other pieces need
    none (the DeepStack layers must be on the first). Returns the hook handles."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if spec.mrope_section is not None:  # 1-D positions (Gemma, Mistral 3 / Small 4) need nothing of the model's RoPE
        if getattr(model.config, "multi_latent_attention", False):
            raise ValueError("images with mRoPE positions and multi-latent attention are not supported")
        if rotary is None:
            raise ValueError("images need a model with rotary position embeddings (mRoPE)")
    decoder = model.decoder
    config = model.config
    if trained:
        own = getattr(model, TOWER, None)
        deep = [layer.layer_number for layer in decoder.layers if layer.layer_number - 1 < spec.deepstack_layers]
        if own is None and deep:
            raise ValueError(f"DeepStack layers {deep} are not on the first model piece, which holds the trained "
                             "vision tower: give the first pipeline stage (and its first virtual chunk) at least "
                             f"{spec.deepstack_layers} layers")
        if own is not None:
            tower = lambda: own  # noqa: E731 - the submodule, found again at each call

    def before_decoder(module, args, kwargs):
        vision = getattr(kwargs.get("packed_seq_params"), "vision", None)
        hidden = kwargs.get("hidden_states")
        if hidden is not None and hasattr(hidden, "unwrap"):
            hidden = hidden.unwrap()
        live = trained and module.pre_process and hidden is not None and torch.is_grad_enabled()
        if vision is None:
            if not live:
                return None
            # a micro-batch without images still gives the trained tower its (zero) gradients
            kwargs["hidden_states"] = hidden + _touch(tower()).to(hidden.dtype)
            return args, kwargs
        if kwargs.get("rotary_pos_emb") is not None and spec.mrope_section is not None:  # (Gemma 3: 1-D positions)
            kwargs["rotary_pos_emb"] = mrope_angles(rotary, vision.positions_T3, spec)
        if module.pre_process and hidden is not None:
            vision.tree.live.pop(key, None)
            if live:  # a training forward: the tower's too
                own = tower()
                merged, _ = vision.live_features(own, hidden.device, key, config)
                # the features always take part in the loss (zero when no image row is this rank's): under
                # sequence parallelism or CP their gather's backward is a collective every rank must reach
                used = merged.sum() * 0.0 if merged is not None else 0.0
                hidden = hidden + (_touch(own) + used).to(hidden.dtype)
            else:
                merged, _ = vision.features(tower, hidden.device, key, config)
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
        live = vision.tree.live.get(key)  # this forward's trained tower's (its leaves), or the kept features
        _, stack = live if live is not None else vision.features(tower, hidden.device, key, config)
        if not stack:
            return None
        rows = _local_rows(vision.rows_T, config, hidden.shape[0])
        return _put(hidden, rows, stack[module.layer_number - 1], add=True), context

    for layer in decoder.layers:
        if layer.layer_number - 1 < spec.deepstack_layers:  # global layer numbers (1-based)
            handles.append(layer.register_forward_hook(deepstack, with_kwargs=True))
    return handles
