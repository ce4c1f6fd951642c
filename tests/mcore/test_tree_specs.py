"""Tree packed-sequence params and layer-spec surgery, in process (0 GPUs, no process group needed).

The model-level behaviour (exactness under TP/PP/MoE) is in test_tree_exact.py; here: the params built from a
layout, their validation messages, and that swapping TreeAttention into Megatron's specs copies rather than edits.
"""

import pytest
import torch


def test_params_from_layout_carry_depth_and_sub_end():
    from forge_megatron.mcore.tree_attention import TreePackedSeqParams, tree_packed_seq_params
    from forge_megatron.tree import build_tree

    layout = build_tree([[1, 2, 3, 4], [1, 2, 9], [7, 8]])
    params = tree_packed_seq_params(layout, backend="reference")
    assert isinstance(params, TreePackedSeqParams)
    assert params.sub_end.dtype == torch.int32 and params.position_ids.dtype == torch.int64
    assert torch.equal(params.sub_end, layout.sub_end.to(torch.int32))
    assert torch.equal(params.position_ids, layout.position_ids)
    assert params.max_seqlen_q == params.max_seqlen_kv == 4  # the longest sample
    assert params.qkv_format == "sbhd" and params.backend == "reference"


@pytest.mark.parametrize("kwargs, message", [
    (dict(position_ids=torch.arange(3)), "needs sub_end and position_ids"),
    (dict(sub_end=torch.full((3,), 3, dtype=torch.int32), position_ids=torch.arange(4)),
     r"sub_end and position_ids must be 1-D, of the same length \(or, under context parallelism, position_ids one "
     r"CP shard of sub_end\), got \(3,\) and \(4,\)"),
])
def test_params_validation_messages(kwargs, message):
    from forge_megatron.mcore.tree_attention import TreePackedSeqParams

    with pytest.raises(ValueError, match=message):
        TreePackedSeqParams(**kwargs)


@pytest.mark.parametrize("moe", [False, True])
def test_tree_layer_spec_swaps_core_attention_only(moe):
    from megatron.core.transformer.enums import AttnMaskType

    from forge_megatron.mcore.model import GPTConfig, layer_spec
    from forge_megatron.mcore.tree_attention import TreeAttention, swap_core_attention

    cfg = GPTConfig(num_moe_experts=4 if moe else None)
    original = layer_spec(cfg)
    before = original.submodules.self_attention.submodules.core_attention
    tree = swap_core_attention(original)
    attn = tree.submodules.self_attention
    assert attn.submodules.core_attention is TreeAttention
    assert attn.params["attn_mask_type"] == AttnMaskType.arbitrary
    assert attn.submodules.linear_qkv is original.submodules.self_attention.submodules.linear_qkv
    assert tree.submodules.mlp is original.submodules.mlp
    assert original.submodules.self_attention.submodules.core_attention is before  # input untouched
    assert original.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.causal


def test_swap_rejects_a_spec_without_self_attention():
    from megatron.core.transformer.spec_utils import ModuleSpec

    from forge_megatron.mcore.tree_attention import swap_core_attention

    with pytest.raises(TypeError, match="cannot find self_attention.submodules.core_attention"):
        swap_core_attention(ModuleSpec(module=torch.nn.Identity))
