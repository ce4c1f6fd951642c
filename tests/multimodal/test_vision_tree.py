"""Samples with images on prefix trees equal transformers' vision-language models, sample by sample.

Tiny Qwen3-VL (DeepStack from its vision block 0, interleaved mRoPE), Qwen3-VL-MoE, Qwen3.5 (Gated DeltaNet beside
gated attention), GLM-4.1V and GLM-4.5V (contiguous mRoPE sections on interleaved pairs), Qwen2.5-VL and Qwen2-VL
(contiguous sections on halves; flat configs, names as released, Qwen2.5-VL's tower attending in windows) checkpoints;
samples share a prefix with an image, branch after it, hold two images, or have the
same token ids as another sample and another image (which must not merge). Checked against each sample run alone
through the transformers model with its images: logprobs, and every language-model parameter's gradient of a weighted
loss; that leaving out DeepStack, mRoPE or the image features changes the logprobs; the 3-D positions against
transformers' ``get_rope_index``; image-aware merging (both tree builders); TP2 with sequence parallelism and CP2.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed

V = 400
IMG, VS, VE = 397, 398, 399  # the tiny tokenizer has no vision tokens: the config names three ids of its vocabulary
FEATURES = 96  # channels 3 x temporal patch 2 x patch 4 x 4
ARCHS = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
         "qwen3_5_vl": "Qwen3_5ForConditionalGeneration", "glm4v": "Glm4vForConditionalGeneration",
         "glm4v_moe": "Glm4vMoeForConditionalGeneration", "glm46v": "Glm46VForConditionalGeneration",
         "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}
LOGP_ATOL = 1e-5
GRAD_RTOL = 1e-4


def build_vl_checkpoint(out_dir: str, arch: str = "qwen3_vl", seed: int = 0) -> str:
    import transformers

    from forge_megatron.models import save_checkpoint
    from forge_megatron.models.tiny import tiny_config

    cfg = tiny_config(arch, vocab_size=V)
    if arch.startswith(("glm4v", "glm46v")):
        cfg.image_token_id, cfg.image_start_token_id, cfg.image_end_token_id = IMG, VS, VE
    else:
        cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id = IMG, VS, VE
    torch.manual_seed(seed)
    save_checkpoint(getattr(transformers, ARCHS[arch])(cfg).float(), out_dir)
    return out_dir


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    return {arch: build_vl_checkpoint(str(root / arch), arch) for arch in ARCHS}


def _image(rng, h, w):
    from forge_megatron.multimodal import ImageInput

    return ImageInput(rng.standard_normal((h * w, FEATURES)).astype(np.float32), (1, h, w))


def _with_image(pre, image, post):
    n = image.grid_thw[1] * image.grid_thw[2] // 4
    return [*pre, VS, *[IMG] * n, VE, *post]


def batch(seed=0):
    """(samples, images per sample): a shared image prefix with two branches, another image, two images in one
    sample, a twin of sample 0 with another image of the same size, and a text sample."""
    rng = np.random.default_rng(seed)
    a, b, c = _image(rng, 4, 4), _image(rng, 4, 6), _image(rng, 4, 4)
    s0 = _with_image([1, 5, 6], a, [7, 8, 9, 10])
    samples = [s0, _with_image([1, 5, 6], a, [7, 11, 12]), _with_image([1, 5, 6], b, [7, 8, 9]),
               s0 + _with_image([13], b, [14, 15]), _with_image([1, 5, 6], c, [7, 8, 9, 10]), [1, 5, 20, 21, 22]]
    return [np.array(s) for s in samples], [[a], [a], [b], [a, b], [c], []]


def _weights(n, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(np.float32))


def hf_logprobs(model, samples, images):
    """Each sample alone through the transformers model: next-token logprobs, concatenated."""
    out = []
    for tokens, ims in zip(samples, images):
        ids = torch.as_tensor(tokens)[None]
        kw = {}
        if ims:
            kw = dict(pixel_values=torch.from_numpy(np.concatenate([i.pixel_values for i in ims])),
                      image_grid_thw=torch.tensor([i.grid_thw for i in ims]), mm_token_type_ids=(ids == IMG).int())
        logits = model(input_ids=ids, **kw).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def _tree_model(hf_dir, sequence_parallel=False, **extra):
    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import vision
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.multimodal import load_vision_tower, vision_spec
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_dir)
    cfg = bridge.cfg
    if sequence_parallel:
        extra["sequence_parallel"] = True
    if extra:
        cfg = dataclasses.replace(cfg, extra={**cfg.extra, **extra})
    model = build_tree_gpt(cfg)
    load_hf_weights([model], bridge, hf_dir)
    spec = vision_spec(bridge.hf_config)
    tower = load_vision_tower(hf_dir, spec)
    class Calls(list):
        pass

    calls = Calls()
    calls.tower = tower

    def make_tower():
        calls.append(1)
        return tower

    vision.install(model, spec, make_tower)
    return bridge, model, spec, calls


def tree_forward(hf_dir, samples, images):
    """The tree model with the checkpoint's frozen tower (:func:`_tree_model`) on the samples merged, forward and
    backward of the weighted logprobs: (model, spec, the tower's calls, layout, logprobs, every gradient by checkpoint
    name)."""
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.multimodal import build_vision_tree

    bridge, model, spec, calls = _tree_model(hf_dir)
    layout = build_vision_tree(samples, images, spec)
    logp, _ = tree_logprobs(model, layout)
    (logp * _weights(logp.numel())).sum().backward()
    grads = dict(bridge.export((n, p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                               for n, p in model.named_parameters()))
    return model, spec, calls, layout, logp, grads


def _one_rank_body(rank, world_size, dirs):
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.multimodal import build_vision_tree

    samples, images = batch()
    out = {}
    for arch, d in dirs.items():
        model, spec, calls, layout, logp, grads = tree_forward(d, samples, images)
        with torch.no_grad():
            again, _ = tree_logprobs(model, layout)  # the micro-batch's features are kept: no second tower call
            tower_calls = len(calls)
            mutants = {}
            if arch == "qwen3_vl":
                merged, stack = layout.vision.features["frozen"]
                assert len(stack) == 1
                no_stack = build_vision_tree(samples, images, spec)
                no_stack.vision.features["frozen"] = (merged, [])  # the features as computed, without DeepStack's
                mutants["no_deepstack"] = tree_logprobs(model, no_stack)[0]
                depth = build_vision_tree(samples, images, spec)
                depth.vision.positions_T3 = depth.position_ids[:, None].expand(-1, 3).clone()
                mutants["depth_rope"] = tree_logprobs(model, depth)[0]
                no_features = build_vision_tree(samples, images, spec)
                no_features.vision.rows_T = torch.full_like(no_features.vision.rows_T, -1)
                mutants["no_features"] = tree_logprobs(model, no_features)[0]
        out[arch] = dict(logp=logp.detach(), again=again, grads=grads, unique=layout.unique_tokens,
                         total=layout.total_tokens, tower_calls=tower_calls,
                         mutants={k: v.detach() for k, v in mutants.items()})
    return out


def _trained_tower_body(rank, world_size, dirs, recompute):
    """The vision tower trained with the language model (mcore.vision.attach_tower, ``Bridge(vision_tower=True)``):
    logprobs and every gradient, the tower's included, exported by the bridge under the checkpoint's names
    (``recompute``: Megatron's full recomputation of the layers and the tower's of its blocks)."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import vision
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.multimodal import build_vision_tree, vision_spec
    from forge_megatron.training.checkpoint import load_hf_weights
    from forge_megatron.tree import build_tree

    samples, images = batch()
    out = {}
    for arch, d in dirs.items():
        bridge = Bridge(d, vision_tower=True)
        cfg = bridge.cfg
        if recompute:  # Megatron's reentrant recomputation re-runs the DeepStack hook in the backward
            cfg = dataclasses.replace(cfg, extra={**cfg.extra, "recompute_granularity": "full",
                                                  "recompute_method": "uniform", "recompute_num_layers": 1})
        model = build_tree_gpt(cfg)
        vision.attach_tower(model, bridge.hf_config, recompute=recompute)  # and the tower's blocks recomputed
        load_hf_weights([model], bridge, d)
        spec = vision_spec(bridge.hf_config)
        vision.install(model, spec, key="policy", trained=True)
        layout = build_vision_tree(samples, images, spec)
        runs, mlp = [], model.vision_tower.blocks[0].mlp
        mlp.forward = lambda *a, _f=mlp.forward, **k: runs.append(1) or _f(*a, **k)  # (hooks skip recomputes)
        logp, _ = tree_logprobs(model, layout)
        (logp * _weights(logp.numel())).sum().backward()
        block_runs = len(runs)
        grads = dict(bridge.export((n, p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                                   for n, p in model.named_parameters()))
        with torch.no_grad():
            again, _ = tree_logprobs(model, layout)  # forward-only: the tower without gradients, kept
        text_grads = []
        for text in (build_vision_tree(samples[-1:], images[-1:], spec), build_tree(samples[-1:])):
            model.zero_grad()  # no image (a vision tree, or none): every tower parameter gets a zero gradient
            tree_logprobs(model, text)[0].sum().backward()
            text_grads += [p.grad for p in model.vision_tower.parameters()]
        out[arch] = dict(logp=logp.detach(), again=again, grads=grads, kept=list(layout.vision.features),
                         block_runs=block_runs,
                         live=list(layout.vision.live),
                         text_only=all(g is not None and not g.any() for g in text_grads))
    return out


def _parallel_body(rank, world_size, hf_dir, sequence_parallel):
    from forge_megatron.mcore.context_parallel import seq_multiple
    from forge_megatron.mcore.forward import output_layer_deferred, tree_model_inputs, logprobs_from_logits
    from forge_megatron.multimodal import build_vision_tree

    samples, images = batch()
    _, model, spec, calls = _tree_model(hf_dir, sequence_parallel)
    layout = build_vision_tree(samples, images, spec)
    multiple = seq_multiple(model.config)
    seen = []  # the images this rank's tower encoded
    with torch.no_grad(), output_layer_deferred(model) as captured:
        tower = calls.tower
        handle = tower.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["grid_thw"].tolist()),
                                                 with_kwargs=True)
        out = model(**tree_model_inputs(layout, multiple=multiple))
        handle.remove()
        logp, _ = logprobs_from_logits(out, layout, output_weight=captured["weight"], multiple=multiple)
    return logp, seen


