"""Process-group and model-parallel set-up shared by the trainer, tools and tests.

``initialize`` is the one call that turns "N processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set"
into a Megatron-Core job: it applies the CPU patches when CUDA is absent, creates the default process group
(NCCL on GPUs, gloo on CPU), builds Megatron's TP/PP/EP/CP/DP groups and seeds the model-parallel RNG tracker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes. DP is whatever is left: world_size / (tp * pp * cp).

    ``etp``: tensor parallelism of the experts (Megatron's expert_tensor_parallel_size), the TP size (None, the
    default) or 1: each expert whole on its EP rank, the usual layout for large MoE models (no TP collectives inside
    the experts; the EP group then spans the TP ranks, so EP may go up to dp * cp * tp)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: int | None = None
    etp: int | None = None

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp not in (1, self.tp):
            raise ValueError(f"expert tensor parallel size {self.etp} must be 1 or the TP size ({self.tp})")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.tp * self.pp * self.cp
        if world_size % mp:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {mp}")
        dp = world_size // mp
        # the experts' layout: etp x ep x pp x expert-DP ranks, over the same world
        expert_ranks = dp * self.cp * self.tp // self.expert_tp
        if self.ep > 1 and expert_ranks % self.ep:
            what = "dp*cp" if self.expert_tp == self.tp else "dp*cp*tp (expert TP 1)"
            raise ValueError(f"ep={self.ep} must divide {what} = {expert_ranks}")
        return dp


def initialize(parallel: ParallelConfig = ParallelConfig(), seed: int = 1234, timeout_s: float = 300.0) -> None:
    """Initialise torch.distributed (from the usual env vars) and Megatron's parallel state."""
    from datetime import timedelta

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from forge_megatron.mcore import cpu_compat

    on_cpu = cpu_compat.apply()
    if not dist.is_initialized():
        backend = "gloo" if on_cpu else "nccl"
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    parallel.data_parallel_size(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )
    model_parallel_cuda_manual_seed(seed)


def comm_device(group=None) -> torch.device:
    """Where a collective's tensors over ``group`` (default: the default group) must live: the current GPU under NCCL,
    which refuses CPU tensors, else the CPU. Every collective on small bookkeeping tensors goes through this, so the
    gloo-tested code also runs under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
