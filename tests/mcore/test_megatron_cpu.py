"""Megatron-Core runs on CPU with gloo through forge_megatron.mcore.cpu_compat (0 GPUs; 1-2 gloo ranks).

Covers the foundation the trainer stands on: a tiny RoPE GPT forward/backward, TP=2 equal to TP=1 for the same
weights, PP=2 through Megatron's pipeline schedule with several micro-batches, MoE (4 experts, top-2) with EP=2
through the all-to-all dispatcher, and Megatron's optimizer on DP=2 (loss falls, replicas agree).
"""

import math

import pytest
import torch

from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed

VOCAB = 96
SEQ = 16


def _cfg(**kw):
    from forge_megatron.mcore.model import GPTConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                vocab_size=VOCAB, max_position_embeddings=64)
    base.update(kw)
    return GPTConfig(**base)


def _batch(batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _forward_loss(model, tokens, labels):
    from forge_megatron.mcore.model import causal_mask

    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    per_token = model(tokens, pos, causal_mask(tokens.shape[1]), labels=labels)  # [b, s] vocab-parallel CE
    return per_token.float().mean()


def _full_state(model):
    """Gather a TP-sharded state dict to full tensors (keys of the local model)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            torch.distributed.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.clone()
    return out


# ----------------------------------------------------------------------------------------------- bodies
def _body_single(rank, world_size):
    from forge_megatron.mcore.model import build_gpt

    model = build_gpt(_cfg())
    tokens, labels = _batch()
    loss = _forward_loss(model, tokens, labels)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # Untrained model on uniform-ish logits: loss near log(V).
    assert abs(loss.item() - math.log(VOCAB)) < 0.5, loss.item()
    return loss.item(), sum(g.abs().sum().item() for g in grads)


def _body_tp(rank, world_size, ref_state):
    """Build a TP=2 model, load the TP=1 reference weights sharded, compare the loss."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.model import build_gpt

    model = build_gpt(_cfg())
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = ref_state[name]
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
            assert full.shape == p.shape, (name, full.shape, p.shape)
            p.copy_(full)
    tokens, labels = _batch()
    return _forward_loss(model, tokens, labels).item()


def _body_reference_state(rank, world_size):
    from forge_megatron.mcore.model import build_gpt

    torch.manual_seed(7)
    model = build_gpt(_cfg())
    tokens, labels = _batch()
    # QKV and fc1 are interleaved per query group / GLU half in Megatron; for TP sharding we must re-layout.
    return _forward_loss(model, tokens, labels).item(), _full_state(model)


def _body_pp(rank, world_size, num_microbatches):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from forge_megatron.mcore.model import build_gpt, causal_mask

    model = build_gpt(_cfg(num_layers=4))
    batches = [_batch(batch=1, seed=i) for i in range(num_microbatches)]
    it = iter(batches)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        pos = torch.arange(tokens.shape[1])[None]
        out = model(tokens, pos, causal_mask(tokens.shape[1]), labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=num_microbatches,
        seq_length=SEQ, micro_batch_size=1, forward_only=False,
    )
    grad_ok = all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    has_grad = any(p.main_grad.abs().sum() > 0 if hasattr(p, "main_grad") else (p.grad is not None and p.grad.abs().sum() > 0)
                   for p in model.parameters())
    last = ps.is_pipeline_last_stage()
    return {"last": last, "n_losses": len(losses), "grad_ok": grad_ok, "has_grad": has_grad,
            "losses": [float(x["loss"]) for x in losses] if last else []}


def _body_moe(rank, world_size):
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.model import build_gpt

    model = build_gpt(_cfg(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                           moe_token_dispatcher_type="alltoall"))
    n_local = sum(1 for n, _ in model.named_parameters() if "local_experts" in n and "linear_fc1" in n)
    tokens, labels = _batch(seed=rank)  # different data per EP rank: tokens really travel between ranks
    loss = _forward_loss(model, tokens, labels)
    loss.backward()
    expert_grads = [p.grad for n, p in model.named_parameters() if "local_experts" in n]
    assert all(g is not None and torch.isfinite(g).all() for g in expert_grads)
    return {"ep": ps.get_expert_model_parallel_world_size(), "local_experts": n_local, "loss": loss.item(),
            "expert_grad_sum": sum(g.abs().sum().item() for g in expert_grads)}


def _body_optimizer(rank, world_size, steps):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from forge_megatron.mcore.model import build_gpt

    torch.manual_seed(3)
    model = build_gpt(_cfg())
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0), [ddp])
    tokens, labels = _batch(seed=rank)  # each DP rank sees its own data
    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = _forward_loss(ddp, tokens, labels)
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok and math.isfinite(grad_norm)
        losses.append(loss.item())
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    return losses, checksum


# ----------------------------------------------------------------------------------------------- tests
def test_gpt_forward_backward_one_rank():
    (loss, grad_sum), = run_distributed(_body_single, world_size=1)
    assert grad_sum > 0


def test_tp2_loss_equals_tp1():
    (ref_loss, state), = run_distributed(_body_reference_state, world_size=1, seed=11)
    # Megatron's fused QKV and GLU fc1 are laid out per TP rank: a TP=1 checkpoint sharded naively along dim 0
    # gives each rank the wrong rows. Re-layout [q-groups | fc1 gate|up] so that chunk(tp) hands out proper shards.
    tp = 2
    for name in list(state):
        if name.endswith("linear_fc1.weight"):
            gate, up = state[name].chunk(2, dim=0)
            state[name] = torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))])
    losses = run_distributed(_body_tp, world_size=2, parallel=ParallelConfig(tp=2), ref_state=state)
    assert losses[0] == pytest.approx(losses[1], abs=0)
    assert losses[0] == pytest.approx(ref_loss, abs=1e-5)


def test_pp2_schedule_with_microbatches():
    out = run_distributed(_body_pp, world_size=2, parallel=ParallelConfig(pp=2), num_microbatches=4)
    last = [o for o in out if o["last"]]
    first = [o for o in out if not o["last"]]
    assert len(last) == 1 and len(first) == 1
    assert last[0]["n_losses"] == 4 and all(math.isfinite(x) for x in last[0]["losses"])
    assert all(o["grad_ok"] and o["has_grad"] for o in out)  # gradients reached the first stage through p2p


def test_moe_ep2_alltoall():
    out = run_distributed(_body_moe, world_size=2, parallel=ParallelConfig(ep=2))
    for o in out:
        assert o["ep"] == 2
        assert o["local_experts"] == 2 * 2  # 2 layers x (4 experts / EP 2)
        assert math.isfinite(o["loss"]) and o["expert_grad_sum"] > 0


def test_optimizer_dp2_loss_falls_and_replicas_agree():
    (l0, c0), (l1, c1) = run_distributed(_body_optimizer, world_size=2, steps=5)
    assert l0[-1] < l0[0] and l1[-1] < l1[0]
    assert c0 == pytest.approx(c1, rel=0, abs=1e-9)  # same averaged gradients -> identical replicas
