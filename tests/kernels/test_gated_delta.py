"""The gated delta rule over prefix forests (kernels/gated_delta.py) against transformers' Qwen3.5 functions run on
each sample alone, and against the token-by-token definition; forward and gradients."""

import gc

import pytest
import torch
import torch.utils.checkpoint

from forge_megatron.kernels import gated_delta as gd
from forge_megatron.tree import build_tree
from forge_megatron.utils.memory import LiveBytes, frozen_heap

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _samples(seed: int, vocab: int = 5):
    """Samples that share prefixes in every way a batch does: a GRPO group, an agent episode whose calls extend each
    other, a sample that is a prefix of another, duplicates and an unrelated one."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompt = rand(13)
    group = [prompt + rand(int(n)) for n in torch.randint(1, 30, (4,), generator=g)]
    call1 = rand(7) + rand(40)
    episode = [call1, call1 + rand(9), call1 + rand(3) + rand(70)]
    return group + episode + [prompt[:5], group[0], rand(1), rand(20)]


def _inputs(T, Hk, H, dk, dv, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, dk, generator=g, dtype=dtype)
    k = torch.randn(T, Hk, dk, generator=g, dtype=dtype)
    v = torch.randn(T, H, dv, generator=g, dtype=dtype)
    a, b = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    A_log, dt_bias = torch.rand(H, generator=g).log(), torch.randn(H, generator=g)
    decay, beta = gd.gate_and_decay(a, b, A_log, dt_bias)
    return q, k, v, decay, beta


def test_parents_from_depths():
    layout = build_tree(_samples(0))
    parent = gd.tree_parents(layout.position_ids)
    # every sample's tokens, in order, are a root-to-leaf chain of parents
    for s in range(layout.num_samples):
        nodes = layout.sample_nodes[layout.sample_offsets[s]:layout.sample_offsets[s + 1]].tolist()
        assert parent[nodes[0]] == -1
        assert [int(parent[n]) for n in nodes[1:]] == nodes[:-1]
    # and parent / sub_end agree: i lies in its parent's subtree, right after it or after a sibling's subtree
    sub_end = layout.sub_end.long()
    for i, p in enumerate(parent.tolist()):
        if p >= 0:
            assert p < i < sub_end[p]


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_tree_rule_equals_each_sample_alone(chunk):
    samples = _samples(1)
    layout = build_tree(samples)
    T, Hk, H, dk, dv = layout.unique_tokens, 2, 4, 8, 6
    q, k, v, decay, beta = _inputs(T, Hk, H, dk, dv)
    plan = gd.plan_tree(layout.position_ids, chunk=chunk)
    assert len(plan.levels) >= 3  # the episode's calls nest
    out = gd.tree_gated_delta_rule(q, k, v, decay, beta, plan)

    ref = gd.recurrent_reference(q, k, v, decay, beta, gd.tree_parents(layout.position_ids))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for s in range(layout.num_samples):  # transformers' own chunked function on the sample alone
        nodes = layout.sample_nodes[layout.sample_offsets[s]:layout.sample_offsets[s + 1]]
        alone, _ = hf.torch_chunk_gated_delta_rule(q[nodes][None], k[nodes][None], v[nodes][None],
                                                   g=decay[nodes][None], beta=beta[nodes][None],
                                                   use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[nodes], alone[0], rtol=1e-4, atol=1e-5)


def test_tree_rule_gradients_equal_unmerged():
    """Merged training is exact: the gradient of a loss summed over samples equals the sum of each sample's."""
    samples = _samples(2)
    layout = build_tree(samples)
    T, Hk, H, dk, dv = layout.unique_tokens, 1, 2, 8, 4
    inputs = [x.requires_grad_() for x in _inputs(T, Hk, H, dk, dv, seed=3)]

    def alone(parts, nodes):
        out, _ = hf.torch_recurrent_gated_delta_rule(*(x[None] for x in parts[:3]), g=parts[3][None],
                                                     beta=parts[4][None], use_qk_l2norm_in_kernel=True)
        return out[0]

    merged, unmerged = _merged_and_alone_grads(layout, inputs, 8, alone)
    for got, want in zip(merged, unmerged):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _merged_and_alone_grads(layout, inputs, chunk, alone):
    """Every input's gradient of a weighted sum of the tree rule's outputs over the samples, and of the same sum of
    ``alone(inputs' rows of a sample, its nodes)`` per sample."""
    w = torch.randn(layout.total_tokens, inputs[2].shape[1], inputs[2].shape[2], dtype=inputs[2].dtype)
    out = gd.tree_gated_delta_rule(*inputs, gd.plan_tree(layout.position_ids, chunk=chunk))
    merged = torch.autograd.grad((out[layout.sample_nodes] * w).sum(), inputs)
    total = 0
    for s in range(layout.num_samples):
        lo, hi = layout.sample_offsets[s], layout.sample_offsets[s + 1]
        nodes = layout.sample_nodes[lo:hi]
        total = total + (alone([x[nodes] for x in inputs], nodes) * w[lo:hi]).sum()
    return merged, torch.autograd.grad(total, inputs)


