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
    # uneven pipeline stages (Megatron's num_layers_in_first/last_pipeline_stage): the first / last stage's layer
    # count, the other stages sharing the rest equally; None: every stage alike (:func:`pipeline_chunks`)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp not in (1, self.tp):
            raise ValueError(f"expert tensor parallel size {self.etp} must be 1 or the TP size ({self.tp})")
        check_pipeline_split(self.pp, self.first_stage_layers, self.last_stage_layers)

    def layer_chunks(self, num_layers: int) -> list[range]:
        """The global layers of every model piece, in model order (:func:`pipeline_chunks`)."""
        return pipeline_chunks(num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers)

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


def check_pipeline_split(pp: int, first: int | None, last: int | None) -> None:
    """Raise ValueError unless ``first`` / ``last`` (uneven stages' layer counts) can be asked of ``pp`` stages (the
    layer counts themselves are checked by :func:`pipeline_chunks`)."""
    for name, n in (("first", first), ("last", last)):
        if n is not None and n < 1:
            raise ValueError(f"the {name} pipeline stage's layer count must be >= 1, got {n}")
    if (first is not None or last is not None) and pp < 2:
        raise ValueError("uneven pipeline stages (--decoder-first/last-pipeline-num-layers) need "
                         "--pipeline-model-parallel-size >= 2")


def pipeline_chunks(num_layers: int, pp: int = 1, vpp: int | None = None, first: int | None = None,
                    last: int | None = None) -> list[range]:
    """The global layers of every model piece in model order (piece c = chunk v of pipeline rank p, c = v * pp + p),
    as Megatron lays them out (``get_transformer_layer_offset``): equal pieces, or with ``first`` / ``last`` (the
    first / last stage's layer count) the other stages sharing the rest equally; with virtual stages each stage's
    layers are split equally among its chunks, and round v of the model holds every stage's chunk v. Raises
    ValueError naming the count that does not split."""
    check_pipeline_split(pp, first, last)
    v = vpp or 1
    if first is None and last is None:
        if num_layers % (pp * v):
            raise ValueError(f"the model's {num_layers} layers do not split into {pp} pipeline stages"
                             + (f" x {v} virtual chunks" if v > 1 else "") +
                             (": give the first / last stage its own count (--decoder-first-pipeline-num-layers, "
                              "--decoder-last-pipeline-num-layers)" if v == 1 else ""))
        per = num_layers // (pp * v)
        return [range(c * per, (c + 1) * per) for c in range(pp * v)]
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    given = (f"{'first stage ' + str(first) if first is not None else ''}"
             f"{', ' if first is not None and last is not None else ''}"
             f"{'last stage ' + str(last) if last is not None else ''} layers")
    if middle < middle_stages or (middle_stages and middle % middle_stages) or (not middle_stages and middle):
        raise ValueError(f"the model's {num_layers} layers do not split into {pp} pipeline stages with {given}: the "
                         f"other {middle_stages} stage(s) must share the remaining {middle} equally, at least one each")
    sizes = ([first] if first is not None else []) + \
        ([middle // middle_stages] * middle_stages if middle_stages else []) + ([last] if last is not None else [])
    if any(n % v for n in sizes) or min(sizes) < v:
        raise ValueError(f"the model's {num_layers} layers over {pp} pipeline stages with {given} give the stages "
                         f"{sizes} layers: each must split into its {v} virtual chunks, at least one layer each")
    per_chunk = [n // v for n in sizes]
    out = []
    for round_ in range(v):  # round v holds every stage's chunk v, stage after stage
        start = round_ * (num_layers // v)
        for n in per_chunk:
            out.append(range(start, start + n))
            start += n
    return out


_SPLIT: list = [None, None]  # this job's uneven pipeline split (first, last), set by initialize


def pipeline_split() -> tuple[int | None, int | None]:
    """(first, last) stage layer counts of the job :func:`initialize` set up (None, None: even stages)."""
    return _SPLIT[0], _SPLIT[1]


def initialize(parallel: ParallelConfig = ParallelConfig(), seed: int = 1234, timeout_s: float = 300.0) -> None:
    """Initialise torch.distributed (from the usual env vars: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun
    sets them) and Megatron's parallel state. A process started without RANK and WORLD_SIZE (forge-sft, a benchmark)
    is a job of one: its group rendezvous in an in-process store, so it needs no port (none to collide with another
    job's) and changes no environment variable."""
    from datetime import timedelta

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from forge_megatron.mcore import cpu_compat

    on_cpu = cpu_compat.apply()
    if not dist.is_initialized():
        backend = "gloo" if on_cpu else "nccl"
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), store=dist.HashStore(),
                                    rank=0, world_size=1)
        else:
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
    _SPLIT[:] = [parallel.first_stage_layers, parallel.last_stage_layers]
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
