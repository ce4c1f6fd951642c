"""Per-sample log-probabilities from one tree-packed forward of a Megatron GPTModel (TP and PP aware).

Every sample is a root-to-node path of the prefix forest, so the logits row of tree token i predicts the next
token of every sample passing through i. With ``(pred_nodes_M, targets_M) = layout.next_token_index()``:

    logp_m    = z[pred_m, y_m] - lse(pred_m),          lse(t) = log sum_v exp z[t, v]
    entropy_m = lse(pred_m) - sum_v p[pred_m, v] z[pred_m, v]

At a branch point one row is scored against several targets: only the scalars z[pred_m, y_m] are gathered,
never an M x V matrix, and autograd sums the gradient of a shared row over the samples that use it, which is
why merged training equals unmerged training. The vocabulary-parallel math (TP slices of z, chunked rows, an
explicit backward that keeps no rows x vocabulary tensor alive) is in ``forge_megatron.mcore.logprobs``.

``make_tree_forward_step`` wraps this for Megatron's pipeline schedules; ``sample_logprobs_unmerged`` runs
each sample alone through a causal model: the oracle the tree path is tested against.

Legend: T = tree tokens, V = vocabulary slice on this TP rank, M = next-token targets of all samples,
L = length of one sample, S = samples.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from forge_megatron.mcore import routing_replay
from forge_megatron.mcore.context_parallel import seq_multiple
from forge_megatron.mcore.logprobs import (  # noqa: F401 (check_targets re-exported)
    check_targets,
    linear_vocab_parallel_logprobs,
    vocab_parallel_logprobs,
)
from forge_megatron.mcore.model import causal_mask
from forge_megatron.mcore.tree_attention import tree_packed_seq_params


# -------------------------------------------------------------------------------------------- tree forward
def tree_model_inputs(layout, backend: str | None = None, device=None, multiple: int | None = None) -> dict:
    """Keyword arguments for ``GPTModel.forward`` on one tree-packed micro-batch (batch of 1, T tokens).

    The tree is padded with single-token roots to a multiple of ``multiple`` (default
    ``context_parallel.default_multiple``, 1 without CP; with sequence parallelism times TP, see
    ``context_parallel.seq_multiple``); under context parallelism the tokens are this CP rank's zig-zag chunks of
    it (forge_megatron.mcore.context_parallel)."""
    from forge_megatron.mcore.context_parallel import cp_world, default_multiple, pad_zeros, take_shard

    params = tree_packed_seq_params(layout, backend=backend, device=device, multiple=multiple)
    tokens_T = layout.tokens.to(device)
    cp, rank, _ = cp_world()
    multiple = multiple or default_multiple(cp)
    if multiple > 1:
        tokens_T = take_shard(pad_zeros(tokens_T, multiple), cp, rank, multiple)
    return dict(
        input_ids=tokens_T[None],
        position_ids=params.position_ids[None],
        attention_mask=None,
        packed_seq_params=params,
    )


def logprobs_from_logits(logits_1TV: torch.Tensor, layout, with_entropy: bool = False,
                         inplace_backward: bool = False, output_weight: torch.Tensor | None = None,
                         head_dtype: torch.dtype | None = None, multiple: int | None = None,
                         temperature: float = 1.0, softcap: float | None = None,
                         extra_targets: tuple[torch.Tensor, torch.Tensor] | None = None):
    """GPTModel's last-stage output [1, T, V] -> (logp_M, entropy_M | None) in next_token_index() order, scored
    under softmax(logits / ``temperature``) (mcore/logprobs.py; 1: the model's own distribution).

    With ``output_weight`` (see :func:`output_layer_deferred`) the output is the output layer's input [1, T, H]
    instead, and the logits are made chunk by chunk inside the loss (``linear_vocab_parallel_logprobs``), their
    matmul in ``head_dtype`` if given (``torch.float32``: an fp32 LM head) and else in the weight's dtype, and
    soft-capped to ``softcap`` * tanh(logits / ``softcap``) when given (the output layer's ``logit_softcap``, which
    :func:`output_layer_deferred` yields in ``captured["softcap"]``; Megatron's own output layer caps its logits).

    Under context parallelism the output holds this CP rank's rows of the padded tree (its zig-zag chunks): it
    scores the targets predicted from its rows, and the partial vectors are summed over the CP group (identity backward),
    so every CP rank returns the same full logp_M and gradients reach only its own rows. ``multiple``: the padding
    multiple the inputs were built with (:func:`tree_model_inputs`); padding rows are never scored.

    ``extra_targets`` (index_X into the targets, ids_XK): also the logprobs of the tokens ``ids_XK`` at the rows that
    predict targets ``index_X`` (a distillation teacher's top-k, ``--distill-kl forward|reverse|jsd``), scored in the
    same pass over the logits (more targets of the same rows cost a gather) and returned as a third output logp_XK."""
    pred_nodes_M, targets_M, _ = layout.next_token_index()
    if extra_targets is None:
        return _score_targets(logits_1TV, layout, pred_nodes_M, targets_M, with_entropy, inplace_backward,
                              output_weight, head_dtype, multiple, temperature, softcap)
    index_X, ids_XK = extra_targets
    M, (X, K) = targets_M.numel(), ids_XK.shape
    index_X = index_X.to(pred_nodes_M.device)
    nodes = torch.cat([pred_nodes_M, pred_nodes_M[index_X].repeat_interleave(K)])
    targets = torch.cat([targets_M, ids_XK.to(targets_M.device).reshape(-1)])
    logp, entropy = _score_targets(logits_1TV, layout, nodes, targets, with_entropy, inplace_backward, output_weight,
                                   head_dtype, multiple, temperature, softcap)
    return logp[:M], None if entropy is None else entropy[:M], logp[M:].reshape(X, K)


def _local_rows(layout, nodes_M: torch.Tensor, rows_here: int, multiple: int | None):
    """Under context parallelism: the local row of each tree position ``nodes_M`` (-1 where another CP rank holds
    it); ``rows_here`` checks the output's row count. (None, None) without CP."""
    from forge_megatron.mcore.context_parallel import cp_world, shard_positions

    cp, rank, _ = cp_world()
    if cp == 1:
        return None, None
    T = layout.tokens.numel()
    positions = shard_positions(T, cp, rank, multiple)
    if rows_here != positions.numel():
        raise ValueError(f"CP rank {rank} expects outputs for its {positions.numel()} tokens, got {rows_here} rows")
    device = nodes_M.device
    row_of = torch.full((positions.numel() * cp,), -1, dtype=torch.long, device=device)  # the padded tree
    row_of[positions.to(device)] = torch.arange(positions.numel(), device=device)  # position -> local row (or -1)
    rows_M = row_of[nodes_M]
    return rows_M, rows_M >= 0


def _score_targets(logits_1TV, layout, pred_nodes_M, targets_M, with_entropy, inplace_backward, output_weight,
                   head_dtype, multiple, temperature, softcap):
    def score(out_TX, rows_M, targets_M):
        if output_weight is not None:
            return linear_vocab_parallel_logprobs(out_TX, output_weight, rows_M, targets_M, with_entropy,
                                                  compute_dtype=head_dtype, temperature=temperature,
                                                  softcap=softcap)
        return vocab_parallel_logprobs(out_TX, rows_M, targets_M, with_entropy, inplace_backward=inplace_backward,
                                       temperature=temperature)

    if softcap is not None and output_weight is None:
        raise ValueError("softcap is for the fused output layer (output_weight): Megatron's own output layer caps "
                         "the logits it makes (model.cap_logits)")
    if head_dtype is not None and output_weight is None:
        raise ValueError("an LM head dtype needs the fused output layer (output_weight): Megatron's own output layer "
                         "computes in the weight's dtype")
    rows_M, local_M = _local_rows(layout, pred_nodes_M, logits_1TV.shape[1], multiple)
    if rows_M is None:
        return score(logits_1TV[0], pred_nodes_M, targets_M)
    logp_m, entropy_m = score(logits_1TV[0], rows_M[local_M], targets_M[local_M])
    return _over_cp(local_M, logp_m), _over_cp(local_M, entropy_m) if with_entropy else None


def _over_cp(local_M: torch.Tensor, x_m: torch.Tensor) -> torch.Tensor:
    """This CP rank's answers ``x_m`` for the targets it holds (``local_M``) as a tensor over every target, summed
    over the CP group (each target lives on one rank; identity backward)."""
    from forge_megatron.mcore.context_parallel import sum_over_cp

    local_M = local_M.to(x_m.device)
    out = x_m.new_zeros((local_M.numel(), *x_m.shape[1:]))
    out[local_M] = x_m
    return sum_over_cp(out)


def topk_from_output(output_1TX: torch.Tensor, layout, k: int, output_weight: torch.Tensor | None = None,
                     head_dtype: torch.dtype | None = None, multiple: int | None = None, temperature: float = 1.0,
                     softcap: float | None = None, vocab_limit: int | None = None):
    """A frozen model's logprobs of the targets and its ``k`` most likely next tokens at each of their rows, in one
    pass over the logits: (logp_M, ids_MK, logp_MK) in ``layout.next_token_index()`` order, forward only
    (``mcore.logprobs.vocab_parallel_topk``). The output is the logits, or the output layer's input with
    ``output_weight`` (fused), as in :func:`logprobs_from_logits`, which also defines ``multiple``, ``temperature``
    and ``softcap``; ``vocab_limit``: only ids below it are candidates. Under context parallelism each CP rank
    answers the targets predicted from the rows it holds, and the answers are summed over the CP group."""
    from forge_megatron.mcore.logprobs import vocab_parallel_topk

    pred_nodes_M, targets_M, _ = layout.next_token_index()
    if output_weight is None and (softcap is not None or head_dtype is not None):
        raise ValueError("softcap and an LM head dtype are for the fused output layer (output_weight)")
    src = ({"hidden_TH": output_1TX[0], "weight_VH": output_weight, "compute_dtype": head_dtype}
           if output_weight is not None else {"logits_TV": output_1TX[0]})
    opts = {"temperature": temperature, "softcap": softcap, "vocab_limit": vocab_limit, **src}
    rows_M, local_M = _local_rows(layout, pred_nodes_M, output_1TX.shape[1], multiple)
    if rows_M is None:
        ids_MK, logp_MK, logp_M = vocab_parallel_topk(pred_nodes_M, k, targets_U=targets_M, **opts)
        return logp_M, ids_MK, logp_MK
    ids_mk, logp_mk, logp_m = vocab_parallel_topk(rows_M[local_M], k, targets_U=targets_M[local_M], **opts)
    return tuple(_over_cp(local_M, x) for x in (logp_m, ids_mk, logp_mk))


def _gpt_output_layer(model):
    """The ColumnParallelLinear output layer under Megatron's wrappers (DDP, Float16Module); None off the last
    pipeline stage, where GPTModel has none."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "output_layer", None)


@contextmanager
def output_layer_deferred(model, enabled: bool = True):
    """While active, the model's output layer hands back its input instead of the logits, and the weight it would
    have used (its own, or the embedding's when they are tied) is yielded in ``captured["weight"]``, and its logit
    soft-cap (``model.cap_logits``; None without) in ``captured["softcap"]``, for ``logprobs_from_logits(...,
    output_weight=..., softcap=...)`` to fuse the output layer into the loss. GPTModel then returns
    the final hidden states [1, T, H] (transposed and, under Float16Module, upcast exactly as it would the logits).
    Yields None (and changes nothing) when disabled or off the last pipeline stage."""
    layer = _gpt_output_layer(model) if enabled else None
    if layer is None:
        yield None
        return
    captured = {"softcap": getattr(layer, "logit_softcap", None)}

    def forward(input_, weight=None, runtime_gather_output=None):
        if (runtime_gather_output or layer.bias is not None
                or getattr(getattr(layer, "config", None), "mtp_num_layers", None)):
            raise ValueError("the fused output layer needs a bias-free output layer whose logits stay "
                             "vocabulary-parallel, and no multi-token prediction (run without fused logprobs)")
        captured["weight"] = weight if weight is not None else layer.weight
        if getattr(layer, "sequence_parallel", False):
            # all-gather the TP ranks' token slices, as the layer itself would. The backward only takes this rank's
            # slice: the fused logprobs already sum the vocabulary slices' partial gradients over TP (an all-reduce
            # where the layer reduce-scatters; one [T, hidden] tensor per micro-batch)
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False)
        return input_, None

    layer.forward = forward  # an instance attribute shadows the class's forward; removed again below
    layer.deferred = True  # (and the soft-cap hook leaves the hidden states alone)
    try:
        yield captured
    finally:
        del layer.forward
        layer.deferred = False


def _captured_head(captured: dict | None) -> dict:
    """``logprobs_from_logits``' output_weight / softcap from :func:`output_layer_deferred`'s ``captured``."""
    if captured is None:
        return {}
    if "weight" not in captured:
        raise RuntimeError("the model's forward did not go through its output layer; cannot fuse it into the loss")
    return {"output_weight": captured["weight"], "softcap": captured["softcap"]}


def tree_logprobs(model, layout, with_entropy: bool = False, backend: str | None = None,
                  fused_output: bool = True, head_dtype: torch.dtype | None = None, temperature: float = 1.0):
    """Run a tree-packed micro-batch through a (single-stage) tree GPTModel; per-sample logprobs, differentiable.

    ``model`` is built with ``build_tree_gpt`` (tree layer spec + depth RoPE). Returns (logp_M, entropy_M | None)
    aligned with ``layout.next_token_index()``. ``fused_output`` fuses the output layer into the logprobs
    (:func:`output_layer_deferred`): same values, no [T, vocabulary] logits; ``head_dtype`` (fused only) runs its
    matmul in that dtype (``torch.float32``: an fp32 LM head).
    """
    device = next(model.parameters()).device
    multiple = seq_multiple(model.config)
    with output_layer_deferred(model, fused_output) as captured:
        out_1TX = model(**tree_model_inputs(layout, backend=backend, device=device, multiple=multiple))
    return logprobs_from_logits(out_1TX, layout, with_entropy, head_dtype=head_dtype, multiple=multiple,
                                temperature=temperature, **_captured_head(captured))


def score_head(model):
    """A reward model's score head (``GPTConfig.score_head``) under Megatron's wrappers; None off the last stage."""
    while not hasattr(model, "score_head") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "score_head", None)


def scores_from_hidden(hidden_1TH: torch.Tensor, layout, head) -> torch.Tensor:
    """[S, labels] scores of a tree's samples: ``head`` on the final hidden state of each sample's last token (where
    transformers' sequence classifiers and SGLang's /classify read them)."""
    from forge_megatron.mcore.context_parallel import cp_world

    if cp_world()[0] > 1:
        raise ValueError("reward models are not trained under context parallelism (a sample's last token lives on "
                         "one CP rank)")
    last_S = layout.sample_nodes[layout.sample_offsets[1:] - 1].to(hidden_1TH.device)
    return head(hidden_1TH[0, last_S].to(head.weight.dtype))


def values_from_hidden(hidden_1TH: torch.Tensor, layout, head, multiple: int | None = None) -> torch.Tensor:
    """A value model's fp32 values V_M: ``head`` (one label) on the final hidden state of every position that predicts
    a target, in ``layout.next_token_index()`` order (where the policy's logprob of that target is read: the state the
    action is taken in). Under context parallelism each CP rank answers the positions it holds and the answers are
    summed over the CP group (identity backward), as :func:`logprobs_from_logits` does."""
    pred_nodes_M, _, _ = layout.next_token_index()
    pred_nodes_M = pred_nodes_M.to(hidden_1TH.device)
    rows_M, local_M = _local_rows(layout, pred_nodes_M, hidden_1TH.shape[1], multiple)
    rows = pred_nodes_M if rows_M is None else rows_M[local_M]
    v = head(hidden_1TH[0, rows].to(head.weight.dtype))[:, 0].float()
    return v if rows_M is None else _over_cp(local_M, v)


def tree_scores(model, layout, backend: str | None = None) -> torch.Tensor:
    """A reward model's [S, labels] scores of a tree-packed micro-batch (one forward of a single-stage tree
    GPTModel; its output layer is never run)."""
    device = next(model.parameters()).device
    multiple = seq_multiple(model.config)
    with output_layer_deferred(model) as captured:
        hidden_1TH = model(**tree_model_inputs(layout, backend=backend, device=device, multiple=multiple))
    head = score_head(model)
    if captured is None or head is None:
        raise ValueError("not a reward model's last stage (no score head)")
    return scores_from_hidden(hidden_1TH, layout, head)


def sample_logprobs_unmerged(model, samples, with_entropy: bool = False):
    """The oracle: each sample alone through a causal GPTModel (standard spec); logp concatenated like logp_M."""
    device = next(model.parameters()).device
    logps, entropies = [], []
    for tokens in samples:
        tokens_L = torch.as_tensor(tokens, dtype=torch.int64, device=device)
        L = tokens_L.numel()
        logits_1LV = model(tokens_L[None], torch.arange(L, device=device)[None], causal_mask(L, device=device))
        logp, entropy = vocab_parallel_logprobs(logits_1LV[0], torch.arange(L - 1, device=device), tokens_L[1:],
                                                with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


# ------------------------------------------------------------------------------------- pipeline schedules
@dataclass
class TreeMicroBatch:
    """One micro-batch for :func:`make_tree_forward_step`: a layout plus whatever per-sample data the loss needs."""

    layout: object
    extras: dict = field(default_factory=dict)
    fixed_length: bool = False
    """Every micro-batch of the step has this layout's length (padded): needed under PP without variable lengths."""
    pad_tokens: int = 0
    """Padding roots at the end of ``layout`` (not real tokens: left out of the token metrics)."""
    routing: torch.Tensor | None = None
    """int16 [T, layers, topk] experts recorded by the rollout engine for the tree tokens (-1: route them here);
    replayed by the routers that ``routing_replay.install`` prepared (mcore/routing_replay.py)."""
    routing_stats: dict = field(default_factory=dict)
    """``tree_routing``'s counts: tree tokens shared by recorded samples, and those whose samples' rows disagree."""


LossFn = Callable[[torch.Tensor, "torch.Tensor | None", TreeMicroBatch], tuple]


def _stage_forward(model, micro_batch: TreeMicroBatch, backend: str | None = None, fused_output: bool = True):
    """This pipeline stage's forward of one tree micro-batch for Megatron's schedules, the output layer deferred
    (:func:`output_layer_deferred`) when ``fused_output``; (output, captured head, padding multiple)."""
    if not isinstance(micro_batch, TreeMicroBatch):
        raise TypeError(f"tree forward step expects TreeMicroBatch items, got {type(micro_batch).__name__}")
    config = model.config  # GPTModel and Megatron's wrappers (DDP, Float16Module) all carry it
    if config.pipeline_model_parallel_size > 1 and not config.variable_seq_lengths and not micro_batch.fixed_length:
        raise ValueError("tree micro-batches vary in length: build the model with variable_seq_lengths=True under "
                         "PP, or pad every micro-batch of the step to one length (TreeMicroBatch.fixed_length)")
    device = next(model.parameters()).device
    multiple = seq_multiple(config)
    routing_replay.set_micro_batch(model, micro_batch.routing, micro_batch.layout.unique_tokens, multiple)
    with output_layer_deferred(model, fused_output) as captured:
        output = model(**tree_model_inputs(micro_batch.layout, backend=backend, device=device, multiple=multiple))
    routing_replay.after_forward(model)
    return output, captured, multiple


def make_tree_forward_step(loss_fn: LossFn, with_entropy: bool = False, backend: str | None = None,
                           fused_output: bool = True, head_dtype: torch.dtype | None = None,
                           temperature: float = 1.0, topk_key: str | None = None):
    """A ``forward_step_func(data_iterator, model)`` for ``megatron.core.pipeline_parallel.get_forward_backward_func``.

    The iterator yields :class:`TreeMicroBatch`. On the last pipeline stage the returned loss function maps
    the model's output to ``loss_fn(logp_M, entropy_M, micro_batch) -> (loss, metrics)``; Megatron then divides
    ``loss`` by the number of micro-batches. Stages exchange [T, 1, hidden] with T varying per micro-batch,
    so under PP the model's config needs ``variable_seq_lengths=True``. ``fused_output`` (default) fuses the
    output layer into the logprobs, so no [T, vocabulary] logits exist at any time; without it the logits are
    scored chunk by chunk and dL/dlogits is written over them. ``head_dtype`` (fused only): the dtype of the
    output layer's matmul (``torch.float32``: an fp32 LM head); default the weight's. ``temperature``: tokens are
    scored under softmax(logits / temperature), the rollout temperature (``--rollout-temperature``).

    ``topk_key``: the micro-batches' extras hold a teacher's top-k token ids under this key ([X, K], at the targets
    ``extras["distill_index_X"]``): the student's logprobs of those tokens are scored in the same pass and given to
    ``loss_fn`` as the keyword ``topk_logp_XK`` (``--distill-kl forward|reverse|jsd``).
    """

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        output, captured, multiple = _stage_forward(model, micro_batch, backend, fused_output)
        head = _captured_head(captured)

        def loss_func(output_1TX):
            # Unfused, the logits are read by nothing after the loss: the backward may write dL/dlogits over them.
            extra = None if topk_key is None else (micro_batch.extras["distill_index_X"],
                                                   micro_batch.extras[topk_key])
            out = logprobs_from_logits(output_1TX, micro_batch.layout, with_entropy, inplace_backward=True,
                                       head_dtype=head_dtype, multiple=multiple, temperature=temperature,
                                       extra_targets=extra, **head)
            if extra is None:
                return loss_fn(*out, micro_batch)
            return loss_fn(out[0], out[1], micro_batch, topk_logp_XK=out[2])

        return output, loss_func

    return forward_step


def make_tree_teacher_step(keep, k: int, vocab_limit: int | None = None, backend: str | None = None,
                           fused_output: bool = True, head_dtype: torch.dtype | None = None,
                           temperature: float = 1.0):
    """A forward-only ``forward_step_func`` for a frozen distillation teacher: on the last pipeline stage the loss
    function calls ``keep(logp_M, index_X, ids_XK, logp_XK, micro_batch) -> (loss, metrics)`` with the teacher's
    logprobs of the sampled tokens, the trained targets ``index_X`` (``extras["loss_mask_M"]``) and the teacher's
    ``k`` most likely tokens there with their logprobs, all from one pass over its logits (:func:`topk_from_output`;
    ``vocab_limit``: candidate ids below it). Options as :func:`make_tree_forward_step`'s."""

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        output, captured, multiple = _stage_forward(model, micro_batch, backend, fused_output)
        head = _captured_head(captured)

        def loss_func(output_1TX):
            logp_M, ids_MK, logp_MK = topk_from_output(
                output_1TX, micro_batch.layout, k, output_weight=head.get("output_weight"), head_dtype=head_dtype,
                multiple=multiple, temperature=temperature, softcap=head.get("softcap"), vocab_limit=vocab_limit)
            index_X = torch.nonzero(micro_batch.extras["loss_mask_M"]).flatten().to(logp_M.device)
            return keep(logp_M, index_X, ids_MK[index_X], logp_MK[index_X], micro_batch)

        return output, loss_func

    return forward_step


def _score_head_step(read, what: str, backend: str | None = None):
    """A ``forward_step_func`` whose last stage hands its final hidden states to ``read(hidden_1TH, micro_batch,
    head, padding multiple) -> (loss, metrics)``, ``head`` the model's score head; the output layer is never run."""

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        output, captured, multiple = _stage_forward(model, micro_batch, backend)
        head = score_head(model) if captured is not None else None

        def loss_func(hidden_1TH):
            if head is None:
                raise ValueError(f"the last pipeline stage has no score head: not a {what}")
            return read(hidden_1TH, micro_batch, head, multiple)

        return output, loss_func

    return forward_step


def make_score_forward_step(loss_fn, backend: str | None = None):
    """A reward model's ``forward_step_func`` for Megatron's schedules: on the last stage the loss function maps the
    final hidden states to ``loss_fn(scores_S, micro_batch) -> (loss, metrics)`` with ``scores_S`` the first label's
    score of every sample (:func:`scores_from_hidden`). The output layer is never run."""
    return _score_head_step(lambda hidden, mb, head, _: loss_fn(scores_from_hidden(hidden, mb.layout, head)[:, 0], mb),
                            "reward model", backend)


def make_value_forward_step(loss_fn, backend: str | None = None):
    """A value model's ``forward_step_func`` for Megatron's schedules (the critic of ``--critic``): on the last stage
    the loss function maps the final hidden states to ``loss_fn(values_M, micro_batch) -> (loss, metrics)``
    (:func:`values_from_hidden`). The output layer is never run."""
    return _score_head_step(lambda hidden, mb, head, multiple: loss_fn(
        values_from_hidden(hidden, mb.layout, head, multiple), mb), "value model", backend)