def test_initial_and_final_states_match_transformers():
    q, k, v, decay, beta = _inputs(40, 2, 2, 8, 8, seed=4)
    qn, kn, _, _ = gd._prepare(q, k, decay, beta, 2, None, True)
    init = torch.randn(1, 2, 8, 8)
    pad = lambda x: torch.cat([x, x.new_zeros(8, *x.shape[1:])])[None]  # noqa: E731  40 -> 48, padding
    o, final = gd.chunked_gated_delta(pad(qn), pad(kn), pad(v), pad(decay), pad(beta), init, chunk=16)
    want_o, want_final = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=decay[None],
                                                             beta=beta[None], initial_state=init,
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o[:, :40], want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, want_final, rtol=1e-4, atol=1e-5)  # padding left the state as it was


def test_chains_plan_matches_batched_sequences():
    B, S = 3, 21
    q, k, v, decay, beta = _inputs(B * S, 2, 4, 8, 8, seed=5)
    out = gd.tree_gated_delta_rule(q, k, v, decay, beta, gd.plan_chains(S, B, chunk=8))
    want, _ = hf.torch_chunk_gated_delta_rule(*(x.reshape(B, S, *x.shape[1:]) for x in (q, k, v)),
                                              g=decay.reshape(B, S, -1), beta=beta.reshape(B, S, -1),
                                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out.reshape(B, S, 4, 8), want, rtol=1e-4, atol=1e-5)


