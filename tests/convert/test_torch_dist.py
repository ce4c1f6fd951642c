"""torch_dist through Megatron's dist_checkpointing on CPU (0 GPUs; 2 gloo ranks started as torchrun does, not as
daemonic test workers: the checkpoint writer's helper processes cannot start from those).

MoE checkpoints saved as torch_dist from a TP=2 job and loaded into an EP=2 job are bit-exact in HF form.
"""

import os

import pytest

from forge_megatron.bridge import ParallelLayout
from forge_megatron.convert import checkpoint as ckpt
from tests.convert.test_convert import _assert_bit_exact
from tests.dist_utils import run_script


def _torchrun(args, nproc):
    """``torchrun --nproc-per-node nproc -m forge_megatron.convert.torch_dist args``, the ranks forked from the test
    server that imported torch and Megatron once (tests.dist_utils.run_script)."""
    out = run_script("forge_megatron.convert.torch_dist", args, nproc=nproc, module=True, timeout_s=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("arch", ["deepseek_v3", "minimax_m2", "qwen3_5", "kimi_linear", "gemma4", "gemma4_moe",
                                  "apertus", "falcon_h1", "nemotron_h_latent"])
def test_torch_dist_round_trip_across_layouts(tmp_path, arch):
    """DeepSeek-V3: a dense layer, routed and shared experts and the routers' expert_bias buffers go through
    dist_checkpointing's sharded state dict (the GLM-4.5 and Qwen3-MoE layouts hold nothing more), with
    multi-latent attention's replicated down projections and latent norms next to its TP-split up projections;
    MiniMax-M2: the all-heads q/k norm weights, whole on each TP rank; Qwen3.5: the Gated DeltaNet's TP-split
    convolution and decay parameters next to its replicated norm and the full-attention layer's per-head q/k norms
    (qwen3_5 has no experts: its second job is PP = 2, the linear-attention layer and the full one apart); Kimi
    Linear: Kimi Delta Attention's TP-split gates, decays and convolution, its gates' down projections, beside MLA
    and experts; Gemma 4: the global layer's own geometry (values = keys) and the layers' scalar buffers (second
    job PP = 2), with 26B-A4B's MoE block (the dense branch's and experts' norms, the router's scales; EP = 2);
    Apertus: each MLP's xIELU module (its scalars and constants, replicated); Falcon-H1: each layer's Mamba-2 mixer
    beside its attention (second jobs PP = 2); Nemotron 3 Super's LatentMoE: the latent projections (whole on each
    rank) around latent experts; gpt-oss's biased experts in the next test."""
    from forge_megatron.models.tiny import build_tiny_model

    hf = build_tiny_model(str(tmp_path / "hf"), arch=arch, seed=6, with_tokenizer=False)
    ckpt.hf_to_megatron(hf, str(tmp_path / "tp2"), ParallelLayout(tp=2))
    _torchrun(["to-torch-dist", "--mcore-dir", str(tmp_path / "tp2"), "--out", str(tmp_path / "dist")], 2)
    assert os.path.isfile(tmp_path / "dist" / ".metadata")
    flag, layout = (["--pp", "2"], ParallelLayout(pp=2)) if arch in ("qwen3_5", "gemma4", "apertus", "falcon_h1") else \
        (["--ep", "2"], ParallelLayout(ep=2))
    _torchrun(["from-torch-dist", "--dist-dir", str(tmp_path / "dist"), "--hf-config", hf,
               "--out", str(tmp_path / "ep2"), *flag], 2)
    assert ckpt.read_meta(str(tmp_path / "ep2"))[1] == layout
    ckpt.megatron_to_hf(str(tmp_path / "ep2"), str(tmp_path / "back"))
    _assert_bit_exact(hf, tmp_path / "back")


def test_torch_dist_into_uneven_pipeline_stages(tmp_path):
    """A 3-layer DeepSeek-V3-layout checkpoint saved as torch_dist from an even PP 3 job loads into PP 2 as 1 + 2
    (Megatron's num_layers_in_first_pipeline_stage): the rank layout records the split, and the export is bit-exact."""
    from forge_megatron.models.tiny import build_tiny_model

    hf = build_tiny_model(str(tmp_path / "hf"), arch="deepseek_v3", seed=7, with_tokenizer=False, num_hidden_layers=3)
    ckpt.hf_to_megatron(hf, str(tmp_path / "pp3"), ParallelLayout(pp=3))
    _torchrun(["to-torch-dist", "--mcore-dir", str(tmp_path / "pp3"), "--out", str(tmp_path / "dist")], 3)
    _torchrun(["from-torch-dist", "--dist-dir", str(tmp_path / "dist"), "--hf-config", hf, "--out",
               str(tmp_path / "uneven"), "--pp", "2", "--decoder-first-pipeline-num-layers", "1"], 2)
    assert ckpt.read_meta(str(tmp_path / "uneven"))[1] == ParallelLayout(pp=2, first=1)
    ckpt.megatron_to_hf(str(tmp_path / "uneven"), str(tmp_path / "back"))
    _assert_bit_exact(hf, tmp_path / "back")


def test_torch_dist_with_whole_experts_under_tp(tmp_path):
    """Expert TP 1: a TP = 2 x EP = 2 checkpoint with whole experts (the EP group over the two TP ranks: 2 processes,
    each rank one TP shard and one EP shard) saved as torch_dist and loaded into EP = 2 alone, bit-exact in HF
    form."""
    from forge_megatron.models.tiny import build_tiny_model

    hf = build_tiny_model(str(tmp_path / "hf"), arch="gpt_oss", seed=6, with_tokenizer=False)
    whole = ParallelLayout(tp=2, ep=2, etp=1)
    ckpt.hf_to_megatron(hf, str(tmp_path / "etp1"), whole)
    _torchrun(["to-torch-dist", "--mcore-dir", str(tmp_path / "etp1"), "--out", str(tmp_path / "dist")], 2)
    for name, flags, layout in (("ep2", ["--ep", "2"], ParallelLayout(ep=2)),):
        _torchrun(["from-torch-dist", "--dist-dir", str(tmp_path / "dist"), "--hf-config", hf,
                   "--out", str(tmp_path / name), *flags], 2)
        assert ckpt.read_meta(str(tmp_path / name))[1] == layout
        ckpt.megatron_to_hf(str(tmp_path / name), str(tmp_path / f"{name}_hf"))
        _assert_bit_exact(hf, tmp_path / f"{name}_hf")
