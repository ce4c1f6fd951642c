"""Context parallelism for tree-packed micro-batches equals CP = 1 (fp32, CPU, gloo; 0 GPUs, 1, 2 and 4 ranks).

The same tree GPTModel weights run one forest at CP = 1 and sharded over CP = 2 / 4 ranks (zig-zag token chunks;
forge_megatron.mcore.context_parallel). Checked: per-sample logprobs and entropies (every CP rank returns the full
vector), and parameter gradients of a per-sample weighted loss summed over the CP ranks, against CP = 1; for both
attention modes (a2a: heads traded by all-to-all, key/value heads all-to-all'd when CP divides them and all-gathered
when they divide CP; all_gather: keys and values all-gathered, each chunk attending as suffix queries, also with
fewer heads than CP ranks), for trees whose length is not a multiple of 2 CP (padding) and for a tree shorter than
the CP size times a tile.
"""

import pytest
import torch

from forge_megatron.mcore.context_parallel import default_multiple, padded_length
from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed
from tests.mcore.test_tree_exact import _cfg, _weighted_loss, _weights, all_samples, forest_cases

LOGP_ATOL = 1e-5
GRAD_RTOL = 1e-5


def _forests():
    """T = 5 for "tiny": under CP = 4 two ranks hold one real token and a padding root, two only padding."""
    return {"all": all_samples(7), "deep_chain": forest_cases(3)["deep_chain"],
            "tiny": [[1, 2, 3], [1, 2, 4, 5]]}


def _model(kv_heads, moe, heads=4, comm=None):
    from forge_megatron.mcore.tree_attention import build_tree_gpt

    extra = {"cp_comm_type": comm} if comm else {}
    if not moe:
        return build_tree_gpt(_cfg(num_query_groups=kv_heads, num_attention_heads=heads, extra=extra))
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from forge_megatron.mcore.model import build_gpt, transformer_config
    from forge_megatron.mcore.tree_attention import swap_core_attention, use_depth_rope

    cfg = _cfg(num_query_groups=kv_heads, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
               num_attention_heads=heads, extra={"moe_layer_freq": [0, 1], **extra})
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


