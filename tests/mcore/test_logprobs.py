"""Chunked vocab-parallel logprobs/entropy (forge_megatron.mcore.logprobs) against plain autograd over log_softmax.

Values and gradients (through both outputs, rows scored several times, rows scored never), every chunking,
fp32 and bf16 logits, in-place backward, TP = 2 over gloo against the full vocabulary, and what the op keeps
alive for the backward (the point of it) next to what the plain formulation keeps.
"""

from __future__ import annotations

import pytest
import torch

from forge_megatron.mcore.logprobs import vocab_parallel_logprobs
from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed

T, V = 13, 50


def _case(seed: int, dtype=torch.float32, all_rows: bool = False, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    logits_TV = (torch.randn(T, vocab, generator=g) * 3).to(dtype)
    if all_rows:
        rows_M = torch.cat([torch.arange(T), torch.randint(0, T, (7,), generator=g)])
    else:  # rows 0 and 5 never scored, row 3 scored four times (a branch point)
        rows_M = torch.tensor([1, 2, 3, 3, 3, 3, 4, 6, 7, 8, 9, 10, 11, 12, 12])
    targets_M = torch.randint(0, vocab, rows_M.shape, generator=g)
    targets_M[2:4] = targets_M[4]  # two targets on one row equal: their one-hot terms add up
    grad_logp_M = torch.randn(rows_M.shape, generator=g)
    grad_ent_M = torch.randn(rows_M.shape, generator=g)
    return logits_TV, rows_M, targets_M, grad_logp_M, grad_ent_M


def _scores(z, temperature=1.0, softcap=None):
    """The reference scores: soft-capped (Gemma's final logits) then tempered."""
    return (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature


def _reference(logits_TV, rows_M, targets_M, grad_logp_M, grad_ent_M, with_entropy, temperature=1.0, softcap=None):
    z = logits_TV.detach().float().requires_grad_(True)
    logsm = _scores(z, temperature, softcap).log_softmax(-1)
    logp = logsm[rows_M, targets_M]
    loss = (logp * grad_logp_M).sum()
    ent = None
    if with_entropy:
        ent = -(logsm.exp() * logsm).sum(-1)[rows_M]
        loss = loss + (ent * grad_ent_M).sum()
    loss.backward()
    return logp.detach(), (ent.detach() if with_entropy else None), z.grad


def _fused(logits_TV, rows_M, targets_M, grad_logp_M, grad_ent_M, with_entropy, **kw):
    z = logits_TV.detach().clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs(z, rows_M, targets_M, with_entropy=with_entropy, **kw)
    loss = (logp * grad_logp_M).sum() + ((ent * grad_ent_M).sum() if with_entropy else 0)
    loss.backward()
    return logp.detach(), (ent.detach() if with_entropy else None), z.grad, z


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 4, 13, 100, None])
@pytest.mark.parametrize("all_rows", [False, True])
def test_values_and_gradients_match_log_softmax(with_entropy, chunk_rows, all_rows):
    case = _case(0, all_rows=all_rows)
    ref_logp, ref_ent, ref_grad = _reference(*case, with_entropy)
    logp, ent, grad, _ = _fused(*case, with_entropy, chunk_rows=chunk_rows)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=2e-6)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-6)
    if not all_rows:  # rows 0 and 5 score nothing: exactly no gradient
        assert grad[0].abs().max() == 0 and grad[5].abs().max() == 0
        assert grad[3].abs().max() > 0


