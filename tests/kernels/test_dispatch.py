"""Tree-attention dispatcher: automatic choice, environment override, errors, logging once. CPU (one gpu case)."""

import logging

import pytest
import torch

from forge_megatron.kernels.tree_attention import available_backends, dispatch, tree_attention
from forge_megatron.kernels.tree_attention.reference import tree_attention_reference
from forge_megatron.kernels.tree_attention.segment import tree_attention_segment
from forge_megatron.tree import build_tree


@pytest.fixture
def inputs():
    layout = build_tree([[1, 2, 3, 4], [1, 2, 5], [6, 7]])
    g = torch.Generator().manual_seed(0)
    T = layout.unique_tokens
    return torch.randn(T, 4, 8, generator=g), torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g), layout.sub_end


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "_logged", set())


def test_automatic_on_cpu_is_segment(inputs, no_env):
    assert dispatch.choose_backend(torch.device("cpu")) == ("segment", "automatic")
    assert torch.equal(tree_attention(*inputs), tree_attention_segment(*inputs))


def test_environment_override(inputs, no_env, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.choose_backend(torch.device("cpu"))[0] == "reference"
    assert torch.equal(tree_attention(*inputs), tree_attention_reference(*inputs))
    assert dispatch.choose_backend(torch.device("cpu"), backend="segment")[0] == "segment", "argument beats env"


def test_unknown_backend(inputs, no_env, monkeypatch):
    with pytest.raises(ValueError, match="unknown tree attention backend 'flash' \\(from backend argument\\)"):
        tree_attention(*inputs, backend="flash")
    monkeypatch.setenv(dispatch.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="unknown tree attention backend 'flash' \\(from FORGE_TREE_ATTN_BACKEND=flash\\)"):
        tree_attention(*inputs)


def test_missing_compiled_backend(inputs, no_env, monkeypatch):
    monkeypatch.setitem(dispatch._COMPILED, "cuda", ("forge_megatron.kernels.tree_attention.absent", "f", "cuda_ext"))
    with pytest.raises(RuntimeError, match="tree attention backend 'cuda'"):
        tree_attention(*inputs, backend="cuda")
    assert "cuda" not in available_backends("cuda")


def test_automatic_on_cuda_prefers_compiled_then_segment(no_env, monkeypatch):
    cuda = torch.device("cuda")
    chosen = dispatch.choose_backend(cuda)[0]
    assert chosen == next((b for b in ("cuda", "triton") if b in available_backends(cuda)), "segment")
    for name in ("cuda", "triton"):
        monkeypatch.setitem(dispatch._COMPILED, name, (f"forge_megatron.kernels.absent_{name}", "f", "cuda_ext"))
    assert dispatch.choose_backend(cuda)[0] == "segment"
    assert available_backends("cpu")[:2] == ["reference", "segment"]


def test_suffix_queries_pass_over_cuda(no_env, monkeypatch):
    """The CUDA kernel takes suffix queries only on its SIMT path: calls with fewer queries go to Triton (or
    segment) even where CUDA is validated and preferred, and forcing its tensor cores on them is refused by name."""
    from forge_megatron.kernels.tree_attention import cuda as cuda_backend

    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "CUDA_VALIDATED", True)
    monkeypatch.setattr(dispatch, "available_backends", lambda device=None: list(dispatch.BACKENDS))
    assert dispatch.choose_backend(cuda)[0] == "cuda"
    assert dispatch.choose_backend(cuda, suffix_queries=True)[0] == "triton"
    monkeypatch.setattr(dispatch, "available_backends", lambda device=None: ["reference", "segment", "cuda"])
    assert dispatch.choose_backend(cuda, suffix_queries=True)[0] == "segment"
    monkeypatch.setenv(cuda_backend.IMPL_ENV_VAR, "mma")
    with pytest.raises(ValueError, match="need one query per key token \\(5\\), got 3 queries"):
        cuda_backend._check_supported(torch.zeros(3, 2, 32), torch.zeros(5, 1, 32))


def test_head_sizes_a_kernel_does_not_take_pass_over_it(no_env, monkeypatch):
    """Multi-latent attention's 192-channel query/key heads: not the CUDA kernel's (32 / 64 / 128) even where it is
    validated and preferred; Triton takes them, and Gemma 4's global heads of 512; beyond that the exact segment
    backend."""
    from forge_megatron.kernels.tree_attention import cuda as cuda_backend

    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "CUDA_VALIDATED", True)
    monkeypatch.setattr(dispatch, "available_backends", lambda device=None: list(dispatch.BACKENDS))
    assert dispatch.HEAD_DIMS["cuda"] == cuda_backend.SUPPORTED_HEAD_DIMS
    triton_kernel = pytest.importorskip("forge_megatron.kernels.tree_attention.triton_kernel")
    assert max(dispatch.HEAD_DIMS["triton"]) == triton_kernel.MAX_HEAD_DIM
    assert [dispatch.choose_backend(cuda, head_dim=h)[0] for h in (128, 192, 512, 576)] == ["cuda", "triton",
                                                                                          "triton", "segment"]


