"""Kimi-K2.5 / K2.6's images on prefix trees (MoonViT: 2-D RoPE over each image's patches, k x k patches merged into a
token, 1-D positions in the DeepSeek-V3 language model): the Megatron tree model with the checkpoint's tower and
projector (read under the release's names: a fused, re-paired wqkv) equals transformers'
Kimi_K25ForConditionalGeneration run on each sample alone, logprobs and gradients; the gateway's images (sizes,
patches, the prompt's text), the engine and the trainer take them through every process, the tower trained too."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.multimodal import vl_checks as vl

V = 400
IMG = 397
PATCH, MERGE = 4, 2  # the tiny MoonViT's patches, merged 2 x 2 into a token: a token is 8 x 8 pixels


def _model(seed: int = 0):
    import transformers

    from forge_megatron.models.tiny import tiny_config

    cfg = tiny_config("kimi_k25", vocab_size=V)
    cfg.image_token_id = IMG
    torch.manual_seed(seed)
    model = transformers.Kimi_K25ForConditionalGeneration(cfg).float()
    with torch.no_grad():  # a tower whose every tensor matters (the position grid and norms start at 0 / 1)
        for name, p in model.named_parameters():
            if name.startswith(("model.vision_tower.", "model.mm_projector.")):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    from forge_megatron.models import save_checkpoint

    out = str(tmp_path_factory.mktemp("kimi_k25"))
    save_checkpoint(_model(), out)
    return out


def test_released_tower_names_load_as_transformers_loads_them(tmp_path):
    """The tiny checkpoint holds the tower under the release's names (``wqkv`` fused, its query / key rows pairing
    channels (2i, 2i + 1), MoonViT's norm / fc / wo names, ``mm_projector.proj.*``); transformers' conversion reads
    it back to the model saved, and so does the trainer's (:func:`load_vision_tower`)."""
    import transformers

    from forge_megatron.convert.checkpoint import HFReader
    from forge_megatron.models import save_checkpoint
    from forge_megatron.multimodal.families import load_vision_tower

    model = _model(1)
    save_checkpoint(model, str(tmp_path))
    names = HFReader(str(tmp_path)).names()
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in names and "mm_projector.proj.0.weight" in names
    assert not any(n.startswith("model.") for n in names)
    loaded = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32)
    want, got = model.state_dict(), loaded.state_dict()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
    tower = load_vision_tower(str(tmp_path)).state_dict()
    assert tower and all(torch.equal(t, want["model." + n]) for n, t in tower.items())


def _image(rng, rows, cols):
    """An ImageInput of rows x cols tokens (2 x 2 patches each) and transformers' inputs of it."""
    from forge_megatron.multimodal import ImageInput
    from forge_megatron.multimodal.families import image_patches

    pixels = torch.from_numpy(rng.standard_normal((1, 3, rows * 8, cols * 8)).astype(np.float32))
    patches = image_patches(pixels, PATCH)
    return ImageInput(patches.numpy(), (1, rows * MERGE, cols * MERGE)), patches


def batch(seed=0):
    """(samples, images per sample, patches per sample): an image shared by two branches, three image sizes, two
    images in one sample, a sample like sample 0 with another image of its size, a text sample."""
    rng = np.random.default_rng(seed)
    (a, pa), (b, pb), (c, pc) = _image(rng, 2, 2), _image(rng, 2, 3), _image(rng, 2, 2)
    s0 = [2, 5, 6, *[IMG] * 4, 7, 8, 9, 10]
    samples = [s0, [2, 5, 6, *[IMG] * 4, 7, 11, 12], [2, 5, 6, *[IMG] * 6, 7, 8, 9], s0 + [13, *[IMG] * 6, 14, 15],
               [2, 5, 6, *[IMG] * 4, 7, 8, 9, 10], [2, 5, 20, 21, 22]]
    return ([np.array(s) for s in samples], [[a], [a], [b], [a, b], [c], []],
            [[(pa, a)], [(pa, a)], [(pb, b)], [(pa, a), (pb, b)], [(pc, c)], []])


