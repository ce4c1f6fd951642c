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
from tree_cases import check_against_reference, cuda_include_dir, forest_cases, random_qkv, sub_end_from_samples

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


class _Emulated(torch.autograd.Function):
    """The CUDA kernels run by the emulator, wired like the real op: forward saves lse, backward uses delta."""

    @staticmethod
    def forward(ctx, lib, q_TNH, k_TKH, v_TKH, sub_end_T, scale):
        T, N, H = q_TNH.shape
        o_TNH, lse_NT = torch.empty_like(q_TNH), torch.empty(N, T)
        rc = lib.emu_fwd(_ptr(q_TNH), _ptr(k_TKH), _ptr(v_TKH), _ptr(sub_end_T), _ptr(o_TNH), _ptr(lse_NT),
                         T, N, k_TKH.shape[1], H, ctypes.c_float(scale), _EMU_DTYPES[q_TNH.dtype])
        assert rc == 0, f"emu_fwd returned {rc} (1: unsupported head_dim {H}, 2: shared memory overflow)"
        ctx.save_for_backward(q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T)
        ctx.lib, ctx.scale = lib, scale
        return o_TNH

    @staticmethod
    def backward(ctx, do_TNH):
        q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T = ctx.saved_tensors
        do_TNH = do_TNH.contiguous()
        delta_NT = (do_TNH.float() * o_TNH.float()).sum(-1).t().contiguous()
        dq, dk, dv = torch.empty_like(q_TNH), torch.empty_like(k_TKH), torch.empty_like(v_TKH)
        T, N, H = q_TNH.shape
        rc = ctx.lib.emu_bwd(_ptr(do_TNH), _ptr(q_TNH), _ptr(k_TKH), _ptr(v_TKH), _ptr(lse_NT), _ptr(delta_NT),
                             _ptr(sub_end_T), _ptr(dq), _ptr(dk), _ptr(dv), T, N, k_TKH.shape[1], H,
                             ctypes.c_float(ctx.scale), _EMU_DTYPES[q_TNH.dtype])
        assert rc == 0, f"emu_bwd returned {rc} (1: unsupported head_dim {H}, 2: shared memory overflow)"
        return None, dq, dk, dv, None, None


def _emulated_attention(lib):
    def attention(q_TNH, k_TKH, v_TKH, sub_end_T, softmax_scale=None):
        scale = softmax_scale if softmax_scale is not None else q_TNH.shape[2] ** -0.5
        return _Emulated.apply(lib, q_TNH.contiguous(), k_TKH.contiguous(), v_TKH.contiguous(),
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
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_matches_reference(dtype, H):
    _needs_cuda_ext()
    for se in (*CASES.values(), _gpu_grpo_forest(8, 700, 300)):
        check_against_reference(cuda.tree_attention_cuda, se, N=8, K=2, H=H, dtype=dtype, device="cuda")


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


@pytest.mark.gpu
def test_gpu_binding_rejects_bad_inputs_loudly():
    _needs_cuda_ext()
    from forge_megatron import _C_tree_attn

    q, k, v = random_qkv(8, 4, 2, 64, torch.float16, "cuda")
    se = torch.full((8,), 8, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="sub_end must be int32"):
        _C_tree_attn.fwd(q, k, v, se.long(), 0.125, stream)
    with pytest.raises(RuntimeError, match="k must be contiguous"):
        _C_tree_attn.fwd(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, se, 0.125, stream)
    with pytest.raises(RuntimeError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"):
        k3 = torch.zeros(8, 3, 64, dtype=torch.float16, device="cuda")
        _C_tree_attn.fwd(q, k3, k3, se, 0.125, stream)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        _C_tree_attn.fwd(q.cpu(), k, v, se, 0.125, stream)
