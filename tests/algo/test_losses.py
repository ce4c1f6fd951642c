"""Policy losses against closed forms computed by hand (math module), gradients included.

GPUs: 0, except ``test_cuda_matches_cpu`` (1, marked ``gpu``).

Legend: M = next-token positions of all samples concatenated, S = samples, T = tree tokens, V = vocabulary.
"""

import math
import re

import pytest
import torch

from forge_megatron.algo import LossConfig, policy_loss


def _exact(message):
    return f"^{re.escape(message)}$"


def _t(*xs, requires_grad=False):
    return torch.tensor(xs, dtype=torch.float32, requires_grad=requires_grad)


def _loss(logp_M, old_M, adv_M, mask_M, cu, cfg, **kw):
    return policy_loss(logp_M, old_M, adv_M, mask_M, torch.tensor(cu), cfg, **kw)


# ---------------------------------------------------------------- CISPO


def test_cispo_closed_form_value_and_detached_weight_gradient():
    logp_M = _t(-1.0, -2.0, -0.5, requires_grad=True)
    old_M = _t(-1.5, -1.0, -0.5)
    adv_M = _t(2.0, 2.0, -1.0)
    mask_M = _t(1, 1, 1)
    cfg = LossConfig()  # eps_high 0.28, eps_low off
    loss, m = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 3], cfg)
    w = [min(math.exp(0.5), 1.28), math.exp(-1.0), 1.0]  # first ratio e^0.5 = 1.65 is clipped to 1.28
    expect = -(w[0] * 2 * -1.0 + w[1] * 2 * -2.0 + w[2] * -1.0 * -0.5) / 3
    assert loss.item() == pytest.approx(expect, rel=1e-6)
    loss.backward()
    # d loss / d logp = -w * A / N with w a constant: no gradient flows through the ratio inside the weight
    assert logp_M.grad.tolist() == pytest.approx([-w[0] * 2 / 3, -w[1] * 2 / 3, w[2] / 3], rel=1e-6)
    assert m["clip_frac_high"] == pytest.approx(1 / 3)
    assert m["clip_frac_low"] == 0.0
    assert m["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert m["ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1) + 1) / 3, rel=1e-6)


def test_cispo_masked_tokens_get_no_gradient_and_do_not_count():
    logp_M = _t(-1.0, -2.0, -3.0, requires_grad=True)
    loss, m = _loss(logp_M, logp_M.detach(), _t(1.0, 1.0, 1.0), _t(1, 0, 1), [0, 3], LossConfig())
    assert loss.item() == pytest.approx(-(-1.0 - 3.0) / 2)
    loss.backward()
    assert logp_M.grad.tolist() == pytest.approx([-0.5, 0.0, -0.5])
    assert m["num_tokens"] == 2.0


def test_clipped_token_ppo_gradient_zero_cispo_not():
    logp_M = _t(-0.5, requires_grad=True)
    old_M = _t(-1.0)  # ratio e^0.5 > 1.2
    adv_M = _t(1.0)
    grads = {}
    for loss_type in ("ppo", "cispo"):
        cfg = LossConfig(loss_type=loss_type, eps_low=0.2, eps_high=0.2)
        logp_M.grad = None
        loss, _ = _loss(logp_M, old_M, adv_M, _t(1), [0, 1], cfg)
        loss.backward()
        grads[loss_type] = logp_M.grad.item()
    assert grads["ppo"] == 0.0
    assert grads["cispo"] == pytest.approx(-1.2)


# ---------------------------------------------------------------- PPO


def test_ppo_closed_form_each_clip_case():
    # tokens: (A>0, r>1+eps) clipped; (A<0, r<1-eps) clipped; (A>0, r in band) unclipped; (A<0, r>1+eps) unclipped
    log_r = [0.5, -0.5, 0.1, 0.5]
    adv = [1.0, -2.0, 3.0, -1.0]
    logp_M = _t(*[-1.0 + x for x in log_r], requires_grad=True)
    old_M = _t(-1.0, -1.0, -1.0, -1.0)
    cfg = LossConfig.recommended("ppo")
    loss, m = _loss(logp_M, old_M, _t(*adv), _t(1, 1, 1, 1), [0, 4], cfg)
    r = [math.exp(x) for x in log_r]
    per_token = [-min(ri * a, min(max(ri, 0.8), 1.2) * a) for ri, a in zip(r, adv)]
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-6)
    loss.backward()
    assert logp_M.grad.tolist() == pytest.approx([0.0, 0.0, -r[2] * 3 / 4, r[3] / 4], rel=1e-6)
    assert m["clip_frac_high"] == pytest.approx(0.5)
    assert m["clip_frac_low"] == pytest.approx(0.25)


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    logp_M = _t(math.log(5.0), requires_grad=True)  # ratio 5 against old logp 0
    cfg = LossConfig(loss_type="ppo", eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    loss, _ = _loss(logp_M, _t(0.0), _t(-1.0), _t(1), [0, 1], cfg)
    assert loss.item() == pytest.approx(3.0)  # plain PPO would give 5
    loss.backward()
    assert logp_M.grad.item() == 0.0
    plain, _ = _loss(logp_M, _t(0.0), _t(-1.0), _t(1), [0, 1], LossConfig.recommended("ppo"))
    assert plain.item() == pytest.approx(5.0, rel=1e-6)


# ---------------------------------------------------------------- GSPO


def _gspo_sequence_objective(logp_list, old_list, adv_list, eps_low, eps_high):
    """GSPO as written in the paper: one length-normalised ratio per sequence, mean over sequences."""
    terms = []
    for logp, old, a in zip(logp_list, old_list, adv_list):
        s = torch.exp((logp - old).mean())
        terms.append(-torch.min(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.5, 0.5)])
