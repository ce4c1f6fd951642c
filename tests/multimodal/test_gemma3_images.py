"""Gemma 3's images on prefix trees: the Megatron tree model with the checkpoint's SigLIP tower and projector, the
tokens of each image seeing each other (tree attention's bidirectional blocks), equals transformers'
Gemma3ForConditionalGeneration run on each sample alone (its token_type_ids mask), logprobs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed
from tests.multimodal import vl_checks as vl
from tests.multimodal.test_vision_tree import LOGP_ATOL, _tree_model

V = 400
IMG, BOI, EOI = 397, 398, 399  # ids of the tiny vocabulary the config names
SIZE, PATCH = 16, 4  # the tiny config's images: 4 x 4 patches pooled 2 x 2 to 4 tokens


def build_gemma3_checkpoint(out_dir: str, seed: int = 0) -> str:
    import transformers

    from forge_megatron.models import save_checkpoint
    from forge_megatron.models.tiny import tiny_config

    cfg = tiny_config("gemma3_vl", vocab_size=V)
    cfg.image_token_index, cfg.boi_token_index, cfg.eoi_token_index = IMG, BOI, EOI
    cfg.image_token_id = IMG
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float()
    with torch.no_grad():  # (initialised at zeros: the images would not reach the language model)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    save_checkpoint(model, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_gemma3_checkpoint(str(tmp_path_factory.mktemp("gemma3_vl")))


def _pixels(rng) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((1, 3, SIZE, SIZE)).astype(np.float32))


def _image(pixels):
    from forge_megatron.multimodal import ImageInput
    from forge_megatron.multimodal.families import image_patches

    return ImageInput(image_patches(pixels, PATCH).numpy(), (1, SIZE // PATCH, SIZE // PATCH))


def _with_image(pre, post):
    return [*pre, BOI, *[IMG] * 4, EOI, *post]


def batch(seed=0):
    """(samples, images per sample, pixels per sample): an image shared by two branches, another image, two images
    in one sample (the twin of sample 0 going on), a sample like sample 0 with another image, a text sample."""
    rng = np.random.default_rng(seed)
    pa, pb, pc = _pixels(rng), _pixels(rng), _pixels(rng)
    a, b, c = _image(pa), _image(pb), _image(pc)
    s0 = _with_image([2, 5, 6], [7, 8, 9, 10])
    samples = [s0, _with_image([2, 5, 6], [7, 11, 12]), _with_image([2, 5, 6], [7, 8, 9]),
               s0 + _with_image([13], [14, 15]), _with_image([2, 5, 6], [7, 8, 9, 10]), [2, 5, 20, 21, 22]]
    images = [[a], [a], [b], [a, b], [c], []]
    pixels = [[pa], [pa], [pb], [pa, pb], [pc], []]
    return [np.array(s) for s in samples], images, pixels


# a transformers 5 Gemma 3 parameter's name in the released checkpoints (and SGLang, and the bridge)
_released = vl.renamer(("model.language_model.", "language_model.model."),
                       ("model.vision_tower.", "vision_tower.vision_model."),
                       ("model.multi_modal_projector.", "multi_modal_projector."))


@pytest.fixture(scope="module")
def hf_reference(gemma_dir):
    """transformers' logprobs of each sample alone (its images and token_type_ids) and gradients by released name."""
    import transformers

    samples, _, pixels = batch()
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma_dir, dtype=torch.float32)
    inputs = [dict(pixel_values=torch.cat(pix), token_type_ids=(torch.as_tensor(t)[None] == IMG).long()) if pix
              else {} for t, pix in zip(samples, pixels)]
    return vl.hf_reference(model, samples, inputs, _released)


@pytest.fixture(scope="module")
def one_rank(gemma_dir):
    return vl.tree_run(gemma_dir, batch(), variants={"causal": {"bidirectional": False}})


