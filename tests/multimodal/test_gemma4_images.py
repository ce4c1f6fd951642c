"""Gemma 4's images on prefix trees: the Megatron tree model with the checkpoint's vision tower and embed_vision
(images of several sizes, their patches pooled 2 x 2), each image's tokens seeing each other in the sliding-window
layers only, equals transformers' Gemma4ForConditionalGeneration run on each sample alone, logprobs and gradients."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.multimodal.test_vision_tree import GRAD_RTOL, LOGP_ATOL, _tree_model, _weights

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
    from forge_megatron.multimodal.qwen_vl import gemma4_inputs

    pixels, positions = gemma4_inputs(images)
    return dict(pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=(ids == IMG).long())


def hf_logprobs(model, samples, images):
    out = []
    for tokens, ims in zip(samples, images):
        ids = torch.as_tensor(tokens)[None]
        logits = model(input_ids=ids, **(hf_inputs(ids, ims) if ims else {})).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


@pytest.fixture(scope="module")
def hf_reference(gemma_dir):
    import transformers

    samples, images = batch()
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(gemma_dir, dtype=torch.float32)
    logp = hf_logprobs(model, samples, images)
    (logp * _weights(logp.numel())).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def _one_rank_body(rank, world_size, hf_dir, mutants=True):
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.multimodal import build_vision_tree

    samples, images = batch()
    bridge, model, spec, calls = _tree_model(hf_dir)
    layout = build_vision_tree(samples, images, spec)
    logp, _ = tree_logprobs(model, layout)
    (logp * _weights(logp.numel())).sum().backward()
    grads = dict(bridge.export((n, p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                               for n, p in model.named_parameters()))
    tower_calls = len(calls)
    if not mutants:
        return dict(logp=logp.detach(), grads=grads, tower_calls=tower_calls, spec=spec)
    with torch.no_grad():
        causal = tree_logprobs(model, build_vision_tree(samples, images,
                                                        dataclasses.replace(spec, bidirectional=False)))[0]
        everywhere = tree_logprobs(model, build_vision_tree(samples, images,
                                                            dataclasses.replace(spec, bidirectional=True)))[0]
    return dict(logp=logp.detach(), grads=grads, causal=causal, everywhere=everywhere, unique=layout.unique_tokens,
                total=layout.total_tokens, tower_calls=tower_calls, spec=spec)


@pytest.fixture(scope="module")
def one_rank(gemma_dir):
    (out,) = run_distributed(_one_rank_body, world_size=1, hf_dir=gemma_dir, timeout_s=600)
    return out


def test_spec_of_a_gemma4_checkpoint(one_rank, tmp_path):
    from forge_megatron.bridge.families import load_hf_config
    from forge_megatron.multimodal import vision_spec

    spec = one_rank["spec"]
    assert (spec.image_token_id, spec.merge, spec.mrope_section, spec.bidirectional) == (IMG, K, None, "sliding")
    assert spec.tokens_per_image((1, 4, 6)) == 6
    causal_dir = _checkpoint(str(tmp_path / "causal"), both_ways=False)
    assert vision_spec(load_hf_config(causal_dir)).bidirectional is False  # (the smaller releases)


def test_tree_with_gemma4_images_equals_transformers(one_rank, hf_reference):
    want, _ = hf_reference
    got = one_rank["logp"]
    assert got.shape == want.shape and one_rank["unique"] < one_rank["total"]
    assert (got - want).abs().max().item() <= LOGP_ATOL
    assert one_rank["tower_calls"] == 1
    # the sliding layers' image blocks matter, and the global layer's causal mask over images too
    assert (one_rank["causal"] - want).abs().max().item() > 1e-3
    assert (one_rank["everywhere"] - want).abs().max().item() > 1e-3


def _released(name: str) -> str:
    return "language_model.model." + name[len("model.language_model."):] \
        if name.startswith("model.language_model.") else name


def test_gemma4_language_model_gradients_equal_transformers(one_rank, hf_reference):
    grads, (_, expected) = one_rank["grads"], hf_reference
    expected = {_released(n): g for n, g in expected.items()}
    names = {n for n in grads if n in expected or _released(n) in expected}
    assert grads and len(names) == len(grads), sorted(set(grads) - names)[:4]
    biggest = max(g.abs().max().item() for g in expected.values())
    for name, g in grads.items():
        ref = expected[name if name in expected else _released(name)]
        err = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-3 * biggest)).item()
        assert err <= GRAD_RTOL, (name, err)


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


@pytest.fixture(scope="module")
def gemma_served(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.launch import start_engine, start_gateway

    d = build_tiny_model(str(tmp_path_factory.mktemp("gemma4_gateway")), "gemma4_vl", images=True, seed=2)
    engine = start_engine(d, in_process=True)
    gw = start_gateway(d, [engine.url], in_process=True)
    yield d, gw
    gw.stop()
    engine.stop()


def test_gemma4_images_through_the_gateway_are_scored_by_the_trainer_as_the_engine(gemma_served):
    """Two chat calls with pictures of two sizes, the second continuing the first: the episode holds each picture's
    pooled token count, and the trainer's tree forward (processor, tower, image blocks in the sliding layers)
    scores the sampled tokens as the engine did."""
    from forge_megatron.middleware.wire import episode_to_blob
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.multimodal.qwen_vl import image_runs
    from tests.middleware.test_gateway import end, episode, new_session
    from tests.multimodal.test_gateway_images import _chat, _trainer_logprobs, _user
    from tests.multimodal.test_vision_tree import png

    d, served = gemma_served
    proc = ImageProcessor(d)
    rng = np.random.default_rng(5)
    pictures = [png(rng, 30, 50), png(rng, 40, 16)]
    s = new_session(served)
    r1 = _chat(s, [_user("what is this?", pictures[0])], max_tokens=8, temperature=0.0)
    history = [_user("what is this?", pictures[0]), {"role": "assistant", "content": r1.choices[0].message.content}]
    _chat(s, [*history, _user("and this?", pictures[1])], max_tokens=8)
    assert end(served, s)[0] == 200
    ep = episode(served, s)
    seg = ep.segments[-1]
    runs = image_runs(np.array(seg.tokens), proc.spec.image_token_id, seg.loss_mask)
    assert [b - a for a, b in runs] == [proc.num_tokens(x) for x in seg.images]
    assert len(set(b - a for a, b in runs)) == len(runs) == 2  # two sizes, two token counts
    (result,) = run_distributed(_trainer_logprobs, world_size=1, hf_dir=d, episode_blob=episode_to_blob(ep),
                                segments=len(ep.segments), timeout_s=300)
    logp, mask, rollout = result
    sampled = mask > 0
    assert int(sampled.sum()) >= 2
    assert (logp[sampled] - rollout[sampled]).abs().max().item() <= 1e-4


def test_gemma4_trained_tower_gradients_equal_transformers(gemma_dir, hf_reference):
    """``--train-vision-tower``: Gemma 4's tower and embed_vision train with the language model; every gradient,
    theirs under the checkpoint's names (model.vision_tower.*, model.embed_vision.*), is transformers'."""
    from tests.multimodal.test_gemma3_images import trained_tower_body

    samples, images = batch()
    (logp, grads), = run_distributed(trained_tower_body, world_size=1, hf_dir=gemma_dir, samples=samples,
                                     images=images, timeout_s=600)
    want, expected = hf_reference
    assert (logp - want).abs().max().item() <= LOGP_ATOL
    tower = {n for n in grads if n.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert tower and tower == {n for n in expected if n.startswith(("model.vision_tower.", "model.embed_vision."))}
    biggest = max(g.abs().max().item() for g in expected.values())
    for name in tower:
        err = ((grads[name] - expected[name]).abs().max() / expected[name].abs().max().clamp_min(1e-3 * biggest))
        assert err.item() <= GRAD_RTOL, (name, err.item())
    assert all(grads[n].abs().max() > 1e-6 for n in tower if not n.endswith("k_proj.linear.weight")), \
        [n for n in tower if grads[n].abs().max() <= 1e-6]


def test_gemma4_trained_tower_reaches_the_engine(tmp_path):
    """The weight sync sends Gemma 4's trained tower and embed_vision under the checkpoint's names, which the
    engine's Gemma4ForConditionalGeneration holds: its tower equals the trainer's afterwards."""
    from tests.multimodal.test_gemma3_images import tower_synced_to_an_engine

    before, after, tower = tower_synced_to_an_engine(tmp_path, "gemma4_vl", ("model.vision_tower.",
                                                                             "model.embed_vision."))
    assert before and set(tower) == set(before)  # (the checkpoint's names are the engine's)
    for name, (t, _) in tower.items():
        assert torch.equal(after[name], t.to(after[name].dtype)), name
        assert not torch.equal(after[name], before[name]), name


def test_e_layout_images_equal_transformers(tmp_path):
    """E2B / E4B's language model (per-layer inputs, KV sharing) with images: an image token's per-layer inputs are
    the pad token's identity row and the projection of its image features, as transformers' Gemma4Model makes them;
    logprobs and every gradient equal transformers' (the images causal, as those releases attend)."""
    import transformers

    d = _checkpoint(str(tmp_path / "e"), seed=1, e_layout=True)
    samples, images = batch()
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32)
    assert model.config.text_config.hidden_size_per_layer_input
    want = hf_logprobs(model, samples, images)
    (want * _weights(want.numel())).sum().backward()
    expected = {_released(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    (got,) = run_distributed(_one_rank_body, world_size=1, hf_dir=d, mutants=False, timeout_s=600)
    assert got["spec"].bidirectional is False
    assert (got["logp"] - want.detach()).abs().max().item() <= LOGP_ATOL
    biggest = max(g.abs().max().item() for g in expected.values())
    for name, g in got["grads"].items():
        ref = expected[name if name in expected else _released(name)]
        err = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-3 * biggest)).item()
        assert err <= GRAD_RTOL, (name, err)


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
