"""Gemma 4's images on prefix trees: the Megatron tree model with the checkpoint's vision tower and embed_vision
(images of several sizes, their patches pooled 2 x 2), each image's tokens seeing each other in the sliding-window
layers only, equals transformers' Gemma4ForConditionalGeneration run on each sample alone, logprobs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.multimodal import vl_checks as vl
from tests.multimodal.test_vision_tree import LOGP_ATOL

V = 400
IMG, BOI, EOI = 397, 398, 399
PATCH, K = 4, 2  # the tiny tower's patches and pooling kernel


def _checkpoint(out_dir: str, seed: int = 0, both_ways: bool = True, e_layout: bool = False) -> str:
    """A tiny Gemma 4 vision-language checkpoint; ``e_layout``: E2B / E4B's language model (per-layer inputs, KV
    sharing, causal over images as those releases are)."""
    import transformers

    from forge_megatron.models import save_checkpoint
    from forge_megatron.models.tiny import tiny_config

    cfg = tiny_config("gemma4_vl", vocab_size=V)
    if e_layout:
        text = tiny_config("gemma4_e", vocab_size=V).to_dict()
        cfg = transformers.Gemma4Config(text_config=text, vision_config=cfg.vision_config.to_dict(),
                                        audio_config=None, tie_word_embeddings=True)
        both_ways = False
    cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id = IMG, BOI, EOI
    cfg.text_config.use_bidirectional_attention = "vision" if both_ways else None
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(cfg).float()
    save_checkpoint(model, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return _checkpoint(str(tmp_path_factory.mktemp("gemma4_vl")))


def _image(rng, h, w):
    """An ImageInput of h x w patches (the processor's layout: row-major, channels last) and its pixel values as
    transformers takes them."""
    from forge_megatron.multimodal import ImageInput

    patches = rng.uniform(0, 1, (h * w, PATCH * PATCH * 3)).astype(np.float32)
    return ImageInput(patches, (1, h, w))


def _with_image(pre, image, post):
    n = image.grid_thw[1] * image.grid_thw[2] // (K * K)
    return [*pre, BOI, *[IMG] * n, EOI, *post]


def batch(seed=0):
    """(samples, images per sample): an image shared by two branches, images of three sizes, two images in one
    sample, a sample like sample 0 with another image of its size, a text sample."""
    rng = np.random.default_rng(seed)
    a, b, c = _image(rng, 4, 4), _image(rng, 4, 6), _image(rng, 4, 4)
    s0 = _with_image([2, 5, 6], a, [7, 8, 9, 10])
    samples = [s0, _with_image([2, 5, 6], a, [7, 11, 12]), _with_image([2, 5, 6], b, [7, 8, 9]),
               s0 + _with_image([13], b, [14, 15]), _with_image([2, 5, 6], c, [7, 8, 9, 10]), [2, 5, 20, 21, 22]]
    return [np.array(s) for s in samples], [[a], [a], [b], [a, b], [c], []]


def hf_inputs(ids: torch.Tensor, images: list) -> dict:
    """transformers' image inputs of one sample: padded patches, their (x, y) positions (-1: padding), and the
    image tokens' type."""
    from forge_megatron.multimodal.families import gemma4_inputs

    pixels, positions = gemma4_inputs(images)
    return dict(pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=(ids == IMG).long())


def _reference(hf_dir: str, samples, images):
    import transformers

    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    inputs = [hf_inputs(torch.as_tensor(t)[None], ims) if ims else {} for t, ims in zip(samples, images)]
    return vl.hf_reference(model, samples, inputs), model.config  # (its checkpoint names are transformers' own)


@pytest.fixture(scope="module")
def hf_reference(gemma_dir):
    samples, images = batch()
    return _reference(gemma_dir, samples, images)[0]


@pytest.fixture(scope="module")
def one_rank(gemma_dir):
    return vl.tree_run(gemma_dir, batch(), variants={"causal": {"bidirectional": False},
                                                     "everywhere": {"bidirectional": True}})


def test_spec_of_a_gemma4_checkpoint(one_rank, tmp_path):
    from forge_megatron.bridge.families import load_hf_config
    from forge_megatron.multimodal import vision_spec

    spec = one_rank["spec"]
    assert (spec.image_token_id, spec.merge, spec.mrope_section, spec.bidirectional) == (IMG, K, None, "sliding")
    assert spec.tokens_per_image((1, 4, 6)) == 6
    causal_dir = _checkpoint(str(tmp_path / "causal"), both_ways=False)
    assert vision_spec(load_hf_config(causal_dir)).bidirectional is False  # (the smaller releases)


def test_tree_with_gemma4_images_equals_transformers(one_rank, hf_reference):
    # the sliding layers' image blocks matter, and the global layer's causal mask over images too
    vl.assert_tree_equals_transformers(one_rank, hf_reference[0], "causal", "everywhere")


def test_gemma4_language_model_gradients_equal_transformers(one_rank, hf_reference):
    vl.assert_lm_grads_equal(one_rank, hf_reference[1])


def test_gateway_images_keep_their_aspect_within_the_budget(tmp_path):
    """Gemma 4's normalised image: the processor's size rule (aspect kept, at most 280 patches here, sides in
    8-pixel cells), a fixed point of it (the processor does not resize it again), its patches the processor's (no
    padding), its token count the pooled grid's; its text boi + image tokens + eoi."""
    import transformers

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor, gemma4_size, open_image
    from tests.multimodal.test_vision_tree import png

    d = build_tiny_model(str(tmp_path / "g"), "gemma4_vl", images=True)
    proc = ImageProcessor(d)
    rng = np.random.default_rng(3)
    for h, w in [(30, 50), (3, 200), (200, 3), (16, 16), (500, 300), (67, 67)]:
        normalized = proc.normalize(png(rng, h, w))
        image = open_image(normalized)
        assert gemma4_size(image.height, image.width, PATCH, 280, K) == (image.height, image.width)
        assert image.height % 8 == 0 and image.width % 8 == 0 and image.height * image.width <= 280 * 16
        got = proc.image_input(normalized)
        out = proc.hf(images=[image], return_tensors="np")
        n = got.grid_thw[1] * got.grid_thw[2]
        assert got.grid_thw == (1, image.height // PATCH, image.width // PATCH)
        assert np.array_equal(got.pixel_values, out["pixel_values"][0, :n])
        assert proc.num_tokens(normalized) == n // 4 == int(out["num_soft_tokens_per_image"][0])
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = proc.placeholder(tok)
    assert tok.encode(text, add_special_tokens=False) == [proc.vision_start, proc.spec.image_token_id, proc.vision_end]


def test_gemma4_images_through_the_gateway_are_scored_by_the_trainer_as_the_engine(tmp_path):
    """Two chat calls with pictures of two sizes, the second continuing the first: the episode holds each picture's
    pooled token count, and the trainer's tree forward (processor, tower, image blocks in the sliding layers)
    scores the sampled tokens as the engine did."""
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.multimodal.families import image_runs

    d = build_tiny_model(str(tmp_path / "g"), "gemma4_vl", images=True, seed=2)
    proc = ImageProcessor(d)
    ep = vl.chat_episode(d, vl.random_pictures(5, [(30, 50), (40, 16)]))
    seg = ep.segments[-1]
    runs = image_runs(np.array(seg.tokens), proc.spec.image_token_id, seg.loss_mask)
    assert [b - a for a, b in runs] == [proc.num_tokens(x) for x in seg.images]
    assert len(set(b - a for a, b in runs)) == len(runs) == 2  # two sizes, two token counts
    vl.assert_scored_as_engine(d, ep)


def test_gemma4_trained_tower_gradients_equal_transformers(gemma_dir, hf_reference):
    """``--train-vision-tower``: Gemma 4's tower and embed_vision train with the language model; every gradient,
    theirs under the checkpoint's names (model.vision_tower.*, model.embed_vision.*), is transformers'."""
    samples, images = batch()
    vl.trained_tower_checks(gemma_dir, samples, images, *hf_reference, ("model.vision_tower.", "model.embed_vision."),
                            no_gradient=("k_proj.linear.weight",))


def test_gemma4_trained_tower_reaches_the_engine(tmp_path):
    """The weight sync sends Gemma 4's trained tower and embed_vision under the checkpoint's names, which the
    engine's Gemma4ForConditionalGeneration holds: its tower equals the trainer's afterwards."""
    before, after, tower = vl.tower_synced_to_an_engine(tmp_path, "gemma4_vl", ("model.vision_tower.",
                                                                             "model.embed_vision."))
    assert before and set(tower) == set(before)  # (the checkpoint's names are the engine's)
    for name, (t, _) in tower.items():
        assert torch.equal(after[name], t.to(after[name].dtype)), name
        assert not torch.equal(after[name], before[name]), name


def test_e_layout_images_equal_transformers(tmp_path):
    """E2B / E4B's language model (per-layer inputs, KV sharing) with images: an image token's per-layer inputs are
    the pad token's identity row and the projection of its image features, as transformers' Gemma4Model makes them;
    logprobs and every gradient equal transformers' (the images causal, as those releases attend)."""
    d = _checkpoint(str(tmp_path / "e"), seed=1, e_layout=True)
    samples, images = batch()
    (want, expected), config = _reference(d, samples, images)
    assert config.text_config.hidden_size_per_layer_input
    (got,) = run_distributed(vl.tree_body, world_size=1, hf_dir=d, samples=samples, images=images, timeout_s=600)
    assert got["spec"].bidirectional is False
    assert (got["logp"] - want).abs().max().item() <= LOGP_ATOL
    vl.assert_grads_equal(got["grads"], expected)


def test_export_of_a_trained_tower_copies_only_what_it_leaves_out(tmp_path, gemma_dir):
    """With the tower trained, the export writes its tensors from the model; from the original checkpoint it copies
    only the vision-language tensors the tower leaves out (Gemma 4's audio tower: one stands in here), and nothing
    twice (Gemma 3's SigLIP, held as vision_tower.* by transformers 5, is the bridge's vision_tower.vision_model.*)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from forge_megatron.bridge import Bridge
    from forge_megatron.convert.checkpoint import vision_tower
    from tests.multimodal.test_gemma3_images import build_gemma3_checkpoint

    d = tmp_path / "with_audio"
    shutil.copytree(gemma_dir, d)
    (f,) = list(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    tensors["model.audio_tower.stand_in.weight"] = torch.ones(3)
    save_file(tensors, str(f), metadata={"format": "pt"})
    assert [n for n, _ in vision_tower(Bridge(str(d), vision_tower=True), str(d))] == \
        ["model.audio_tower.stand_in.weight"]
    assert any(n.startswith("model.vision_tower.") for n, _ in vision_tower(Bridge(str(d)), str(d)))  # frozen: all
    g3 = build_gemma3_checkpoint(str(tmp_path / "g3"))
    assert list(vision_tower(Bridge(g3, vision_tower=True), g3)) == []