def train_samples(samples, images):
    """The trainer's view of the samples (what the pool delivers), images attached; the last two tokens sampled."""
    from forge_megatron.middleware.batch import TrainSample

    n = [len(t) for t in samples]
    return [TrainSample(tokens=np.asarray(t, np.int32), loss_mask=np.asarray([0] * (k - 2) + [1, 1], np.uint8),
                        rollout_logprobs=np.zeros(k, np.float32), policy_versions=np.zeros(k, np.int32),
                        advantages=np.ones(k, np.float32), sample_weight=1.0, group_index=i // 3, episode_id=str(i),
                        domain="vision", reward=0.0, images=ims or None)
            for i, (t, ims, k) in enumerate(zip(samples, images, n))]


def _pp_body(rank, world_size, hf_dir):
    """The trainer's micro-batches (training.trainer.micro_batch_of) through Megatron's pipeline schedule, PP2: the
    first stage puts the features in and adds DeepStack's (layer 0), both stages rotate by mRoPE."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from forge_megatron.mcore.forward import make_tree_forward_step
    from forge_megatron.training.trainer import micro_batch_of

    samples, images = batch()
    _, model, spec, calls = _tree_model(hf_dir, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    ts = train_samples(samples, images)
    mbs = [micro_batch_of(ts[:3], ["vision"], vision=spec), micro_batch_of(ts[3:], ["vision"], vision=spec)]
    out = get_forward_backward_func()(
        forward_step_func=make_tree_forward_step(lambda logp, ent, mb: (logp.sum() * 0, {"logp": logp.detach()})),
        data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs), seq_length=1, micro_batch_size=1,
        forward_only=True)
    logp = torch.cat([o["logp"] for o in out]) if ps.is_pipeline_last_stage() else None
    return logp, len(calls)


@pytest.fixture(scope="module")
def one_rank(vl_dirs):
    (out,) = run_distributed(_one_rank_body, world_size=1, dirs=vl_dirs, timeout_s=600)
    return out


@pytest.fixture(scope="module")
def hf_reference(vl_dirs, tmp_path_factory):
    """Per arch: (logprobs, {checkpoint name: gradient of the weighted loss}) of transformers' model."""
    import transformers
    from safetensors.torch import load_file

    from forge_megatron.models import save_checkpoint

    samples, images = batch()
    out = {}
    for arch, d in vl_dirs.items():
        model = getattr(transformers, ARCHS[arch]).from_pretrained(d, dtype=torch.float32)
        logp = hf_logprobs(model, samples, images)
        (logp * _weights(logp.numel())).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        grads_dir = str(tmp_path_factory.mktemp(f"{arch}_grads"))
        save_checkpoint(model, grads_dir)
        import glob

        grads = {}
        for f in glob.glob(f"{grads_dir}/*.safetensors"):
            grads.update(load_file(f))
        out[arch] = (logp.detach(), grads)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tree_with_images_equals_transformers(one_rank, hf_reference, arch):
    got, (want, _) = one_rank[arch], hf_reference[arch]
    assert got["logp"].shape == want.shape
    assert (got["logp"] - want).abs().max().item() <= LOGP_ATOL
    assert torch.equal(got["again"], got["logp"].detach())
    assert got["tower_calls"] == 1  # once per micro-batch, its features reused by the second pass
    assert got["unique"] < got["total"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_language_model_gradients_equal_transformers(one_rank, hf_reference, arch):
    grads, (_, expected) = one_rank[arch]["grads"], hf_reference[arch]
    assert set(grads) <= set(expected)
    for name, g in grads.items():
        ref = expected[name]
        err = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        # Gated DeltaNet's decay parameters sum many cancelling terms in another order (tests/mcore/test_tree_exact.py)
        assert err <= (1e-2 if name.endswith(("A_log", "dt_bias")) else GRAD_RTOL), (arch, name, err)
    embed = next(g for n, g in grads.items() if n.endswith("embed_tokens.weight"))
    assert embed[IMG].abs().max() == 0  # the image tokens' embeddings are replaced: no gradient reaches them
    assert embed[VS].abs().max() > 0


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_trained_vision_tower_gradients_equal_transformers(vl_dirs, hf_reference, recompute):
    archs = ("qwen3_vl",) if recompute else ("qwen3_vl", "glm4v", "qwen2_5_vl", "qwen2_vl")
    dirs = {a: vl_dirs[a] for a in archs}
    (out,) = run_distributed(_trained_tower_body, world_size=1, dirs=dirs, recompute=recompute, timeout_s=600)
    for arch, got in out.items():
        want, expected = hf_reference[arch]
        assert (got["logp"] - want).abs().max().item() <= LOGP_ATOL
        assert (got["again"] - want).abs().max().item() <= LOGP_ATOL
        assert got["kept"] == ["policy"] and got["live"] == []  # the no-grad pass kept its features, no live ones
        assert got["text_only"]  # (Megatron's DDP with --overlap-grad-reduce waits for every parameter's gradient)
        assert got["block_runs"] == (2 if recompute else 1)  # the tower's blocks run again in the backward
        prefix = "visual." if arch.startswith("qwen2") else "model.visual."  # (Qwen2.x-VL: as released)
        tower = {n: g for n, g in got["grads"].items() if n.startswith(prefix)}
        assert tower and set(tower) == {n for n in expected if n.startswith(prefix)}
        for name, g in got["grads"].items():
            ref = expected[name]
            err = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            assert err <= GRAD_RTOL, (arch, name, err)
        # every tower tensor takes part (DeepStack's merger included): a missing path would leave one at zero
        assert all(g.abs().max() > 0 for g in tower.values()), [n for n, g in tower.items() if g.abs().max() == 0]


def test_bridge_maps_a_trained_vision_tower(vl_dirs):
    """``Bridge(vision_tower=True)``: every tower tensor of the checkpoint maps one to one (replicated over TP) to
    the first model piece's ``vision_tower.*``; without it they are left out; a text model is refused."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.convert.checkpoint import HFReader
    from forge_megatron.models.tiny import tiny_config

    for arch, d in vl_dirs.items():  # every family whose images the trainer takes
        prefix = "visual." if arch.startswith("qwen2") else "model.visual."  # (Qwen2.x-VL: as released)
        names = sorted(n for n in HFReader(d).names() if n.startswith(prefix))
        frozen, trained = Bridge(d), Bridge(d, vision_tower=True)
        assert names and all(frozen.is_left_out(n) for n in names)
        assert not any(trained.is_left_out(n) for n in names)
        tower = [n for n in trained.piece_names(range(0), True, False) if n.startswith("vision_tower.")]
        assert sorted(trained.hf_names(n)[0] for n in tower) == names, d
        assert not any(n.startswith("vision_tower.") for n in trained.piece_names(range(2), False, True))
        assert all(trained.rule(n)[0].tp == "rep" and trained.rename(n, 3, 0) == n for n in tower)
        assert not any(n.startswith("vision_tower.") for n in frozen.canonical_names())
    text = {**tiny_config("qwen3", vocab_size=V).to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ValueError, match="Qwen3-VL, Qwen3-VL-MoE"):
        Bridge(text, vision_tower=True)


def test_deepstack_mrope_and_features_all_matter(one_rank, hf_reference):
    want = hf_reference["qwen3_vl"][0]
    for name, logp in one_rank["qwen3_vl"]["mutants"].items():
        assert (logp - want).abs().max().item() > 1e-3, name


@pytest.mark.parametrize("arch,model_class", [("qwen3_vl", "Qwen3VLModel"), ("qwen2_5_vl", "Qwen2_5_VLModel")])
def test_positions_equal_transformers_rope_index(vl_dirs, arch, model_class):
    import transformers

    from forge_megatron.bridge.families import load_hf_config
    from forge_megatron.multimodal import positions_3d, vision_spec

    spec = vision_spec(load_hf_config(vl_dirs[arch]))
    model = getattr(transformers, model_class)(transformers.AutoConfig.from_pretrained(vl_dirs[arch]))
    samples, images = batch(3)
    for tokens, ims in zip(samples, images):
        ids = torch.as_tensor(tokens)[None]
        grid = torch.tensor([i.grid_thw for i in ims]) if ims else None
        want, _ = model.get_rope_index(ids, mm_token_type_ids=(ids == IMG).int(), image_grid_thw=grid)
        got = positions_3d(tokens, [i.grid_thw for i in ims], spec)
        assert np.array_equal(got, want[:, 0].T.numpy())


@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_image_aware_merging(vl_dirs, backend):
    from forge_megatron.bridge.families import load_hf_config
    from forge_megatron.multimodal import build_vision_tree, vision_spec
    from forge_megatron.tree import build_tree
    from forge_megatron.utils import env

    if backend == "cpp" and not env.has_tree_ext():
        pytest.skip("the C++ tree builder is not built")
    spec = vision_spec(load_hf_config(vl_dirs["qwen3_vl"]))
    samples, images = batch()
    layout = build_vision_tree(samples, images, spec, backend=backend)
    # the oracle: distinct prefixes of the samples written as (token, image, index in the image) keys
    prefixes = set()
    for tokens, ims in zip(samples, images):
        keys, it, k = [], iter(ims), 0
        for t in tokens.tolist():
            if t == IMG:
                if k == 0:
                    image = next(it)
                keys.append((t, image.digest, k))
                k = (k + 1) % (image.grid_thw[1] * image.grid_thw[2] // 4)
            else:
                keys.append((t,))
            prefixes.add(tuple(keys))
    assert layout.unique_tokens == len(prefixes)
    # samples 0 and 4 have the same ids and other images: merged by ids alone they would be one
    assert build_tree(samples, backend=backend).unique_tokens < len(prefixes)
    assert torch.equal(layout.gather(layout.tokens), torch.from_numpy(np.concatenate(samples)))
    rows = layout.gather(layout.vision.rows_T)
    is_image = torch.from_numpy(np.concatenate(samples) == IMG)
    assert bool((rows[is_image] >= 0).all()) and bool((rows[~is_image] == -1).all())
    assert layout.vision.num_images == 3  # a, b and c once each however many samples hold them
    assert layout.vision.pixel_values.shape == (16 + 24 + 16, FEATURES)
    if backend == "cpp":
        other = build_vision_tree(samples, images, spec, backend="python")
        assert torch.equal(layout.tokens, other.tokens) and torch.equal(layout.vision.rows_T, other.vision.rows_T)


def test_image_token_errors(vl_dirs):
    from forge_megatron.bridge.families import load_hf_config
    from forge_megatron.multimodal import build_vision_tree, vision_spec

    spec = vision_spec(load_hf_config(vl_dirs["qwen3_vl"]))
    samples, images = batch()
    with pytest.raises(ValueError, match="sample 0: image tokens at 4..8 beyond the sample's 0 image"):
        build_vision_tree([samples[0]], [[]], spec)
    with pytest.raises(ValueError, match="image 0 has 4 tokens"):
        build_vision_tree([samples[0][:-7]], [images[0]], spec)  # an image cut short
    with pytest.raises(ValueError, match="the sample has 2 image"):
        build_vision_tree([samples[0]], [images[0] * 2], spec)
    with pytest.raises(ValueError, match="Qwen3-VL"):
        vision_spec({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})


@pytest.mark.parametrize("parallel,sp", [(ParallelConfig(tp=2), True), (ParallelConfig(cp=2), False)],
                         ids=["tp2_sp", "cp2"])
def test_tree_with_images_under_tp_sp_and_cp(vl_dirs, hf_reference, parallel, sp):
    out = run_distributed(_parallel_body, world_size=2, parallel=parallel, hf_dir=vl_dirs["qwen3_vl"],
                          sequence_parallel=sp, timeout_s=600)
    want = hf_reference["qwen3_vl"][0]
    for logp, _ in out:
        assert (logp - want).abs().max().item() <= LOGP_ATOL
    # the images dealt out over TP / CP (largest first): b (4 x 6 patches) to one rank, a and c to the other
    assert [s for _, s in out] == [[[[1, 4, 6]]], [[[1, 4, 4], [1, 4, 4]]]]


def test_deal_images_balances_patches():
    from forge_megatron.mcore.vision import deal_images

    grid = torch.tensor([[1, 4, 4], [1, 8, 8], [1, 4, 6], [1, 2, 2], [1, 4, 4]])
    assert deal_images(grid, 2) == [[1], [0, 2, 3, 4]]  # 64 patches against 16 + 24 + 4 + 16
    assert deal_images(grid, 3) == [[1], [2, 3], [0, 4]]  # 64; 24 + 4; 16 + 16
    assert deal_images(grid[:1], 4) == [[0], [], [], []]


def test_trainer_micro_batches_with_images_under_pp2(vl_dirs, hf_reference):
    out = run_distributed(_pp_body, world_size=2, parallel=ParallelConfig(pp=2), hf_dir=vl_dirs["qwen3_vl"],
                          timeout_s=600)
    (first, first_calls), (last, _) = out
    assert first is None and first_calls == 2  # the first stage encodes each micro-batch's images once
    assert (last - hf_reference["qwen3_vl"][0]).abs().max().item() <= LOGP_ATOL


def png(rng, h, w) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_images_over_the_wire():
    """Encoded images travel with their segments (episode wire form, the pool's blobs, JSON) and samples (the batch
    the trainer broadcasts); patches (ImageInput) do not travel."""
    from forge_megatron.middleware.batch import TrainBatch, group_samples
    from forge_megatron.middleware.schema import Episode, Segment
    from forge_megatron.middleware.wire import (WireError, batch_from_wire, batch_to_wire, blob_to_wire,
                                                episode_from_blob, episode_to_blob, episode_to_wire, pack, unpack)

    rng = np.random.default_rng(0)
    a, b = png(rng, 8, 8), png(rng, 16, 8)
    segs = [Segment([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.2], [-1, 0, 0], images=[a, b]),
            Segment([4, 5], [0, 1], [0.0, -1.0], [-1, 0]), Segment([6, 7], [0, 1], [0.0, -1.0], [-1, 0], images=[b])]
    ep = Episode("e", "g", "t", segs, reward=1.0)
    for back in (episode_from_blob(episode_to_blob(ep)), Episode.from_dict(ep.to_dict())):
        assert [s.images for s in back.segments] == [[a, b], None, [b]]
    samples = group_samples([blob_to_wire(episode_to_blob(ep))], {"rewards": [1.0], "segment_advantages": [[1, 1, 1]],
                                                                 "segment_weights": [[1, 1, 1]]}, 0)
    assert [[bytes(x) for x in s.images or ()] for s in samples] == [[a, b], [], [b]]
    sent = TrainBatch(batch_id=3, samples=samples, group_indices=[0], metrics={})
    meta, arrays = batch_to_wire(sent)
    got = batch_from_wire(*unpack([bytes(memoryview(f)) for f in pack(meta, arrays)], max_bytes=1 << 30))
    assert [[bytes(x) for x in s.images or ()] for s in got.samples] == [[a, b], [], [b]]
    assert sent.num_bytes == got.num_bytes
    with pytest.raises(WireError, match="encoded bytes as the last array"):
        batch_from_wire(dict(meta, images=[[len(a), len(b) + 1], [], [len(b)]]), arrays)
    with pytest.raises(WireError, match="for each of the 3"):
        batch_from_wire(dict(meta, images=[[len(a)]]), arrays)
    ep_meta, ep_arrays = episode_to_wire(ep)
    assert ep_meta["segment_images"] == [[len(a), len(b)], [], [len(b)]]
    rng2 = np.random.default_rng(1)
    with pytest.raises(WireError, match="travel encoded"):
        batch_to_wire(TrainBatch(0, [dataclasses.replace(samples[0], images=[_image(rng2, 4, 4)])], [0]))


def test_rank_batch_packs_and_merges_by_images(vl_dirs):
    from forge_megatron.bridge.families import load_hf_config
    from forge_megatron.middleware.batch import TrainBatch
    from forge_megatron.multimodal import build_vision_tree, vision_spec
    from forge_megatron.training.trainer import rank_batch

    spec = vision_spec(load_hf_config(vl_dirs["qwen3_vl"]))
    samples, images = batch()
    tb = TrainBatch(batch_id=0, samples=train_samples(samples, images), group_indices=[0, 1], metrics={})
    rb = rank_batch(tb, 4096, True, 0, 1, [], hidden_size=8, vision=spec)
    assert [mb.layout.unique_tokens for mb in rb.micro_batches] == [build_vision_tree(samples, images, spec).unique_tokens]
    # a budget the trees fit only when counted with their images' keys (by ids alone samples 0 and 4 are one)
    budget = 27
    rb = rank_batch(tb, budget, True, 0, 1, [], hidden_size=8, vision=spec)
    assert len(rb.micro_batches) > 1 and all(mb.layout.vision is not None for mb in rb.micro_batches)
    assert max(mb.layout.unique_tokens for mb in rb.micro_batches) <= budget
    with pytest.raises(ValueError, match="samples with images, but the model takes none"):
        rank_batch(tb, 4096, True, 0, 1, [], hidden_size=8)


# ------------------------------------------------------------------------------------------- engine, images
@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl", "glm4v", "glm46v", "gemma3_vl", "gemma4_vl",
                                        "ministral3_vl"])
def vl_model_dir(tmp_path_factory, request):
    """A tiny Qwen3-VL / Qwen2.5-VL / GLM-4.1V / GLM-4.6V (transformers 5.x's Glm46V) / Gemma 3 / Gemma 4 / Ministral 3
    with image tokens in its tokenizer and an image processor (models.tiny, images=True)."""
    from forge_megatron.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("vl_images")), request.param, images=True)


def test_engine_generates_from_images(vl_model_dir):
    """forge-engine's /generate with SGLang's image_data: the completion's logprobs are transformers' of the prompt
    with its images (teacher-forced, the same processor); concurrent requests with and without images keep their own
    mRoPE offsets; a text request after an image one is plain; bad image_data is a 400 naming it."""
    import asyncio

    import transformers

    from forge_megatron.multimodal.images import ImageProcessor, data_url
    from forge_megatron.rollout.launch import start_engine
    from forge_megatron.rollout.sglang_client import EngineRequestError, SGLangClient

    proc = ImageProcessor(vl_model_dir)
    rng = np.random.default_rng(0)
    pics = [proc.normalize(png(rng, 24, 40)), proc.normalize(png(rng, 16, 16))]
    tok = transformers.AutoTokenizer.from_pretrained(vl_model_dir)
    pad = proc.spec.image_token_id
    # the prompt as the gateway writes it (each family's image text, its images written out) and as it sends it
    # (one placeholder an image, as SGLang's processors take them)
    ph = proc.placeholder(tok)
    prompt = proc.expand(tok.encode(f"a b{ph} c{ph} d", add_special_tokens=False), pics)
    grids = [proc.grid(p) for p in pics]
    sent = proc.engine_ids(prompt, grids)
    assert sent.count(pad) == 2 and len(sent) < len(prompt) and proc.expand_placeholders(sent, grids) == prompt
    text_prompt = [5, 6, 7, 8, 9]
    handle = start_engine(vl_model_dir, in_process=True)

    async def calls():
        c = SGLangClient(handle.url)
        try:
            both = await asyncio.gather(
                c.generate(sent, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3},
                           image_data=[data_url(p) for p in pics]),
                c.generate(text_prompt, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 4}))
            errors = []
            for ids, bad in ((sent, ["data:image/png;base64,!!"]), (sent, [data_url(pics[0])]),
                             (sent, ["https://example.com/a.png"]), (prompt, [data_url(p) for p in pics])):
                try:
                    await c.generate(ids, {"max_new_tokens": 1}, image_data=bad)
                except EngineRequestError as exc:
                    errors.append(str(exc))
            return both, errors
        finally:
            await c.close()

    try:
        (with_images, text), errors = asyncio.run(calls())
    finally:
        handle.stop()
    arch = transformers.AutoConfig.from_pretrained(vl_model_dir).architectures[0]
    model = getattr(transformers, arch).from_pretrained(vl_model_dir, dtype=torch.float32).eval()
    inputs = [proc.image_input(p) for p in pics]
    for result, ids, ims in ((with_images, prompt, inputs), (text, text_prompt, [])):
        full = torch.tensor([ids + result.output_ids])
        kw = {}
        if ims and proc.spec.gemma3:  # whole images; the prompt's image tokens see each other
            from forge_megatron.multimodal.families import gemma3_images

            pixels = torch.from_numpy(np.concatenate([i.pixel_values for i in ims]))
            image = torch.zeros_like(full)
            image[:, :len(ids)] = torch.tensor([ids]) == pad
            kw = dict(pixel_values=gemma3_images(pixels, proc.spec.image_size, proc.spec.patch_size),
                      token_type_ids=image)
        elif ims and proc.spec.mistral3:
            from forge_megatron.multimodal.families import mistral3_inputs

            pixels, sizes = mistral3_inputs(ims, proc.spec.patch_size)
            kw = dict(pixel_values=pixels, image_sizes=sizes)
        elif ims and proc.spec.gemma4:
            from forge_megatron.multimodal.families import gemma4_inputs

            image = torch.zeros_like(full)
            image[:, :len(ids)] = torch.tensor([ids]) == pad
            pixels, positions = gemma4_inputs(ims)
            kw = dict(pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=image)
        elif ims:
            kw = dict(pixel_values=torch.from_numpy(np.concatenate([i.pixel_values for i in ims])),
                      image_grid_thw=torch.tensor([i.grid_thw for i in ims]), mm_token_type_ids=(full == pad).int())
        with torch.no_grad():
            logits = model(input_ids=full, **kw).logits[0, len(ids) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert np.allclose(result.logprobs, want.numpy(), atol=1e-4), (result.logprobs, want)
    assert len(errors) == 4, errors
    assert "not valid base64" in errors[0] and "for 1 image(s)" in errors[1] and "not fetched" in errors[2]
    assert "image_data:" in errors[3]  # the images written out: refused (SGLang's processors refuse or garble it)


def test_sampled_image_tokens_are_text(vl_dirs):
    """An image token the policy sampled (loss mask 1) is a text token: no image row, plain positions; the trainer
    leaves out a sample whose prompt's image tokens do not match its images rather than stop the run."""
    from forge_megatron.bridge.families import load_hf_config
    from forge_megatron.middleware.batch import TrainBatch
    from forge_megatron.multimodal import build_vision_tree, vision_spec
    from forge_megatron.training.trainer import rank_batch

    spec = vision_spec(load_hf_config(vl_dirs["qwen3_vl"]))
    samples, images = batch()
    sample = np.concatenate([samples[0], [IMG, 3]])
    mask = np.zeros(len(sample), np.uint8)
    mask[-2:] = 1
    layout = build_vision_tree([sample], [images[0]], spec, samples_sampled=[mask])
    assert int(layout.vision.rows_T[-2]) == -1 and int(layout.tokens[-2]) == IMG
    pos = layout.vision.positions_T3
    assert torch.equal(pos[-2], pos[-3] + 1) and torch.equal(pos[-2], pos[-2, :1].expand(3))
    with pytest.raises(ValueError, match="beyond the sample's 1 image"):
        build_vision_tree([sample], [images[0]], spec)  # without the mask: an image token run too many
    ts = train_samples([sample, samples[1]], [images[0], []])  # sample 1's image tokens have no image
    ts[0].loss_mask[:] = mask
    rb = rank_batch(TrainBatch(0, ts, [0]), 4096, True, 0, 1, [], hidden_size=8, vision=spec)
    assert [s.episode_id for s in rb.samples] == ["0"]


def test_decode_data_takes_inline_images_only():
    import base64

    from forge_megatron.multimodal.images import ImageError, data_url, decode_data

    jpeg_head = b"\xff\xd8\xff\xe0"  # plain base64 of a JPEG starts with "/9j/": not a path
    assert decode_data(base64.b64encode(jpeg_head).decode()) == jpeg_head
    assert decode_data(data_url(b"\x89PNG")) == b"\x89PNG"
    assert decode_data("data:image/jpeg;charset=x;base64," + base64.b64encode(jpeg_head).decode()) == jpeg_head
    for bad, words in (("https://example.com/a.png", "not fetched"), ("file:///tmp/a.png", "not fetched"),
                       ("/tmp/a.png", "not valid base64"), ("", "must be a data URL")):
        with pytest.raises(ImageError, match=words):
            decode_data(bad)


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl", "glm4v"])
def test_normalized_images_are_what_the_processor_makes(tmp_path, arch):
    """The gateway's normalised size is a fixed point of the checkpoint's image processor (Qwen2-VL's and GLM-4.xV's
    rules; Qwen2.5-VL's file as released: min_pixels / max_pixels, CLIP's mean and std): its grid is the processor's,
    for images smaller than a patch, wide, tall, and over the pixel bound."""
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.multimodal.images import ImageProcessor

    proc = ImageProcessor(build_tiny_model(str(tmp_path / arch), arch, images=True, with_tokenizer=True))
    rng = np.random.default_rng(7)
    for h, w in [(3, 5), (7, 40), (40, 7), (30, 50), (16, 16), (64, 64), (100, 33), (9, 9)]:
        normalized = proc.normalize(png(rng, h, w))
        image = proc.image_input(normalized)  # raises when the processor's grid differs from the normalised one
        assert image.grid_thw == proc.grid(normalized) == proc.grid(proc.normalize(normalized))
        assert 1 <= proc.num_tokens(normalized) <= 16


def test_vision_trainable_globs():
    from forge_megatron.mcore.vision import trainable_matches

    names = ["patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "merger.linear_fc1.weight",
             "deepstack_merger_list.0.norm.weight"]
    assert trainable_matches(names, "*") == set(names)
    assert trainable_matches(names, "merger.*, deepstack_merger_list.*") == set(names[2:])
    with pytest.raises(ValueError, match="'mergr.\\*' matches none of the vision tower's parameters"):
        trainable_matches(names, "merger.*,mergr.*")
    with pytest.raises(ValueError, match="names no parameters"):
        trainable_matches(names, " , ")