def test_key_end_is_passed_on_and_never_chooses_cuda(inputs, no_env, monkeypatch):
    """Bidirectional blocks (key_end): passed to the backend as key_end_T (here the reference: blocks [0, 2), ending
    at the branch after token 1, and [5, 7)), flagged to the choice, which passes over the CUDA kernel (it has none)
    even where it is validated and preferred."""
    from forge_megatron.kernels.tree_attention import ops

    q, k, v, sub_end = inputs
    key_end = ops.block_key_end(torch.tensor([1, 1, 0, 0, 0, 1, 1], dtype=torch.bool), sub_end)
    assert key_end.tolist() == [2, 2, 3, 4, 5, 7, 7]
    o = tree_attention(q, k, v, sub_end, backend="reference", key_end=key_end)
    assert torch.equal(o, tree_attention_reference(q, k, v, sub_end, key_end_T=key_end))
    assert not torch.allclose(o, tree_attention_reference(q, k, v, sub_end))
    seen = []
    monkeypatch.setattr(dispatch, "resolve", lambda *a, **kw: seen.append(kw) or "reference")
    tree_attention(q, k, v, sub_end, key_end=key_end)
    tree_attention(q, k, v, sub_end)
    assert [kw["bidirectional_blocks"] for kw in seen] == [True, False]

    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "CUDA_VALIDATED", True)
    monkeypatch.setattr(dispatch, "available_backends", lambda device=None: list(dispatch.BACKENDS))
    assert dispatch.choose_backend(cuda)[0] == "cuda"
    assert dispatch.choose_backend(cuda, bidirectional_blocks=True)[0] == "triton"
    monkeypatch.setattr(dispatch, "available_backends", lambda device=None: ["reference", "segment", "cuda"])
    assert dispatch.choose_backend(cuda, bidirectional_blocks=True)[0] == "segment"


def test_softcap_is_passed_on_and_never_chooses_cuda(inputs, no_env, monkeypatch):
    """Gemma 2's soft-capped scores: passed to the backend as softcap (the reference's capped scores differ from
    uncapped ones), flagged to the choice as a score extra, which passes over the CUDA kernel; the CUDA backend
    itself refuses a cap by name before it looks for its extension."""
    from forge_megatron.kernels.tree_attention import cuda as cuda_backend

    q, k, v, sub_end = inputs
    q = q * 4.0
    o = tree_attention(q, k, v, sub_end, backend="reference", softcap=1.5)
    assert torch.equal(o, tree_attention_reference(q, k, v, sub_end, softcap=1.5))
    assert not torch.allclose(o, tree_attention_reference(q, k, v, sub_end), atol=1e-3)
    assert torch.allclose(tree_attention(q, k, v, sub_end, softcap=1.5), o, atol=1e-5)  # segment, automatic
    with pytest.raises(ValueError, match="softcap must be positive"):
        tree_attention(q, k, v, sub_end, softcap=-1.0)
    seen = []
    monkeypatch.setattr(dispatch, "resolve", lambda *a, **kw: seen.append(kw) or "reference")
    tree_attention(q, k, v, sub_end, softcap=1.5)
    tree_attention(q, k, v, sub_end)
    assert [kw["score_extras"] for kw in seen] == [True, False]
    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "CUDA_VALIDATED", True)
    monkeypatch.setattr(dispatch, "available_backends", lambda device=None: list(dispatch.BACKENDS))
    assert dispatch.choose_backend(cuda, score_extras=True)[0] == "triton"
    with pytest.raises(ValueError, match="no soft-capped scores"):
        cuda_backend._forward(q, k, v, sub_end, 0.5, softcap=1.5)


def test_choice_logged_once(inputs, no_env, caplog):
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        tree_attention(*inputs)
        tree_attention(*inputs)
        tree_attention(*inputs, backend="reference")
    messages = [r.getMessage() for r in caplog.records if r.name == dispatch.__name__]
    assert messages == [
        "tree attention backend 'segment' on cpu (automatic)",
        "tree attention backend 'reference' on cpu (backend argument)",
    ]


@pytest.mark.gpu
def test_cuda_tensors_use_a_gpu_backend(inputs, no_env):
    q, k, v, sub_end = (x.cuda() for x in inputs)
    o = tree_attention(q, k, v, sub_end)
    assert dispatch.choose_backend(q.device)[0] in ("cuda", "triton", "segment")
    # fp32 inputs: compiled kernels may run their dots in TF32 (10-bit mantissa), hence the loose tolerance
    torch.testing.assert_close(o.cpu(), tree_attention_reference(*inputs), rtol=0, atol=5e-3)


def test_cuda_backend_needs_the_built_extension_not_just_the_module():
    from forge_megatron.kernels.tree_attention import dispatch
    from forge_megatron.utils import env

    if env.has_cuda_ext():
        pytest.skip("the CUDA extension is built here")
    assert "cuda" not in dispatch.available_backends("cuda")
    with pytest.raises(RuntimeError, match="cuda"):
        dispatch.choose_backend(torch.device("cpu"), "cuda")
