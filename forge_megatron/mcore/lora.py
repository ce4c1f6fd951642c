"""LoRA adapters on Megatron's tensor-parallel linears (``--lora-rank``): the checkpoint's weights frozen, a low-rank
update trained beside each chosen linear, y = x W^T + scaling * (x A^T) B^T with scaling = alpha / rank.

Each adapter follows its linear's tensor-parallel split, so TP (with or without sequence parallelism) trains what one
rank trains:
- column-parallel linears (``linear_qkv``, ``linear_fc1``; multi-latent attention's ``linear_q_proj`` or
  ``linear_q_up_proj`` and ``linear_kv_up_proj``; W is [out / TP, in]): A [rank, in] whole on every TP rank,
  B [out / TP, rank] split as W is. h = x A^T is made once per rank, its gradient summed over TP on the way back
  (Megatron's copy-to-TP region); under sequence parallelism the rank's tokens' h is all-gathered (rank wide, not
  hidden wide) and A's gradient, a sum over each rank's tokens, is reduced over TP by Megatron as the norms' are
  (the ``sequence_parallel`` attribute).
- row-parallel linears (``linear_proj``, ``linear_fc2``; W is [out, in / TP]): A [rank, in / TP] split as W is, B
  [out, rank] whole. The partial h of each rank is summed over TP (all-reduce; reduce-scatter to the rank's tokens
  under sequence parallelism, B's gradient then reduced over TP by Megatron).
A starts as the same draw whatever the layout (a generator seeded by the layer's global number and the linear's name;
the row-parallel ranks take their columns of it), B as zeros: the adapted model starts as the checkpoint.

A MoE layer's MLP is adapted only when named (``experts``, ``shared_experts``): a routed expert's adapters are
seeded by its global id and, as its weights, reduced over the expert-data-parallel group (``allreduce`` False);
experts split over TP leave all communication to the token dispatcher (every rank has the tokens, partial outputs
are summed on the way back), so their adapters do not cross TP and the whole factor's gradient, a partial sum on each
rank, is summed over TP by a gradient hook. Never adapted: multi-latent attention's down projections (replicated
latents), linear-attention mixers (Gated DeltaNet, Kimi Delta Attention), the embeddings, norms and head.

Only the adapters train: the optimizer holds them alone (its state is a few MB), the gradients are theirs. The KL
reference, the checkpoint's model, is the policy with its adapters switched off (:func:`disabled`): no second copy of
the weights. The weight sync and the HF export send W + scaling * B A (:func:`merged`, per TP shard: B A has the
weight's shard shape), so the engines serve plain weights and need no LoRA support.

Legend: S = tokens (this rank's under sequence parallelism), R = rank, I / O = the linear's input / output width.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch

ATTENTION = ("linear_qkv", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj")
TARGETS = (*ATTENTION, "linear_fc1", "linear_fc2")  # the default ("all")
MOE = ("experts", "shared_experts")  # a MoE layer's routed experts' and shared expert's fc1 and fc2 (opt-in)
COLUMN = ("linear_qkv", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_fc1")
PARAM_NAMES = ("lora_A", "lora_B", "lora_scaling")


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.alpha}")
        unknown = sorted(set(self.targets) - set(TARGETS) - set(MOE))
        if unknown or not self.targets:
            raise ValueError(f"--lora-target-modules takes some of {', '.join(TARGETS + MOE)} (or all); got "
                             f"{', '.join(self.targets)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_lora_name(name: str) -> bool:
    """True for an adapter's tensor (``...linear_qkv.lora_A``) in a state dict or named_parameters."""
    return name.rsplit(".", 1)[-1] in PARAM_NAMES


def _init_A(seed_name: str, rank: int, in_features: int) -> torch.Tensor:
    """A's whole [R, I] initial value, the same on every rank and layout: kaiming-uniform(a=sqrt(5)) as nn.Linear
    (and PEFT) draw it, from a generator seeded by ``seed_name``."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound


def _hook(kind: str, sequence_parallel: bool, group):
    """The linear's forward hook: its output plus the adapter's, the intermediate crossing ``group`` (the linear's
    TP group: the expert-TP group for a routed expert; none when it has one rank)."""
    from megatron.core.tensor_parallel import mappings as tpm

    def forward(module, args, output):
        if module.lora_off:  # (disabled(): the checkpoint's linear, for the KL reference)
            return output
        x = args[0]
        out, bias = output if isinstance(output, tuple) else (output, None)
        h = x.to(module.lora_A.dtype) @ module.lora_A.t()  # [S, b, R]
        if group is None:
            pass
        elif kind == "column":
            h = tpm.gather_from_sequence_parallel_region(h, group=group) if sequence_parallel else \
                tpm.copy_to_tensor_model_parallel_region(h, group=group)
        else:
            h = tpm.reduce_scatter_to_sequence_parallel_region(h, group=group) if sequence_parallel else \
                tpm.reduce_from_tensor_model_parallel_region(h, group=group)
        delta = (h @ module.lora_B.t()) * module.lora_scaling.to(h.dtype)
        out = out + delta.to(out.dtype)
        return (out, bias) if isinstance(output, tuple) else out

    return forward


def _summed_over(group):
    """A gradient hook summing a factor's gradient over ``group`` before it is accumulated (each rank's is a partial
    sum: a routed expert split over TP)."""
    import torch.distributed as dist

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def _embedding_requires_grad(module, args, output):
    """The frozen embedding's output marked as requiring a gradient: activation recomputation (Megatron's reentrant
    checkpoints) back-propagates into a recomputed layer only if its input requires one, and with every weight
    frozen the first layer's would not, so the adapters inside would get no gradient. (Later pipeline stages get
    their input from the previous stage with requires_grad set by Megatron's schedule.)"""
    if torch.is_tensor(output) and not output.requires_grad and torch.is_grad_enabled():
        return output.detach().requires_grad_(True)
    return output


