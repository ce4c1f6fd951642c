"""forge_megatron.mcore.cpu_compat on a CPU-only torch (0 GPUs, in process)."""

import pytest
import torch

from forge_megatron.mcore import cpu_compat
from forge_megatron.utils import env

pytestmark = pytest.mark.skipif(env.has_cuda(), reason="the patches apply only on machines without CUDA")


def test_cuda_factories_and_tensor_cuda_land_on_cpu():
    with cpu_compat.cuda_factories_to_cpu():
        a = torch.zeros(3, device="cuda")
        b = torch.tensor([1.0], device=torch.device("cuda", 0))
        c = torch.ones(2).cuda()
        d = torch.ones(2).to("cuda")
    assert {t.device.type for t in (a, b, c, d)} == {"cpu"}
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # outside the context nothing is rewritten


def test_apply_is_idempotent_and_patches_megatron_spots():
    assert cpu_compat.apply() and cpu_compat.apply()
    from megatron.core.transformer import utils as tutils

    assert torch.cuda.current_device() == torch.device("cpu")
    mask = tutils.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert torch.equal(mask, torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1))
    with torch.cuda.stream(torch.cuda.Stream()):  # streams and events are synchronous no-ops
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
    torch.cuda.synchronize()


def test_rng_tracker_forks_reproducible_cpu_streams():
    cpu_compat.apply()
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.CudaRNGStatesTracker()
    tracker.add("region", 1234)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork("region"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside_before)  # the default stream is restored
    with tracker.fork("region"):
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the region's stream advanced
    fresh = mp_random.CudaRNGStatesTracker()
    fresh.add("region", 1234)
    with fresh.fork("region"):
        assert torch.equal(torch.rand(4), first)  # same seed, same stream


def test_megatrons_compiled_fusions_run_eagerly():
    """Megatron's jit_fuser (torch.compile) functions run as written: no Inductor compile in a CPU process."""
    cpu_compat.apply()
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from torch._dynamo.utils import counters

    before = dict(counters["stats"])
    x = torch.randn(3, 8)
    assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
    assert dict(counters["stats"]) == before  # dynamo saw no frame


def test_importing_megatron_defers_torch_compile_until_a_first_call():
    """In a fresh CPU process, ``import forge_megatron`` then Megatron: Megatron's ~40 import-time torch.compile calls
    import neither TorchDynamo nor Inductor (1.8 s of the import here); a deferred function compiles at its first
    call before the patches (TorchDynamo traces it) and runs as written after them."""
    import subprocess
    import sys

    code = """
import sys, torch
import forge_megatron
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "dynamo imported"
assert torch.compile._forge_original is not None
x = torch.randn(3, 8)
def double(t):
    return t * 2
lazy = torch.compile(double, backend="eager")
assert "torch._dynamo" not in sys.modules
assert torch.equal(lazy(x), x * 2)  # compiled now: TorchDynamo traced one frame
from torch._dynamo.utils import counters
assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
from forge_megatron.mcore import cpu_compat
cpu_compat.apply()
before = dict(counters["stats"])
assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
assert torch.equal(torch.compile(double)(x), x * 2)
assert dict(counters["stats"]) == before  # run as written once the patches are applied
assert isinstance(torch.compile(torch.nn.Linear(2, 2), backend="eager"), torch._dynamo.eval_frame.OptimizedModule)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