def hf_inputs(images: list) -> dict:
    """transformers' image inputs of one sample: patches [N, 3, p, p] and grids."""
    return dict(pixel_values=torch.cat([p for p, _ in images]).reshape(-1, 3, PATCH, PATCH),
                image_grid_thw=torch.tensor([list(im.grid_thw) for _, im in images]))


@pytest.fixture(scope="module")
def hf_reference(kimi_dir):
    import transformers

    from forge_megatron.models import _kimi_k25_names

    samples, _, images = batch()
    model = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(kimi_dir, dtype=torch.float32)
    logp, grads = vl.hf_reference(model, samples, [hf_inputs(x) if x else {} for x in images])
    return logp, _kimi_k25_names(grads, model.config)  # (the checkpoint's names: experts one by one)


@pytest.fixture(scope="module")
def one_rank(kimi_dir):
    return vl.tree_run(kimi_dir, batch())


def test_spec_of_a_kimi_checkpoint(one_rank):
    spec = one_rank["spec"]
    assert (spec.kind, spec.image_token_id, spec.merge, spec.mrope_section, spec.bidirectional) == \
        ("kimi_k25", IMG, MERGE, None, False)
    assert spec.tokens_per_image((1, 4, 6)) == 6 and spec.rows_of_image((1, 4, 6)) == (1, 6)
    assert torch.equal(one_rank["rows"] >= 0, one_rank["tokens"] == IMG)


def test_tree_with_kimi_images_equals_transformers(one_rank, hf_reference):
    vl.assert_tree_equals_transformers(one_rank, hf_reference[0])


def test_kimi_language_model_gradients_equal_transformers(one_rank, hf_reference):
    vl.assert_lm_grads_equal(one_rank, hf_reference[1])


