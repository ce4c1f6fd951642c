"""mcore/parallel.pipeline_chunks (every place forge puts layers on pipeline stages: the model's stages, HF loading,
checkpoints, export, forge-plan) against Megatron-Core's own layer offsets (``get_transformer_layer_offset``), for
even, uneven (first / last stage given) and interleaved layouts."""

import pytest
import torch

from forge_megatron.mcore.parallel import pipeline_chunks

CASES = [(4, 2, None, None, None), (8, 2, 2, None, None), (61, 4, None, 13, 12), (6, 2, 2, 2, None),
         (12, 3, 2, 2, 2), (10, 3, None, None, 2), (8, 2, 2, None, 2), (9, 3, 3, 3, 3), (3, 2, None, 1, 2)]


@pytest.mark.parametrize("layers,pp,vpp,first,last", CASES)
def test_pipeline_chunks_are_megatrons_layout(layers, pp, vpp, first, last):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from forge_megatron.mcore import cpu_compat

    cpu_compat.apply()
    cfg = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
                            num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32,
                            **({"cuda_graph_scope": []} if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__
                               else {}))
    chunks = pipeline_chunks(layers, pp, vpp, first, last)
    assert [r.start for r in chunks] == [get_transformer_layer_offset(cfg, vp_stage=v if vpp else None, pp_rank=p)
                                         for v in range(vpp or 1) for p in range(pp)]
    assert sorted(layer for r in chunks for layer in r) == list(range(layers))  # every layer once
    assert min(len(r) for r in chunks) >= 1
