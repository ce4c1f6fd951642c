"""scripts/train_forge.py on episodes with images: the pool stores and delivers them, the trainer broadcasts them to its
ranks, encodes them with the checkpoint's image processor and its frozen vision tower, and scores the engine's
sampled tokens as the engine did (step 1: the same weights), under one rank, PP2 (two processes: the batch
broadcast carries the images; the first stage puts the features in and adds DeepStack's) and full recomputation (the
recomputed layers add DeepStack's features again)."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import torch

from tests.multimodal.test_vision_tree import png
from tests.training.trainer_run import run_on_fresh_pool


def _feed_image_rollouts(client, model_dir: str, groups: int = 2, group_size: int = 3, lead: int = 4) -> list:
    """Finished episodes sampled by the reference engine from prompts with an image (one image per group, shared by
    its episodes) after ``lead`` text tokens, as the gateway records them. Returns them as (tokens, prompt length,
    image)."""
    from transformers import AutoTokenizer

    from forge_megatron.middleware.schema import Episode, Segment
    from forge_megatron.multimodal.images import ImageProcessor, data_url
    from forge_megatron.rollout.engine_server import ReferenceEngine

    engine = ReferenceEngine(model_dir)
    proc = ImageProcessor(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vs, ve, pad = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    rng = np.random.default_rng(4)
    fed = []
    for g in range(groups):
        image = proc.normalize(png(rng, 20 + 8 * g, 24))
        prompt = [*rng.integers(10, 200, size=lead).tolist(), vs, *proc.image_ids(image), ve, 9]
        gid = client.register_group(f"task-{g}", group_size, "default")
        for e in range(group_size):
            sampling = {"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 10 * g + e, "ignore_eos": True,
                        "stop_token_ids": [pad]}
            # (as the gateway sends it: one placeholder per image, which the engine writes out)
            req = engine.new_request({"input_ids": proc.engine_ids(prompt, [proc.grid(image)]),
                                      "image_data": [data_url(image)],
                                      "sampling_params": sampling})
            while req.finish is None:
                engine._step(req)
            n = len(req.output_ids)
            seg = Segment(tokens=prompt + req.output_ids, loss_mask=[0] * len(prompt) + [1] * n,
                          rollout_logprobs=[0.0] * len(prompt) + list(req.logprobs),
                          policy_versions=[-1] * len(prompt) + [0] * n, images=[image])
            eid = uuid.uuid4().hex
            client.episode_started(gid, eid)
            now = time.time()
            client.submit_episode(Episode(episode_id=eid, group_id=gid, task_id=f"task-{g}", segments=[seg],
                                          reward=float(e % 2), started_at=now - 1, ended_at=now))
            fed.append((seg.tokens, len(prompt), image))
    return fed


def _run(tmp_path, name, nproc=1, extra=(), arch="qwen3_vl", exits=(None,), lead=4, groups=1, most_tokens=16):
    from forge_megatron.models.tiny import build_tiny_model

    # (vocabulary 404: 400 + the image tokens, padded to split over TP 2)
    model_dir = build_tiny_model(str(tmp_path / "vl"), arch, images=True, seed=3, vocab_size=404)
    steps, stdouts, _ = run_on_fresh_pool(
        tmp_path, name, model_dir, lambda c: _feed_image_rollouts(c, model_dir, groups=2 * groups, lead=lead),
        iters=2, groups=groups, nproc=nproc, model=[], extra=list(extra), exits=exits)
    assert len(steps) == 2
    first = steps[0]
    assert first["rollout_logp_abs_diff"] < 1e-4 and first["rollout_logp_abs_diff_max"] < 1e-3
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert all(np.isfinite(s["loss"]) for s in steps)
    if "--train-vision-tower" in extra:
        assert "vision tower trained with the language model" in "".join(stdouts)
    else:
        assert "vision tower of" in "".join(stdouts)  # loaded on the first micro-batch with images
    # ``groups`` groups a step: each group's episodes share one picture, encoded once, its tokens once in the tree
    # (under DP2 rank 0's share: one group)
    extra = list(extra)
    size = [int(extra[extra.index(f) + 1]) if f in extra else 1 for f in (
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")]
    dp = nproc // (size[0] * size[1] * size[2])
    assert all(s["images"] == groups // dp and 1 <= s["image_tokens"] <= most_tokens * groups for s in steps)
    return steps


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), "one")


def test_trainer_scores_and_trains_on_images(one_rank_run):
    assert one_rank_run[1]["loss"] != one_rank_run[0]["loss"]


def test_images_train_alike_under_cp2(tmp_path, one_rank_run):
    """The frozen tower's features under CP2 (each rank encodes its share of the pictures, the features gathered);
    PP2 and recomputation: with the tower trained below, a superset of this path."""
    steps = _run(tmp_path, "run", 2, ["--context-parallel-size", "2"])
    for got, want in zip(steps, one_rank_run):  # the second step after one update: the gradients agreed
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_glm4v_images_train(tmp_path):
    """GLM-4.1V (contiguous mRoPE sections on interleaved pairs, no DeepStack) through the same path."""
    steps = _run(tmp_path, "glm", arch="glm4v")
    assert steps[1]["loss"] != steps[0]["loss"]


def test_qwen2_5_vl_images_train(tmp_path):
    """Qwen2.5-VL as released (a flat config, the tower under visual.*, contiguous mRoPE sections on halves; the
    tower attending in windows in one block, over the whole picture in the other) through the same path, the tower
    trained too."""
    steps = _run(tmp_path, "qwen2_5", arch="qwen2_5_vl", extra=TRAIN_TOWER)
    assert steps[1]["loss"] != steps[0]["loss"] and steps[0]["grad_norm_vision"] > 0


def test_gemma3_images_train(tmp_path):
    """Gemma 3 (the SigLIP tower and projector, 1-D positions, each image's tokens seeing each other) through the
    same path: the first step's logprobs are the engine's (transformers' Gemma 3 with its token_type_ids mask)."""
    steps = _run(tmp_path, "gemma", arch="gemma3_vl")
    assert steps[1]["loss"] != steps[0]["loss"]


def test_gemma4_images_train(tmp_path):
    """Gemma 4 (its tower on pictures of their own sizes, pooled 2 x 2, each picture's tokens seeing each other in
    the sliding layer, the global one causal) through the same path, the tower trained too."""
    steps = _run(tmp_path, "gemma4", arch="gemma4_vl", extra=TRAIN_TOWER, most_tokens=70)  # (its picture budget)
    assert steps[1]["loss"] != steps[0]["loss"] and steps[0]["grad_norm_vision"] > 0


@pytest.mark.parametrize("arch", ["ministral3_vl", "mistral4_vl"])
def test_mistral3_images_train(tmp_path, arch):
    """Mistral 3 (its Pixtral tower, each picture written row by row between break tokens; the language model
    Ministral 3's, or Mistral Small 4's with multi-latent attention and experts) through the same path, the tower
    trained too."""
    steps = _run(tmp_path, "mistral3", arch=arch, extra=TRAIN_TOWER, most_tokens=64)
    assert steps[1]["loss"] != steps[0]["loss"] and steps[0]["grad_norm_vision"] > 0


def test_kimi_images_train(tmp_path):
    """Kimi-K2.5 (MoonViT read under the release's names, its merged patches one run of tokens, the DeepSeek-V3
    language model's multi-latent attention and experts) through the same path, the tower trained too."""
    steps = _run(tmp_path, "kimi", arch="kimi_k25", extra=TRAIN_TOWER)
    assert steps[1]["loss"] != steps[0]["loss"] and steps[0]["grad_norm_vision"] > 0


TRAIN_TOWER = ["--train-vision-tower", "--rl-kl-coef", "0.05"]
LEAD = 20  # text tokens before the image: its tokens straddle the two TP ranks' halves under sequence parallelism


@pytest.fixture(scope="module")
def trained_tower_run(tmp_path_factory):
    """One rank, the tower trained (and a KL reference, whose tower stays the checkpoint's)."""
    root = tmp_path_factory.mktemp("tower")
    return root, _run(root, "one", extra=TRAIN_TOWER, lead=LEAD, groups=2)


def test_trained_vision_tower_is_trained_checkpointed_and_exported(trained_tower_run, tmp_path):
    """The KL reference keeps the checkpoint's tower (no KL at step 1, some at step 2); the checkpoint holds the moved
    tower, exported as the checkpoint's tensors (model.visual.*) that transformers loads; a resume without the flag
    is refused, naming it."""
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint
    from tests.dist_utils import run_script
    from tests.training.trainer_run import TRAIN, train_env

    root, steps = trained_tower_run
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference's tower is the policy's at step 1
    assert all(0 < s["grad_norm_vision"] < s["grad_norm"] for s in steps)
    assert steps[1]["kl"] > 0
    out = str(tmp_path / "hf")
    export_trainer_checkpoint(str(root / "one" / "ckpt"), out)
    got, before = {}, {}
    for d, into in ((out, got), (str(root / "vl"), before)):
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                into.update(load_file(os.path.join(d, f)))
    tower = sorted(n for n in before if n.startswith("model.visual."))
    assert tower and set(got) == set(before)
    moved = [n for n in tower if not torch.equal(got[n], before[n])]
    assert len(moved) >= len(tower) // 2, moved  # Adam moves every tensor with a gradient
    import transformers

    transformers.Qwen3VLForConditionalGeneration.from_pretrained(out)  # loads whole
    res = run_script(TRAIN, ["--hf-checkpoint", str(root / "vl"), "--load", str(root / "one" / "ckpt"), "--lr", "1e-3",
                             "--train-iters", "3", "--weight-sync-transport", "none", "--pool-addr", "tcp://127.0.0.1:1"],
                     env=train_env())
    assert res.returncode != 0 and "saved with --train-vision-tower" in res.stdout + res.stderr


@pytest.mark.parametrize("nproc,extra", [
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (2, ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"]),
    (2, ["--pipeline-model-parallel-size", "2"]),
    (2, ["--context-parallel-size", "2"]),
    # DP2: the tower's gradients reduced and sharded with the others', overlapped with the backward, its weights
    # all-gathered in the next forward; small buckets (bucketing needs the overlap), each split over both ranks, so
    # both hold parts of the tower
    (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
         "4000"]),
    # the KL reference's tower in host memory but for its forward pass; layers and tower blocks recomputed
    (1, ["--ref-offload", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--recompute-vision-tower"])],
    ids=["tp2_sp", "tp2", "pp2", "cp2", "dp2_distopt", "ref_offload_recompute"])
def test_trained_vision_tower_alike_under_tp_sp_pp2_and_recomputation(tmp_path, trained_tower_run, nproc, extra):
    """Two pictures a step: under TP each rank encodes one and their gradients come together (with sequence
    parallelism each rank back-propagates its half of the tokens, which the pictures' straddle); on the first stage
    under PP2; recomputed: the second step (after one update of tower and language model) as on one rank."""
    _, want = trained_tower_run
    steps = _run(tmp_path, "run", nproc, [*TRAIN_TOWER, *extra], lead=LEAD, groups=2)
    for got, ref in zip(steps, want):
        if "--use-distributed-optimizer" not in extra:  # (DP2: each rank's loss is its share of the batch)
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
            assert got["kl"] == pytest.approx(ref["kl"], rel=1e-3, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert got["grad_norm_vision"] == pytest.approx(ref["grad_norm_vision"], rel=1e-4)


def _tower_sync_body(rank, world_size, hf_dir, engine_url, trainable):
    """A TP2 trainer model with the tower trained (moved off the checkpoint's) syncs to the engine. Its frozen
    parameters (outside ``trainable``) are moved too, here only: to see that they are not sent."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import vision
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.training.checkpoint import load_hf_weights
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer

    bridge = Bridge(hf_dir, vision_tower=True)
    model = build_tree_gpt(bridge.cfg)
    vision.attach_tower(model, bridge.hf_config, trainable=trainable)
    load_hf_weights([model], bridge, hf_dir)
    gen = torch.Generator().manual_seed(0)  # the same moves on both TP ranks: the tower is replicated
    with torch.no_grad():
        for p in model.vision_tower.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[engine_url], transport="distributed", bucket_bytes=40_000,
                                           timeout_s=60), bridge)
    try:
        report = syncer.sync([model], policy_version=1)
    finally:
        syncer.close()
    tower = {bridge.hf_names(f"{vision.TOWER}.{n}")[0]: (p.detach().clone(), p.requires_grad)
             for n, p in model.vision_tower.named_parameters()}
    return report.policy_version, report.excluded, tower


@pytest.mark.parametrize("trainable", ["*", "merger.*,deepstack_merger_list.*"], ids=["whole", "projectors"])
def test_trained_vision_tower_reaches_the_engine(tmp_path, trainable):
    """The weight sync sends the trained tower's tensors under the checkpoint's names (model.visual.*), and the
    engine's vision-language model takes them: its tower equals the trainer's afterwards (before: the checkpoint's).
    Under --vision-trainable only the trained ones travel: the others are the checkpoint's on both sides."""
    from forge_megatron.mcore.parallel import ParallelConfig
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.launch import start_engine
    from tests.dist_utils import run_distributed

    model_dir = build_tiny_model(str(tmp_path / "vl"), "qwen3_vl", images=True, seed=3, vocab_size=404)
    engine = start_engine(model_dir, in_process=True)
    try:
        before = {n: t.clone() for n, t in engine.engine.model.state_dict().items() if n.startswith("model.visual.")}
        out = run_distributed(_tower_sync_body, world_size=2, parallel=ParallelConfig(tp=2), hf_dir=model_dir,
                              engine_url=engine.url, timeout_s=600, trainable=trainable)
        after = engine.engine.model.state_dict()
        (version, excluded, tower), _ = out
        assert version == 1 and excluded == []
        assert before and set(tower) == set(before)
        trained = [name for name, (_, grad) in tower.items() if grad]
        assert trained and (len(trained) == len(tower)) == (trainable == "*")
        for name, (t, grad) in tower.items():
            assert torch.equal(after[name], t.to(after[name].dtype) if grad else before[name]), name
            assert torch.equal(after[name], before[name]) != grad, name
    finally:
        engine.stop()


def test_qwen2_5_vl_images_through_the_gateway_are_scored_by_the_trainer_as_the_engine(tmp_path):
    """Two chat calls with a picture each through a real gateway and forge-engine serving a Qwen2.5-VL release
    (flat config, CLIP-normalised pixels), the second continuing the first: the trainer's logprobs of the sampled
    tokens are the engine's."""
    from forge_megatron.models.tiny import build_tiny_model
    from tests.multimodal import vl_checks as vl

    model_dir = build_tiny_model(str(tmp_path / "qwen2_5_vl"), "qwen2_5_vl", images=True, seed=4)
    ep = vl.chat_episode(model_dir, vl.random_pictures(6, [(30, 50), (16, 16)]))
    assert sum(len(s.images) for s in ep.segments) >= 2
    vl.assert_scored_as_engine(model_dir, ep)


def test_qwen2_5_vl_trained_tower_reaches_the_engine(tmp_path):
    """Qwen2.5-VL's trained tower is sent under the release's names (visual.*, what SGLang's loader reads) and the
    engine's whole model (transformers' model.visual.*) takes them."""
    from tests.multimodal import vl_checks as vl

    before, after, tower = vl.tower_synced_to_an_engine(tmp_path, "qwen2_5_vl", ("model.visual.",))
    assert tower and all(n.startswith("visual.") for n in tower) and {"model." + n for n in tower} == set(before)
    for name, (t, _) in tower.items():
        assert torch.equal(after["model." + name], t.to(after["model." + name].dtype)), name
        assert not torch.equal(after["model." + name], before["model." + name]), name


def test_trained_vision_tower_resumes_under_another_layout(tmp_path):
    """A checkpoint with the trained tower (its weights and Adam state) resumed under TP2 + SP (resharded by name):
    step 3 as in a run that never stopped."""
    from forge_megatron.models.tiny import build_tiny_model

    model_dir = build_tiny_model(str(tmp_path / "vl"), "qwen3_vl", images=True, seed=3, vocab_size=404)
    runs = {}
    for name, exits in (("straight", (None,)),
                        ("resumed", ((2, (), 1), (None, ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
                                                  2)))):
        steps, stdouts, counts = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: _feed_image_rollouts(c, model_dir, groups=3, lead=LEAD), iters=3,
            groups=1, model=[], extra=TRAIN_TOWER, exits=exits)
        runs[name] = steps
    assert counts == [2, 3] and "resharding the model and optimizer state" in stdouts[1]
    assert [s["step"] for s in runs["resumed"]] == [1, 2, 3]
    for got, want in zip(runs["resumed"], runs["straight"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_vision_lr_sets_the_towers_own_learning_rate(tmp_path, trained_tower_run):
    """``--vision-lr 0``: the tower is in the optimizer with a learning rate of its own, here 0: after two steps the
    exported tower is the checkpoint's, the language model moved (at the learning rate it has without the flag)."""
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    steps = _run(tmp_path, "vlr", extra=[*TRAIN_TOWER, "--vision-lr", "0"], lead=LEAD)
    assert steps[1]["kl"] > 0
    assert [s["lr"] for s in steps] == [s["lr"] for s in trained_tower_run[1]]
    out = str(tmp_path / "hf")
    export_trainer_checkpoint(str(tmp_path / "vlr" / "ckpt"), out)
    got = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(f"{out}/{f}").items()}
    before = load_file(str(tmp_path / "vl" / "model.safetensors"))
    tower = [n for n in before if n.startswith("model.visual.")]
    assert tower and all(torch.equal(got[n], before[n]) for n in tower)
    assert not torch.equal(got["model.language_model.embed_tokens.weight"],
                           before["model.language_model.embed_tokens.weight"])


def test_a_frozen_towers_run_resumes_with_the_tower_trained(tmp_path):
    """Two steps with the tower frozen, then ``--train-vision-tower`` on resume: the language model and its
    optimizer state as saved, the tower from the HF checkpoint (what the frozen run encoded with) with fresh Adam
    state. Step 3 scores as the run that stays frozen does (same weights), its gradient norm takes the tower's in,
    and the next checkpoint holds the moved tower."""
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint
    from forge_megatron.models.tiny import build_tiny_model

    model_dir = build_tiny_model(str(tmp_path / "vl"), "qwen3_vl", images=True, seed=3, vocab_size=404)
    runs = {}
    for name, exits in (("frozen", (None,)), ("unfrozen", ((2, (), 1), (None, ("--train-vision-tower",), 1)))):
        steps, stdouts, _ = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: _feed_image_rollouts(c, model_dir, groups=3, lead=LEAD), iters=3,
            groups=1, model=[], exits=exits, extra=["--save-interval", "1"])
        runs[name] = (steps, stdouts)
    (frozen, _), (unfrozen, stdouts) = runs["frozen"], runs["unfrozen"]
    assert "saved with the vision tower frozen: it trains from here" in stdouts[1]
    assert [s["step"] for s in unfrozen] == [1, 2, 3]
    for got, want in zip(unfrozen[:2], frozen[:2]):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert unfrozen[2]["loss"] == pytest.approx(frozen[2]["loss"], rel=1e-5, abs=1e-7)
    assert unfrozen[2]["grad_norm"] > frozen[2]["grad_norm"] * (1 + 1e-4)
    out = str(tmp_path / "hf")
    export_trainer_checkpoint(str(tmp_path / "unfrozen" / "ckpt"), out)
    got = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(f"{out}/{f}").items()}
    before = load_file(f"{model_dir}/model.safetensors")
    assert any(not torch.equal(got[n], before[n]) for n in before if n.startswith("model.visual."))


def test_vision_trainable_trains_only_the_chosen_parameters(tmp_path):
    """``--vision-trainable 'merger.*,deepstack_merger_list.*'``: Qwen3-VL's projectors train, the encoder's blocks
    and patch embedding stay the checkpoint's (no gradients, no optimizer state); a resume with other globs is
    refused, naming the flag."""
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint
    from tests.dist_utils import run_script
    from tests.training.trainer_run import TRAIN, train_env

    globs = "merger.*,deepstack_merger_list.*"
    steps = _run(tmp_path, "part", extra=[*TRAIN_TOWER, "--vision-trainable", globs], lead=LEAD)
    assert all(s["grad_norm_vision"] > 0 for s in steps)
    out = str(tmp_path / "hf")
    export_trainer_checkpoint(str(tmp_path / "part" / "ckpt"), out)
    got = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(f"{out}/{f}").items()}
    before = load_file(str(tmp_path / "vl" / "model.safetensors"))
    tower = [n for n in before if n.startswith("model.visual.")]
    chosen = [n for n in tower if n.startswith(("model.visual.merger.", "model.visual.deepstack_merger_list."))]
    assert chosen and all(not torch.equal(got[n], before[n]) for n in chosen if n.endswith("weight"))
    assert all(torch.equal(got[n], before[n]) for n in tower if n not in chosen)
    res = run_script(TRAIN, ["--hf-checkpoint", str(tmp_path / "vl"), "--load", str(tmp_path / "part" / "ckpt"),
                             "--lr", "1e-3", "--train-iters", "3", "--weight-sync-transport", "none", "--pool-addr",
                             "tcp://127.0.0.1:1", "--train-vision-tower", "--vision-trainable", "merger.*"],
                     env=train_env())
    assert res.returncode != 0 and "resume with the same globs" in res.stdout + res.stderr


def test_lora_adapters_train_a_vision_language_model_alike_under_tp_sp(tmp_path):
    """--lora-rank on Qwen3-VL (the tower frozen, the language model's linears adapted; images' features, DeepStack
    and mRoPE as without LoRA) with a KL term whose reference is the policy with its adapters off: TP = 2 with
    sequence parallelism trains the same steps as one rank; KL 0 at step 1 (B = 0), > 0 after."""
    from tests.training.trainer_run import assert_same_as_one_rank

    lora = ["--lora-rank", "4", "--rl-kl-coef", "0.05"]
    steps = {"one": _run(tmp_path, "one", extra=lora, lead=LEAD),
             "tp2sp": _run(tmp_path, "tp2sp", nproc=2, lead=LEAD,
                           extra=lora + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])}
    assert steps["one"][0]["kl"] == pytest.approx(0.0, abs=1e-7) and steps["one"][1]["kl"] > 0
    assert_same_as_one_rank(steps, ["tp2sp"], keys=("loss", "grad_norm", "kl"))


def test_vision_language_teacher_scores_with_its_own_tower(tmp_path):
    """On-policy distillation of a tiny Qwen3-VL student from a Qwen3-VL teacher 1.5x as wide (--teacher-hf-checkpoint):
    the teacher runs its own frozen tower on the batch's pictures (its features kept apart from the student's) and
    its logprobs of the sampled tokens are transformers' teacher's on each episode with its picture, and so is the
    probability its top 8 tokens hold (--distill-kl forward --distill-topk 8: the dense loss's teacher pass, one
    pass over its logits); a text teacher for a vision-language student is refused."""
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal import vision_spec
    from forge_megatron.multimodal.families import model_image_inputs
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.rollout.engine_server import ReferenceEngine
    from tests.dist_utils import run_script
    from tests.training.pool_feed import PoolProcess
    from tests.training.trainer_run import TRAIN, train_cmd, train_env

    student = build_tiny_model(str(tmp_path / "vl"), "qwen3_vl", images=True, seed=3, vocab_size=404)
    teacher = build_tiny_model(str(tmp_path / "teacher"), "qwen3_vl", images=True, seed=8, vocab_size=404,
                               hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2)
    fed = []
    steps, stdouts, _ = run_on_fresh_pool(
        tmp_path, "distil", student, lambda c: fed.extend(_feed_image_rollouts(c, student, groups=1)), iters=1,
        groups=1, model=[], extra=["--teacher-hf-checkpoint", teacher, "--old-logprobs", "recompute",
                                   "--distill-kl", "forward", "--distill-topk", "8"])
    assert f"vision tower of {teacher} loaded" in stdouts[0] and f"vision tower of {student} loaded" in stdouts[0]
    engine = ReferenceEngine(teacher)
    proc, spec = ImageProcessor(teacher), vision_spec(engine.model.config.to_dict())
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(teacher))  # (the top-k's candidates: the tokenizer's ids)
    want, mass = [], []
    with torch.no_grad():
        for tokens, prompt_len, image in fed:
            ids = torch.tensor([tokens])
            extra = model_image_inputs(spec, [proc.image_input(image)], tokens[:prompt_len], ids)
            logp = torch.log_softmax(engine.model(input_ids=ids, **extra).logits[0].double(), -1)
            want += [logp[t - 1, tokens[t]].item() for t in range(prompt_len, len(tokens))]
            mass += [logp[t - 1, :vocab].exp().topk(8).values.sum().item() for t in range(prompt_len, len(tokens))]
    assert steps[0]["num_tokens"] == len(want)
    assert steps[0]["distill_teacher_logp"] == pytest.approx(float(np.mean(want)), rel=1e-4)
    assert steps[0]["distill_topk_mass"] == pytest.approx(float(np.mean(mass)), rel=1e-4)
    import shutil

    text_teacher = build_tiny_model(str(tmp_path / "text_teacher"), "qwen3", seed=2, vocab_size=404)
    for name in os.listdir(student):  # the student's tokenizer (its image tokens): only the images differ
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(student, name), text_teacher)
    pool = PoolProcess(str(tmp_path / "refused.sqlite"))
    try:
        out = run_script(TRAIN, train_cmd(student, pool, str(tmp_path / "refused"), iters=1, groups=1, model=[],
                                          extra=["--teacher-hf-checkpoint", text_teacher]), env=train_env())
    finally:
        pool.stop()
    assert out.returncode != 0 and "the policy takes images and the teacher does not" in out.stdout + out.stderr
