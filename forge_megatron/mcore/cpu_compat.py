"""Let Megatron-Core run on a CPU-only torch with gloo (tests, the demo, laptops).

Megatron-Core assumes CUDA in a handful of places. Each patch below names the Megatron function it works
around and why. They are applied by :func:`apply` only when CUDA is absent (a CUDA machine never sees them),
are idempotent, and change no math: they move allocations to the CPU, give the model-parallel RNG tracker a
CPU generator, turn CUDA streams/events/synchronisation into no-ops (CPU kernels are synchronous), and run
Megatron's torch.compile'd fusions eagerly.

Patches (megatron-core 0.16.x; 0.17-0.19 have the same spots unless noted):
  1. torch.cuda.current_device -> torch.device("cpu")
       GlobalMemoryBuffer.get_tensor (core/utils.py), p2p_communication._communicate_shapes/_communicate,
       param_and_grad_buffer, distrib_optimizer allocate with ``device=torch.cuda.current_device()``.
  2. torch.cuda.{synchronize, empty_cache, Stream, Event, current_stream, default_stream, stream} -> CPU no-ops
       p2p_communication calls torch.cuda.synchronize(); MoEAlltoAllTokenDispatcher creates a side
       torch.cuda.Stream for device-to-host copies; DDP/param_and_grad_buffer use a communication stream.
  3. tensor_parallel.random: _get_cuda_rng_state/_set_cuda_rng_state and CudaRNGStatesTracker.add use the CUDA
       generator; model_parallel_cuda_manual_seed calls torch.cuda.manual_seed. They use the CPU generator here,
       so ``tracker.fork()`` still gives model-parallel regions their own reproducible stream.
  4. transformer.utils.get_default_causal_mask (also imported by fusions.fused_softmax) and
       get_sliding_window_causal_mask build masks with ``device="cuda"``.
  5. pipeline_parallel.schedules.forward_backward_{no_pipelining, pipelining_without_interleaving,
       pipelining_with_interleaving} create ``total_num_tokens`` with ``device="cuda"``; optimizer constructors,
       step() and grad scalers create scalars with ``device='cuda'``. These run under :func:`cuda_factories_to_cpu`,
       a TorchFunctionMode that rewrites ``device="cuda"`` factory arguments (and ``Tensor.cuda()``) to the CPU.
       ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings under PP) calls ``weight.data.cuda()``
       and runs under it too.
  6. optimizer.clip_grads.clip_grad_by_total_norm_fp32 asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``;
       replaced by the same scaling on CPU tensors.
  7. MoE: moe_utils references ``te_general_gemm`` when Transformer Engine is absent (NameError in 0.16.1's
       router gemm); defined as None so the torch path is taken. torch.distributed.all_to_all_single on gloo
       rejects split sizes given as tensors (the all-to-all dispatcher keeps them as CPU tensors because
       maybe_move_tensor_to_cpu only converts CUDA tensors): converted to lists. Gloo's all_gather and
       reduce_scatter take equal pieces only, where NCCL takes uneven ones (the dispatcher's expert-TP exchange when
       TP ranks route different numbers of tokens: LongCat-Flash's identity experts): zero-padded to equal pieces.
  8. Megatron's ``jit_fuser`` is ``torch.compile`` (torch >= 2.2): the functions it decorates (quick_gelu, the
       bias-GLU fusions, router helpers) are compiled by Inductor on first call, which on CPU costs seconds per
       process (about 3 s for gpt-oss's clamped GLU in every trainer process) and needs a C++ toolchain, for no
       gain on a CPU. TorchDynamo is turned off (``torch._dynamo.config.disable``), so they run eagerly: the same
       function, unfused. This is the one patch that reaches beyond Megatron: torch.compile in a CPU process that
       applied the patches runs eagerly. Importing Megatron also costs: ``@jit_fuser`` calls ``torch.compile`` on
       about 40 functions at import time, and the first call imports TorchDynamo and Inductor (1.8 of Megatron's 3 s
       import on this CPU, in every trainer process). :func:`defer_torch_compile` makes ``torch.compile`` of a plain
       function lazy (the real ``torch.compile`` runs at the function's first call, which is all it does then
       anyway; modules and other callables go to it at once, with TorchDynamo off once the patches are applied); a
       CPU process that applied the patches then calls the function itself. ``import forge_megatron`` installs it,
       on a machine without an NVIDIA driver, just before Megatron's ``megatron.core.jit`` is first imported (an
       import hook that removes itself), so it is in place when Megatron binds ``jit_fuser``.
  9. Megatron's optimizers accept only CUDA tensor types: ``DistributedOptimizer._build_model_and_main_param_groups``
       and ``Float16OptimizerWithFloat16Params`` compare ``param.type()`` with ``'torch.cuda.FloatTensor'`` /
       ``'torch.cuda.BFloat16Tensor'``. Under the factory rewrite of patch 5 ``Tensor.type()`` (no argument) answers
       with the CUDA name; every method of the distributed optimizer runs under it (it also allocates on
       ``torch.cuda.current_device()``). gloo has the collectives it needs (reduce-scatter, all-gather into a tensor,
       gather) in the torch installed here (2.13).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys

import torch
from torch.overrides import TorchFunctionMode

from forge_megatron.utils import env

log = logging.getLogger(__name__)

_APPLIED = False


# ------------------------------------------------------------------------------------------ lazy torch.compile
def defer_torch_compile() -> None:
    """Patch 8's import half: ``torch.compile(fn)`` of a plain function returns ``fn`` wrapped so that the real
    ``torch.compile`` runs at the first call (once the patches are applied: ``fn`` itself runs, as TorchDynamo is
    off then). Idempotent; the original is ``torch.compile._forge_original``."""
    original = torch.compile
    if getattr(original, "_forge_original", None) is not None:
        return

    @functools.wraps(original)
    def compile(model=None, **kwargs):
        if model is None:  # decorator with arguments: @torch.compile(mode=...)
            return lambda fn: compile(fn, **kwargs)
        if not inspect.isfunction(model):
            if _APPLIED:
                torch._dynamo.config.disable = True
            return original(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def run(*args, **kw):
            nonlocal compiled
            if _APPLIED:
                return model(*args, **kw)
            if compiled is None:
                compiled = original(model, **kwargs)
            return compiled(*args, **kw)

        return run

    compile._forge_original = original
    torch.compile = compile


# --------------------------------------------------------------------------------------------- device rewrite
def _is_cuda_device(dev) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device=<cuda>`` keyword arguments of torch calls to CPU, and makes ``Tensor.cuda()`` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # Megatron's dtype checks name CUDA types
            name = func(*args)
            return "torch.cuda." + name[len("torch."):] if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def cuda_factories_to_cpu():
    """Context manager: inside it, ``device="cuda"`` factory calls allocate on the CPU (no-op with CUDA)."""
    if env.has_cuda():
        return contextlib.nullcontext()
    return _CudaToCpu()


def _run_on_cpu(fn):
    """Wrap ``fn`` so that its body runs under :func:`cuda_factories_to_cpu`."""
    if getattr(fn, "_forge_cpu_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaToCpu():
            return fn(*args, **kwargs)

    wrapper._forge_cpu_wrapped = True
    return wrapper


# ---------------------------------------------------------------------------------------- CUDA runtime stubs
class _CpuStream:
    """Stand-in for torch.cuda.Stream on CPU: every operation is synchronous already."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


