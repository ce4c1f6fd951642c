"""CUDA tree attention (forge_megatron._C_tree_attn) vs the dense reference.

GPUs needed: 0 for the availability/fake-tensor tests and for the CPU emulation tests, 1 for the `gpu` ones (they
also need the extension built: `python setup.py build_ext --inplace` on a CUDA machine, see benchmarks/gpu_check.sh).

The emulation tests compile the real kernel source (csrc/tree_attn/tree_attn_kernels.cuh, fp32 instantiations) with
the host compiler and tests/kernels/cuda_emu.cpp, which runs every CUDA thread as a fiber with real barriers and
warp shuffles, and check forward and backward against the reference: the kernels' indexing, tile skipping, masking,
online softmax, GQA reduction and fp16/bf16 conversions are tested on every CI machine that has the CUDA headers
(any machine with nvcc).
"""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from tree_cases import (
    check_against_reference,
    check_suffix_queries,
    cuda_include_dir,
    forest_cases,
    random_qkv,
    sub_end_from_samples,
)

from forge_megatron.kernels.tree_attention import cuda
from forge_megatron.utils import env

CASES = forest_cases()


def test_is_available_matches_environment():
    assert cuda.is_available() == (env.has_cuda() and env.has_cuda_ext())


@pytest.mark.skipif(cuda.is_available(), reason="checks the error raised where the extension cannot run")
def test_unavailable_raises_with_instructions():
    q, k, v = random_qkv(5, 2, 1, 32, torch.float32)
    with pytest.raises(RuntimeError, match="is not available .*needed for the CUDA tree attention kernel.*To get it"):
        cuda.tree_attention_cuda(q, k, v, torch.full((5,), 5, dtype=torch.int32))


def test_fake_impl_shapes_without_extension():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(9, 4, 64), torch.empty(9, 1, 64), torch.empty(9, 1, 64)
        sub_end = torch.empty(9, dtype=torch.int32)
        o, lse = cuda.tree_attention_cuda_op(q, k, v, sub_end, 0.125)
        dq, dk, dv = torch.ops.forge.tree_attn_cuda_bwd(o, q, k, v, o, lse, sub_end, 0.125)
    assert (o.shape, lse.shape, dq.shape, dk.shape, dv.shape) == ((9, 4, 64), (4, 9), (9, 4, 64), (9, 1, 64), (9, 1, 64))


