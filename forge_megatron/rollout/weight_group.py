"""The process group that carries weights from the trainer to engines (``/init_weights_update_group``).

SGLang's convention: the trainer is rank 0 and hosts the rendezvous at ``master_address:master_port``; each engine
joins as ranks ``rank_offset ..``; tensors are then broadcast from rank 0 in the order announced by
``/update_weights_from_distributed``. The group is a standalone process group (not torch.distributed's default
group), so it coexists with the trainer's Megatron groups and with any other group in the same process. Its store
keys live under ``"<group_name>/"`` like groups made by ``torch.distributed``'s own helper.

On CPU the backend is gloo; NCCL groups for real SGLang engines are made by the weight-sync layer.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 120.0) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the weight-update group and return it; blocks until all ranks joined."""
    if backend != "gloo":
        raise ValueError(f"backend {backend!r} is not supported by the CPU weight-update group (use 'gloo')")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{group_name}/", store), rank, world_size, timeout)


def broadcast_tensor(group: dist.ProcessGroup, tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from ``src`` over ``group`` (a standalone group: ranks are group ranks)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()