@pytest.mark.parametrize("all_rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_writes_the_same_gradient_into_the_logits(all_rows, dtype):
    case = _case(1, dtype=dtype, all_rows=all_rows)
    logits_TV, rows_M, targets_M, grad_logp_M, grad_ent_M = case
    _, _, grad, _ = _fused(*case, True, chunk_rows=3)
    leaf = logits_TV.clone().requires_grad_(True)
    z = leaf * 1  # logits as the model hands them over: a non-leaf whose buffer nothing else needs
    logp, ent = vocab_parallel_logprobs(z, rows_M, targets_M, with_entropy=True, chunk_rows=3, inplace_backward=True)
    ((logp * grad_logp_M).sum() + (ent * grad_ent_M).sum()).backward()
    grad_inplace = leaf.grad
    assert grad_inplace.dtype == dtype
    torch.testing.assert_close(grad_inplace, grad, rtol=0, atol=0)
    torch.testing.assert_close(z.detach(), grad, rtol=0, atol=0)  # written over the logits, not beside them
    # bf16 logits: the math runs in fp32 on the upcast values, so it matches the fp32 reference on those values.
    ref_logp, _, ref_grad = _reference(*case, True)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-6)
    tol = 2e-6 if dtype == torch.float32 else 2 ** -8 * ref_grad.abs().max().item()
    torch.testing.assert_close(grad_inplace.float(), ref_grad, rtol=0, atol=tol)


@pytest.mark.parametrize("temperature", [0.6, 1.4])
@pytest.mark.parametrize("inplace", [False, True])
def test_temperature_scores_the_tempered_distribution(temperature, inplace):
    """--rollout-temperature: logp and entropy of softmax(z / T), and the gradient with respect to the raw logits,
    as autograd through the division gives them (plainly different from T = 1)."""
    case = _case(6)
    ref_logp, ref_ent, ref_grad = _reference(*case, True, temperature)
    leaf = case[0].clone().requires_grad_(True)
    z = leaf * 1
    logp, ent = vocab_parallel_logprobs(z, *case[1:3], with_entropy=True, chunk_rows=4, inplace_backward=inplace,
                                        temperature=temperature)
    ((logp * case[3]).sum() + (ent * case[4]).sum()).backward()
    torch.testing.assert_close(logp.detach(), ref_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.detach(), ref_ent, rtol=0, atol=2e-6)
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=0, atol=2e-6)
    untempered = _reference(*case, True)[0]
    assert (logp.detach() - untempered).abs().max() > 0.1
    with pytest.raises(ValueError, match="temperature must be in \\(0, 2\\]"):
        vocab_parallel_logprobs(case[0], *case[1:3], temperature=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("inplace", [False, True])
def test_softcap_scores_the_capped_logits(temperature, inplace):
    """Final-logit soft-capping (Gemma 4): logp and entropy of softmax(c tanh(z / c) / T), the gradient with respect
    to the raw logits as autograd through tanh gives it; logits of scale ~10 against c = 5, so the cap bites."""
    case = _case(9)
    case = (case[0] * 3,) + case[1:]
    ref_logp, ref_ent, ref_grad = _reference(*case, True, temperature, softcap=5.0)
    leaf = case[0].clone().requires_grad_(True)
    z = leaf * 1
    logp, ent = vocab_parallel_logprobs(z, *case[1:3], with_entropy=True, chunk_rows=4, inplace_backward=inplace,
                                        temperature=temperature, softcap=5.0)
    ((logp * case[3]).sum() + (ent * case[4]).sum()).backward()
    torch.testing.assert_close(logp.detach(), ref_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.detach(), ref_ent, rtol=0, atol=2e-6)
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=0, atol=2e-6)
    uncapped = _reference(*case, True, temperature)
    assert (logp.detach() - uncapped[0]).abs().max() > 0.5 and (leaf.grad - uncapped[2]).abs().max() > 0.05
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match="softcap"):
            vocab_parallel_logprobs(case[0], *case[1:3], softcap=bad)


def test_gradient_through_one_output_only():
    logits_TV, rows_M, targets_M, grad_logp_M, _ = _case(2)
    zero_M = torch.zeros_like(grad_logp_M)
    _, _, ref_grad = _reference(logits_TV, rows_M, targets_M, zero_M, grad_logp_M, True)  # entropy only
    z = logits_TV.clone().requires_grad_(True)
    _, ent = vocab_parallel_logprobs(z, rows_M, targets_M, with_entropy=True, chunk_rows=5)
    (ent * grad_logp_M).sum().backward()
    torch.testing.assert_close(z.grad, ref_grad, rtol=0, atol=2e-6)


