"""HostOffload (forge_megatron.training.offload): a frozen module's weights live on the host between uses.

Checked on CPU (the "device" copy is then a fresh host tensor, so release and restore are the same code): between
uses every parameter and buffer holds no elements; inside ``resident()`` the module computes exactly what it did
before offloading, also after several round trips and when the block raises; tied weights are stored once;
trainable modules are refused. The trainer's KL reference with --ref-offload: tests/training/test_trainer.py.
"""

import pytest
import torch

from forge_megatron.training.offload import HostOffload


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.head(self.norm(self.embed(x)) * self.scale)


def test_weights_leave_and_come_back_exactly():
    torch.manual_seed(0)
    nets = [_Net(), _Net()]
    for net in nets:
        net.requires_grad_(False)
    x = torch.tensor([1, 4, 7, 10])
    want = [net(x) for net in nets]
    offload = HostOffload(nets)
    assert len(offload.tensors) == 2 * 4  # embed (= head), norm weight and bias, scale: tied stored once
    assert offload.nbytes == 2 * (11 * 8 + 8 + 8 + 1) * 4
    assert all(t.numel() == 0 for net in nets for t in [*net.parameters(), *net.buffers()])
    for _ in range(3):
        with offload.resident():
            assert offload.resident_now
            for net, w in zip(nets, want):
                assert torch.equal(net(x), w)
        assert not offload.resident_now and all(p.numel() == 0 for net in nets for p in net.parameters())
    with pytest.raises(RuntimeError, match="boom"):
        with offload.resident():
            raise RuntimeError("boom")
    assert all(p.numel() == 0 for p in nets[0].parameters())  # released on the way out, too
    with offload.resident():
        assert torch.equal(nets[1](x), want[1])


def test_trainable_modules_are_refused():
    with pytest.raises(ValueError, match="for frozen modules"):
        HostOffload([_Net()])