def test_spec_of_a_gemma3_checkpoint(one_rank):
    spec = one_rank["spec"]
    assert (spec.image_token_id, spec.merge, spec.mrope_section, spec.bidirectional) == (IMG, 2, None, True)
    assert spec.tokens_per_image((1, SIZE // PATCH, SIZE // PATCH)) == 4


def test_tree_with_gemma3_images_equals_transformers(one_rank, hf_reference):
    # the images' own attention matters: a causal mask over the image tokens scores the text after them otherwise
    vl.assert_tree_equals_transformers(one_rank, hf_reference[0], "causal")


def test_gemma3_language_model_gradients_equal_transformers(one_rank, hf_reference):
    vl.assert_lm_grads_equal(one_rank, hf_reference[1])
    assert any(n.endswith("embed_tokens.weight") for n in one_rank["grads"])  # (tied to the head: every row has a gradient)


def test_patches_round_trip():
    from forge_megatron.multimodal.families import gemma3_images, image_patches

    x = torch.randn(2, 3, SIZE, SIZE)
    p = image_patches(x, PATCH)
    assert p.shape == (2 * 16, 3 * PATCH * PATCH)
    assert torch.equal(p[1].view(3, PATCH, PATCH), x[0, :, 0:PATCH, PATCH:2 * PATCH])  # row-major, channels first
    assert torch.equal(gemma3_images(p, SIZE, PATCH), x)
    with pytest.raises(ValueError, match="patches"):
        gemma3_images(p[:-1], SIZE, PATCH)


def _parallel_body(rank, world_size, hf_dir, sequence_parallel, extra):
    from forge_megatron.mcore.context_parallel import seq_multiple
    from forge_megatron.mcore.forward import logprobs_from_logits, output_layer_deferred, tree_model_inputs
    from forge_megatron.multimodal import build_vision_tree

    samples, images, _ = batch()
    _, model, spec, _ = _tree_model(hf_dir, sequence_parallel, **extra)
    layout = build_vision_tree(samples, images, spec)
    multiple = seq_multiple(model.config)
    with torch.no_grad(), output_layer_deferred(model) as captured:
        out = model(**tree_model_inputs(layout, multiple=multiple))
        logp, _ = logprobs_from_logits(out, layout, output_weight=captured["weight"], multiple=multiple)
    return logp


@pytest.mark.parametrize("parallel,sp,extra", [(ParallelConfig(tp=2), True, {}),
                                               (ParallelConfig(cp=2), False, {"cp_comm_type": "a2a"})],
                         ids=["tp2_sp", "cp2_a2a"])
def test_gemma3_images_under_tp2_sp_and_cp2(gemma_dir, hf_reference, parallel, sp, extra):
    out = run_distributed(_parallel_body, world_size=2, parallel=parallel, hf_dir=gemma_dir, sequence_parallel=sp,
                          extra=extra, timeout_s=600)
    for logp in out:
        assert (logp - hf_reference[0]).abs().max().item() <= LOGP_ATOL


def test_gemma3_images_refuse_cp_all_gather(gemma_dir):
    with pytest.raises(Exception, match="all-to-all mode"):
        run_distributed(_parallel_body, world_size=2, parallel=ParallelConfig(cp=2), hf_dir=gemma_dir,
                        sequence_parallel=False, extra={"cp_comm_type": "all_gather"}, timeout_s=600)


def test_gateway_images_are_the_processors_squares(tmp_path):
    """Gemma 3's normalised image is the checkpoint's square, made with the processor's filter: its patches are the
    processor's pixel values of the original image, cut as the tower takes them; every image is 4 tokens, and an
    image's text in a prompt is Gemma3Processor's (blank lines around boi, the image tokens, eoi)."""
    import transformers

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor, open_image
    from forge_megatron.multimodal.families import image_patches
    from tests.multimodal.test_vision_tree import png

    d = build_tiny_model(str(tmp_path / "g"), "gemma3_vl", images=True)
    proc = ImageProcessor(d)
    rng = np.random.default_rng(3)
    for h, w in [(3, 5), (40, 7), (16, 16), (64, 48)]:
        original = png(rng, h, w)
        normalized = proc.normalize(original)
        assert open_image(normalized).size == (SIZE, SIZE) and proc.num_tokens(original) == 4
        image = proc.image_input(normalized)
        want = proc.hf(images=[open_image(original)], return_tensors="pt")["pixel_values"]
        assert image.grid_thw == (1, 4, 4)
        assert np.allclose(image.pixel_values, image_patches(want, PATCH).numpy(), atol=1e-6)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = proc.placeholder(tok)
    assert text.startswith("\n\n") and text.endswith("\n\n")
    ids = tok.encode(text.strip("\n"), add_special_tokens=False)
    assert ids == [proc.vision_start, proc.spec.image_token_id, proc.vision_end]
    assert proc.expand(ids, [normalized]) == [proc.vision_start, *[proc.spec.image_token_id] * 4, proc.vision_end]


# --- through the gateway and the engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gateway_model(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("gemma3_gateway")), "gemma3_vl", images=True, seed=2)


@pytest.mark.parametrize("second", ["continued", "rewritten"])
def test_gemma3_images_through_the_gateway_are_scored_by_the_trainer_as_the_engine(gateway_model, second):
    """Two chat calls with a picture each, the second continuing the first (one segment, both pictures) or
    rewriting the history: the episode holds Gemma 3's image text (4 image tokens between boi and eoi, blank lines
    around) and the normalised squares, and the trainer's tree forward (processor, SigLIP tower, bidirectional image
    attention) scores the sampled tokens as the engine did."""
    import transformers

    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.multimodal.families import image_runs

    d = gateway_model
    proc = ImageProcessor(d)
    pictures = vl.random_pictures(5, [(30, 50), (16, 16)])
    ep = vl.chat_episode(d, pictures, continued=second == "continued")
    assert len(ep.segments) == (1 if second == "continued" else 2)
    seg = ep.segments[-1]
    tokens = np.array(seg.tokens)
    runs = image_runs(tokens, proc.spec.image_token_id, seg.loss_mask)
    assert [b - a for a, b in runs] == [4] * len(seg.images) and seg.images[-1] == proc.normalize(pictures[1])
    tok = transformers.AutoTokenizer.from_pretrained(d)
    for a, b in runs:
        assert tokens[a - 1] == proc.vision_start and tokens[b] == proc.vision_end
        assert tok.decode(tokens[:a - 1]).endswith("\n\n") and tok.decode(tokens[b + 1:]).startswith("\n\n")
    vl.assert_scored_as_engine(d, ep)


def test_gemma3_trained_tower_gradients_equal_transformers(gemma_dir, hf_reference):
    """``--train-vision-tower``: the SigLIP tower and the projector train with the language model; every gradient,
    theirs under the checkpoint's names, is transformers'."""
    samples, images, _ = batch()
    vl.trained_tower_checks(gemma_dir, samples, images, *hf_reference, ("vision_tower.", "multi_modal_projector."),
                            no_gradient=("k_proj.bias",))


def test_gemma3_trained_tower_reaches_the_engine(tmp_path):
    """The weight sync sends Gemma 3's trained tower and projector under the released checkpoints' (and SGLang's)
    names (vision_tower.vision_model.*, multi_modal_projector.*; the checkpoint here is transformers 5's, which saves
    vision_tower.*), and the engine's Gemma3ForConditionalGeneration takes them (model.vision_tower.*, ...): its
    tower equals the trainer's afterwards, the checkpoint's before."""
    before, after, tower = vl.tower_synced_to_an_engine(tmp_path, "gemma3_vl",
                                                     ("model.vision_tower.", "model.multi_modal_projector."))
    held = {n: k for k in before if (n := _released(k)) in tower}
    assert before and set(held) == set(tower) and len(held) == len(before)
    assert all(n.startswith(("vision_tower.vision_model.", "multi_modal_projector.")) for n in tower)
    for name, (t, _) in tower.items():
        assert torch.equal(after[held[name]], t.to(after[held[name]].dtype)), name
        assert not torch.equal(after[held[name]], before[held[name]]), name