def test_tree_conv_equals_each_sample_alone():
    samples = _samples(6)
    layout = build_tree(samples)
    T, C, K = layout.unique_tokens, 10, 4
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(T, C, generator=g), torch.randn(C, K, generator=g)
    plan = gd.plan_tree(layout.position_ids, conv_kernel=K)
    out = gd.tree_causal_conv(x, weight, plan)
    for s in range(layout.num_samples):
        nodes = layout.sample_nodes[layout.sample_offsets[s]:layout.sample_offsets[s + 1]]
        alone = hf.causal_conv1d_fn(x[nodes].t()[None], weight)  # no activation
        torch.testing.assert_close(out[nodes], alone[0].t(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kernel of 2"):
        gd.tree_causal_conv(x, weight, gd.plan_tree(layout.position_ids, conv_kernel=2))


def test_tree_conv_backward_passes_gradcheck():
    """The convolution's hand-written backward (it keeps x, not the K gathered copies) against finite differences
    in fp64, over a forest with branch points, roots and paths shorter than the kernel."""
    layout = build_tree(_samples(28)[:6])
    plan = gd.plan_tree(layout.position_ids, conv_kernel=4)
    g = torch.Generator().manual_seed(29)
    x = torch.randn(layout.unique_tokens, 3, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()
    for silu in (False, True):  # SiLU fused in (Gated DeltaNet's q, k, v): recomputed in the backward too
        assert torch.autograd.gradcheck(lambda *xs: gd.tree_causal_conv(xs[0], xs[1], plan, xs[2], silu=silu),
                                        (x, w, bias))
    out = gd.tree_causal_conv(x, w, plan, bias, silu=True)
    torch.testing.assert_close(out, torch.nn.functional.silu(gd.tree_causal_conv(x, w, plan, bias)))


def test_levels_group_segments_by_depth_and_length():
    # one prompt, three completions (2, 1 and 3 tokens): the prompt is level 0 (one segment), the completions
    # level 1, run in batches of similar length (3 and 2 together, 1 alone: padding at most doubles a batch)
    layout = build_tree([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 7, 8, 9]])
    plan = gd.plan_tree(layout.position_ids, chunk=4)
    assert plan.num_segments == 4
    # chunks of at most 4, smaller for shorter segments: widths 4 (3 tokens), 4 (3 and 2), 1 (1 token)
    assert [lv.tokens.shape for lv in plan.levels] == [torch.Size([1, 4]), torch.Size([2, 4]), torch.Size([1, 1])]
    assert [lv.chunk for lv in plan.levels] == [4, 4, 1]
    assert [lv.parents.tolist() for lv in plan.levels] == [[-1], [0, 0], [0]]
    assert [(lv.tokens < layout.unique_tokens).sum(1).tolist() for lv in plan.levels] == [[3], [3, 2], [1]]
    assert (plan.levels[0].tokens[0, :3] == torch.tensor([0, 1, 2])).all()
    assert (plan.levels[0].tokens[0, 3:] == layout.unique_tokens).all()  # padding
    assert gd.plan_tree(layout.position_ids, chunk=64).levels[1].tokens.shape == (2, 4)  # not padded to 64
    # a level of one long segment and many short ones is not padded to the long one
    prompt = list(range(10, 20))
    uneven = [prompt + list(range(100, 400))] + [prompt + [i, i + 1] for i in range(500, 540, 2)]
    plan = gd.plan_tree(build_tree(uneven).position_ids, chunk=4)
    padded = sum(lv.tokens.numel() for lv in plan.levels)
    assert padded <= 2 * build_tree(uneven).unique_tokens + 4 * plan.num_segments
    empty = gd.plan_tree(torch.zeros(0, dtype=torch.long))
    assert empty.num_segments == 0 and empty.levels == []


def test_decay_parameter_gradients_are_exact_in_float64():
    """A_log and dt_bias get their gradients as sums over every token of terms that largely cancel, so in fp32 the
    tree (chunks per segment) and the samples alone (chunks per sequence) agree only to the rounding of the terms.
    In fp64 the two agree to 1e-10: the model-level tests' looser bound on these two gradients is rounding."""
    samples = _samples(8)
    layout = build_tree(samples)
    T, Hk, H, dk, dv = layout.unique_tokens, 2, 4, 8, 6
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(T, Hk, dk, generator=g, dtype=torch.float64), torch.randn(T, Hk, dk, generator=g,
                                                                                   dtype=torch.float64)
    v = torch.randn(T, H, dv, generator=g, dtype=torch.float64)
    a, b = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(T, H, generator=g, dtype=torch.float64)
    A_log = torch.rand(H, generator=g, dtype=torch.float64).log().requires_grad_()
    dt_bias = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(layout.total_tokens, H, dv, generator=g, dtype=torch.float64)

    decay, beta = gd.gate_and_decay(a, b, A_log, dt_bias)
    out = gd.tree_gated_delta_rule(q, k, v, decay, beta, gd.plan_tree(layout.position_ids, chunk=8))
    assert out.dtype == torch.float64
    (out[layout.sample_nodes] * w).sum().backward()
    merged = A_log.grad.clone(), dt_bias.grad.clone()
    A_log.grad = dt_bias.grad = None
    total = 0
    for s in range(layout.num_samples):
        lo, hi = layout.sample_offsets[s], layout.sample_offsets[s + 1]
        nodes = layout.sample_nodes[lo:hi]
        chain = torch.arange(len(nodes)) - 1
        d, bt = gd.gate_and_decay(a[nodes], b[nodes], A_log, dt_bias)
        total = total + (gd.recurrent_reference(q[nodes], k[nodes], v[nodes], d, bt, chain) * w[lo:hi]).sum()
    total.backward()
    torch.testing.assert_close(merged[0], A_log.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(merged[1], dt_bias.grad, rtol=1e-10, atol=1e-12)


def _chunk_inputs(B, L, H, dk, dv, seed, dtype=torch.float32):
    """Normalised keys and queries (as the layer's), decays and write strengths, an initial state."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    q = torch.nn.functional.normalize(rand(B, L, H, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(rand(B, L, H, dk), dim=-1)
    decay = -torch.rand(B, L, H, generator=g, dtype=dtype)
    beta = torch.rand(B, L, H, generator=g, dtype=dtype)
    return [q, k, rand(B, L, H, dv), decay, beta, rand(B, H, dk, dv)]


def test_chunk_scan_backward_passes_gradcheck():
    """The scan's hand-written backward (recomputed states, one reverse scan) against finite differences, in fp64,
    through every input: q, k, v, decays, write strengths and the initial state."""
    inputs = [x.requires_grad_() for x in _chunk_inputs(2, 12, 2, 3, 4, seed=20, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *xs: gd.chunked_gated_delta(*xs, chunk=4, backend="torch"), inputs)
    # the plain rule (Mamba-2: no correction term, so no W anywhere in the scan)
    assert torch.autograd.gradcheck(lambda *xs: gd.chunked_gated_delta(*xs, chunk=4, backend="torch", delta=False),
                                    inputs)


def test_chunk_scan_saves_nothing_per_chunk():
    """What the backward keeps does not grow with the number of chunks beyond the per-token inputs: no state per
    chunk is saved (a [dk, dv] state per chunk is what autograd through the loop kept, with every chunk's Vn)."""
    def saved_state_tensors(L):
        inputs = [x.requires_grad_() for x in _chunk_inputs(1, L, 2, 8, 8, seed=21)]
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            gd.chunked_gated_delta(*inputs, chunk=4, backend="torch")
        return sum(1 for shape in shapes if shape[-2:] == (8, 8))  # states are [.., dk, dv] = [.., 8, 8]

    assert saved_state_tensors(8) == saved_state_tensors(64) == 1  # the initial state, whatever the length


def test_recompute_keeps_only_the_inputs():
    """By default the forest rule keeps nothing but its inputs for the backward (an activation checkpoint): between
    forward and backward the only memory it made that is still alive is its output. The gradients are bit-identical
    to keeping everything."""
    layout = build_tree(_samples(26))
    inputs = _inputs(layout.unique_tokens, 2, 4, 16, 16, seed=27)
    plan = gd.plan_tree(layout.position_ids, chunk=16)
    live, grads = {}, {}
    for recompute in (False, True):
        xs = [x.clone().requires_grad_() for x in inputs]
        with frozen_heap():  # (the collection walks only what the rule made)
            with LiveBytes(xs) as mode:
                out = gd.tree_gated_delta_rule(*xs, plan, recompute=recompute)
            gc.collect()
        live[recompute] = mode.live - out.untyped_storage().nbytes()
        grads[recompute] = torch.autograd.grad(out.square().sum(), xs)
    assert live[False] > 10 * out.untyped_storage().nbytes()  # every chunk's terms, without recomputation
    assert live[True] == 0
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)
    # inside an outer reentrant checkpoint (Megatron's recomputation), the two nest
    xs = [x.clone().requires_grad_() for x in inputs]
    out = torch.utils.checkpoint.checkpoint(lambda *ys: gd.tree_gated_delta_rule(*ys, plan), *xs, use_reentrant=True)
    out.square().sum().backward()
    for x, b in zip(xs, grads[False]):
        assert torch.equal(x.grad, b)


@pytest.mark.parametrize("B,L,H,dk,dv,chunk,per_channel,narrow,delta", [
    (2, 48, 3, 24, 40, 16, False, False, True), (1, 64, 2, 130, 100, 32, False, False, True),
    (2, 128, 1, 16, 16, 64, False, False, True), (2, 48, 3, 24, 40, 16, True, False, True),
    (1, 32, 2, 130, 20, 16, True, False, True), (1, 48, 2, 32, 72, 16, False, True, True),
    (2, 48, 3, 24, 40, 16, False, False, False)])
def test_triton_scan_matches_torch(B, L, H, dk, dv, chunk, per_channel, narrow, delta, monkeypatch):
    """The Triton scans (interpreter on CPU) against the torch scans: outputs, final state and the gradients of
    every input. Shapes cover masked key / value blocks (24 x 40), several value blocks with the 256-wide key block
    (130 x 100) and one block at chunk 64; ``per_channel``: the PER_ROW variant, a decay per key channel (Kimi Delta
    Attention), whose gradient is then one per channel; ``narrow``: value blocks narrowed to 16 columns for a launch
    of few programs (as on a GPU with more multiprocessors than sequences x heads x value blocks), the last one
    masked; ``delta=False``: the plain rule (Mamba-2; no W, HAS_W off)."""
    if narrow:
        from forge_megatron.kernels import gated_delta_triton as gt

        monkeypatch.setattr(gt, "programs_wanted", lambda device: 1000)
        assert gt.blocks(dk, dv, B * H, 1000) == (32, 16)
    inputs = _chunk_inputs(B, L, H, dk, dv, seed=22)
    if per_channel:
        inputs[3] = -torch.rand(B, L, H, dk, generator=torch.Generator().manual_seed(27))
    g = torch.Generator().manual_seed(23)
    w_o, w_s = torch.randn(B, L, H, dv, generator=g), torch.randn(B, H, dk, dv, generator=g)
    results = {}
    for backend in ("torch", "triton"):
        xs = [x.clone().requires_grad_() for x in inputs]
        o, final = gd.chunked_gated_delta(*xs, chunk=chunk, backend=backend, delta=delta)
        grads = torch.autograd.grad((o * w_o).sum() + (final * w_s).sum(), xs)
        results[backend] = (o, final, *grads)
    for name, a, b in zip(["o", "final", "dq", "dk", "dv", "ddecay", "dbeta", "dstate"], results["torch"],
                          results["triton"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


def test_triton_scan_value_blocks_narrow_for_small_launches():
    from forge_megatron.kernels import gated_delta_triton as gt

    assert gt.blocks(128, 128) == (128, 64)  # no device to fill (the interpreter): the widest block
    assert gt.blocks(128, 128, BH=32, min_programs=264) == (128, 16)  # the H200 benchmark's 4 x 8 heads
    assert gt.blocks(128, 128, BH=128, min_programs=264) == (128, 32)
    assert gt.blocks(128, 128, BH=512, min_programs=264) == (128, 64)
    assert gt.blocks(256, 256, BH=1, min_programs=10**6) == (256, 16)
    assert gt.programs_wanted(torch.device("cpu")) == 0


def test_triton_scan_over_a_forest_equals_the_definition():
    """The forest's levels with the Triton scan (segments of 16 tokens or more; shorter ones take the torch scan
    whatever is asked) against the token-by-token definition, forward and gradients."""
    layout = build_tree(_samples(24))
    T, Hk, H, dk, dv = layout.unique_tokens, 2, 4, 16, 16
    inputs = [x.requires_grad_() for x in _inputs(T, Hk, H, dk, dv, seed=25)]
    plan = gd.plan_tree(layout.position_ids, chunk=16)
    assert any(level.chunk == 16 and level.tokens.shape[1] > 16 for level in plan.levels)  # Triton runs, n > 1
    out = gd.tree_gated_delta_rule(*inputs, plan, backend="triton")
    ref = gd.recurrent_reference(*inputs, gd.tree_parents(layout.position_ids))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * w).sum(), inputs)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_scan_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(gd.SCAN_BACKEND_ENV, raising=False)
    assert gd.scan_backend(cpu, torch.float32, 64, 128) == "torch"  # automatic on CPU
    assert gd.scan_backend(torch.device("cuda"), torch.float32, 64, 128) == "torch"  # and on CUDA (measured faster)
    assert gd.scan_backend(cpu, torch.float32, 64, 128, "triton") == "triton"  # interpreter (conftest)
    assert gd.scan_backend(cpu, torch.float64, 64, 128, "triton") == "torch"  # fp64: the kernels are fp32
    assert gd.scan_backend(cpu, torch.float32, 8, 128, "triton") == "torch"  # a one-chunk segment under 16 tokens
    assert gd.scan_backend(cpu, torch.float32, 64, 512, "triton") == "torch"  # key heads over 256
    monkeypatch.setenv(gd.SCAN_BACKEND_ENV, "triton")
    assert gd.scan_backend(cpu, torch.float32, 64, 128) == "triton"
    monkeypatch.setenv(gd.SCAN_BACKEND_ENV, "fla")
    with pytest.raises(ValueError, match="unknown gated delta scan backend 'fla'"):
        gd.scan_backend(cpu, torch.float32, 64, 128)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
        gd.scan_backend(cpu, torch.float32, 64, 128, "triton")


def test_triton_scan_compiles_for_sm90_without_gpu():
    """The scan kernels lower to an sm_90 cubin (ieee fp32 dots, two pipeline stages) and fit an H100's shared
    memory (227 KiB per block) at the head sizes of Qwen3.5 / Qwen3-Next (128) and the largest taken (256), with
    a decay per key channel at Kimi Linear's, with narrowed value blocks, and the plain rule's (Mamba-2's)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("triton_aot.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shapes = ["128x128x64", "256x256x64", "24x40x16", "128x128x16r", "128x128x64/16", "128x64x64p"]  # one process:
    # triton's start-up once; r: a decay per key channel (Kimi Delta Attention: Kimi Linear's 128-channel heads in
    # chunks of 16); /16: value blocks narrowed to 16 columns (a launch of few programs); p: the plain rule (Mamba-2's
    # state of 128 by heads of 64: Nemotron-H's, Granite 4.0-H's)
    proc = subprocess.run([sys.executable, str(script), "--gated-delta", *shapes], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [(line[1], line[2]) for line in lines] == [(shape, kernel) for shape in shapes
                                                      for kernel in ("_scan_fwd_kernel", "_scan_bwd_kernel")]
    assert all(int(line[3].removeprefix("shared=")) <= 227 * 1024 for line in lines), proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rule_on_cuda_matches_the_fp64_reference(dtype, backend, monkeypatch):
    """The same forest on a GPU (bf16 inputs as the trainer's, fp32 inside) against the fp64 definition on CPU;
    gradients too; with either scan (torch: the automatic choice on CUDA too)."""
    monkeypatch.setenv(gd.SCAN_BACKEND_ENV, backend)
    samples = _samples(10)
    layout = build_tree(samples)
    T, Hk, H, dk, dv = layout.unique_tokens, 2, 4, 16, 16
    dev = [x.to("cuda", dtype if i < 3 else torch.float32).requires_grad_()
           for i, x in enumerate(_inputs(T, Hk, H, dk, dv, seed=11))]
    ref = gd.recurrent_reference(*(x.detach().cpu().double() for x in dev), gd.tree_parents(layout.position_ids))
    assert gd.scan_backend(dev[0].device, torch.float32, 64, dk) == backend
    monkeypatch.delenv(gd.SCAN_BACKEND_ENV)
    assert gd.scan_backend(dev[0].device, torch.float32, 64, dk) == "torch"  # the automatic choice on CUDA
    monkeypatch.setenv(gd.SCAN_BACKEND_ENV, backend)
    out = gd.tree_gated_delta_rule(*dev, gd.plan_tree(layout.position_ids.cuda()))
    assert out.dtype == dtype and out.is_cuda
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)
    out.float().square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in dev)


# ------------------------------------------------------------------- a decay per key channel (Kimi Delta Attention)
kda = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _channel_decay(T, H, dk, seed, dtype=torch.float32):
    """Kimi Linear's forget gate: -exp(A_log) * softplus(f + dt_bias) per head and key channel."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(T, H, dk, generator=g, dtype=dtype)
    return -torch.rand(H, 1, generator=g, dtype=dtype).mul(3).exp() * torch.nn.functional.softplus(f - 2)


@pytest.mark.parametrize("chunk", [4, 16])
def test_channel_decay_tree_rule_equals_each_sample_alone(chunk):
    """With a decay per key channel, the tree's chunked rule equals the token-by-token definition along every path
    and transformers' Kimi Linear functions (chunked and recurrent) on each sample alone."""
    samples = _samples(11)
    layout = build_tree(samples)
    T, H, dk, dv = layout.unique_tokens, 3, 8, 6
    q, k, v, _, beta = _inputs(T, H, H, dk, dv, seed=12)
    decay = _channel_decay(T, H, dk, seed=13)
    out = gd.tree_gated_delta_rule(q, k, v, decay, beta, gd.plan_tree(layout.position_ids, chunk=chunk))
    ref = gd.recurrent_reference(q, k, v, decay, beta, gd.tree_parents(layout.position_ids))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    scalar = gd.tree_gated_delta_rule(q, k, v, decay.mean(-1), beta, gd.plan_tree(layout.position_ids, chunk=chunk))
    assert (scalar - out).abs().max() > 1e-2  # the channels' own decays matter
    for s in range(layout.num_samples):
        nodes = layout.sample_nodes[layout.sample_offsets[s]:layout.sample_offsets[s + 1]]
        parts = [x[nodes][None] for x in (q, k, v)]
        for fn in (kda.chunk_kimi_delta_attention, kda.recurrent_kimi_delta_attention):
            alone, _ = fn(*parts, g=decay[nodes][None], beta=beta[nodes][None], initial_state=None,
                          output_final_state=False, use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(out[nodes], alone[0], rtol=1e-4, atol=1e-5)


def test_channel_decay_gradients_equal_unmerged_in_float64():
    """Merged training with a decay per channel is exact: every input's gradient (the decays' too) equals the sum
    of the samples' alone, to fp64 rounding."""
    samples = _samples(14)
    layout = build_tree(samples)
    T, H, dk, dv = layout.unique_tokens, 2, 4, 3
    q, k, v, _, beta = _inputs(T, H, H, dk, dv, seed=15, dtype=torch.float64)
    inputs = [x.double().requires_grad_() for x in (q, k, v, _channel_decay(T, H, dk, 16, torch.float64), beta)]
    merged, unmerged = _merged_and_alone_grads(
        layout, inputs, 4, lambda parts, nodes: gd.recurrent_reference(*parts, torch.arange(len(nodes)) - 1))
    for got, want in zip(merged, unmerged):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_channel_decay_chunk_scan_passes_gradcheck():
    """The scan's hand-written backward with a decay vector per chunk, against finite differences in fp64."""
    inputs = _chunk_inputs(2, 12, 2, 3, 4, seed=21, dtype=torch.float64)
    inputs[3] = -torch.rand(2, 12, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(22))
    inputs = [x.requires_grad_() for x in inputs]
    assert torch.autograd.gradcheck(lambda *xs: gd.chunked_gated_delta(*xs, chunk=4, backend="torch"), inputs)



@pytest.mark.parametrize("chunk", [4, 64])
def test_plain_gated_rule_is_mamba2_on_each_sample_alone(chunk):
    """delta=False is Mamba-2's state space duality (no correction term): over a forest it equals the token-by-token
    definition, and on each sample alone transformers' Mamba-2 chunked scan (x -> v, B -> k, C -> q, dt -> beta,
    dt * A -> the log decay; no normalisation, scale 1), forward and gradients."""
    mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    samples = _samples(4)
    layout = build_tree(samples)
    T, G, H, N, P = layout.unique_tokens, 2, 4, 8, 6
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, P, generator=g, dtype=torch.float64, requires_grad=True)
    Bm = torch.randn(T, G, N, generator=g, dtype=torch.float64, requires_grad=True)
    Cm = torch.randn(T, G, N, generator=g, dtype=torch.float64, requires_grad=True)
    dt = torch.nn.functional.softplus(torch.randn(T, H, generator=g, dtype=torch.float64)).requires_grad_()
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 4
    plan = gd.plan_tree(layout.position_ids, chunk=chunk)
    out = gd.tree_gated_delta_rule(Cm, Bm, x, dt * A, dt, plan, scale=1.0, l2norm=False, delta=False)
    ref = gd.recurrent_reference(Cm, Bm, x, dt * A, dt, gd.tree_parents(layout.position_ids), scale=1.0,
                                 l2norm=False, delta=False)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    with_delta = gd.tree_gated_delta_rule(Cm, Bm, x, dt * A, dt, plan, scale=1.0, l2norm=False)
    assert (with_delta - out).abs().max() > 1e-2  # the correction term matters at this scale
    w = torch.randn(layout.total_tokens, H, P, generator=g, dtype=torch.float64)
    inputs = (x, Bm, Cm, dt)
    merged = torch.autograd.grad((out[layout.sample_nodes] * w).sum(), inputs)
    total = 0
    for s in range(layout.num_samples):
        lo, hi = layout.sample_offsets[s], layout.sample_offsets[s + 1]
        nodes = layout.sample_nodes[lo:hi]
        alone = mamba2.mamba2_chunk_scan(x[nodes][None], dt[nodes][None], A, Bm[nodes][None], Cm[nodes][None],
                                         chunk_size=8)[0]
        # (transformers' scan computes in fp32 whatever its inputs)
        torch.testing.assert_close(out[nodes].float(), alone.float(), rtol=1e-4, atol=1e-5)
        total = total + (alone.to(w.dtype) * w[lo:hi]).sum()
    unmerged = torch.autograd.grad(total, inputs)
    for got, want in zip(merged, unmerged):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-5)
