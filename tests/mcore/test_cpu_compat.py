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

    before = dict(counters["frames"])
    x = torch.randn(3, 8)
    assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
    assert dict(counters["frames"]) == before  # dynamo saw no frame