def test_gspo_token_form_equals_sequence_objective(eps):
    torch.manual_seed(0)
    lengths = [3, 5, 2]
    logp_M = (-torch.rand(10) * 2).requires_grad_()
    old_M = logp_M.detach() + 0.3 * torch.randn(10)
    adv_S = [1.5, -0.7, 0.4]
    adv_M = torch.repeat_interleave(torch.tensor(adv_S), torch.tensor(lengths))
    cfg = LossConfig(loss_type="gspo", eps_low=eps[0], eps_high=eps[1], norm="seq_mean")
    loss, m = _loss(logp_M, old_M, adv_M, torch.ones(10), [0, 3, 8, 10], cfg)
    (grad,) = torch.autograd.grad(loss, logp_M)
    ref_logp = logp_M.detach().clone().requires_grad_()
    ref = _gspo_sequence_objective(ref_logp.split(lengths), old_M.split(lengths), adv_S, *eps)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    seq_ratio = [math.exp(float((a - b).mean())) for a, b in zip(logp_M.detach().split(lengths), old_M.split(lengths))]
    assert m["ratio_max"] == pytest.approx(max(seq_ratio), rel=1e-5)


def test_gspo_sequence_ratio_uses_only_masked_tokens():
    logp_M = _t(-1.0, -1.0, -5.0, requires_grad=True)
    old_M = _t(-1.2, -1.4, 0.0)  # the masked third token would dominate the mean log-ratio
    cfg = LossConfig(loss_type="gspo", eps_low=1.0, eps_high=1.0)
    _, m = _loss(logp_M, old_M, _t(1.0, 1.0, 1.0), _t(1, 1, 0), [0, 3], cfg)
    assert m["ratio_mean"] == pytest.approx(math.exp(0.3), rel=1e-6)


# ---------------------------------------------------------------- normalisation, weights, extra terms


def test_normalisers_token_seq_constant():
    logp_M = _t(-1.0, -2.0, -3.0, -4.0)
    adv_M = _t(1.0, 1.0, 1.0, 1.0)
    mask_M = _t(1, 1, 1, 0)
    cu = [0, 1, 4]  # sample 0: 1 token; sample 1: 3 tokens, 2 masked in
    per_token = [1.0, 2.0, 3.0]  # CISPO at ratio 1: -A * logp
    token_mean, _ = _loss(logp_M, logp_M, adv_M, mask_M, cu, LossConfig())
    seq_mean, _ = _loss(logp_M, logp_M, adv_M, mask_M, cu, LossConfig(norm="seq_mean"))
    const, _ = _loss(logp_M, logp_M, adv_M, mask_M, cu, LossConfig(norm="constant", norm_constant=10.0))
    assert token_mean.item() == pytest.approx(sum(per_token) / 3)
    assert seq_mean.item() == pytest.approx((1.0 + (2.0 + 3.0) / 2) / 2)
    assert const.item() == pytest.approx(sum(per_token) / 10)


def test_sample_weights_scale_contributions():
    logp_M = _t(-1.0, -2.0, -3.0)
    adv_M = torch.ones(3)
    w_S = _t(0.5, 2.0)
    cu = [0, 1, 3]
    tok, _ = _loss(logp_M, logp_M, adv_M, torch.ones(3), cu, LossConfig(), sample_weight_S=w_S)
    seq, _ = _loss(logp_M, logp_M, adv_M, torch.ones(3), cu, LossConfig(norm="seq_mean"), sample_weight_S=w_S)
    assert tok.item() == pytest.approx((0.5 * 1.0 + 2.0 * (2.0 + 3.0)) / 3)
    assert seq.item() == pytest.approx((0.5 * 1.0 + 2.0 * 2.5) / 2.5)


def test_seq_mean_segment_count_invariance():
    """An episode split into n copies of weight 1/n weighs exactly as the single copy (value and gradient)."""
    torch.manual_seed(1)
    a_logp = (-torch.rand(3)).requires_grad_()
    b_logp = (-torch.rand(4)).requires_grad_()
    old = lambda x: x.detach() + 0.1  # noqa: E731
    cfg = LossConfig(norm="seq_mean")

    def run(n_b):
        logp_M = torch.cat([a_logp] + [b_logp] * n_b)
        old_M = torch.cat([old(a_logp)] + [old(b_logp)] * n_b)
        adv_M = torch.cat([torch.full((3,), 1.0)] + [torch.full((4,), -0.5)] * n_b)
        cu = torch.tensor([0] + [3 + 4 * k for k in range(n_b + 1)])
        w_S = torch.tensor([1.0] + [1.0 / n_b] * n_b)
        loss, _ = policy_loss(logp_M, old_M, adv_M, torch.ones_like(logp_M), cu, cfg, sample_weight_S=w_S)
        return loss, torch.autograd.grad(loss, [a_logp, b_logp])

    one, grads_one = run(1)
    three, grads_three = run(3)
    torch.testing.assert_close(one, three)
    for g1, g3 in zip(grads_one, grads_three):
        torch.testing.assert_close(g1, g3)


def test_kl_k1_k3_and_entropy_bonus():
    logp_M = _t(-1.0, -2.0, requires_grad=True)
    ref_M = _t(-1.5, -1.0)
    ent_M = _t(0.7, 1.1, requires_grad=True)
    adv_M = torch.zeros(2)  # isolate the extra terms
    for kl_type in ("k1", "k3"):
        cfg = LossConfig(kl_coef=0.1, kl_type=kl_type, entropy_coef=0.01)
        loss, m = _loss(logp_M, logp_M.detach(), adv_M, torch.ones(2), [0, 2], cfg, ref_logp_M=ref_M, entropy_M=ent_M)
        d = [-0.5, 1.0]  # ref - logp
        kl = [-x for x in d] if kl_type == "k1" else [math.exp(x) - x - 1 for x in d]
        assert m["kl"] == pytest.approx(sum(kl) / 2, rel=1e-6)
        assert m["entropy"] == pytest.approx(0.9)
        assert loss.item() == pytest.approx(0.1 * sum(kl) / 2 - 0.01 * 0.9, rel=1e-6)
        g_logp, g_ent = torch.autograd.grad(loss, [logp_M, ent_M])
        dkl = [1.0, 1.0] if kl_type == "k1" else [1 - math.exp(x) for x in d]  # d kl / d logp
        assert g_logp.tolist() == pytest.approx([0.1 * g / 2 for g in dkl], rel=1e-6)
        assert g_ent.tolist() == pytest.approx([-0.005, -0.005])


