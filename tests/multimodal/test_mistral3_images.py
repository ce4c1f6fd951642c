"""Mistral 3's images on prefix trees (Ministral 3 / Mistral Small 3.x, and Mistral Small 4, whose language model has
multi-latent attention and experts: a Pixtral tower, images written row by row with [IMG_BREAK] after each row and
[IMG_END] after the last): the Megatron tree model with the checkpoint's tower and projector equals transformers'
Mistral3ForConditionalGeneration run on each sample alone, logprobs and gradients; the engine, the gateway and the
trainer take them through every process. Each test runs for both language models (ARCHS)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.multimodal import vl_checks as vl

V = 400
IMG, BREAK, END = 397, 398, 399
PATCH, MERGE = 4, 2  # the tiny Pixtral tower's patches, merged 2 x 2 into a token: a token is 8 x 8 pixels
ARCHS = ("ministral3_vl", "mistral4_vl")  # Ministral 3 / Mistral Small 3.x; Mistral Small 4 (MLA, experts)


def _checkpoint(out_dir: str, arch: str, seed: int = 0) -> str:
    import transformers

    from forge_megatron.models import save_checkpoint
    from forge_megatron.models.tiny import tiny_config

    cfg = tiny_config(arch, vocab_size=V)
    cfg.image_token_index = cfg.image_token_id = IMG
    torch.manual_seed(seed)
    save_checkpoint(transformers.Mistral3ForConditionalGeneration(cfg).float(), out_dir)
    return out_dir


@pytest.fixture(scope="module", params=ARCHS)
def mistral_dir(tmp_path_factory, request):
    return _checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)


def _image(rng, rows, cols):
    """An ImageInput of rows x cols tokens (2 x 2 patches each) and its pixels [3, H, W]."""
    from forge_megatron.multimodal import ImageInput
    from forge_megatron.multimodal.families import image_patches

    pixels = torch.from_numpy(rng.standard_normal((1, 3, rows * 8, cols * 8)).astype(np.float32))
    return ImageInput(image_patches(pixels, PATCH).numpy(), (1, rows * MERGE, cols * MERGE)), pixels[0]


def _text(image):
    """The image's tokens as Mistral 3's processor writes them."""
    rows, cols = image.grid_thw[1] // MERGE, image.grid_thw[2] // MERGE
    out = []
    for r in range(rows):
        out += [IMG] * cols + [END if r == rows - 1 else BREAK]
    return out


def batch(seed=0):
    """(samples, images per sample, pixels per sample): an image shared by two branches, three image sizes, two images
    in one sample, a sample like sample 0 with another image of its size, a text sample."""
    rng = np.random.default_rng(seed)
    (a, pa), (b, pb), (c, pc) = _image(rng, 2, 2), _image(rng, 2, 3), _image(rng, 2, 2)
    s0 = [2, 5, 6, *_text(a), 7, 8, 9, 10]
    samples = [s0, [2, 5, 6, *_text(a), 7, 11, 12], [2, 5, 6, *_text(b), 7, 8, 9], s0 + [13, *_text(b), 14, 15],
               [2, 5, 6, *_text(c), 7, 8, 9, 10], [2, 5, 20, 21, 22]]
    return [np.array(s) for s in samples], [[a], [a], [b], [a, b], [c], []], [[pa], [pa], [pb], [pa, pb], [pc], []]


def hf_inputs(pixels: list) -> dict:
    """transformers' image inputs of one sample: the images padded to the largest and their sizes."""
    height, width = max(p.shape[1] for p in pixels), max(p.shape[2] for p in pixels)
    padded = torch.zeros(len(pixels), 3, height, width)
    for i, p in enumerate(pixels):
        padded[i, :, :p.shape[1], :p.shape[2]] = p
    return dict(pixel_values=padded, image_sizes=torch.tensor([list(p.shape[1:]) for p in pixels]))