def _reference_navit():
    """transformers' ``navit_resize`` (its image processor module needs torchvision to import: the function is read
    out of the file)."""
    import transformers.models.kimi_k25 as pkg

    path = Path(pkg.__file__).with_name("image_processing_kimi_k25.py")
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    scope = {"math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["navit_resize"]


def test_gateway_sizes_and_patches_are_the_processors(tmp_path):
    """Kimi's normalised image: transformers' navit rule (never upscaled, within the patch budgets) rounded to whole
    merged patches, a size that rule keeps as it is (no resize, no padding); its patches the image rescaled,
    normalised with the release's mean / std (media_proc_cfg) and cut row-major, which is what the tower's patch
    embedding of the whole image gives; its prompt text the release's ``<|media_begin|>image<|media_content|>`` form
    where the tokenizer has it (the tiny one has no ``<|media_content|>``)."""
    import transformers

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor, kimi_size, open_image
    from forge_megatron.multimodal.families import load_vision_tower
    from tests.multimodal.test_vision_tree import png

    navit = _reference_navit()
    d = build_tiny_model(str(tmp_path / "m"), "kimi_k25", images=True)
    proc = ImageProcessor(d)
    assert proc.kimi == dict(patch=4, merge=2, max_patches=64, per_side=16, mean=[0.5] * 3, std=[0.5] * 3)
    rng = np.random.default_rng(3)
    for h, w in [(30, 50), (3, 200), (200, 3), (16, 16), (500, 300), (9, 9), (64, 8), (100, 100)]:
        (nh, nw), _ = navit(h, w, 4, 2, 64, 16)
        got = kimi_size(h, w, 4, 2, 64, 16)
        assert all(abs(a - b) < 8 or a < b for a, b in zip(got, (nh, nw))) and got[0] % 8 == got[1] % 8 == 0
        assert navit(*got, 4, 2, 64, 16) == (got, got)  # the processor keeps it: no resize, no padding
        normalized = proc.normalize(png(rng, h, w))
        image = open_image(normalized)
        assert (image.height, image.width) == got
        x = proc.image_input(normalized)
        assert x.grid_thw == (1, got[0] // 4, got[1] // 4) and proc.num_tokens(normalized) == got[0] * got[1] // 64
        want = (np.asarray(image, np.float32) / 255 - 0.5) / 0.5
        assert np.allclose(x.pixel_values.reshape(-1, 3, 4, 4)[0], want[:4, :4].transpose(2, 0, 1), atol=1e-6)
    tower = load_vision_tower(d)
    conv = tower.vision_tower.patch_embed.proj
    whole = torch.from_numpy(np.ascontiguousarray(want.transpose(2, 0, 1)))[None]
    by_image = conv(whole).flatten(2)[0].T  # [patches, hidden], row-major over the grid
    by_patch = conv(torch.from_numpy(x.pixel_values).reshape(-1, 3, 4, 4)).flatten(1)
    assert torch.allclose(by_image, by_patch, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert proc.placeholder(tok) == tok.decode([proc.vision_start, proc.spec.image_token_id, proc.vision_end])
    tok.add_special_tokens({"additional_special_tokens": ["<|media_content|>"]})  # the release's tokenizer has it
    assert proc.placeholder(tok) == "<|vision_start|>image<|media_content|><|image_pad|><|vision_end|>"


def test_transformers_processor_settings(tmp_path):
    """transformers' processor fields read as the release's media_proc_cfg are; fixed output tokens refused."""
    import json

    from forge_megatron.multimodal.images import kimi_settings

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Kimi_K25ImageProcessor", "patch_size": 14, "merge_size": 2, "max_patches": 16384,
         "size": {"max_height": 512, "max_width": 512}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    assert kimi_settings(str(tmp_path)) == dict(patch=14, merge=2, max_patches=16384, per_side=512, mean=[0.5] * 3,
                                                std=[0.5] * 3)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {"fixed_output_tokens": 64}}))
    with pytest.raises(ValueError, match="fixed_output_tokens"):
        kimi_settings(str(tmp_path))


def test_kimi_images_through_the_gateway_are_scored_by_the_trainer_as_the_engine(tmp_path):
    """Two chat calls with pictures of two sizes, the second continuing the first: the engine (transformers' Kimi
    model) samples, and the trainer's tree forward (processor, MoonViT, projector) scores the sampled tokens as the
    engine did."""
    from forge_megatron.models.tiny import build_tiny_model

    d = build_tiny_model(str(tmp_path / "m"), "kimi_k25", images=True, seed=2)
    vl.assert_scored_as_engine(d, vl.chat_episode(d, vl.random_pictures(5, [(30, 50), (40, 16)])))


def test_kimi_trained_tower_gradients_equal_transformers(kimi_dir, hf_reference):
    """``--train-vision-tower``: MoonViT and the projector train with the language model (read from the release's
    names); every gradient, theirs exported under the release's names (a layer's q / k / v as its fused, re-paired
    wqkv), is transformers'."""
    samples, images, _ = batch()
    vl.trained_tower_checks(kimi_dir, samples, images, *hf_reference, ("vision_tower.", "mm_projector."))


def test_kimi_trained_tower_reaches_the_engine(tmp_path):
    """The weight sync sends the trained tower under the release's names (what SGLang's Kimi-K2.5 loader takes:
    wqkv, wo, norm0 / norm1, mlp.fc0 / fc1, mm_projector.proj.*); forge-engine's transformers model takes them, its
    tower then the trainer's."""
    from forge_megatron.bridge import Bridge

    before, after, tower = vl.tower_synced_to_an_engine(tmp_path, "kimi_k25", ("model.vision_tower.",
                                                                            "model.mm_projector."))
    assert before and set(tower) <= set(before) and len(tower) == len(before)
    for name, (t, _) in tower.items():
        assert torch.allclose(after[name], t.to(after[name].dtype), atol=1e-6), name
        assert not torch.equal(after[name], before[name]), name
    sent = Bridge(str(tmp_path / "kimi_k25"), vision_tower=True).vision_tensor_names
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in sent and not any(n.startswith("model.") for n in sent)


