"""forge-convert trainer-to-hf: a trainer checkpoint exported offline equals, bit for bit, what the live run pushed
to its engine at the same step (the disk weight-sync transport writes the gathered HF tensors), under TP = 2 and
under PP = 2 x VPP = 2 with tied embeddings; the export is servable (tokenizer copied, transformers loads it)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from forge_megatron.models.tiny import build_tiny_model
from tests.training.pool_feed import feed_groups
from tests.training.trainer_run import run_on_fresh_pool


def _hf_tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("name,extra,tied", [
    ("tp2", ["--tensor-model-parallel-size", "2"], False),
    ("pp2vpp2", ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], True),
])
def test_exported_checkpoint_equals_the_weights_the_run_synced(tmp_path, name, extra, tied):
    from forge_megatron.rollout.launch import start_engine

    model_dir = build_tiny_model(str(tmp_path / "model"), num_hidden_layers=4, tie_word_embeddings=tied)
    engine = start_engine(model_dir, in_process=True)
    sync_dir = tmp_path / "sync"
    try:
        steps, _, _ = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: feed_groups(c, 2, np.random.default_rng(4), completion_len=(4, 10)),
            iters=2, groups=1, nproc=2,
            extra=["--num-layers", "4", *extra, "--weight-sync-transport", "disk", "--weight-sync-dir", str(sync_dir),
                   "--engine-urls", engine.url])
    finally:
        engine.stop()
    assert [s["policy_version"] for s in steps] == [1, 2]
    out = tmp_path / "export"
    cli = subprocess.run([sys.executable, "-m", "forge_megatron.convert.cli", "trainer-to-hf", "--save-dir",
                          str(tmp_path / name / "ckpt"), "--out", str(out)], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "iteration 2 (policy version 2)" in cli.stdout
    exported, synced = _hf_tensors(out), _hf_tensors(sync_dir / "policy_2")
    assert sorted(exported) == sorted(synced) and len(exported) > 20
    for key, t in synced.items():
        assert torch.equal(exported[key], t), key
    original = _hf_tensors(model_dir)
    assert any(not torch.equal(exported[k], original[k]) for k in exported)  # two steps really moved the weights
    assert json.load(open(out / "config.json"))["num_hidden_layers"] == 4
    assert os.path.isfile(out / "tokenizer.json")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(str(out))
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.tie_word_embeddings == tied


def test_vision_language_checkpoint_trains_syncs_and_exports_with_its_vision_tower(tmp_path):
    """Qwen3.5 as released (a vision-language checkpoint): the trainer trains the language model under TP = 2 and
    syncs it by the checkpoint's names (model.language_model.*) to an engine serving the checkpoint; the export
    holds what was synced plus the original vision tower, bit for bit, and loads as the vision-language model."""
    from forge_megatron.rollout.launch import start_engine

    model_dir = build_tiny_model(str(tmp_path / "model"), arch="qwen3_5_vl", seed=3)
    engine = start_engine(model_dir, in_process=True)
    sync_dir = tmp_path / "sync"
    try:
        steps, _, _ = run_on_fresh_pool(
            tmp_path, "vl", model_dir, lambda c: feed_groups(c, 2, np.random.default_rng(4), completion_len=(4, 10)),
            iters=2, groups=1, nproc=2, model=[],
            extra=["--tensor-model-parallel-size", "2", "--weight-sync-transport", "disk", "--weight-sync-dir",
                   str(sync_dir), "--engine-urls", engine.url])
        assert engine.engine.weight_version == "2"
    finally:
        engine.stop()
    assert [s["policy_version"] for s in steps] == [1, 2]
    out = tmp_path / "export"
    cli = subprocess.run([sys.executable, "-m", "forge_megatron.convert.cli", "trainer-to-hf", "--save-dir",
                          str(tmp_path / "vl" / "ckpt"), "--out", str(out)], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-3000:]
    exported, synced, original = _hf_tensors(out), _hf_tensors(sync_dir / "policy_2"), _hf_tensors(model_dir)
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in synced) and len(synced) > 20
    assert sorted(exported) == sorted(original)
    for key, t in exported.items():
        assert torch.equal(t, synced[key] if key in synced else original[key]), key
    assert any(k.startswith("model.visual.") for k in exported)
    assert any(not torch.equal(synced[k], original[k]) for k in synced)  # two steps really moved the weights
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(str(out), output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration" and not info["missing_keys"]


def test_export_errors_are_named(tmp_path):
    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    with pytest.raises(FileNotFoundError, match="no complete trainer checkpoint"):
        export_trainer_checkpoint(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "iter_0000003").mkdir()
    (tmp_path / "iter_0000003" / "rank_00000.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="has no rank_\\*.json"):
        export_trainer_checkpoint(str(tmp_path), str(tmp_path / "out"), iteration=3)
    with open(tmp_path / "iter_0000003" / "rank_00000.json", "w") as f:
        json.dump({"rank": 0, "tp": 0, "pp": 0, "ep": 0, "dp": 0, "cp": 0,
                   "layout": {"tp": 2, "pp": 1, "ep": 1, "cp": 1, "dp": 1, "vpp": 1}}, f)
    with pytest.raises(FileNotFoundError, match="holds 1 rank files, the job had 2 ranks"):
        export_trainer_checkpoint(str(tmp_path), str(tmp_path / "out"), iteration=3)