# a transformers 5 Mistral 3 parameter's name in the checkpoint (the bridge's)
_released = vl.renamer(("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                       ("model.multi_modal_projector.", "multi_modal_projector."),
                       lm_head__weight="language_model.lm_head.weight")


@pytest.fixture(scope="module")
def hf_reference(mistral_dir):
    import transformers

    samples, _, pixels = batch()
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(mistral_dir, dtype=torch.float32)
    return vl.hf_reference(model, samples, [hf_inputs(pix) if pix else {} for pix in pixels], _released)


@pytest.fixture(scope="module")
def one_rank(mistral_dir):
    return vl.tree_run(mistral_dir, batch())


def test_spec_and_rows_of_a_mistral3_checkpoint(one_rank):
    spec = one_rank["spec"]
    assert (spec.image_token_id, spec.merge, spec.mrope_section, spec.row_breaks) == (IMG, MERGE, None, True)
    assert spec.rows_of_image((1, 4, 6)) == (2, 3) and spec.tokens_per_image((1, 4, 6)) == 6
    tokens, rows = one_rank["tokens"], one_rank["rows"]
    assert torch.equal(rows >= 0, tokens == IMG)  # the breaks and ends are text in the tree


def test_tree_with_mistral3_images_equals_transformers(one_rank, hf_reference):
    vl.assert_tree_equals_transformers(one_rank, hf_reference[0])


def test_mistral3_language_model_gradients_equal_transformers(one_rank, hf_reference):
    vl.assert_lm_grads_equal(one_rank, hf_reference[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_image_rows_must_match_the_grid(arch):
    from forge_megatron.multimodal.families import image_token_spans, vision_spec
    from forge_megatron.models.tiny import tiny_config

    cfg = tiny_config(arch, vocab_size=V)
    cfg.image_token_index = IMG
    spec = vision_spec({**cfg.to_dict(), "architectures": ["Mistral3ForConditionalGeneration"]})
    rng = np.random.default_rng(0)
    image, _ = _image(rng, 2, 3)
    good = [1, *_text(image), 5]
    assert image_token_spans(np.array(good), [image.grid_thw], spec) == [[(1, 4), (5, 8)]]
    for bad, words in (([1, IMG, IMG, BREAK, IMG, IMG, IMG, END], "does not match"),
                       ([1, *_text(image), *_text(image)], "beyond")):
        with pytest.raises(ValueError, match=words):
            image_token_spans(np.array(bad), [image.grid_thw], spec)


def test_gateway_images_are_written_row_by_row(tmp_path):
    """Mistral 3's normalised image: Pixtral's size rule (the longest side within 64 pixels, sides rounded up to
    8-pixel merged patches), a fixed point of it, its patches the processor's pixels; in a prompt its rows of image
    tokens each end with the break token, the last with the end token."""
    import transformers

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor, open_image, pixtral_size
    from forge_megatron.multimodal.families import image_patches
    from tests.multimodal.test_vision_tree import png

    d = build_tiny_model(str(tmp_path / "m"), "ministral3_vl", images=True)
    proc = ImageProcessor(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    brk, end = proc.breaks
    assert tok.convert_ids_to_tokens([brk, end]) == ["<|vision_start|>", "<|vision_end|>"]
    rng = np.random.default_rng(3)
    for h, w in [(30, 50), (3, 200), (200, 3), (16, 16), (500, 300), (9, 9)]:
        normalized = proc.normalize(png(rng, h, w))
        image = open_image(normalized)
        assert pixtral_size(image.height, image.width, 64, 8) == (image.height, image.width)
        got = proc.image_input(normalized)
        want = proc.hf(images=[image], patch_size={"height": 8, "width": 8}, return_tensors="pt")["pixel_values"]
        assert np.allclose(got.pixel_values, image_patches(want, PATCH).numpy())
        rows, cols = image.height // 8, image.width // 8
        ids = proc.image_ids(normalized)
        assert len(ids) == rows * (cols + 1) and ids.count(proc.spec.image_token_id) == proc.num_tokens(normalized)
        assert ids[cols::cols + 1] == [brk] * (rows - 1) + [end]
    assert proc.placeholder(tok) == tok.decode([proc.spec.image_token_id])


@pytest.mark.parametrize("arch", ARCHS)
def test_mistral3_images_through_the_gateway_are_scored_by_the_trainer_as_the_engine(tmp_path, arch):
    """Two chat calls with pictures of two sizes, the second continuing the first: the episode writes each picture
    row by row, and the trainer's tree forward (processor, Pixtral tower, projector) scores the sampled tokens as the
    engine did."""
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.multimodal.families import image_token_spans

    d = build_tiny_model(str(tmp_path / "m"), arch, images=True, seed=2)
    proc = ImageProcessor(d)
    ep = vl.chat_episode(d, vl.random_pictures(5, [(30, 50), (40, 16)]))
    seg = ep.segments[-1]
    grids = [proc.grid(x) for x in seg.images]
    spans = image_token_spans(np.array(seg.tokens), grids, proc.spec, seg.loss_mask)
    assert [len(rows) for rows in spans] == [proc.spec.rows_of_image(g)[0] for g in grids]
    vl.assert_scored_as_engine(d, ep)


def test_mistral3_trained_tower_gradients_equal_transformers(mistral_dir, hf_reference):
    """``--train-vision-tower``: the Pixtral tower and the projector train with the language model; every gradient,
    theirs under the checkpoint's names (vision_tower.*, multi_modal_projector.*), is transformers'."""
    samples, images, _ = batch()
    vl.trained_tower_checks(mistral_dir, samples, images, *hf_reference, ("vision_tower.", "multi_modal_projector."),
                            no_gradient=("k_proj.weight",))


@pytest.mark.parametrize("arch", ARCHS)
def test_mistral3_trained_tower_reaches_the_engine(tmp_path, arch):
    """The weight sync sends the trained Pixtral tower and projector under the checkpoint's names; the engine's
    Mistral3ForConditionalGeneration (model.vision_tower.*, ...) takes them."""
    before, after, tower = vl.tower_synced_to_an_engine(tmp_path, arch, ("model.vision_tower.",
                                                                                 "model.multi_modal_projector."))
    assert before and {"model." + n for n in tower} == set(before)
    for name, (t, _) in tower.items():
        assert torch.equal(after["model." + name], t.to(after["model." + name].dtype)), name
        assert not torch.equal(after["model." + name], before["model." + name]), name


def test_mistral_small_4_spec():
    """Mistral Small 4 inside Mistral3ForConditionalGeneration: the same image layout as Mistral 3 (its language
    model's multi-latent attention takes 1-D positions, so images need nothing of its RoPE)."""
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.multimodal.families import vision_spec

    hf = {**tiny_config("mistral4_vl", vocab_size=V).to_dict(), "architectures": ["Mistral3ForConditionalGeneration"]}
    spec = vision_spec(hf)
    assert (spec.kind, spec.mrope_section, spec.row_breaks, spec.merge) == ("mistral3", None, True, MERGE)