CSRC = Path(__file__).resolve().parents[2] / "csrc" / "tree_attn"


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """ctypes handle to the CPU emulation of the CUDA kernels, built from the real kernel source."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not env.has_nvcc() or cxx is None:
        pytest.skip("needs the CUDA toolkit headers (nvcc installed) and a C++20 compiler")
    lib = tmp_path_factory.mktemp("cuda_emu") / "cuda_emu.so"
    cmd = [cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-w", f"-I{cuda_include_dir()}", f"-I{CSRC}",
           str(Path(__file__).with_name("cuda_emu.cpp")), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ctypes.CDLL(str(lib))


def _ptr(x: torch.Tensor) -> ctypes.c_void_p:
    assert x.is_contiguous() and x.device.type == "cpu"
    return ctypes.c_void_p(x.data_ptr())


_EMU_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_EMU_IMPLS = {"simt": 0, "mma": 1}


class _Emulated(torch.autograd.Function):
    """The CUDA kernels run by the emulator, wired like the real op: forward saves lse, backward uses delta."""

    @staticmethod
    def forward(ctx, lib, impl, q_TNH, k_TKH, v_TKH, sub_end_T, scale):
        Tq, N, H = q_TNH.shape
        o_TNH, lse_NT = torch.empty_like(q_TNH), torch.empty(N, Tq)
        rc = lib.emu_fwd(_ptr(q_TNH), _ptr(k_TKH), _ptr(v_TKH), _ptr(sub_end_T), _ptr(o_TNH), _ptr(lse_NT),
                         k_TKH.shape[0], Tq, N, k_TKH.shape[1], H, ctypes.c_float(scale), _EMU_DTYPES[q_TNH.dtype],
                         _EMU_IMPLS[impl])
        assert rc == 0, f"emu_fwd returned {rc} (1: unsupported head_dim {H} / dtype / impl, 2: shared memory overflow)"
        ctx.save_for_backward(q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T)
        ctx.lib, ctx.impl, ctx.scale = lib, impl, scale
        return o_TNH

    @staticmethod
    def backward(ctx, do_TNH):
        q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T = ctx.saved_tensors
        do_TNH = do_TNH.contiguous()
        delta_NT = (do_TNH.float() * o_TNH.float()).sum(-1).t().contiguous()
        dq, dk, dv = torch.empty_like(q_TNH), torch.empty_like(k_TKH), torch.empty_like(v_TKH)
        Tq, N, H = q_TNH.shape
        rc = ctx.lib.emu_bwd(_ptr(do_TNH), _ptr(q_TNH), _ptr(k_TKH), _ptr(v_TKH), _ptr(lse_NT), _ptr(delta_NT),
                             _ptr(sub_end_T), _ptr(dq), _ptr(dk), _ptr(dv), k_TKH.shape[0], Tq, N, k_TKH.shape[1], H,
                             ctypes.c_float(ctx.scale), _EMU_DTYPES[q_TNH.dtype], _EMU_IMPLS[ctx.impl])
        assert rc == 0, f"emu_bwd returned {rc} (1: unsupported head_dim {H} / dtype / impl, 2: shared memory overflow)"
        return None, None, dq, dk, dv, None, None


def _emulated_attention(lib, impl="simt"):
    def attention(q_TNH, k_TKH, v_TKH, sub_end_T, softmax_scale=None):
        scale = softmax_scale if softmax_scale is not None else q_TNH.shape[2] ** -0.5
        return _Emulated.apply(lib, impl, q_TNH.contiguous(), k_TKH.contiguous(), v_TKH.contiguous(),
                               sub_end_T.contiguous(), scale)

    return attention


@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_cuda_kernels_match_reference(emu, case):
    check_against_reference(_emulated_attention(emu), CASES[case], N=2, K=1, H=32, dtype=torch.float32)


def test_emulated_cuda_kernels_gqa_head_dim_64_and_scale(emu):
    check_against_reference(_emulated_attention(emu), CASES["grpo"], N=4, K=2, H=64, dtype=torch.float32, scale=0.2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_cuda_kernels_low_precision(emu, dtype):
    check_against_reference(_emulated_attention(emu), CASES["many_roots"], N=2, K=1, H=32, dtype=dtype)


@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_kernels_at_the_gpu_tests_shapes(emu, impl, dtype):
    """test_gpu_matches_reference's heads (8 query heads on 2 key/value heads, H = 64) on every forest: within
    check_against_reference's rule, whose low-precision math rounds as FlashAttention-style kernels do. (Its first
    H200 run measured the low-precision error with SDPA's fused kernel, fp32 inside: dK of many_roots and random_trie
    then came out 1.07-1.18x over budget on these emulated kernels too.)"""
    for se in CASES.values():
        check_against_reference(_emulated_attention(emu, impl), se, N=8, K=2, H=64, dtype=dtype)


# Tensor-core kernels (tree_attn_mma.cuh): fragments, ldmatrix, cp.async ordering and the atomic dQ, emulated lane by
# lane. Forests wider than one 64-token tile (grpo: 97+ tokens, long_chain: 77) exercise skipped, full and partial
# tiles at warp granularity; the GQA case sums dK/dV over two query heads and dQ over two key blocks.
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_mma_kernels_match_reference(emu, case, dtype):
    check_against_reference(_emulated_attention(emu, "mma"), CASES[case], N=2, K=1, H=32, dtype=dtype)


@pytest.mark.parametrize("H,scale", [(64, 0.2), (128, None)])
def test_emulated_mma_kernels_head_dims_gqa_and_scale(emu, H, scale):
    """H = 64 and 128 use different backward query tiles (64 and 32) and dQ warp splits (4x1 and 2x2)."""
    se = sub_end_from_samples([list(range(70)) + [100 + i] + list(range(i % 3 * 7)) for i in range(3)])
    check_against_reference(_emulated_attention(emu, "mma"), se, N=4, K=2, H=H, dtype=torch.bfloat16, scale=scale)


@pytest.mark.parametrize("impl", ["mma", "simt"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("forest", ["long_prefix", "chains"])
def test_emulated_kernels_full_and_straddling_tiles(emu, dtype, forest, impl):
    """long_prefix: a 200-token shared prompt, whose key tiles are full (unmasked) for every later warp of queries,
    next to partial and skipped tiles among the completions. chains: disjoint chains of 90, 100 and 110 tokens
    (subtrees ending at 90, 190, 300), so a whole 64-key tile lies before a warp of queries in which its subtrees end
    (rows 80-95 of a 16-row warp, rows 64-95 of a 32-row warp, 16-31 rows in; query tile 64-127 in the backward):
    that tile is partial for the warp, and treating it as full would leak attention."""
    samples = {"long_prefix": [list(range(200)) + [1000 + i] + list(range(2000, 2000 + 30 + 9 * i)) for i in range(3)],
               "chains": [[r] + list(range(100, 100 + 89 + 10 * r)) for r in range(3)]}[forest]
    check_against_reference(_emulated_attention(emu, impl), sub_end_from_samples(samples), N=2, K=1, H=32, dtype=dtype)


def _fa2_numerics(q, k, v, do, sub_end, scale):
    """FlashAttention-2's backward roundings simulated in fp32 torch: delta = rowsum(dO * O) from the output O rounded
    to the input dtype, P rounded before P^T dO, dS rounded before dS K and dS^T Q; outputs rounded."""
    dt, T, N, K = q.dtype, q.shape[0], q.shape[1], k.shape[1]
    i = torch.arange(T)
    vis = (i[None, :] <= i[:, None]) & (i[:, None] < sub_end[None, :].long())
    qf, kf, vf, dof = (x.float() for x in (q, k, v, do))
    kr, vr = kf.repeat_interleave(N // K, 1), vf.repeat_interleave(N // K, 1)
    p = torch.softmax(torch.einsum("inh,jnh->nij", qf, kr).mul(scale).masked_fill(~vis, float("-inf")), -1)
    o = torch.einsum("nij,jnh->inh", p, vr).to(dt)
    delta = (dof * o.float()).sum(-1).t()
    ds = (p * (torch.einsum("inh,jnh->nij", dof, vr) - delta[:, :, None])).to(dt).float()
    dq = torch.einsum("nij,jnh->inh", ds, kr) * scale
    dk = (torch.einsum("nij,inh->jnh", ds, qf) * scale).unflatten(1, (K, N // K)).sum(2)
    dv = torch.einsum("nij,inh->jnh", p.to(dt).float(), dof).unflatten(1, (K, N // K)).sum(2)
    return o, dq.to(dt), dk.to(dt), dv.to(dt)


def test_emulated_mma_kernels_follow_flash_attention_numerics(emu):
    """With a sharp softmax (scale 0.2 at H = 128: logits with standard deviation 2.3) the kernels must agree with
    FlashAttention-2's bf16 roundings (delta from the bf16 output, bf16 dS) simulated in torch to within two bf16
    ulps of each output's largest value (the simulation and the kernels differ only in summation order): a bound
    on the kernels' arithmetic itself, tighter than check_against_reference's error budget."""
    se = sub_end_from_samples([list(range(70)) + [100 + i] + list(range(i % 3 * 7)) for i in range(3)])
    q, k, v = random_qkv(se.shape[0], 4, 2, 128, torch.bfloat16)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = _emulated_attention(emu, "mma")(q, k, v, se, softmax_scale=0.2)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    for name, g, want in zip(("o", "dq", "dk", "dv"), got, _fa2_numerics(q.detach(), k.detach(), v.detach(), do, se, 0.2)):
        ulp = 2.0 ** (torch.frexp(want.float().abs().max()).exponent.item() - 8)
        err = (g.float() - want.float()).abs().max().item()
        assert err <= 2 * ulp, f"{name}: {err:.3g} from FlashAttention-2 numerics (2 ulp = {2 * ulp:.3g})"


def test_emulated_mma_rejects_fp32(emu):
    q, k, v = random_qkv(5, 1, 1, 32, torch.float32)
    o, lse = torch.empty_like(q), torch.empty(1, 5)
    se = torch.full((5,), 5, dtype=torch.int32)
    assert emu.emu_fwd(_ptr(q), _ptr(k), _ptr(v), _ptr(se), _ptr(o), _ptr(lse), 5, 5, 1, 1, 32, ctypes.c_float(1.0),
                       0, 1) == 1


@pytest.mark.parametrize("case", ["long_chain", "grpo", "many_roots", "random_trie"])
def test_emulated_simt_kernels_suffix_queries(emu, case):
    """Suffix queries (CP all-gather mode) on the SIMT kernels: query tiles laid from T - Tq, the dK/dV loop starting
    at max(k_lo, T - Tq), rows of q/o/lse offset; against rows of the full reference, forward and backward."""
    check_suffix_queries(_emulated_attention(emu), CASES[case], N=2, K=1, H=32)


def test_emulated_mma_refuses_suffix_queries(emu):
    q, k, v = random_qkv(5, 1, 1, 32, torch.float16)
    o, lse = torch.empty_like(q[2:]), torch.empty(1, 3)
    se = torch.full((5,), 5, dtype=torch.int32)
    assert emu.emu_fwd(_ptr(q[2:].contiguous()), _ptr(k), _ptr(v), _ptr(se), _ptr(o), _ptr(lse), 5, 3, 1, 1, 32,
                       ctypes.c_float(1.0), 1, 1) == 1


def test_emulated_block_bounds(emu):
    sub_end = CASES["many_roots"]
    B = -(-sub_end.shape[0] // 32)
    kmin, kmax = torch.empty(B, dtype=torch.int32), torch.empty(B, dtype=torch.int32)
    emu.emu_block_bounds(_ptr(sub_end), sub_end.shape[0], _ptr(kmin), _ptr(kmax))
    blocks = [sub_end[b * 32:(b + 1) * 32] for b in range(B)]
    assert kmin.tolist() == [int(x.min()) for x in blocks] and kmax.tolist() == [int(x.max()) for x in blocks]


def _needs_cuda_ext():
    if not cuda.is_available():
        pytest.skip("needs a CUDA GPU and the compiled extension")


def _gpu_grpo_forest(n_samples: int, prompt: int, completion: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return sub_end_from_samples([list(range(prompt)) + [10_000 + i] + torch.randint(0, 4, (completion,), generator=g).tolist()
                                 for i in range(n_samples)])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mma", "simt"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_matches_reference(dtype, H, impl, monkeypatch):
    _needs_cuda_ext()
    monkeypatch.setenv(cuda.IMPL_ENV_VAR, impl)
    for se in (*CASES.values(), _gpu_grpo_forest(8, 700, 300)):
        check_against_reference(cuda.tree_attention_cuda, se, N=8, K=2, H=H, dtype=dtype, device="cuda")


@pytest.mark.gpu
def test_gpu_auto_uses_tensor_cores_for_bf16():
    _needs_cuda_ext()
    from forge_megatron import _C_tree_attn

    q, k, v = random_qkv(64, 4, 2, 128, torch.bfloat16, "cuda")
    assert _C_tree_attn.mma_unsupported(q, k, v) == ""
    assert "float16 or bfloat16" in _C_tree_attn.mma_unsupported(q.float(), k.float(), v.float())
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)  # 2 bytes off alignment
    assert "16-byte aligned" in _C_tree_attn.mma_unsupported(shifted, k, v)


@pytest.mark.gpu
def test_gpu_forced_mma_on_fp32_raises(monkeypatch):
    _needs_cuda_ext()
    monkeypatch.setenv(cuda.IMPL_ENV_VAR, "mma")
    q, k, v = random_qkv(16, 2, 1, 64, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"impl=\"mma\" \(tensor cores\) cannot run here: .*not float32"):
        cuda.tree_attention_cuda(q, k, v, torch.full((16,), 16, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
def test_gpu_mma_follows_flash_attention_numerics(monkeypatch):
    _needs_cuda_ext()
    monkeypatch.setenv(cuda.IMPL_ENV_VAR, "mma")
    se = _gpu_grpo_forest(4, 300, 200)
    q, k, v = random_qkv(se.shape[0], 8, 2, 128, torch.bfloat16, "cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = cuda.tree_attention_cuda(q, k, v, se.cuda(), softmax_scale=0.2)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    want = _fa2_numerics(*(x.detach().cpu() for x in (q, k, v, do)), se, 0.2)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        ulp = 2.0 ** (torch.frexp(w.float().abs().max()).exponent.item() - 8)
        assert (g.float().cpu() - w.float()).abs().max().item() <= 2 * ulp, name


def test_implementation_env_var(monkeypatch):
    monkeypatch.delenv(cuda.IMPL_ENV_VAR, raising=False)
    assert cuda.implementation() == "auto"
    monkeypatch.setenv(cuda.IMPL_ENV_VAR, " MMA ")
    assert cuda.implementation() == "mma"
    monkeypatch.setenv(cuda.IMPL_ENV_VAR, "wgmma")
    with pytest.raises(ValueError, match="FORGE_TREE_ATTN_CUDA_IMPL='wgmma' is not one of auto, simt, mma"):
        cuda.implementation()


@pytest.mark.gpu
def test_gpu_fp32_and_scale():
    _needs_cuda_ext()
    check_against_reference(cuda.tree_attention_cuda, CASES["grpo"], N=4, K=4, H=32, dtype=torch.float32,
                            device="cuda", scale=0.3)


@pytest.mark.gpu
def test_gpu_matches_triton():
    _needs_cuda_ext()
    from forge_megatron.kernels.tree_attention.triton_kernel import tree_attention_triton

    se = _gpu_grpo_forest(4, 300, 200).cuda()
    q, k, v = random_qkv(se.shape[0], 8, 2, 128, torch.bfloat16, "cuda")
    diff = (cuda.tree_attention_cuda(q, k, v, se).float() - tree_attention_triton(q, k, v, se).float()).abs().max()
    assert diff.item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("H,message", [(48, "head_dim 48 is not supported by the CUDA kernel")])
def test_gpu_unsupported_head_dim(H, message):
    _needs_cuda_ext()
    q, k, v = random_qkv(5, 2, 1, H, torch.float16, "cuda")
    with pytest.raises(ValueError, match=message):
        cuda.tree_attention_cuda(q, k, v, torch.full((5,), 5, dtype=torch.int32, device="cuda"))


_BAD_INPUTS = {  # case -> (what the message must say, the arguments of fwd made from good q, k, v, sub_end)
    "sub_end_int64": ("sub_end must be int32", lambda q, k, v, se: (q, k, v, se.long())),
    "k_not_contiguous": ("k must be contiguous", lambda q, k, v, se: (q, k.transpose(0, 1).contiguous().transpose(0, 1),
                                                                     v, se)),
    "heads_not_divisible": (r"query heads \(4\) must be a multiple of key/value heads \(3\)",
                            lambda q, k, v, se: (q, *[torch.zeros(8, 3, 64, dtype=q.dtype, device=q.device)] * 2, se)),
    "q_on_cpu": ("must be a CUDA tensor", lambda q, k, v, se: (q.cpu(), k, v, se)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [*_BAD_INPUTS, "unknown_impl"])
def test_gpu_binding_rejects_bad_inputs_loudly(case):
    """One case per test: the first H200 run crashed (SIGSEGV) in the heads_not_divisible call after the two before
    it had raised as they should, and took the rest of the pytest process with it; the cause is not known yet."""
    _needs_cuda_ext()
    from forge_megatron import _C_tree_attn

    q, k, v = random_qkv(8, 4, 2, 64, torch.float16, "cuda")
    se = torch.full((8,), 8, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    if case == "unknown_impl":
        with pytest.raises(RuntimeError, match='impl must be "auto", "simt" or "mma"'):
            _C_tree_attn.fwd(q, k, v, se, 0.125, stream, "fast")
        return
    message, make = _BAD_INPUTS[case]
    with pytest.raises(RuntimeError, match=message):
        _C_tree_attn.fwd(*make(q, k, v, se), 0.125, stream)