def test_no_grad_and_extreme_logits():
    logits_TV, rows_M, targets_M, *_ = _case(3)
    logits_TV[1] = -1e30
    logits_TV[1, 7] = 80.0  # one-hot row: softmax underflows everywhere else
    logits_TV[2] += 1e4  # large offset: needs the max shift
    with torch.no_grad():
        logp, ent = vocab_parallel_logprobs(logits_TV, rows_M, targets_M, with_entropy=True, chunk_rows=2)
    ref = logits_TV.float().log_softmax(-1)
    torch.testing.assert_close(logp, ref[rows_M, targets_M], rtol=0, atol=5e-4)
    assert torch.isfinite(ent).all() and abs(ent[0].item()) < 1e-6  # row 1 is certain


def test_bad_input_is_refused():
    z = torch.zeros(4, V)
    with pytest.raises(ValueError, match=r"target token ids must lie in \[0, 50\)"):
        vocab_parallel_logprobs(z, torch.tensor([0, 1]), torch.tensor([5, V]))
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\)"):
        vocab_parallel_logprobs(z, torch.tensor([0, 4]), torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        vocab_parallel_logprobs(z, torch.tensor([0]), torch.tensor([5]), chunk_rows=0)
    with pytest.raises(ValueError, match=r"logits must be \[rows, vocab slice\]"):
        vocab_parallel_logprobs(z[None], torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(ValueError, match="1-D of the same length"):
        vocab_parallel_logprobs(z, torch.tensor([0, 1]), torch.tensor([5]))


def _saved_bytes(fn):
    """Bytes of every tensor autograd keeps for the backward while ``fn`` runs, as (storage ptr, bytes) pairs."""
    saved = []

    def pack(t):
        saved.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_keeps_no_rows_by_vocabulary_tensor_but_the_logits(with_entropy):
    """The chunked op saves the logits themselves and per-row/per-target vectors; the plain formulation (the control,
    showing the probe sees such tensors) saves fp32 rows x vocabulary tensors besides."""
    Tb, Vb = 64, 4096
    logits_TV = torch.randn(Tb, Vb, dtype=torch.bfloat16, requires_grad=True)
    rows_M = torch.arange(Tb - 1)
    targets_M = torch.randint(0, Vb, (Tb - 1,))
    big = Tb * Vb  # bytes of a bf16 copy / 2; anything that large is a rows x vocabulary tensor

    saved, _ = _saved_bytes(lambda: vocab_parallel_logprobs(logits_TV, rows_M, targets_M, with_entropy, chunk_rows=8))
    logits_ptr = logits_TV.untyped_storage().data_ptr()
    large = [(p, n) for p, n in saved if n >= big]
    assert large == [(logits_ptr, 2 * big)], large
    assert sum(n for p, n in saved if p != logits_ptr) <= 64 * Tb * 8  # a handful of int64/fp32 vectors

    def plain():
        logsm = logits_TV.float().log_softmax(-1)
        ent = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
        return logsm[rows_M, targets_M], ent

    saved, _ = _saved_bytes(plain)
    assert sum(n for p, n in saved if p != logits_ptr and n >= 4 * big) >= 4 * big * (3 if with_entropy else 1)


# ------------------------------------------------------------------------------------------ TP = 2 (gloo)
def _body_tp(rank, world_size, with_entropy, temperature=1.0, softcap=None):
    from megatron.core import parallel_state as ps

    assert ps.get_tensor_model_parallel_world_size() == 2
    out = {}
    for all_rows, chunk_rows in ((False, 3), (True, None)):
        case = _case(4, all_rows=all_rows, vocab=2 * V)
        full_TV = case[0]
        full_TV[4, :V] -= 30  # row 4's max lies on rank 1 only: the ranks' maxima differ
        full_TV[6, V:] += 30  # and row 6's on rank 0
        ref_logp, ref_ent, ref_grad = _reference(*case, with_entropy, temperature, softcap)
        mine = (full_TV[:, rank * V:(rank + 1) * V].contiguous(),) + case[1:]
        logp, ent, grad, _ = _fused(*mine, with_entropy, chunk_rows=chunk_rows, temperature=temperature,
                                    softcap=softcap)
        ref_slice = ref_grad[:, rank * V:(rank + 1) * V]
        out[all_rows] = ((logp - ref_logp).abs().max().item(),
                         (ent - ref_ent).abs().max().item() if with_entropy else 0.0,
                         (grad - ref_slice).abs().max().item(), ref_slice.abs().max().item())
    return out


@pytest.mark.parametrize("with_entropy,temperature,softcap", [(False, 1.0, None), (True, 1.0, None),
                                                              (True, 0.7, None), (True, 0.7, 20.0)])
def test_tensor_parallel_matches_the_full_vocabulary(with_entropy, temperature, softcap):
    results = run_distributed(_body_tp, world_size=2, parallel=ParallelConfig(tp=2), with_entropy=with_entropy,
                              temperature=temperature, softcap=softcap)
    for per_rank in results:
        for logp_err, ent_err, grad_err, grad_scale in per_rank.values():
            assert logp_err <= 5e-6 and ent_err <= 5e-6 and grad_err <= 2e-6 * max(1.0, grad_scale), per_rank
            assert grad_scale > 0.01  # each rank's slice really carries gradient


# ------------------------------------------------------------------------------- output layer fused into the loss
H = 16


def _linear_case(seed: int, vocab: int = V, all_rows: bool = False, weight_dtype=torch.float32):
    logits_TV, rows_M, targets_M, grad_logp_M, grad_ent_M = _case(seed, all_rows=all_rows, vocab=vocab)
    g = torch.Generator().manual_seed(seed + 100)
    hidden_TH = torch.randn(T, H, generator=g)
    weight_VH = (torch.randn(vocab, H, generator=g) * 0.8).to(weight_dtype)
    return hidden_TH, weight_VH, rows_M, targets_M, grad_logp_M, grad_ent_M


def _linear_reference(hidden_TH, weight_VH, rows_M, targets_M, grad_logp_M, grad_ent_M, with_entropy, vocab_slice=None,
                      temperature=1.0, softcap=None):
    """Plain autograd: logits = hidden @ W^T in W's dtype, log_softmax in fp32 (of logits / ``temperature``). Returns
    values and both gradients (the weight's restricted to ``vocab_slice`` rows when given)."""
    h = hidden_TH.clone().requires_grad_(True)
    w = weight_VH.clone().requires_grad_(True)
    z = (h.to(w.dtype) @ w.t()).float()
    logp, ent, _ = _reference(z, rows_M, targets_M, grad_logp_M, grad_ent_M, with_entropy, temperature, softcap)
    logsm = _scores(z, temperature, softcap).log_softmax(-1)
    loss = (logsm[rows_M, targets_M] * grad_logp_M).sum()
    if with_entropy:
        loss = loss + (-(logsm.exp() * logsm).sum(-1)[rows_M] * grad_ent_M).sum()
    loss.backward()
    w_grad = w.grad if vocab_slice is None else w.grad[vocab_slice]
    return logp, ent, h.grad, w_grad


def _linear_fused(hidden_TH, weight_VH, rows_M, targets_M, grad_logp_M, grad_ent_M, with_entropy, **kw):
    from forge_megatron.mcore.logprobs import linear_vocab_parallel_logprobs

    h = hidden_TH.clone().requires_grad_(True)
    w = weight_VH.clone().requires_grad_(True)
    logp, ent = linear_vocab_parallel_logprobs(h, w, rows_M, targets_M, with_entropy=with_entropy, **kw)
    loss = (logp * grad_logp_M).sum() + ((ent * grad_ent_M).sum() if with_entropy else 0)
    loss.backward()
    return logp.detach(), (ent.detach() if with_entropy else None), h.grad, w.grad


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
@pytest.mark.parametrize("all_rows", [False, True])
def test_fused_output_layer_matches_logits_then_log_softmax(with_entropy, chunk_rows, all_rows):
    case = _linear_case(5, all_rows=all_rows)
    ref = _linear_reference(*case, with_entropy)
    got = _linear_fused(*case, with_entropy, chunk_rows=chunk_rows)
    for name, a, b in zip(("logp", "entropy", "hidden grad", "weight grad"), got, ref):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    if not all_rows:
        assert got[2][0].abs().max() == 0 and got[2][5].abs().max() == 0  # unscored rows: no hidden gradient


def test_fused_output_layer_with_temperature():
    case = _linear_case(8)
    ref = _linear_reference(*case, True, temperature=0.75)
    got = _linear_fused(*case, True, chunk_rows=3, temperature=0.75)
    for name, a, b in zip(("logp", "entropy", "hidden grad", "weight grad"), got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    assert (got[0] - _linear_reference(*case, True)[0]).abs().max() > 0.1


@pytest.mark.parametrize("temperature", [1.0, 0.75])
def test_fused_output_layer_with_softcap(temperature):
    case = _linear_case(10)
    case = (case[0] * 3,) + case[1:]  # logits of scale ~10 against the cap of 4
    ref = _linear_reference(*case, True, temperature=temperature, softcap=4.0)
    got = _linear_fused(*case, True, chunk_rows=3, temperature=temperature, softcap=4.0)
    for name, a, b in zip(("logp", "entropy", "hidden grad", "weight grad"), got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    uncapped = _linear_reference(*case, True, temperature=temperature)
    assert (got[0] - uncapped[0]).abs().max() > 0.5 and (got[3] - uncapped[3]).abs().max() > 0.05


def test_fused_output_layer_bf16_weight():
    """bf16 weight (the output layer under --bf16): the matmul runs in bf16 as the layer's would; the weight
    gradient is summed over chunks in fp32 and rounded once."""
    case = _linear_case(6, all_rows=True, weight_dtype=torch.bfloat16)
    ref = _linear_reference(*case, True)
    got = _linear_fused(*case, True, chunk_rows=3)
    assert got[3].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-5)
    for a, b in ((got[2], ref[2]), (got[3].float(), ref[3].float())):
        torch.testing.assert_close(a, b, rtol=0, atol=2 ** -7 * b.abs().max().item())


def test_fp32_lm_head_computes_the_bf16_output_layer_in_fp32():
    """compute_dtype=float32 with a bf16 weight and bf16-valued hidden states (--fp32-lm-head): the values and both
    gradients are those of the same math done in fp32 from the upcast operands (<= 1e-5), the gradients keep the
    operands' dtypes; and the logprobs are much closer to fp64 than the bf16 head's (the point of it)."""
    hidden_TH, weight_VH, *rest = _linear_case(7, vocab=512, all_rows=True, weight_dtype=torch.bfloat16)
    hidden_TH = (hidden_TH * 2).to(torch.bfloat16).float()  # bf16 hidden states, upcast as Float16Module hands them
    case = (hidden_TH, weight_VH, *rest)
    fp32 = _linear_fused(*case, True, chunk_rows=3, compute_dtype=torch.float32)
    ref = _linear_reference(hidden_TH, weight_VH.float(), *rest, True)  # the fp32 matmul of the same operands
    assert fp32[3].dtype == torch.bfloat16 and fp32[2].dtype == torch.float32
    for name, a, b in zip(("logp", "entropy", "hidden grad"), fp32[:3], ref[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    torch.testing.assert_close(fp32[3].float(), ref[3].to(torch.bfloat16).float(), rtol=0, atol=0)  # one rounding
    exact = _linear_reference(hidden_TH.double(), weight_VH.double(), *rest, False)[0]
    bf16 = _linear_fused(*case, False)[0]
    err_fp32, err_bf16 = (fp32[0].double() - exact).abs().max(), (bf16.double() - exact).abs().max()
    assert err_fp32 < 1e-4 < err_bf16 and err_fp32 * 100 < err_bf16, (err_fp32, err_bf16)


def test_fused_output_layer_refuses_mismatched_shapes():
    from forge_megatron.mcore.logprobs import linear_vocab_parallel_logprobs

    with pytest.raises(ValueError, match=r"hidden must be \[rows, H\] and weight \[vocab slice, H\]"):
        linear_vocab_parallel_logprobs(torch.zeros(4, H), torch.zeros(V, H + 1), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"target token ids must lie in \[0, 50\)"):
        linear_vocab_parallel_logprobs(torch.zeros(4, H), torch.zeros(V, H), torch.tensor([0]), torch.tensor([V]))


def _body_tp_linear(rank, world_size):
    case = list(_linear_case(7, vocab=2 * V))
    case[1][8] += 3.0  # two large vocabulary rows, one per rank: the row maxima land on either rank
    case[1][V + 3] += 3.0
    mine = slice(rank * V, (rank + 1) * V)
    ref = _linear_reference(*case, True, vocab_slice=mine)
    local = list(case)
    local[1] = case[1][mine].contiguous()
    got = _linear_fused(*local, True, chunk_rows=5)
    # the hidden gradient is the sum over both vocabulary slices (all-reduced over TP); the weight's is this slice's
    return [(a - b).abs().max().item() for a, b in zip(got, ref)] + [got[3].abs().max().item()]


def test_fused_output_layer_tensor_parallel():
    for errs in run_distributed(_body_tp_linear, world_size=2, parallel=ParallelConfig(tp=2)):
        assert max(errs[:4]) <= 1e-5 and errs[4] > 0.01, errs


# ---------------------------------------------------------------------------------- in the model (GPTModel)
def _body_model(rank, world_size, tie):
    from forge_megatron.mcore.forward import _gpt_output_layer, tree_logprobs
    from forge_megatron.tree import build_tree
    from tests.mcore.test_tree_exact import _cfg, _twin_models, _weighted_loss, _weights, all_samples

    tree, _ = _twin_models(_cfg(tie_word_embeddings=tie))
    samples = all_samples(8)
    layout = build_tree(samples)
    w_S = _weights(samples)
    out = {}
    for fused in (False, True):
        tree.zero_grad()
        logp, ent = tree_logprobs(tree, layout, with_entropy=True, fused_output=fused)
        (_weighted_loss(logp, layout, w_S) + ent.sum()).backward()
        out[fused] = (logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in tree.named_parameters()})
    layer = _gpt_output_layer(tree)
    (lp0, e0, g0), (lp1, e1, g1) = out[False], out[True]
    return {
        "logp": (lp1 - lp0).abs().max().item(), "entropy": (e1 - e0).abs().max().item(),
        "grad": max(((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-12)).item() for n in g0),
        "output_grads": [n for n in g0 if ("output_layer" in n or "word_embeddings" in n) and g0[n].abs().sum() > 0],
        "restored": "forward" not in vars(layer),
    }


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tie", [False, True])
def test_fused_output_layer_in_gptmodel_equals_the_unfused_forward(tp, tie):
    """tree_logprobs with the output layer fused into the loss: same logprobs, entropies and every parameter's
    gradient as Megatron's own output layer followed by the logits op, with tied or untied embeddings."""
    for res in run_distributed(_body_model, world_size=tp, parallel=ParallelConfig(tp=tp), tie=tie):
        assert res["logp"] <= 1e-5 and res["entropy"] <= 1e-5 and res["grad"] <= 1e-5, res
        assert res["restored"]
        assert len(res["output_grads"]) == (1 if tie else 2), res  # the tied weight gets both uses' gradients


def _body_fp32_head(rank, world_size):
    from forge_megatron.mcore.forward import _gpt_output_layer, output_layer_deferred, tree_logprobs, tree_model_inputs
    from forge_megatron.tree import build_tree
    from tests.mcore.test_tree_exact import _cfg, _twin_models, all_samples

    tree, _ = _twin_models(_cfg(vocab_size=512, hidden_size=64))
    tree.to(torch.bfloat16)
    layout = build_tree(all_samples(8))
    with torch.no_grad():
        with output_layer_deferred(tree) as captured:
            hidden_TH = tree(**tree_model_inputs(layout, device=torch.device("cpu")))[0]
        rows_M, targets_M, _ = layout.next_token_index()
        exact_M = (hidden_TH.double() @ captured["weight"].double().t()).log_softmax(-1)[rows_M, targets_M]
        bf16_M, _ = tree_logprobs(tree, layout)
        fp32_M, _ = tree_logprobs(tree, layout, head_dtype=torch.float32)
    try:
        tree_logprobs(tree, layout, fused_output=False, head_dtype=torch.float32)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"bf16": (bf16_M.double() - exact_M).abs().max().item(),
            "fp32": (fp32_M.double() - exact_M).abs().max().item(), "refused": refused,
            "restored": "forward" not in vars(_gpt_output_layer(tree))}


def test_fp32_lm_head_through_a_bf16_gptmodel():
    """A bf16 tree GPTModel: tree_logprobs(head_dtype=float32) scores the model's own final hidden states with the
    output layer in fp32 (equal to fp64 math on the same bf16 operands), the default bf16 head does not; the
    unfused path refuses a head dtype (Megatron's output layer computes in the weight's dtype)."""
    (res,) = run_distributed(_body_fp32_head, world_size=1)
    assert res["fp32"] <= 1e-4 < res["bf16"], res
    assert res["refused"] and "needs the fused output layer" in res["refused"] and res["restored"]


def _body_refusal(rank, world_size):
    from forge_megatron.mcore.forward import _gpt_output_layer, tree_logprobs
    from forge_megatron.tree import build_tree
    from tests.mcore.test_tree_exact import _cfg, _twin_models, all_samples

    tree, _ = _twin_models(_cfg())
    layer = _gpt_output_layer(tree)
    layer.bias = torch.nn.Parameter(torch.zeros(layer.weight.shape[0]))  # what the fused path does not add
    try:
        tree_logprobs(tree, build_tree(all_samples(1)))
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    return message, "forward" not in vars(layer)


def test_fused_output_layer_refuses_what_it_cannot_reproduce():
    ((message, restored),) = run_distributed(_body_refusal, world_size=1)
    assert "bias-free output layer" in message and "run without fused logprobs" in message
    assert restored  # the output layer is itself again after the error


# ------------------------------------------------------------------------------------------- top-k (a teacher's)
def _topk_reference(z_TV, rows, k, limit=None, temperature=1.0, softcap=None):
    logsm = _scores(z_TV.float(), temperature, softcap).log_softmax(-1)[rows]
    cand = logsm if limit is None else logsm[:, :limit]
    logp, ids = cand.topk(k, dim=-1)
    return ids, logp


@pytest.mark.parametrize("chunk_rows", [1, 4, None])
@pytest.mark.parametrize("fused", [False, True])
def test_topk_is_the_full_distributions_top_k(chunk_rows, fused):
    """The k most likely tokens (most likely first) and their logprobs under the full softmax, for rows asked once,
    several times or never, from logits or from the output layer's input, tempered and soft-capped, with and
    without a candidate limit (ids at or above it never chosen, though they count in the normaliser)."""
    from forge_megatron.mcore.logprobs import vocab_parallel_topk

    hidden_TH, weight_VH, rows_M, *_ = _linear_case(3)
    logits_TV = (hidden_TH @ weight_VH.t()).float()
    logits_TV[4, 45] = 40.0  # row 4's favourite lies past the limit below
    for k, limit, temperature, softcap in ((1, None, 1.0, None), (5, None, 0.7, None), (6, 40, 1.0, 20.0),
                                           (V, None, 1.0, None)):
        if fused:  # (the favourite past the limit is planted in the unfused logits only)
            src, z_TV = {"hidden_TH": hidden_TH, "weight_VH": weight_VH}, (hidden_TH @ weight_VH.t()).float()
        else:
            src, z_TV = {"logits_TV": logits_TV}, logits_TV
        ids, logp = vocab_parallel_topk(rows_M, k, vocab_limit=limit, chunk_rows=chunk_rows,
                                        temperature=temperature, softcap=softcap, **src)
        ref_ids, ref_logp = _topk_reference(z_TV, rows_M, k, limit, temperature, softcap)
        targets = (rows_M * 7) % V  # and each row's target's logprob from the same pass
        *same, target_logp = vocab_parallel_topk(rows_M, k, targets_U=targets, vocab_limit=limit,
                                                 chunk_rows=chunk_rows, temperature=temperature, softcap=softcap, **src)
        want = _scores(z_TV.float(), temperature, softcap).log_softmax(-1)[rows_M, targets]
        assert torch.equal(same[0], ids) and (target_logp - want).abs().max() < 5e-6
        assert ids.dtype == torch.int64 and ids.shape == (rows_M.numel(), k)
        assert torch.equal(ids, ref_ids), (k, limit)
        assert (logp - ref_logp).abs().max() < 5e-6  # (fp32 matmuls of other shapes)
        if limit is not None:
            assert int(ids.max()) < limit
    with pytest.raises(ValueError, match="1 <= k <= 40"):
        vocab_parallel_topk(rows_M, 41, logits_TV=logits_TV, vocab_limit=40)
    with pytest.raises(ValueError, match="either logits_TV or hidden_TH"):
        vocab_parallel_topk(rows_M, 2, logits_TV=logits_TV, hidden_TH=hidden_TH, weight_VH=weight_VH)


def _body_tp_topk(rank, world_size):
    from forge_megatron.mcore.logprobs import vocab_parallel_topk

    hidden_TH, weight_VH, rows_M, *_ = _linear_case(7, vocab=2 * V)
    full_TV = (hidden_TH @ weight_VH.t()).float()
    full_TV[2, :V] += 5.0  # row 2's top tokens all on rank 0, row 9's on rank 1
    full_TV[9, V:] += 5.0
    out = []
    for k, limit in ((4, None), (V + 3, None), (7, V + 10)):  # more than one slice holds; a limit inside rank 1's
        ref_ids, ref_logp = _topk_reference(full_TV, rows_M, k, limit, 0.8)
        targets = (rows_M * 11) % (2 * V)  # owned by either rank
        ids, logp, target_logp = vocab_parallel_topk(
            rows_M, k, targets_U=targets, logits_TV=full_TV[:, rank * V:(rank + 1) * V].contiguous(),
            vocab_limit=limit, temperature=0.8)
        want = (full_TV / 0.8).log_softmax(-1)[rows_M, targets]
        assert (target_logp - want).abs().max() < 5e-6
        fids, flogp = vocab_parallel_topk(rows_M, k, hidden_TH=hidden_TH, vocab_limit=limit, temperature=0.8,
                                          weight_VH=weight_VH[rank * V:(rank + 1) * V].contiguous())
        fref_ids, fref_logp = _topk_reference((hidden_TH @ weight_VH.t()).float(), rows_M, k, limit, 0.8)
        out.append((torch.equal(ids, ref_ids), (logp - ref_logp).abs().max().item(),
                    torch.equal(fids, fref_ids), (flogp - fref_logp).abs().max().item()))
    return out


def test_topk_tensor_parallel_matches_the_full_vocabulary():
    """Over two TP ranks (each the top-k of its vocabulary slice, merged after one all-gather): the same ids and
    logprobs as the full vocabulary's, with k beyond one slice and a candidate limit inside the second slice."""
    for per_rank in run_distributed(_body_tp_topk, world_size=2, parallel=ParallelConfig(tp=2)):
        for same_ids, err, fused_same, fused_err in per_rank:
            assert same_ids and fused_same and err < 5e-6 and fused_err < 5e-6, per_rank