def test_on_policy_distillation_advantage():
    """With a teacher's logprobs each trained token's advantage is outcome_coef * A + distill_coef * (teacher - old):
    CISPO's loss and gradient with that advantage; masked tokens get none; the reverse-KL metric is the token mean
    of old - teacher; outcome_coef 0 leaves the teacher's term alone."""
    logp_M = _t(-1.0, -2.0, -0.7, -1.2, requires_grad=True)
    old_M = _t(-1.1, -2.0, -0.5, -1.2)
    teacher_M = _t(-0.4, -3.0, -0.5, -9.0)
    adv_M = _t(1.0, 1.0, 0.0, -0.5)
    mask_M = _t(1, 1, 1, 0)
    for outcome in (1.0, 0.0):
        cfg = LossConfig(distill_coef=0.5, outcome_coef=outcome)
        loss, m = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], cfg, teacher_logp_M=teacher_M)
        a = [outcome * x + 0.5 * (t - o) for x, t, o in zip(adv_M.tolist(), teacher_M.tolist(), old_M.tolist())]
        w = [min(math.exp(lp - o), 1.28) for lp, o in zip(logp_M.tolist(), old_M.tolist())]
        expect = -sum(w[i] * a[i] * logp_M[i].item() for i in range(3)) / 3  # the 4th token is masked
        assert loss.item() == pytest.approx(expect, rel=1e-6)
        (grad,) = torch.autograd.grad(loss, [logp_M])
        assert grad.tolist() == pytest.approx([-w[0] * a[0] / 3, -w[1] * a[1] / 3, -w[2] * a[2] / 3, 0.0], rel=1e-6)
        assert m["distill_reverse_kl"] == pytest.approx((-0.7 + 1.0 + 0.0) / 3, rel=1e-6)
        assert m["distill_teacher_logp"] == pytest.approx((-0.4 - 3.0 - 0.5) / 3, rel=1e-6)
        assert m["advantage_mean"] == pytest.approx(sum(a[:3]) / 3, rel=1e-6)
    # without distill_coef the teacher's logprobs change nothing but the metrics
    plain, _ = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], LossConfig())
    teacher_only, m = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], LossConfig(), teacher_logp_M=teacher_M)
    assert plain.item() == teacher_only.item() and "distill_reverse_kl" in m


