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


def _reference(logits_TV, rows_M, targets_M, grad_logp_M, grad_ent_M, with_entropy):
    z = logits_TV.detach().float().requires_grad_(True)
    logsm = z.log_softmax(-1)
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
def _body_tp(rank, world_size, with_entropy):
    from megatron.core import parallel_state as ps

    assert ps.get_tensor_model_parallel_world_size() == 2
    out = {}
    for all_rows, chunk_rows in ((False, 3), (True, None)):
        case = _case(4, all_rows=all_rows, vocab=2 * V)
        full_TV = case[0]
        full_TV[4, :V] -= 30  # row 4's max lies on rank 1 only: the ranks' maxima differ
        full_TV[6, V:] += 30  # and row 6's on rank 0
        ref_logp, ref_ent, ref_grad = _reference(*case, with_entropy)
        mine = (full_TV[:, rank * V:(rank + 1) * V].contiguous(),) + case[1:]
        logp, ent, grad, _ = _fused(*mine, with_entropy, chunk_rows=chunk_rows)
        ref_slice = ref_grad[:, rank * V:(rank + 1) * V]
        out[all_rows] = ((logp - ref_logp).abs().max().item(),
                         (ent - ref_ent).abs().max().item() if with_entropy else 0.0,
                         (grad - ref_slice).abs().max().item(), ref_slice.abs().max().item())
    return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_tensor_parallel_matches_the_full_vocabulary(with_entropy):
    results = run_distributed(_body_tp, world_size=2, parallel=ParallelConfig(tp=2), with_entropy=with_entropy)
    for per_rank in results:
        for logp_err, ent_err, grad_err, grad_scale in per_rank.values():
            assert logp_err <= 5e-6 and ent_err <= 5e-6 and grad_err <= 2e-6, per_rank
            assert grad_scale > 0.01  # each rank's slice really carries gradient
