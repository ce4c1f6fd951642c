"""Counting the memory a computation keeps alive, on any device (the CPU has no allocator statistics).

:class:`LiveBytes` is a dispatch mode that records the storage of every tensor an op creates under it and counts it
out again when the storage is freed (a weak-reference finalizer), so ``mode.live`` is, at any moment, the bytes made
under the mode that something still holds: after a forward pass, what autograd keeps for the backward plus the
outputs. :func:`held_by_module` reads it around one module's forward. The benchmarks and tests of activation memory
(benchmarks/gated_delta.py, tests/kernels/test_gated_delta.py, tests/training/test_plan.py) use these.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive. ``existing`` tensors' storages (inputs:
    an op may return a view of one) are never counted."""

    def __init__(self, existing=()):
        super().__init__()
        self.live = 0
        self.seen = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                self.seen.add(key)
                self.live += nbytes
                weakref.finalize(storage, self._freed, key, nbytes)
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)


@contextlib.contextmanager
def frozen_heap():
    """Inside, ``gc.collect()`` looks only at the objects made inside (``gc.freeze``): whatever a measurement frees
    (autograd's reference cycles) was made during it, while a whole collection of a process that imported torch,
    transformers and Megatron-Core walks millions of objects (0.1-0.4 s each, which was most of a tower's
    activation test). Garbage from before stays uncollected until the end, alive in both readings of a difference.
    A heap frozen already (the test workers freeze theirs) stays frozen, with what outlived the block added."""
    frozen_before = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def held_by_module(module: torch.nn.Module, mode: LiveBytes) -> dict:
    """Hooks on ``module`` recording, in the returned dict's ``"held"``, the bytes its forward left alive under
    ``mode`` (its first output excluded): what it keeps for its backward. Run the forward inside ``mode``. (The heap
    from before the forward is frozen while it runs, as :func:`frozen_heap`: the collection after it walks only what
    the forward made.)"""
    out: dict = {}
    frozen = contextlib.ExitStack()

    def before(*_):
        frozen.enter_context(frozen_heap())
        out["before"] = mode.live

    def after(_module, _args, result):
        with frozen:
            gc.collect()
        first = result[0] if isinstance(result, (tuple, list)) else result
        out["held"] = mode.live - out["before"] - first.untyped_storage().nbytes()

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
    return out