def _run(state_path, kv_heads, save, moe=False, heads=4, comm=None):
    """Per forest: (logp_M, entropy_M, {param: grad summed over CP ranks}) on this rank."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.forward import tree_model_inputs

    torch.manual_seed(3)
    model = _model(kv_heads, moe, heads, comm if ps.get_context_parallel_world_size() > 1 else None)
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
    from forge_megatron.mcore.tree_attention import TreeAttention

    out["comm"] = sorted({str(m.cp_comm_type) for m in model.modules() if isinstance(m, TreeAttention)})
    return out


def _body(rank, world_size, state_path, kv_heads, save, moe, heads, comm):
    return _run(state_path, kv_heads, save, moe, heads, comm)


@pytest.mark.parametrize("cp,tp,heads,kv_heads,moe,comm", [
    (2, 1, 4, 2, True, "a2a"), (4, 1, 4, 2, False, None), (2, 1, 4, 2, False, "all_gather"),
    (4, 1, 2, 1, False, None), (2, 2, 2, 2, False, None)])
def test_cp_equals_cp1(tmp_path, cp, tp, heads, kv_heads, moe, comm):
    """(2, 1, 4, 2) k/v all-to-all, on a dense then a MoE layer (4 experts, top-2) routing each CP shard's tokens
    (router auxiliary losses are off in the fp32 test config); (4, 1, 4, 2): k/v all-gathered (automatic: 4 ranks,
    2 KV heads), each rank keeping its KV head; all_gather: asked for with heads that a2a could split, chosen
    automatically for CP = 4 with 2 query heads and 1 KV head, and under TP = 2 x CP = 2 (4 ranks) with one head per
    TP rank, against TP = 2 alone (vocab-parallel logprobs summed over CP), each rank against the CP = 1 rank with
    its TP rank. TP x CP with all-to-all: test_tree_sp.py."""
    state = str(tmp_path / "model.pt")
    want = run_distributed(_body, world_size=tp, parallel=ParallelConfig(tp=tp), state_path=state, kv_heads=kv_heads,
                           save=True, moe=moe, heads=heads, comm=comm)
    want = {w.pop("tp_rank"): w for w in want}
    for w in want.values():
        w.pop("comm")
    got = run_distributed(_body, world_size=cp * tp, parallel=ParallelConfig(tp=tp, cp=cp), state_path=state,
                          kv_heads=kv_heads, save=False, moe=moe, heads=heads, comm=comm, timeout_s=400)
    assert all(r.pop("comm") == [str(comm)] for r in got)  # Megatron handed the config's mode to every layer
    assert sorted(r["tp_rank"] for r in got) == sorted(list(range(tp)) * cp)
    for rank, result in enumerate(got):
        base = want[result.pop("tp_rank")]
        for name, (logp, ent, grads, (T, local)) in result.items():
            w_logp, w_ent, w_grads, _ = base[name]
            assert local == padded_length(T, default_multiple(cp)) // cp, (rank, name, T, local)  # its chunks only
            assert (logp - w_logp).abs().max().item() <= LOGP_ATOL, (rank, name)
            assert (ent - w_ent).abs().max().item() <= LOGP_ATOL, (rank, name)
            for pname, g in grads.items():
                ref = w_grads[pname]
                rel = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                assert rel <= GRAD_RTOL, (rank, name, pname, rel)


def test_cp_head_requirements_are_explained():
    from forge_megatron.mcore.context_parallel import check_heads, resolve_comm_type

    check_heads(8, 2, 4)
    check_heads(8, 8, 4)
    with pytest.raises(ValueError, match=r"cp=3 must divide the query heads per tensor-parallel rank \(8\); "
                                         "all_gather works with any head count"):
        check_heads(8, 2, 3)
    with pytest.raises(ValueError, match=r"cp=4 must divide, or be a multiple of, the key/value heads .* \(6\)"):
        check_heads(12, 6, 4)
    assert resolve_comm_type(None, 8, 2, 4) == resolve_comm_type("auto", 8, 8, 4) == "a2a"
    assert resolve_comm_type("auto", 8, 2, 3) == resolve_comm_type(None, 4, 1, 8) == "all_gather"
    assert resolve_comm_type("all_gather", 8, 2, 4) == resolve_comm_type("allgather", 8, 2, 4) == "all_gather"
    with pytest.raises(ValueError, match="cp=3 must divide"):
        resolve_comm_type("a2a", 8, 2, 3)
    with pytest.raises(ValueError, match="supports cp_comm_type a2a or all_gather .* got 'p2p'"):
        resolve_comm_type("p2p", 8, 2, 4)


def test_padding_makes_single_token_roots():
    from forge_megatron.mcore.context_parallel import pad_sub_end, pad_zeros

    se = torch.tensor([3, 2, 3, 5, 5], dtype=torch.int32)
    assert pad_sub_end(se, 4).tolist() == [3, 2, 3, 5, 5, 6, 7, 8]
    assert pad_zeros(torch.tensor([7, 8, 9, 1, 2]), 4).tolist() == [7, 8, 9, 1, 2, 0, 0, 0]
    assert pad_sub_end(se, 5).tolist() == se.tolist()


def test_zigzag_shards_and_orders():
    """Of every 2C consecutive chunks rank r holds the r-th and the (2C - 1 - r)-th (ROUNDS times); the rank-major
    gather order and the tree order convert into each other; every position is held by exactly one rank."""
    from forge_megatron.mcore import context_parallel as cpm

    R = cpm.ROUNDS
    assert cpm.default_multiple(1) == 1 and cpm.default_multiple(4) == 8 * R
    chunk = 13 // (4 * R) + 1  # T = 13 padded to a multiple of 2 R C with C = 2
    got = [cpm.shard_ranges(13, 2, r) for r in range(2)]
    for r in range(2):
        want = [c for g in range(R) for c in (4 * g + r, 4 * g + 3 - r)]
        assert got[r] == [(c * chunk, (c + 1) * chunk) for c in want]
    with pytest.raises(ValueError, match="must be a multiple of 2 x .* rounds x CP"):
        cpm.shard_ranges(13, 4, 0, 12)
    for cp, multiple in ((2, 4 * R), (3, 6 * R), (4, 16 * R)):
        T = 3 * multiple
        x = torch.arange(T) * 10
        shards = [cpm.take_shard(x, cp, r, multiple) for r in range(cp)]
        positions = [cpm.shard_positions(T, cp, r, multiple) for r in range(cp)]
        for shard, pos in zip(shards, positions):
            assert torch.equal(shard, x[pos])
        gathered = torch.cat(shards)  # what an all-gather over the CP group returns
        assert torch.equal(cpm.ranks_to_tree_order(gathered, cp), x)
        assert torch.equal(cpm.tree_to_ranks_order(x, cp), gathered)
        assert sorted(torch.cat(positions).tolist()) == list(range(T))


def test_chunks_balance_a_chain_exactly():
    """Attention work of a query = its depth + 1: on a chain every rank's chunks sum to the same work."""
    from forge_megatron.mcore import context_parallel as cpm

    for cp in (2, 4, 8):
        T = cpm.default_multiple(cp) * 5
        work = [sum(p + 1 for p in cpm.shard_positions(T, cp, r).tolist()) for r in range(cp)]
        assert len(set(work)) == 1, (cp, work)