def _dense_case(seed=0, V=12, X=4):
    """Student logits (differentiable), a teacher's log-distribution and its tokens, most likely first."""
    g = torch.Generator().manual_seed(seed)
    z_XV = (torch.randn(X, V, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    t_XV = torch.log_softmax(torch.randn(X, V, generator=g, dtype=torch.float64) * 2, -1)
    ids_XK = t_XV.argsort(-1, descending=True)
    return z_XV, t_XV, ids_XK


@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_topk_kl_over_the_whole_vocabulary_is_the_exact_kl_and_its_gradient(kind):
    """K = V: the merged distributions are the distributions, so the top-k KL and its gradient with respect to the
    student's logits are the exact KL's."""
    from forge_megatron.algo.losses import topk_kl

    z_XV, t_XV, ids_XK = _dense_case()
    s_XV = torch.log_softmax(z_XV, -1)
    exact = (t_XV.exp() * (t_XV - s_XV)).sum(-1) if kind == "forward" else (s_XV.exp() * (s_XV - t_XV)).sum(-1)
    (g_exact,) = torch.autograd.grad(exact.sum(), [z_XV])
    s_XV = torch.log_softmax(z_XV, -1)
    forward_X, reverse_X = topk_kl(s_XV.gather(1, ids_XK), t_XV.gather(1, ids_XK))
    mine = forward_X if kind == "forward" else reverse_X
    (g_mine,) = torch.autograd.grad(mine.sum(), [z_XV])
    assert mine.tolist() == pytest.approx(exact.tolist(), rel=1e-5, abs=1e-7)
    assert (g_mine - g_exact).abs().max() < 1e-6 and g_exact.abs().max() > 1e-2


def test_topk_jsd_over_the_whole_vocabulary_is_the_exact_jsd():
    """GKD's JSD(beta) with K = V is beta KL(t || m) + (1 - beta) KL(s || m), m = beta t + (1 - beta) s, written out
    over the vocabulary, value and gradient; symmetric at beta 0.5; beta outside (0, 1) is refused."""
    from forge_megatron.algo.losses import topk_jsd

    z_XV, t_XV, ids_XK = _dense_case(seed=5)
    for beta in (0.5, 0.2):
        s_XV = torch.log_softmax(z_XV, -1)
        m_XV = torch.log(beta * t_XV.exp() + (1 - beta) * s_XV.exp())
        exact = beta * (t_XV.exp() * (t_XV - m_XV)).sum(-1) + (1 - beta) * (s_XV.exp() * (s_XV - m_XV)).sum(-1)
        (g_exact,) = torch.autograd.grad(exact.sum(), [z_XV])
        s_XV = torch.log_softmax(z_XV, -1)
        mine = topk_jsd(s_XV.gather(1, ids_XK), t_XV.gather(1, ids_XK), beta)
        (g_mine,) = torch.autograd.grad(mine.sum(), [z_XV])
        assert mine.tolist() == pytest.approx(exact.tolist(), rel=1e-5, abs=1e-7)
        assert (g_mine - g_exact).abs().max() < 1e-6 and g_exact.abs().max() > 1e-3
    s_XK, t_XK = torch.log_softmax(z_XV.detach(), -1).gather(1, ids_XK), t_XV.gather(1, ids_XK)
    assert topk_jsd(s_XK, t_XK, 0.5).tolist() == pytest.approx(topk_jsd(t_XK, s_XK, 0.5).tolist(), rel=1e-5)
    with pytest.raises(ValueError, match="beta must lie in"):
        topk_jsd(s_XK, t_XK, 1.0)


def test_topk_kl_is_a_lower_bound_that_tightens_with_k():
    """Fewer tokens kept, less KL (merging outcomes never raises a KL), for both directions; a teacher sure of its
    top k (a tail of exactly 0) still gives finite values and gradients (the tail's floor)."""
    from forge_megatron.algo.losses import topk_kl

    z_XV, t_XV, _ = _dense_case(seed=3, V=30)
    s_XV = torch.log_softmax(z_XV, -1).detach()
    order = t_XV.argsort(-1, descending=True)
    last = None
    for k in (1, 3, 8, 20, 30):
        ids = order[:, :k]
        kls = torch.stack(topk_kl(s_XV.gather(1, ids), t_XV.gather(1, ids)))
        if last is not None:
            assert (kls >= last - 1e-6).all(), k
        last = kls
    sure = torch.tensor([[0.0, -80.0, -90.0]])  # all of the teacher's mass on its first token (to fp64)
    student = torch.tensor([[-0.5, -1.5, -3.0]], requires_grad=True)
    f, r = topk_kl(student[:, :2], sure[:, :2])
    (g,) = torch.autograd.grad((f + r).sum(), [student])
    assert torch.isfinite(f).all() and torch.isfinite(r).all() and torch.isfinite(g).all()
    assert r.item() > 0.3  # the student's rest bucket against a teacher with none costs log(1 / 1e-12) per unit


def test_dense_distillation_loss():
    """distill_kl='reverse': the loss is the policy-gradient loss of outcome_coef * A plus distill_coef times the
    token mean of the trained positions' top-k reverse KLs; the metrics carry both KLs, the teacher's top-k mass and
    the teacher's logprob of the sampled token; the index must list exactly the trained positions."""
    from forge_megatron.algo.losses import topk_kl

    logp_M = _t(-1.0, -2.0, -0.7, -1.2, requires_grad=True)
    old_M = _t(-1.1, -2.0, -0.5, -1.2)
    adv_M = _t(1.0, 1.0, 0.0, -0.5)
    mask_M = _t(1, 0, 1, 1)
    index_X = torch.tensor([0, 2, 3])
    g = torch.Generator().manual_seed(1)
    student_XK = torch.log_softmax(torch.randn(3, 6, generator=g), -1)[:, :4].requires_grad_(True)
    teacher_XK = torch.log_softmax(torch.randn(3, 6, generator=g), -1)[:, :4]
    cfg = LossConfig(distill_coef=0.5, outcome_coef=0.3, distill_kl="reverse")
    kw = dict(teacher_topk_logp_XK=teacher_XK, topk_logp_XK=student_XK, distill_index_X=index_X,
              teacher_logp_M=_t(-0.3, -0.2, -0.1, -0.4))
    loss, m = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], cfg, **kw)
    plain, _ = _loss(logp_M, old_M, 0.3 * adv_M, mask_M, [0, 2, 4], LossConfig())
    fwd, rev = topk_kl(student_XK, teacher_XK)
    assert loss.item() == pytest.approx(plain.item() + 0.5 * rev.mean().item(), rel=1e-6)
    assert m["distill_loss"] == pytest.approx(rev.mean().item(), rel=1e-6)
    assert m["distill_forward_kl"] == pytest.approx(fwd.mean().item(), rel=1e-6)
    assert m["distill_topk_mass"] == pytest.approx(teacher_XK.exp().sum(-1).mean().item(), rel=1e-6)
    assert m["distill_teacher_logp"] == pytest.approx((-0.3 - 0.1 - 0.4) / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, [student_XK])
    (expect,) = torch.autograd.grad(0.5 * rev.mean(), [student_XK])
    assert torch.allclose(grad, expect, atol=1e-7)
    for bad, message in ((torch.tensor([0, 1, 3]), "must list trained positions (loss_mask_M == 1), each once"),
                         (torch.tensor([0, 0, 3]), "must list trained positions (loss_mask_M == 1), each once"),
                         (torch.tensor([0, 2]), "must be [X, K], [X, K] and [X]"),
                         (torch.tensor([0, 2, 9]), "must index the 4 positions")):
        with pytest.raises(ValueError, match=re.escape(message)):
            _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], cfg, **{**kw, "distill_index_X": bad})
    with pytest.raises(ValueError, match="needs teacher_topk_logp_XK, topk_logp_XK and distill_index_X"):
        _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], cfg)
    from forge_megatron.algo.losses import topk_jsd

    jsd_cfg = LossConfig(distill_coef=0.5, outcome_coef=0.3, distill_kl="jsd", distill_jsd_beta=0.25)
    loss, m = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], jsd_cfg, **kw)
    jsd = topk_jsd(student_XK, teacher_XK, 0.25).mean().item()
    assert m["distill_jsd"] == pytest.approx(jsd, rel=1e-6) and m["distill_loss"] == pytest.approx(jsd, rel=1e-6)
    assert loss.item() == pytest.approx(plain.item() + 0.5 * jsd, rel=1e-6)