def _linears(layer, targets, ep_rank: int):
    """(name, linear, seed name) of each linear ``targets`` pick in a transformer ``layer`` (its global number in
    the seed, and a routed expert's global id)."""
    number = layer.layer_number
    mlp = getattr(layer, "mlp", None)
    for name in targets:
        if name in MOE:
            module = getattr(mlp, name, None)
            if module is None:
                continue  # a dense layer
            if name == "experts":
                local = getattr(module, "local_experts", None)
                if local is None:
                    raise ValueError(f"--lora-target-modules experts: layer {number}'s experts are a "
                                     f"{type(module).__name__}, not Megatron's SequentialMLP (the local spec's)")
                pieces = [(e, f"expert{ep_rank * len(local) + i}") for i, e in enumerate(local)]
            else:
                pieces = [(module, "shared")]
            for owner, tag in pieces:
                for fc in ("linear_fc1", "linear_fc2"):
                    yield fc, getattr(owner, fc), f"{number}.{tag}.{fc}"
            continue
        parent = layer.self_attention if name in ATTENTION else mlp
        linear = getattr(parent, name, None)
        if linear is not None:  # (a MoE layer's MLP, another attention: none)
            yield name, linear, f"{number}.{name}"


def install(chunks: list, cfg: LoraConfig) -> list[str]:
    """Add adapters to ``cfg.targets`` of every transformer layer of this rank's model ``chunks`` (before DDP wraps
    them) and freeze every other parameter. Returns the adapted linears' names (chunk-local, on this rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      set_tensor_model_parallel_attributes)

    ep_rank = ps.get_expert_model_parallel_rank()
    adapted = []
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        chunk_sp = bool(getattr(chunk.config, "sequence_parallel", False))
        modules = {id(m): n for n, m in chunk.named_modules()}
        for layer in chunk.modules():
            if getattr(layer, "layer_number", None) is None or not hasattr(layer, "self_attention"):
                continue
            for name, linear, seed in _linears(layer, cfg.targets, ep_rank):
                kind = "column" if name in COLUMN else "row"
                want = ColumnParallelLinear if kind == "column" else RowParallelLinear
                if not isinstance(linear, want):
                    raise ValueError(f"--lora-target-modules: layer {layer.layer_number}'s {name} is a "
                                     f"{type(linear).__name__}, not Megatron's {want.__name__} (LoRA adapts the local "
                                     "layer spec's linears)")
                group = getattr(linear, "tp_group", None) or ps.get_tensor_model_parallel_group()
                tp, tp_rank = dist.get_world_size(group), dist.get_rank(group)
                # a routed expert split over TP: the token dispatcher does the communication (every rank has the
                # tokens, the partial outputs are summed on the way back), so the adapter's do not cross TP either
                # and its whole factor's gradient (a partial sum on each rank) is summed over the group instead
                explicit = tp > 1 and getattr(linear, "explicit_expert_comm", False)
                sp = bool(getattr(linear, "sequence_parallel", chunk_sp))  # (the linear's own: its input is sliced)
                w = linear.weight
                full_in = w.shape[1] * (tp if kind == "row" else 1)
                A = _init_A(seed, cfg.rank, full_in)
                if kind == "row":
                    A = A.chunk(tp, dim=1)[tp_rank]
                linear.lora_A = torch.nn.Parameter(A.to(device=w.device, dtype=w.dtype).contiguous())
                linear.lora_B = torch.nn.Parameter(torch.zeros(w.shape[0], cfg.rank, device=w.device, dtype=w.dtype))
                linear.register_buffer("lora_scaling", torch.tensor(cfg.scaling, dtype=torch.float32,
                                                                    device=w.device))
                for factor in (linear.lora_A, linear.lora_B):  # a routed expert's: reduced over its expert-DP group
                    factor.allreduce = getattr(w, "allreduce", True)
                if tp == 1:  # whole, as the weight: counted in the gradient norm where the weight is
                    for factor in (linear.lora_A, linear.lora_B):
                        factor.tensor_model_parallel = bool(getattr(w, "tensor_model_parallel", False))
                else:
                    split, whole = (linear.lora_B, linear.lora_A) if kind == "column" else \
                        (linear.lora_A, linear.lora_B)
                    set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
                    if explicit:
                        whole.register_hook(_summed_over(group))
                    elif sp:  # a sum over this rank's tokens: Megatron reduces it over TP as the norms' gradients
                        whole.sequence_parallel = True
                linear.lora_off = False
                linear.register_forward_hook(_hook(kind, sp and not explicit, group if tp > 1 and not explicit
                                                   else None))
                adapted.append(modules[id(linear)])
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:  # the first stage: see _embedding_requires_grad
            embedding.register_forward_hook(_embedding_requires_grad)
    if not adapted:
        raise ValueError(f"--lora-rank: this pipeline stage's layers have none of {', '.join(cfg.targets)} to adapt "
                         "(a MoE layer's MLP and linear-attention mixers have none unless experts / shared_experts "
                         "are named): choose other --lora-target-modules or another pipeline split")
    return adapted


@contextlib.contextmanager
def disabled(chunks: list):
    """Within the block the adapted linears of ``chunks`` compute with their frozen weights alone: the model is the
    checkpoint's (the KL reference of a LoRA run, without a second copy of the weights)."""
    linears = [m for chunk in chunks for m in chunk.modules() if hasattr(m, "lora_off")]
    for m in linears:
        m.lora_off = True
    try:
        yield
    finally:
        for m in linears:
            m.lora_off = False


