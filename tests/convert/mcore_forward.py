"""Test helper: full-vocabulary logits of a (TP/PP-sharded) Megatron GPT model, for comparisons with HF.

Legend: b = batch, s = sequence, V = vocabulary.
"""

import torch


def forward_logits(model, tokens_bs: torch.Tensor):
    """Logits [b, s, V] on the last pipeline stage (None elsewhere): activations are sent stage to stage with
    point-to-point calls and the vocab-parallel logits are all-gathered over TP."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.model import causal_mask

    b, s = tokens_bs.shape
    pos_bs = torch.arange(s)[None].expand_as(tokens_bs)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, b, model.config.hidden_size)
            torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens_bs, pos_bs, causal_mask(s))
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def load_converted(mcore_dir: str):
    """Build this rank's model from a checkpoint written by forge-convert and load its shard (strict)."""
    from forge_megatron.convert import checkpoint as ckpt
    from forge_megatron.mcore.cpu_compat import cuda_factories_to_cpu
    from forge_megatron.mcore.model import build_gpt

    bridge, _ = ckpt.read_meta(mcore_dir)
    with cuda_factories_to_cpu():  # tied embeddings with PP > 1 call .cuda() at construction
        model = build_gpt(bridge.cfg).eval()
    ckpt.load_into(model, mcore_dir)
    return bridge, model