def test_distillation_on_the_positions_the_teacher_scored():
    """Trained positions without the teacher's word (episodes recorded before the gateway had a teacher): the sampled
    form leaves them the outcome advantage alone (``teacher_mask_M`` 0), the dense form the trained positions left
    out of ``distill_index_X``; the metrics are means over the scored positions and ``distill_scored_fraction`` is
    their share; all of them scored, nothing changes."""
    from forge_megatron.algo.losses import topk_kl

    logp_M = _t(-1.0, -2.0, -0.7, -1.2, requires_grad=True)
    old_M = _t(-1.1, -2.0, -0.5, -1.2)
    adv_M = _t(1.0, 1.0, 0.0, -0.5)
    mask_M = _t(1, 0, 1, 1)
    teacher_M = _t(-0.4, 0.0, -3.0, -0.2)
    cfg = LossConfig(distill_coef=0.5)
    full, m_full = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], cfg, teacher_logp_M=teacher_M)
    same, _ = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], cfg, teacher_logp_M=teacher_M,
                    teacher_mask_M=_t(1, 1, 1, 1))
    assert same.item() == full.item() and m_full["distill_scored_fraction"] == 1.0
    part, m = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], cfg, teacher_logp_M=teacher_M,
                    teacher_mask_M=_t(1, 0, 0, 1))  # position 2 trained, not scored
    a = [1.0 + 0.5 * (-0.4 + 1.1), 0.0, 0.0, -0.5 + 0.5 * (-0.2 + 1.2)]
    w = [min(math.exp(lp - o), 1.28) for lp, o in zip(logp_M.tolist(), old_M.tolist())]
    expect = -sum(w[i] * a[i] * logp_M[i].item() for i in (0, 2, 3)) / 3
    assert part.item() == pytest.approx(expect, rel=1e-6)
    assert m["distill_scored_fraction"] == pytest.approx(2 / 3)
    assert m["distill_reverse_kl"] == pytest.approx(((-1.1 + 0.4) + (-1.2 + 0.2)) / 2, rel=1e-6)
    assert m["distill_teacher_logp"] == pytest.approx((-0.4 - 0.2) / 2, rel=1e-6)
    g = torch.Generator().manual_seed(2)
    student_XK = torch.log_softmax(torch.randn(2, 6, generator=g), -1)[:, :4].requires_grad_(True)
    teacher_XK = torch.log_softmax(torch.randn(2, 6, generator=g), -1)[:, :4]
    dense = LossConfig(distill_coef=0.5, distill_kl="reverse")
    loss, m = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], dense, teacher_topk_logp_XK=teacher_XK,
                    topk_logp_XK=student_XK, distill_index_X=torch.tensor([0, 3]))
    plain, _ = _loss(logp_M, old_M, adv_M, mask_M, [0, 2, 4], LossConfig())
    _, rev = topk_kl(student_XK, teacher_XK)
    assert loss.item() == pytest.approx(plain.item() + 0.5 * rev.sum().item() / 3, rel=1e-6)  # (token mean of 3)
    assert m["distill_reverse_kl"] == pytest.approx(rev.mean().item(), rel=1e-6)
    assert m["distill_scored_fraction"] == pytest.approx(2 / 3)


def test_truncated_importance_weights_scale_token_loss():
    logp_M = _t(-1.0, -1.0, requires_grad=True)
    old_M = _t(-1.0, -1.0)
    rollout_M = _t(-3.0, -0.9)  # w = min(e^2, 2) = 2 and e^-0.1
    cfg = LossConfig(tis_cap=2.0)
    loss, m = _loss(logp_M, old_M, _t(1.0, 1.0), _t(1, 1), [0, 2], cfg, rollout_logp_M=rollout_M)
    w = [2.0, math.exp(-0.1)]
    assert loss.item() == pytest.approx((w[0] + w[1]) / 2, rel=1e-6)  # -w * A * logp with logp = -1
    loss.backward()
    assert logp_M.grad.tolist() == pytest.approx([-w[0] / 2, -w[1] / 2], rel=1e-6)
    assert m["tis_clip_frac"] == pytest.approx(0.5)
    assert m["tis_weight_mean"] == pytest.approx(sum(w) / 2, rel=1e-6)


