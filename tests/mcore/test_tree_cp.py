"""Context parallelism for tree-packed micro-batches equals CP = 1 (fp32, CPU, gloo; 0 GPUs, 1, 2 and 4 ranks).

The same tree GPTModel weights run one forest at CP = 1 and sharded over CP = 2 / 4 ranks (tokens split, heads
traded by all-to-all around the tree kernel, forge_megatron.mcore.context_parallel). Checked: per-sample logprobs
and entropies (every CP rank returns the full vector), and parameter gradients of a per-sample weighted loss summed
over the CP ranks, against CP = 1; for both ways of moving key/value heads (all-to-all when CP divides them,
all-gather when they divide CP), for trees whose length is not a multiple of CP (padding) and for a tree shorter
than the CP size times a tile.
"""

import pytest
import torch

from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed
from tests.mcore.test_tree_exact import _cfg, _weighted_loss, _weights, all_samples, forest_cases

LOGP_ATOL = 1e-5
GRAD_RTOL = 1e-5


def _forests():
    """T = 5 for "tiny": under CP = 4 two ranks hold one real token and a padding root, two only padding."""
    return {"all": all_samples(7), "deep_chain": forest_cases(3)["deep_chain"],
            "tiny": [[1, 2, 3], [1, 2, 4, 5]]}


def _model(kv_heads, moe):
    from forge_megatron.mcore.tree_attention import build_tree_gpt

    if not moe:
        return build_tree_gpt(_cfg(num_query_groups=kv_heads))
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from forge_megatron.mcore.model import build_gpt, transformer_config
    from forge_megatron.mcore.tree_attention import swap_core_attention, use_depth_rope

    cfg = _cfg(num_query_groups=kv_heads, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
               extra={"moe_layer_freq": [0, 1]})
    model = build_gpt(cfg, spec=swap_core_attention(get_gpt_decoder_block_spec(transformer_config(cfg),
                                                                               use_transformer_engine=False)))
    use_depth_rope(model)
    return model


def forest_runs(model, groups_of):
    """Per forest of ``_forests()``: (logp, entropy, {param: gradient}, layout) of a weighted per-sample loss, each
    parameter's gradient all-reduced over the process groups ``groups_of(name, param)`` names."""
    import torch.distributed as dist

    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.tree import build_tree

    out = {}
    for name, samples in _forests().items():
        layout = build_tree(samples)
        model.zero_grad()
        logp, ent = tree_logprobs(model, layout, with_entropy=True)
        _weighted_loss(logp, layout, _weights(samples)).backward()
        grads = {}
        for pname, p in model.named_parameters():
            g = p.grad.clone()
            for group in groups_of(pname, p):
                dist.all_reduce(g, group=group)
            grads[pname] = g
        out[name] = (logp.detach(), ent.detach(), grads, layout)
    return out


def _run(state_path, kv_heads, save, moe=False):
    """Per forest: (logp_M, entropy_M, {param: grad summed over CP ranks}) on this rank."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.forward import tree_model_inputs

    torch.manual_seed(3)
    model = _model(kv_heads, moe)
    state_path = f"{state_path}.tp{ps.get_tensor_model_parallel_rank()}"  # TP shards differ; CP ranks share one
    if save:
        torch.save(model.state_dict(), state_path)
    else:
        model.load_state_dict(torch.load(state_path))
    cp_group = [ps.get_context_parallel_group()] if ps.get_context_parallel_world_size() > 1 else []
    out = {}
    for name, (logp, ent, grads, layout) in forest_runs(model, lambda pname, p: cp_group).items():
        local = tree_model_inputs(layout)["input_ids"].shape[1]
        out[name] = (logp, ent, grads, (layout.unique_tokens, local))
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    return out


def _body(rank, world_size, state_path, kv_heads, save, moe):
    return _run(state_path, kv_heads, save, moe)


@pytest.mark.parametrize("cp,tp,kv_heads,moe", [(2, 1, 2, False), (2, 1, 1, False), (4, 1, 2, False),
                                                 (2, 2, 2, False), (2, 1, 2, True)])
def test_cp_equals_cp1(tmp_path, cp, tp, kv_heads, moe):
    """(2, 1, 2): k/v all-to-all; (2, 1, 1) and (4, 1, 2): k/v all-gathered, each rank keeping its one KV head;
    (2, 2, 2): TP = 2 x CP = 2 on 4 ranks against TP = 2 alone (2 query and 1 KV head per TP rank, vocab-parallel
    logprobs summed over CP), each rank against the CP = 1 rank with its TP rank; MoE: a dense then a MoE layer
    (4 experts, top-2) routing each CP shard's tokens (router auxiliary losses are off in the fp32 test config)."""
    state = str(tmp_path / "model.pt")
    want = run_distributed(_body, world_size=tp, parallel=ParallelConfig(tp=tp), state_path=state, kv_heads=kv_heads,
                           save=True, moe=moe)
    want = {w.pop("tp_rank"): w for w in want}
    got = run_distributed(_body, world_size=cp * tp, parallel=ParallelConfig(tp=tp, cp=cp), state_path=state,
                          kv_heads=kv_heads, save=False, moe=moe, timeout_s=400)
    assert sorted(r["tp_rank"] for r in got) == sorted(list(range(tp)) * cp)
    for rank, result in enumerate(got):
        base = want[result.pop("tp_rank")]
        for name, (logp, ent, grads, (T, local)) in result.items():
            w_logp, w_ent, w_grads, _ = base[name]
            assert local == -(-T // cp), (rank, name, T, local)  # this rank really held one shard of the tree
            assert (logp - w_logp).abs().max().item() <= LOGP_ATOL, (rank, name)
            assert (ent - w_ent).abs().max().item() <= LOGP_ATOL, (rank, name)
            for pname, g in grads.items():
                ref = w_grads[pname]
                rel = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                assert rel <= GRAD_RTOL, (rank, name, pname, rel)


def test_cp_head_requirements_are_explained():
    from forge_megatron.mcore.context_parallel import check_heads

    check_heads(8, 2, 4)
    check_heads(8, 8, 4)
    with pytest.raises(ValueError, match=r"cp=3 must divide the query heads per tensor-parallel rank \(8\)"):
        check_heads(8, 2, 3)
    with pytest.raises(ValueError, match=r"cp=4 must divide, or be a multiple of, the key/value heads .* \(6\)"):
        check_heads(12, 6, 4)


def test_padding_makes_single_token_roots():
    from forge_megatron.mcore.context_parallel import pad_sub_end, pad_zeros, shard_range

    se = torch.tensor([3, 2, 3, 5, 5], dtype=torch.int32)
    assert pad_sub_end(se, 4).tolist() == [3, 2, 3, 5, 5, 6, 7, 8]
    assert pad_zeros(torch.tensor([7, 8, 9, 1, 2]), 4).tolist() == [7, 8, 9, 1, 2, 0, 0, 0]
    assert [shard_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert pad_sub_end(se, 5).tolist() == se.tolist()
