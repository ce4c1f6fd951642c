"""xIELU (Apertus's MLP activation): a piecewise activation with two trained scalars per layer.

    xIELU(x) = a_p x^2 + beta x                         x > 0
             = a_n (expm1(min(x, eps)) - x) + beta x    x <= 0
    a_p = softplus(alpha_p),  a_n = beta + softplus(alpha_n)

``alpha_p`` and ``alpha_n`` are parameters of each MLP (checkpoint ``mlp.act_fn.alpha_p`` / ``alpha_n``, shape [1]);
``beta`` and ``eps`` are constants the checkpoint stores as 0-dim buffers (0.5 and -1e-6 in the releases), kept as
buffers of one element here (dist checkpoints shard no 0-dim tensor; the bridge reshapes them), converted and
exported, never trained or synced. The formula is transformers' Python one.

Megatron's MLP applies ``self.activation_func`` to its fc1 output (a plain, non-gated MLP), so
:func:`attach` makes each dense MLP's ``activation_func`` an :class:`XIELU` module: its parameters become the MLP's
(``mlp.activation_func.alpha_p``). Under tensor parallelism each rank applies it to its own slice of the fc1
channels, so each rank's gradient of the (replicated) scalars is a partial sum: the parameters enter the formula
through Megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce over TP backward), which
sums them, with or without sequence parallelism; data and context parallelism reduce them as every parameter.
"""

from __future__ import annotations

import torch


class XIELU(torch.nn.Module):
    """xIELU with its two trained scalars and two constant buffers (module docstring)."""

    def __init__(self, dtype: torch.dtype = torch.float32, alpha_p: float = 0.8, alpha_n: float = 0.8,
                 beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        # (transformers' initialisation, inverse softplus; a checkpoint's values replace them)
        self.alpha_p = torch.nn.Parameter(torch.log(torch.expm1(torch.tensor([alpha_p], dtype=torch.float64)))
                                          .to(dtype))
        self.alpha_n = torch.nn.Parameter(torch.log(torch.expm1(torch.tensor([alpha_n - beta], dtype=torch.float64)))
                                          .to(dtype))
        self.register_buffer("beta", torch.tensor([beta], dtype=dtype))
        self.register_buffer("eps", torch.tensor([eps], dtype=dtype))

    def forward(self, x):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        alpha_p, alpha_n = self.alpha_p, self.alpha_n
        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            alpha_p = copy_to_tensor_model_parallel_region(alpha_p)  # (their gradients summed over TP)
            alpha_n = copy_to_tensor_model_parallel_region(alpha_n)
        a_p = torch.nn.functional.softplus(alpha_p)
        a_n = self.beta + torch.nn.functional.softplus(alpha_n)
        return torch.where(x > 0, a_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * a_n + self.beta * x)


    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's dist-checkpoint view (Megatron's MLP asks each child for one): every tensor replicated."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, \
            make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(own, prefix, {}, sharded_offsets,
                                                   tp_group=ps.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


def unset(x):
    """The activation Megatron's config holds for an xIELU model: never called (each MLP has its own XIELU)."""
    raise RuntimeError("an xIELU MLP without its XIELU module (mcore/xielu.attach was not applied)")


def attach(model, dtype: torch.dtype) -> int:
    """Give every dense MLP of ``model`` its own :class:`XIELU` as ``activation_func``; the number given."""
    from megatron.core.transformer.mlp import MLP

    count = 0
    for module in list(model.modules()):
        if isinstance(module, MLP) and not isinstance(module.activation_func, XIELU):
            module.activation_func = XIELU(dtype).to(module.linear_fc1.weight.device)
            count += 1
    return count
