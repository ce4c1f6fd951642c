"""CUDA tree attention (forge_megatron._C_tree_attn) vs the dense reference.

GPUs needed: 0 for the availability/fake-tensor tests, 1 for the `gpu` ones (they also need the extension built:
`pip install --no-build-isolation -e .` on a CUDA machine, see benchmarks/gpu_check.sh).
"""

import pytest
import torch
from tree_cases import check_against_reference, forest_cases, random_qkv, sub_end_from_samples

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