def test_rollout_mismatch_metrics():
    """|logp - rollout_logp| (mean, max) and the k3 estimate of KL(rollout || trainer), over loss tokens only;
    identical probabilities give exact zeros, and the loss does not depend on them (metrics only)."""
    logp_M = _t(-1.0, -2.0, -0.5, requires_grad=True)
    rollout_M = _t(-1.5, -2.0, -9.0)  # the third token is masked out
    mask_M = _t(1, 1, 0)
    _, same = _loss(logp_M, logp_M.detach(), _t(1.0, 1.0, 1.0), mask_M, [0, 3], LossConfig(),
                    rollout_logp_M=logp_M.detach())
    assert same["rollout_logp_abs_diff"] == 0.0 and same["rollout_kl"] == 0.0 and same["rollout_logp_abs_diff_max"] == 0
    loss_a, m = _loss(logp_M, logp_M.detach(), _t(1.0, 1.0, 1.0), mask_M, [0, 3], LossConfig(),
                      rollout_logp_M=rollout_M)
    d = [0.5, 0.0]
    assert m["rollout_logp_abs_diff"] == pytest.approx(sum(d) / 2, rel=1e-6)
    assert m["rollout_logp_abs_diff_max"] == pytest.approx(0.5, rel=1e-6)
    assert m["rollout_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 2, rel=1e-6)
    loss_b, _ = _loss(logp_M, logp_M.detach(), _t(1.0, 1.0, 1.0), mask_M, [0, 3], LossConfig())
    assert "rollout_kl" not in _ and loss_a.item() == loss_b.item()
    # Over the tokens sampled by the weights being trained alone (the second here): numerical mismatch only.
    _, m = _loss(logp_M, logp_M.detach(), _t(1.0, 1.0, 1.0), mask_M, [0, 3], LossConfig(),
                 rollout_logp_M=rollout_M, on_policy_M=torch.tensor([False, True, True]))
    assert m["onpolicy/num_tokens"] == 1 and m["onpolicy/rollout_logp_abs_diff"] == 0.0
    assert m["onpolicy/rollout_kl"] == 0.0 and m["rollout_logp_abs_diff"] == pytest.approx(0.25, rel=1e-6)


def test_mismatch_band_masks_tokens_outside_it():
    """IcePop: tokens whose exp(old - rollout) lies outside [low, high] get no policy-gradient loss or gradient; the
    rest are untouched and the normaliser still counts every masked-in loss token."""
    logp_M = _t(-1.0, -1.0, -1.0, -1.0, requires_grad=True)
    old_M = _t(-1.0, -1.0, -1.0, -1.0)
    rollout_M = _t(-1.0, -1.0 - math.log(3.0), -1.0 + math.log(4.0), -1.2)  # r = 1, 3, 1/4, e^0.2
    cfg = LossConfig(mismatch_band=(0.5, 2.0))
    loss, m = _loss(logp_M, old_M, _t(1.0, 1.0, 1.0, 1.0), _t(1, 1, 1, 1), [0, 4], cfg, rollout_logp_M=rollout_M)
    assert loss.item() == pytest.approx(2 / 4, rel=1e-6)  # two kept tokens, -A * logp = 1 each, over 4 tokens
    loss.backward()
    assert logp_M.grad.tolist() == pytest.approx([-0.25, 0.0, 0.0, -0.25], abs=1e-7)
    assert m["mismatch_masked_frac"] == pytest.approx(0.5)
    for band in ((1.5, 2.0), (0.5, 0.9), (0.5,)):
        with pytest.raises(ValueError, match="mismatch_band must be"):
            LossConfig(mismatch_band=band)
    with pytest.raises(ValueError, match="rollout_logp_M was not given"):
        _loss(logp_M, old_M, _t(1.0, 1.0, 1.0, 1.0), _t(1, 1, 1, 1), [0, 4], cfg)


def test_log_ratio_clamp_keeps_loss_finite():
    logp_M = _t(0.0, requires_grad=True)
    for loss_type in ("cispo", "ppo", "gspo"):
        cfg = LossConfig(loss_type=loss_type, log_ratio_clamp=20.0)
        loss, m = _loss(logp_M, _t(-500.0), _t(-1.0), _t(1), [0, 1], cfg)
        assert math.isfinite(loss.item())
        assert m["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def test_low_precision_inputs_computed_in_fp32():
    logp_M = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = _loss(logp_M, logp_M.detach(), torch.ones(2, dtype=torch.bfloat16), torch.ones(2), [0, 2], LossConfig())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    assert logp_M.grad.dtype == torch.bfloat16


def test_per_domain_metrics():
    logp_M = _t(-1.0, -2.0, -3.0)
    adv_M = _t(1.0, 1.0, -1.0)
    _, m = _loss(logp_M, logp_M, adv_M, torch.ones(3), [0, 2, 3], LossConfig(),
                 domain_ids_S=torch.tensor([1, 0]), domain_names=["math", "agent"])
    assert m["agent/num_tokens"] == 2.0 and m["math/num_tokens"] == 1.0
    assert m["agent/pg_loss"] == pytest.approx(1.5)  # -A * logp averaged over agent tokens
    assert m["math/pg_loss"] == pytest.approx(-3.0)
    assert m["math/advantage"] == -1.0
    _, m = _loss(logp_M, logp_M, adv_M, torch.ones(3), [0, 2, 3], LossConfig(),
                 domain_ids_S=torch.tensor([0, 0]), domain_names=["math", "agent", "qa"])
    assert m["math/num_tokens"] == 3.0
    assert not any(k.startswith(("agent/", "qa/")) for k in m)  # domains without tokens are left out


# ---------------------------------------------------------------- tree-packed vs unmerged


def _forest():
    """Three samples sharing prefixes: tree rows 0-1 are shared by all, row 2 by samples 0 and 1.

    Each sample is a list of (tree row, label); at a branch point one row is scored against a different label per
    child. Returns rows_M, labels_M, cu_seqlens_S1."""
    samples = [[(0, 1), (1, 2), (2, 3), (3, 0)], [(0, 1), (1, 2), (2, 4), (4, 1)], [(0, 1), (1, 5)]]
    rows = [r for s in samples for r, _ in s]
    labels = [y for s in samples for _, y in s]
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s))
    return torch.tensor(rows), torch.tensor(labels), torch.tensor(cu)