class _CpuEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_CPU_STREAM = _CpuStream()


def _patch_torch_cuda():
    # Patch 1 and 2 (see module docstring).
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
    torch.cuda.default_stream = lambda *a, **k: _CPU_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------- RNG
def _patch_rng():
    # Patch 3: megatron.core.tensor_parallel.random keeps per-region CUDA generator states.
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly, no recursion.
    # model_parallel_cuda_manual_seed therefore (re)seeds the CPU generator, as it seeds the CUDA one on GPUs.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


# ---------------------------------------------------------------------------------------------- masks
def _patch_masks():
    # Patch 4: default causal / sliding-window masks hard-code device="cuda".
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=8)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def get_sliding_window_causal_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])

    tutils.get_default_causal_mask = get_default_causal_mask
    tutils.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    try:
        from megatron.core.fusions import fused_softmax

        fused_softmax.get_default_causal_mask = get_default_causal_mask
        if hasattr(fused_softmax, "get_sliding_window_causal_mask"):
            fused_softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    except ImportError:  # pragma: no cover - layout differs across versions
        pass


# ----------------------------------------------------------------------------- schedules and optimizers
def _patch_schedules_and_optimizer():
    # Patch 5: device="cuda" factories in pipeline schedules and optimizer code paths.
    from megatron.core.pipeline_parallel import schedules

    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        if hasattr(schedules, name):
            setattr(schedules, name, _run_on_cpu(getattr(schedules, name)))

    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt_impl

    mopt.get_megatron_optimizer = _run_on_cpu(mopt.get_megatron_optimizer)
    for cls_name in ("MegatronOptimizer", "MixedPrecisionOptimizer", "Float16OptimizerWithFloat16Params",
                     "FP32Optimizer", "ChainedOptimizer"):
        cls = getattr(mopt_impl, cls_name, None)
        if cls is None:
            continue
        for meth in ("__init__", "step", "prepare_grads", "step_with_ready_grads", "get_grad_norm",
                     "clip_grad_norm", "count_zeros", "load_state_dict"):
            if meth in cls.__dict__:
                setattr(cls, meth, _run_on_cpu(cls.__dict__[meth]))
    try:
        from megatron.core.optimizer import grad_scaler

        for cls_name in ("ConstantGradScaler", "DynamicGradScaler", "MegatronGradScaler"):
            cls = getattr(grad_scaler, cls_name, None)
            if cls is not None and "__init__" in cls.__dict__:
                cls.__init__ = _run_on_cpu(cls.__dict__["__init__"])
    except ImportError:  # pragma: no cover
        pass

    # Patch 6: clip_grad_by_total_norm_fp32 asserts CUDA float grads.
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff >= 1.0:
            return
        for p in parameters:
            g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if g is not None:
                g.detach().mul_(clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mopt_impl.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    clip_grads.get_grad_norm_fp32 = _run_on_cpu(clip_grads.get_grad_norm_fp32)
    mopt_impl.get_grad_norm_fp32 = clip_grads.get_grad_norm_fp32
    if hasattr(clip_grads, "count_zeros_fp32"):
        clip_grads.count_zeros_fp32 = _run_on_cpu(clip_grads.count_zeros_fp32)
        mopt_impl.count_zeros_fp32 = clip_grads.count_zeros_fp32

    # The distributed optimizer checks ``param.type()`` against CUDA type names and allocates with
    # ``device=torch.cuda.current_device()``: every method of it runs under the rewrite.
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    for name, member in list(cls.__dict__.items()):
        if isinstance(member, classmethod):
            setattr(cls, name, classmethod(_run_on_cpu(member.__func__)))
        elif isinstance(member, staticmethod):
            setattr(cls, name, staticmethod(_run_on_cpu(member.__func__)))
        elif callable(member) and not isinstance(member, type):
            setattr(cls, name, _run_on_cpu(member))

    from megatron.core.distributed import param_and_grad_buffer

    for cls_name in ("_ParamAndGradBuffer", "ParamAndGradBuffer"):
        cls = getattr(param_and_grad_buffer, cls_name, None)
        if cls is not None:
            cls.__init__ = _run_on_cpu(cls.__dict__["__init__"])

    # Tied embeddings with PP > 1: the first and last stage's copies are all-reduced at construction after
    # ``weight.data.cuda()``.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    if "setup_embeddings_and_output_layer" in LanguageModule.__dict__:
        LanguageModule.setup_embeddings_and_output_layer = _run_on_cpu(
            LanguageModule.__dict__["setup_embeddings_and_output_layer"])


# ------------------------------------------------------------------------------------------------- MoE
def _patch_moe():
    # Patch 7.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    import torch.distributed as dist

    original = dist.all_to_all_single
    if getattr(original, "_forge_cpu_wrapped", False):
        return

    def _as_list(sizes):
        if isinstance(sizes, torch.Tensor):
            return [int(x) for x in sizes.tolist()]
        return sizes

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return original(output, input, _as_list(output_split_sizes), _as_list(input_split_sizes), group=group,
                        async_op=async_op)

    all_to_all_single._forge_cpu_wrapped = True
    # tensor_parallel.mappings calls torch.distributed.all_to_all_single through the module: this reaches it.
    dist.all_to_all_single = all_to_all_single

    # Gloo gathers and reduce-scatters equal pieces only; NCCL takes uneven ones, which Megatron's MoE dispatcher
    # asks for under expert TP when the TP ranks hold different numbers of routed tokens (LongCat-Flash's identity
    # experts route a token to fewer than k experts). Uneven lists go through equal, zero-padded pieces here.
    original_gather, original_scatter = dist.all_gather, dist.reduce_scatter

    @functools.wraps(original_gather)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or len({tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}) == 1:
            return original_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros(rows, *tensor.shape[1:])
        padded[:tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        original_gather(pieces, padded, group=group)
        for out, piece in zip(tensor_list, pieces):
            out.copy_(piece[:out.shape[0]])
        return None

    @functools.wraps(original_scatter)
    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or len({tuple(t.shape) for t in input_list}) == 1:
            return original_scatter(output, input_list, op=op, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in input_list)
        stacked = input_list[0].new_zeros(len(input_list), rows, *input_list[0].shape[1:])
        for i, t in enumerate(input_list):
            stacked[i, :t.shape[0]] = t
        dist.all_reduce(stacked, op=op, group=group)
        output.copy_(stacked[dist.get_rank(group), :output.shape[0]])
        return None

    all_gather._forge_cpu_wrapped = reduce_scatter._forge_cpu_wrapped = True
    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


def apply() -> bool:
    """Apply every patch if CUDA is absent. Returns True when the patches are active. Idempotent."""
    global _APPLIED
    if env.has_cuda():  # asked without initialising CUDA (env.probe_cuda): processes forked later can still use it
        return False
    if _APPLIED:
        return True
    _patch_torch_cuda()
    _patch_rng()
    _patch_masks()
    _patch_schedules_and_optimizer()
    _patch_moe()
    if "torch._dynamo" in sys.modules:  # 8. (not imported yet: the deferred torch.compile turns it off when it is)
        torch._dynamo.config.disable = True
    _APPLIED = True
    log.info("forge_megatron: Megatron-Core CPU compatibility patches applied (no CUDA device)")
    return True


def is_applied() -> bool:
    return _APPLIED
