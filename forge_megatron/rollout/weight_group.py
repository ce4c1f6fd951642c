"""The process group that carries weights from the trainer to engines (``/init_weights_update_group``).

SGLang's convention: the trainer is rank 0 and hosts the rendezvous at ``master_address:master_port``; each engine
joins as ranks ``rank_offset ..``; tensors are then broadcast from rank 0 in the order announced by
``/update_weights_from_distributed``. The group is a standalone process group (not torch.distributed's default
group), so it coexists with the trainer's Megatron groups and with any other group in the same process.

Both ends must build it the same way, or the ranks look for each other under different store keys and the NCCL id
exchange never meets. SGLang's engines (``init_custom_process_group``) rendezvous over ``tcp://`` (rank 0 hosts the
TCP store), wrap the store in ``PrefixStore(group_name)`` and hand it to torch's own group constructor
(``_new_process_group_helper``), which prefixes the keys again by group name and by device. :func:`custom_group`
does exactly that, for the trainer (rank 0, ``forge_megatron.weight_sync``) and for forge-engine alike, so the CPU
tests between them exercise the construction a real SGLang engine uses. ``_new_process_group_helper`` is private to
torch (SGLang relies on it too); its options argument was renamed once, which :func:`custom_group` handles.

Group names must be unique within a process (torch refuses a name twice), hence the trainer's per-run token in its
group names: a trainer restarted against long-lived engines must not reuse a name they already hold.
"""

from __future__ import annotations

import datetime
import inspect

import torch.distributed as dist


def custom_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
                 timeout_s: float = 120.0):
    """Host (rank 0) or join a standalone group built as SGLang builds it; returns (store, group).

    Blocks until every rank has joined (gloo) or, for NCCL, until the first collective. The group holds the store
    (through its prefix stores); the caller may keep it too."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if group_name in _world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(f"tcp://{master_address}:{int(master_port)}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    made = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                     group_name=group_name, timeout=timeout, **{options: None})
    group = made[0] if isinstance(made, tuple) else made
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return store, group


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 120.0) -> dist.ProcessGroup:
    """forge-engine's side (rank > 0; rank 0 in tests): join the weight-update group over gloo and return it."""
    if backend != "gloo":
        raise ValueError(f"backend {backend!r} is not supported by the CPU weight-update group (use 'gloo')")
    return custom_group(master_address, master_port, rank, world_size, group_name, backend, timeout_s)[1]


def broadcast_tensor(group: dist.ProcessGroup, tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from ``src`` over ``group`` (a standalone group: ranks are group ranks)."""
    from forge_megatron.weight_sync.buckets import wire_view

    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([wire_view(tensor, "gloo")], opts).wait()