@pytest.mark.parametrize("loss_type", ["cispo", "ppo", "gspo"])
def test_tree_packed_equals_unmerged(loss_type):
    torch.manual_seed(2)
    T, V = 5, 6
    rows_M, labels_M, cu_S1 = _forest()
    M = rows_M.numel()
    logits_TV = torch.randn(T, V, requires_grad=True)
    old_M = torch.randn(M) * 0.2 - 1.5
    adv_M = torch.repeat_interleave(torch.tensor([1.0, -0.5, 0.3]), cu_S1[1:] - cu_S1[:-1])
    mask_M = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.float32)
    ref_M = torch.randn(M) * 0.2 - 1.5
    cfg = LossConfig.recommended(loss_type, kl_coef=0.05, entropy_coef=0.01)
    extra = dict(ref_logp_M=ref_M, sample_weight_S=torch.tensor([0.5, 0.5, 1.0]))

    def logp_and_entropy(logits_MV):
        logprobs_MV = torch.log_softmax(logits_MV, dim=-1)
        entropy_M = -(logprobs_MV.exp() * logprobs_MV).sum(-1)
        return logprobs_MV.gather(1, labels_M[:, None])[:, 0], entropy_M

    # tree-packed: every sample's positions gathered from one shared logits tensor
    logp_M, ent_M = logp_and_entropy(logits_TV[rows_M])
    packed, _ = policy_loss(logp_M, old_M, adv_M, mask_M, cu_S1, cfg, entropy_M=ent_M, **extra)
    (grad_packed,) = torch.autograd.grad(packed, logits_TV)

    # unmerged: each sample owns a private copy of its logits rows
    copies = [logits_TV.detach()[rows_M[a:b]].clone().requires_grad_() for a, b in zip(cu_S1[:-1], cu_S1[1:])]
    logp_M, ent_M = logp_and_entropy(torch.cat(copies))
    unmerged, _ = policy_loss(logp_M, old_M, adv_M, mask_M, cu_S1, cfg, entropy_M=ent_M, **extra)
    grads = torch.autograd.grad(unmerged, copies)
    grad_unmerged = torch.zeros(T, V).index_add(0, rows_M, torch.cat(grads))

    torch.testing.assert_close(packed, unmerged, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_packed, grad_unmerged, rtol=1e-5, atol=1e-7)
    assert grad_packed[0].abs().sum() > 0  # the shared root row really receives gradient from several samples


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(loss_type="grpo"), "loss_type must be one of ('cispo', 'ppo', 'gspo'), got 'grpo'"),
        (dict(eps_high=-0.1), "eps_low and eps_high must be >= 0, got eps_low=1000000.0, eps_high=-0.1"),
        (dict(dual_clip_c=3.0), "dual_clip_c applies to loss_type='ppo' only, got loss_type='cispo'"),
        (dict(loss_type="ppo", dual_clip_c=1.0), "dual_clip_c must be > 1, got 1.0"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp must be > 0, got 0.0"),
        (dict(norm="sum"), "norm must be one of ('token_mean', 'seq_mean', 'constant'), got 'sum'"),
        (dict(norm="constant"), "norm='constant' needs norm_constant > 0, got None"),
        (dict(kl_type="k2"), "kl_type must be one of ('k1', 'k3'), got 'k2'"),
        (dict(kl_coef=-1.0), "kl_coef and entropy_coef must be >= 0, got kl_coef=-1.0, entropy_coef=0.0"),
        (dict(tis_cap=0.0), "tis_cap must be > 0, got 0.0"),
        (dict(distill_coef=-1.0), "distill_coef and outcome_coef must be >= 0, got distill_coef=-1.0, outcome_coef=1.0"),
        (dict(distill_kl="gkd"), "distill_kl must be one of ('sampled', 'forward', 'reverse', 'jsd'), got 'gkd'"),
        (dict(distill_jsd_beta=0.0), "distill_jsd_beta must lie in (0, 1), got 0.0"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=_exact(message)):
        LossConfig(**kwargs)


def test_recommended_rejects_unknown_loss():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        LossConfig.recommended("a2c")
    assert (LossConfig.recommended("ppo").eps_low, LossConfig.recommended("ppo").eps_high) == (0.2, 0.2)
    tuned = LossConfig.recommended("ppo", eps_high=0.3, dual_clip_c=3.0)
    assert (tuned.loss_type, tuned.eps_low, tuned.eps_high, tuned.dual_clip_c) == ("ppo", 0.2, 0.3, 3.0)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        LossConfig.recommended("ppo", dual_clip_c=0.5)  # overrides are validated too


def _good():
    return dict(logp_M=_t(-1.0, -2.0), old_M=_t(-1.0, -2.0), adv_M=_t(1.0, 1.0), mask_M=_t(1, 1), cu=[0, 1, 2])


@pytest.mark.parametrize(
    "change, kw, message",
    [
        (dict(logp_M=torch.zeros(2, 1)), {}, "logp_M must be 1-D [M], got shape (2, 1)"),
        (dict(old_M=_t(-1.0)), {}, "old_logp_M has shape (1,), expected (2,) like logp_M"),
        (dict(adv_M=_t(float("nan"), 1.0)), {}, "advantages_M has non-finite values"),
        (dict(mask_M=_t(1, 0.5)), {}, "loss_mask_M must contain only 0 and 1"),
        (dict(mask_M=_t(0, 0)), {}, "loss_mask_M selects no tokens: token_mean normaliser is 0"),
        (dict(cu=[0, 1]), {}, "cu_seqlens_S1 must start at 0 and end at M=2, got 0..1"),
        (dict(cu=[0, 2, 2]), {}, "sample 1 is empty (cu_seqlens_S1 must be strictly increasing)"),
        (dict(cu=[2]), {}, "cu_seqlens_S1 must be 1-D with at least 2 entries, got shape (1,)"),
        (dict(cu=[0.0, 2.0]), {}, "cu_seqlens_S1 must be an integer tensor, got torch.float32"),
        ({}, dict(sample_weight_S=_t(1.0)), "sample_weight_S has shape (1,), expected (2,)"),
        ({}, dict(sample_weight_S=_t(1.0, -1.0)), "sample_weight_S must be finite and >= 0"),
        ({}, dict(rollout_logp_M=_t(-1.0, float("inf"))), "rollout_logp_M has non-finite values"),
        ({}, dict(domain_ids_S=torch.tensor([0, 2]), domain_names=["a", "b"]),
         "domain_ids_S must lie in [0, 2) to index domain_names"),
        ({}, dict(domain_ids_S=torch.tensor([0.0, 1.0])), "domain_ids_S must be an integer tensor of shape (2,)"),
        ({}, dict(domain_ids_S=torch.tensor([0, -1])), "domain_ids_S must be >= 0"),
    ],
)
def test_bad_inputs(change, kw, message):
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=_exact(message)):
        _loss(args["logp_M"], args["old_M"], args["adv_M"], args["mask_M"], args["cu"], LossConfig(), **kw)