def merged(module_state: dict, weight_name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` + scaling * B A when ``module_state`` (a name -> tensor mapping) holds the adapter of the linear
    whose weight is ``weight_name`` (``...linear_qkv.weight``), else ``weight`` itself. Per TP shard: B A has the
    shard's shape. Computed in fp32, returned in the weight's dtype."""
    prefix = weight_name[: -len("weight")]
    A = module_state.get(prefix + "lora_A")
    if A is None or not weight_name.endswith(".weight"):
        return weight
    B, scaling = module_state[prefix + "lora_B"], module_state[prefix + "lora_scaling"]
    delta = (B.detach().float() @ A.detach().float()) * float(scaling)
    return (weight.detach().float() + delta.to(weight.device)).to(weight.dtype)


def joined_factors(bridge, weight: str, A_shards: list, B_shards: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) whole from the TP ranks' factors of the adapter on canonical weight ``weight``: a column-parallel
    linear's B is split as its weight (A whole on every rank), a row-parallel one's A (B whole); the split one is
    joined as the weight is (``Bridge.tp_join``: QKV groups, GLU halves), the whole one taken from the first rank."""
    if weight.rsplit(".", 2)[-2] in COLUMN:
        return A_shards[0], bridge.tp_join(weight, B_shards) if len(B_shards) > 1 else B_shards[0]
    return (bridge.tp_join(weight, A_shards) if len(A_shards) > 1 else A_shards[0]), B_shards[0]


def peft_tensors(bridge, weight: str, A: torch.Tensor, B: torch.Tensor, dtype: torch.dtype | None = None) -> dict:
    """The PEFT form of the adapter on canonical weight ``weight`` (A [R, I] and B [O, R] whole, TP shards joined):
    ``base_model.model.<hf module>.lora_A.weight`` / ``lora_B.weight``. A fused Megatron linear becomes HF's
    projections, each with the shared A and its rows of B (q/k/v, gate/up), so B_hf A = the rows of B A that a merge
    adds to that projection's weight."""
    column = weight.rsplit(".", 2)[-2] in COLUMN
    pairs = {n: (A, b) for n, b in bridge.to_hf(weight, B).items()} if column else \
        {n: (a, B) for n, a in bridge.to_hf(weight, A).items()}
    out = {}
    for hf_name, (a, b) in pairs.items():
        module = hf_name[: -len(".weight")]
        out[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype or a.dtype, copy=True).contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype or b.dtype, copy=True).contiguous()
    return out


def peft_config(rank: int, alpha: float, tensors: dict, base_model: str | None) -> dict:
    """``adapter_config.json`` of the PEFT LoRA adapter ``tensors`` (:func:`peft_tensors`' keys): its target modules
    are the HF module names (``q_proj``, ...) they adapt."""
    modules = sorted({key.rsplit(".", 3)[1] for key in tensors})  # <module path>.<name>.lora_X.weight
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "target_modules": modules,
            "base_model_name_or_path": base_model}


def merge_state(state: dict) -> dict:
    """A model state dict with every adapter merged into its weight and the adapters' entries left out (the HF
    export of a LoRA run's checkpoint)."""
    return {k: merged(state, k, v) if isinstance(v, torch.Tensor) else v
            for k, v in state.items() if not is_lora_name(k)}