def _tower_round_trip(rank, world_size, hf_dir):
    from forge_megatron.bridge import Bridge
    from forge_megatron.convert.checkpoint import HFReader
    from forge_megatron.mcore import vision
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_dir, vision_tower=True)
    model = build_tree_gpt(bridge.cfg)
    vision.attach_tower(model, bridge.hf_config)
    load_hf_weights([model], bridge, hf_dir)
    out = dict(bridge.export((f"{vision.TOWER}.{n}", p.detach()) for n, p in model.vision_tower.named_parameters()))
    return out, HFReader(hf_dir).get(bridge.vision_tensor_names)


def test_trained_tower_exports_the_release_tensors(kimi_dir):
    """A trained tower read from the release's names and exported (mcore-to-hf, the weight sync) gives back the
    release's tensors exactly: every one of them, under its own name."""
    ((exported, released),) = run_distributed(_tower_round_trip, world_size=1, hf_dir=kimi_dir, timeout_s=300)
    assert released and set(exported) == set(released)
    assert all(torch.equal(exported[n], released[n]) for n in released)


def test_engine_takes_one_placeholder_per_image_as_sglang_does(tmp_path):
    """SGLang's Kimi-K2.5 processor takes token ids with one ``<|media_pad|>`` per image and expands it: forge-engine
    does the same (its logprobs then transformers' on the expanded prompt) and refuses expanded runs, as SGLang
    does; the gateway's ``engine_ids`` collapses a recorded prompt to that form and back."""
    import asyncio

    import transformers

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor, data_url
    from forge_megatron.rollout.launch import start_engine
    from forge_megatron.rollout.sglang_client import EngineRequestError, SGLangClient
    from tests.multimodal.test_vision_tree import png

    d = build_tiny_model(str(tmp_path / "m"), "kimi_k25", images=True, seed=4)
    proc = ImageProcessor(d)
    rng = np.random.default_rng(1)
    pics = [proc.normalize(png(rng, 24, 40)), proc.normalize(png(rng, 16, 16))]
    pad, vs, ve = proc.spec.image_token_id, proc.vision_start, proc.vision_end
    expanded = [5, 6, vs, *proc.image_ids(pics[0]), ve, 7, vs, *proc.image_ids(pics[1]), ve, 8]
    collapsed = proc.engine_ids(expanded, [proc.grid(p) for p in pics])
    assert collapsed == [5, 6, vs, pad, ve, 7, vs, pad, ve, 8]
    assert proc.expand_placeholders(collapsed, [proc.grid(p) for p in pics]) == expanded
    handle = start_engine(d, in_process=True)

    async def calls():
        c = SGLangClient(handle.url)
        try:
            ok = await c.generate(collapsed, {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3},
                                  image_data=[data_url(p) for p in pics])
            try:
                await c.generate(expanded, {"max_new_tokens": 1}, image_data=[data_url(p) for p in pics])
            except EngineRequestError as exc:
                return ok, str(exc)
            return ok, None
        finally:
            await c.close()

    try:
        result, error = asyncio.run(calls())
    finally:
        handle.stop()
    assert error is not None and "one placeholder token per image" in error, error
    model = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    inputs = [proc.image_input(p) for p in pics]
    full = torch.tensor([expanded + result.output_ids])
    with torch.no_grad():
        logits = model(input_ids=full, pixel_values=torch.from_numpy(
            np.concatenate([x.pixel_values for x in inputs])).reshape(-1, 3, PATCH, PATCH),
            image_grid_thw=torch.tensor([x.grid_thw for x in inputs])).logits[0, len(expanded) - 1:-1]
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
    assert result.logprobs == pytest.approx(want.tolist(), abs=1e-4)
