"""Virtual pipeline chunks (PP = 2, two chunks per rank, 4 layers): the HF checkpoint loads into the chunks by
their own global layer numbers, and the weight-sync gather sends every HF tensor back under its HF name, exactly,
each from the stage that holds it.
(That the chunks hold the right layers in the right order is checked by training: tests/training/test_trainer.py
test_interleaved_pipeline_trains_like_one_rank_and_resumes matches a single rank's losses.)"""

import pytest

from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed


def _body(rank, world_size, hf_dir):
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.training.checkpoint import load_hf_weights
    from forge_megatron.weight_sync.gather import is_stage_lead, iter_stage_buckets

    bridge = Bridge(hf_dir)
    chunks = [build_tree_gpt(bridge.cfg, vp_stage=v) for v in range(ps.get_virtual_pipeline_model_parallel_world_size())]
    load_hf_weights(chunks, bridge, hf_dir)
    layers = [[layer.layer_number for layer in c.decoder.layers] for c in chunks]
    ends = [(c.pre_process, c.post_process) for c in chunks]
    sent = {}
    for bucket in iter_stage_buckets(bridge, chunks, bucket_bytes=20_000):
        sent.update({name: t.clone() for name, t in bucket})
    assert is_stage_lead()  # PP = 2 on 2 ranks: each rank leads its stage and sends its own layers
    hf = load_file(f"{hf_dir}/model.safetensors")
    return {"layers": layers, "ends": ends, "names": sorted(sent),
            "max_diff": max((sent[n].float() - hf[n].float()).abs().max().item() for n in sent)}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_weights_round_trip_through_virtual_pipeline_chunks(tmp_path, tied):
    from forge_megatron.models.tiny import build_tiny_model

    hf_dir = build_tiny_model(str(tmp_path / "hf"), arch="qwen3", num_hidden_layers=4, tie_word_embeddings=tied)
    r0, r1 = run_distributed(_body, world_size=2, parallel=ParallelConfig(pp=2, vpp=2), hf_dir=hf_dir)
    assert r0["layers"] == [[1], [3]] and r1["layers"] == [[2], [4]]  # Megatron's interleaved layout
    assert r0["ends"] == [(True, False), (False, False)] and r1["ends"] == [(False, False), (False, True)]
    from safetensors.torch import load_file

    hf = set(load_file(f"{hf_dir}/model.safetensors"))
    if tied:
        hf.discard("lm_head.weight")  # the engine takes the tied head from the embedding
    assert not set(r0["names"]) & set(r1["names"])  # each tensor is sent by one stage only
    assert sorted(r0["names"] + r1["names"]) == sorted(hf) and len(hf) > 20
    assert "model.embed_tokens.weight" in r0["names"] and "model.norm.weight" in r1["names"]
    assert r0["max_diff"] == 0.0 and r1["max_diff"] == 0.0
