"""Sequence parallelism for tree-packed micro-batches equals the same TP layout without it (fp32, CPU, gloo).

With ``sequence_parallel`` each TP rank embeds, normalises and feeds the MLP/MoE only 1/TP of the (padded) tree's
tokens; the TP-split linear layers all-gather and reduce-scatter around themselves, and forge's fused output layer
all-gathers the final hidden states before the vocabulary-parallel logprobs. The same weights run the same forests
with and without SP; per-sample logprobs, entropies and gradients (after the TP sum Megatron's
``finalize_model_grads`` applies to sequence-parallel parameters, norms and routers) must agree. Forests whose
length is not a multiple of TP (or of TP x CP) exercise the padding.
"""

import pytest
import torch

from forge_megatron.mcore.context_parallel import default_multiple, padded_length
from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed
from tests.mcore.test_tree_cp import forest_runs
from tests.mcore.test_tree_exact import _cfg

ATOL = 1e-5
GRAD_RTOL = 1e-5


def _model(sp: bool, moe: bool, comm=None):
    from forge_megatron.mcore.model import build_gpt, transformer_config
    from forge_megatron.mcore.tree_attention import build_tree_gpt, swap_core_attention, use_depth_rope

    extra = {"cp_comm_type": comm} if comm else {}
    cfg = _cfg(qk_layernorm=True, add_qkv_bias=False, extra=extra)
    if not moe:
        return build_tree_gpt(cfg, sequence_parallel=sp)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = _cfg(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
               extra={"moe_layer_freq": [0, 1], **extra})
    model = build_gpt(cfg, spec=swap_core_attention(get_gpt_decoder_block_spec(transformer_config(cfg),
                                                                               use_transformer_engine=False)),
                      sequence_parallel=sp)
    use_depth_rope(model)
    return model


def _body(rank, world_size, state_path, sp, moe, comm=None):
    """Per forest on this rank: (logp, entropy, {param: gradient after the TP sums}, tokens the embedding held)."""
    from megatron.core import parallel_state as ps


    torch.manual_seed(3)
    model = _model(sp, moe, comm if ps.get_context_parallel_world_size() > 1 else None)
    # Megatron's MoE layer refuses to train under TP without SP (the reason for SP): the reference runs in eval mode,
    # which changes nothing else here (no dropout, no token dropping, aux losses off)
    model.train(sp)
    path = f"{state_path}.tp{ps.get_tensor_model_parallel_rank()}"
    if not sp:
        torch.save(model.state_dict(), path)
    else:
        model.load_state_dict(torch.load(path))
    held = []
    model.embedding.register_forward_hook(lambda m, a, out: held.append(out.shape[0]))
    tp_group = ps.get_tensor_model_parallel_group()
    cp_group = [ps.get_context_parallel_group()] if ps.get_context_parallel_world_size() > 1 else []

    def groups_of(pname, p):  # what finalize_model_grads sums over TP: sequence-parallel params (SP on), q/k norms
        tp = (sp and getattr(p, "sequence_parallel", False)) or "q_layernorm" in pname or "k_layernorm" in pname
        return ([tp_group] if tp else []) + cp_group

    out = {name: (logp, ent, grads, held[i], layout.unique_tokens)
           for i, (name, (logp, ent, grads, layout)) in enumerate(forest_runs(model, groups_of).items())}
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    return out


@pytest.mark.parametrize("cp,moe,comm", [(1, False, None), (1, True, None), (2, False, None), (2, True, "all_gather")],
                         ids=["tp2", "tp2-moe", "tp2-cp2", "tp2-cp2-moe-allgather"])
def test_sequence_parallel_equals_tp_alone(tmp_path, cp, moe, comm):
    state = str(tmp_path / "model.pt")
    want = run_distributed(_body, world_size=2, parallel=ParallelConfig(tp=2), state_path=state, sp=False, moe=moe)
    want = {w.pop("tp_rank"): w for w in want}
    got = run_distributed(_body, world_size=2 * cp, parallel=ParallelConfig(tp=2, cp=cp), state_path=state, sp=True,
                          moe=moe, comm=comm, timeout_s=400)
    for rank, result in enumerate(got):
        base = want[result.pop("tp_rank")]
        for name, (logp, ent, grads, held, T) in result.items():
            w_logp, w_ent, w_grads, w_held, _ = base[name]
            multiple = 2 * default_multiple(cp)  # TP x (the zig-zag chunks under CP)
            assert w_held == T and held == padded_length(T, multiple) // (2 * cp), (rank, name, T, held)
            assert (logp - w_logp).abs().max().item() <= ATOL, (rank, name)
            assert (ent - w_ent).abs().max().item() <= ATOL, (rank, name)
            for pname, g in grads.items():
                ref = w_grads[pname]
                if ".experts." in pname:
                    # without SP the all-to-all dispatcher gathers every TP rank's (identical) copy of the tokens,
                    # so each expert sees every token TP times and its gradient is TP x too large: why Megatron
                    # refuses to train MoE under TP without SP. With SP each token is dispatched once.
                    ref = ref / 2
                rel = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                assert rel <= GRAD_RTOL, (rank, name, pname, rel)