def test_seq_mean_with_a_batch_normaliser_is_split_invariant():
    """Split a batch into parts holding different numbers of sequences: the per-part losses with norm_constant = the
    whole batch's summed weight add up to the whole batch's seq_mean (per-part means would weight parts equally)."""
    torch.manual_seed(0)
    lengths = [3, 5, 2, 4, 6]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    M = cu[-1]
    logp_M, adv_M = -torch.rand(M), torch.randn(M)
    mask_M = (torch.rand(M) > 0.2).float()
    w_S = torch.tensor([1.0, 0.5, 0.5, 2.0, 1.0])
    whole, _ = _loss(logp_M, logp_M.detach() - 0.1, adv_M, mask_M, cu, LossConfig(norm="seq_mean"), sample_weight_S=w_S)
    parts = []
    for lo, hi in ((0, 1), (1, 5)):  # 1 and 4 sequences
        a, b = cu[lo], cu[hi]
        cu_part = [c - a for c in cu[lo:hi + 1]]
        cfg = LossConfig(norm="seq_mean", norm_constant=float(w_S.sum()))
        part, _ = _loss(logp_M[a:b], logp_M[a:b].detach() - 0.1, adv_M[a:b], mask_M[a:b], cu_part, cfg,
                        sample_weight_S=w_S[lo:hi])
        unnormalised, _ = _loss(logp_M[a:b], logp_M[a:b].detach() - 0.1, adv_M[a:b], mask_M[a:b], cu_part,
                                LossConfig(norm="seq_mean"), sample_weight_S=w_S[lo:hi])
        parts.append((part, unnormalised))
    assert sum(p for p, _ in parts).item() == pytest.approx(whole.item(), rel=1e-6)
    assert (sum(u for _, u in parts) / 2).item() != pytest.approx(whole.item(), rel=1e-3)
    with pytest.raises(ValueError, match="norm_constant must be > 0"):
        LossConfig(norm="seq_mean", norm_constant=0.0)


def test_seq_mean_with_all_zero_sample_weights():
    g = _good()
    with pytest.raises(ValueError, match=_exact("sample_weight_S sums to 0: seq_mean normaliser is 0")):
        _loss(g["logp_M"], g["old_M"], g["adv_M"], g["mask_M"], g["cu"], LossConfig(norm="seq_mean"),
              sample_weight_S=torch.zeros(2))


@pytest.mark.parametrize(
    "cfg, message",
    [
        (LossConfig(tis_cap=2.0), "tis_cap / mismatch_band is set but rollout_logp_M was not given"),
        (LossConfig(kl_coef=0.1), "kl_coef > 0 but ref_logp_M was not given"),
        (LossConfig(entropy_coef=0.1), "entropy_coef > 0 but entropy_M was not given"),
        (LossConfig(distill_coef=1.0), "distill_coef > 0 but teacher_logp_M was not given"),
    ],
)
def test_missing_optional_inputs(cfg, message):
    g = _good()
    with pytest.raises(ValueError, match=_exact(message)):
        _loss(g["logp_M"], g["old_M"], g["adv_M"], g["mask_M"], g["cu"], cfg)


# ---------------------------------------------------------------- micro-batches and devices


def test_constant_norm_micro_batches_sum_to_global_token_mean():
    """Gradient accumulation: micro-batch losses with norm_constant = the global masked-token count add up to the
    token-mean loss of the whole batch (value and gradient)."""
    torch.manual_seed(3)
    cu = torch.tensor([0, 3, 7, 8, 12])
    logp_M = (-torch.rand(12)).requires_grad_()
    old_M, adv_M = logp_M.detach() + 0.2 * torch.randn(12), torch.randn(12)
    mask_M = (torch.rand(12) < 0.7).float()
    mask_M[0] = 1.0
    full, _ = policy_loss(logp_M, old_M, adv_M, mask_M, cu, LossConfig())
    (g_full,) = torch.autograd.grad(full, logp_M)
    cfg = LossConfig(norm="constant", norm_constant=float(mask_M.sum()))
    total = sum(
        policy_loss(logp_M[a:b], old_M[a:b], adv_M[a:b], mask_M[a:b], cu[i:j + 1] - cu[i], cfg)[0]
        for i, j, a, b in ((0, 2, 0, 7), (2, 4, 7, 12))
    )
    (g_total,) = torch.autograd.grad(total, logp_M)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_total, g_full)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["cispo", "ppo", "gspo"])
def test_cuda_matches_cpu(loss_type):
    torch.manual_seed(4)
    cu = torch.tensor([0, 5, 9, 16])
    inputs = dict(old=-torch.rand(16), adv=torch.randn(16), mask=(torch.rand(16) < 0.8).float(),
                  ref=-torch.rand(16), domains=torch.tensor([0, 1, 0]))
    inputs["mask"][0] = 1.0
    logp_cpu = (-torch.rand(16)).requires_grad_()
    cfg = LossConfig.recommended(loss_type, kl_coef=0.1)
    results = []
    for device in ("cpu", "cuda"):
        logp = logp_cpu.detach().to(device).requires_grad_()
        x = {k: v.to(device) for k, v in inputs.items()}
        loss, metrics = policy_loss(logp, x["old"], x["adv"], x["mask"], cu.to(device), cfg, ref_logp_M=x["ref"],
                                    domain_ids_S=x["domains"], domain_names=["a", "b"])
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss.cpu(), grad.cpu(), metrics))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    assert results[1][2] == pytest.approx(results[0][2], rel=1e-5)
