"""Keep a frozen model's weights in host memory between uses (the KL reference model, ``--ref-offload``).

The reference model of the KL term is used once per step, for one forward-only pass, yet holds a full copy of this
rank's weights on the GPU the whole time. :class:`HostOffload` keeps every parameter and buffer of the given
modules in host memory (pinned when CUDA is present, so the copies back are asynchronous DMA) and leaves the
modules holding empty tensors; ``with offload.resident():`` copies them to the device for the duration of the block
and releases the device memory afterwards. The modules stay the same objects (hooks, e.g. routing replay, stay
installed); only ``tensor.data`` changes. Frozen weights only: gradients or optimizer state would not follow.

Cost per step: one host-to-device copy of this rank's weights (e.g. 8 GB at ~25 GB/s over PCIe Gen5 or far more
over NVLink-C2C: a fraction of a second against an RL step of tens of seconds); saved: the same 8 GB of GPU memory
for the whole training pass. Without CUDA the "device" copy is a fresh host tensor, so the mechanism (release and
exact restore) runs and is tested on CPU too.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class HostOffload:
    """Host copies of every parameter and buffer of ``modules``; the modules hold empty tensors between uses."""

    def __init__(self, modules, device: torch.device | str | None = None):
        self.tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                if id(t) not in seen:  # tied weights appear once
                    seen.add(id(t))
                    self.tensors.append(t)
        if any(t.requires_grad for t in self.tensors):
            raise ValueError("HostOffload is for frozen modules: call requires_grad_(False) first")
        self.device = torch.device(device) if device is not None else (
            self.tensors[0].device if self.tensors else torch.device("cpu"))
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t.detach()) for t in self.tensors]
        self.resident_now = True
        self.offload()

    @property
    def nbytes(self) -> int:
        """Bytes kept on the host (what the device no longer holds between uses)."""
        return sum(h.numel() * h.element_size() for h in self.host)

    def offload(self) -> None:
        """Release the device copies (the host copies are the weights)."""
        for t in self.tensors:
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        self.resident_now = False

    def load(self) -> None:
        """Copy the weights to the device (asynchronously from pinned memory, ordered on the current stream)."""
        for t, h in zip(self.tensors, self.host):
            t.data = h.to(self.device, non_blocking=True, copy=True)
        self.resident_now = True

    @contextmanager
    def resident(self):
        """The weights are on the device inside the block, released after it (also when it raises)."""
        self.load()
        try:
            yield
        finally:
            self.offload()
