"""Checks shared by the vision-language families' image tests (Gemma 3, Gemma 4, Mistral 3): transformers' logprobs
and gradients of samples run alone, the tree model's of the same samples merged, gradients compared, a chat with
pictures through a real engine and gateway, and the trainer scoring what they recorded."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tests.dist_utils import run_distributed
from tests.multimodal.test_vision_tree import GRAD_RTOL, LOGP_ATOL, _weights, tree_forward


def hf_reference(model, samples, inputs: list, rename=lambda name: name) -> tuple[torch.Tensor, dict]:
    """transformers' next-token logprobs of each sample alone (``inputs[s]``: its image keyword arguments, {} for
    text), concatenated, and the gradients of their weighted sum by checkpoint name (``rename`` of the in-memory
    name)."""
    out = []
    for tokens, kw in zip(samples, inputs):
        ids = torch.as_tensor(tokens)[None]
        logits = model(input_ids=ids, **kw).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0])
    logp = torch.cat(out)
    (logp * _weights(logp.numel())).sum().backward()
    return logp.detach(), {rename(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def renamer(*prefixes: tuple[str, str], **whole: str):
    """A map of transformers 5 in-memory parameter names to checkpoint names: each (held, stored) prefix swapped,
    and whole names (``whole``: in-memory name with dots as "__") renamed."""
    names = {k.replace("__", "."): v for k, v in whole.items()}

    def rename(name: str) -> str:
        if name in names:
            return names[name]
        for held, stored in prefixes:
            if name.startswith(held):
                return stored + name[len(held):]
        return name
    return rename


def assert_tree_equals_transformers(run: dict, want: torch.Tensor, *differing: str) -> None:
    """The tree run's logprobs (``tree_body``) are transformers' on a tree that merged samples, its tower ran once
    per micro-batch, and each of the ``differing`` variants scores otherwise (what it replaces matters)."""
    got = run["logp"]
    assert got.shape == want.shape and run["unique"] < run["total"]
    assert (got - want).abs().max().item() <= LOGP_ATOL
    assert run["tower_calls"] == 1
    for name in differing:
        assert (run["variants"][name] - want).abs().max().item() > 1e-3, name


def tree_body(rank, world_size, hf_dir, samples, images, variants=None):
    """The tree model with the checkpoint's frozen tower on the samples merged: logprobs, every gradient by
    checkpoint name, the tower's calls, the spec, the tree's tokens and feature rows; and the logprobs under each of
    ``variants`` ({name: VisionSpec fields replaced}), to show what the replaced behaviour changes."""
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.multimodal import build_vision_tree

    model, spec, calls, layout, logp, grads = tree_forward(hf_dir, samples, images)
    out = dict(logp=logp.detach(), grads=grads, tower_calls=len(calls), spec=spec, unique=layout.unique_tokens,
               total=layout.total_tokens, tokens=layout.tokens, rows=layout.vision.rows_T)
    with torch.no_grad():
        out["variants"] = {name: tree_logprobs(model, build_vision_tree(samples, images,
                                                                        dataclasses.replace(spec, **fields)))[0]
                           for name, fields in (variants or {}).items()}
    return out


def tree_run(hf_dir: str, batch: tuple, variants=None) -> dict:
    """:func:`tree_body` in a process of its own on ``batch`` (samples, images per sample, ...)."""
    samples, images = batch[:2]
    (out,) = run_distributed(tree_body, world_size=1, hf_dir=hf_dir, samples=samples, images=images,
                             variants=variants, timeout_s=600)
    return out


def assert_lm_grads_equal(run: dict, expected: dict) -> None:
    """The tree run's gradients (checkpoint names) are a nonempty subset of transformers' and equal them."""
    grads = run["grads"]
    assert grads and set(grads) <= set(expected), sorted(set(grads) - set(expected))[:4]
    assert_grads_equal(grads, expected)


def trained_tower_body(rank, world_size, hf_dir, samples, images):
    """The tower trained with the language model (``--train-vision-tower``) on ``samples`` with ``images``: logprobs
    and every gradient, exported under the checkpoint's names."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import vision
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.multimodal import build_vision_tree, vision_spec
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_dir, vision_tower=True)
    model = build_tree_gpt(bridge.cfg)
    vision.attach_tower(model, bridge.hf_config)
    load_hf_weights([model], bridge, hf_dir)
    spec = vision_spec(bridge.hf_config)
    vision.install(model, spec, key="policy", trained=True)
    logp, _ = tree_logprobs(model, build_vision_tree(samples, images, spec))
    (logp * _weights(logp.numel())).sum().backward()
    grads = dict(bridge.export((n, p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                               for n, p in model.named_parameters()))
    return logp.detach(), grads


def assert_grads_equal(grads: dict, expected: dict, names=None) -> None:
    """Every gradient of ``names`` (default all of ``grads``) equals transformers' to GRAD_RTOL of its size (or of a
    thousandth of the largest gradient, for those round-off alone makes: a key bias under softmax)."""
    biggest = max(g.abs().max().item() for g in expected.values())
    for name in names if names is not None else grads:
        ref = expected[name]
        err = ((grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-3 * biggest)).item()
        assert err <= GRAD_RTOL, (name, err)


def trained_tower_checks(hf_dir, samples, images, want, expected, prefixes: tuple, no_gradient: tuple = ()) -> None:
    """``--train-vision-tower``: the logprobs are transformers' (``want``), every gradient too (``expected``), the
    tower's (names under ``prefixes``) exactly transformers' set, each of them nonzero (but ``no_gradient``: key
    biases and projections softmax ignores, round-off alone)."""
    (logp, grads), = run_distributed(trained_tower_body, world_size=1, hf_dir=hf_dir, samples=samples, images=images,
                                     timeout_s=600)
    assert (logp - want).abs().max().item() <= LOGP_ATOL
    tower = {n for n in grads if n.startswith(prefixes)}
    assert tower and tower == {n for n in expected if n.startswith(prefixes)}
    assert_grads_equal(grads, expected, tower)
    silent = [n for n in tower if grads[n].abs().max() <= 1e-6 and not n.endswith(no_gradient)]
    assert not silent, silent


def tower_synced_to_an_engine(tmp_path, arch: str, prefixes: tuple) -> tuple[dict, dict, dict]:
    """A tiny ``arch`` served by forge-engine, a TP2 trainer model whose trained tower moved off the checkpoint's
    synced to it: (the engine's tensors under ``prefixes`` before, its state after, {sent name: (tensor, trained)})."""
    from forge_megatron.mcore.parallel import ParallelConfig
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.launch import start_engine
    from tests.multimodal.test_trainer_images import _tower_sync_body

    model_dir = build_tiny_model(str(tmp_path / arch), arch, images=True, seed=3, vocab_size=404)
    engine = start_engine(model_dir, in_process=True)
    try:
        before = {n: t.clone() for n, t in engine.engine.model.state_dict().items() if n.startswith(prefixes)}
        out = run_distributed(_tower_sync_body, world_size=2, parallel=ParallelConfig(tp=2), hf_dir=model_dir,
                              engine_url=engine.url, timeout_s=600, trainable="*")
        after = engine.engine.model.state_dict()
    finally:
        engine.stop()
    (version, excluded, tower), _ = out
    assert version == 1 and excluded == []
    return before, after, tower


def chat_episode(model_dir: str, pictures: list, continued: bool = True):
    """Two chat calls through a real forge-engine and gateway serving ``model_dir``, a picture each (the first
    completion greedy: a sampled image token would end it), the second continuing the first or not: the episode."""
    from forge_megatron.rollout.launch import start_engine, start_gateway
    from tests.middleware.test_gateway import end, episode, new_session
    from tests.multimodal.test_gateway_images import _chat, _user

    engine = start_engine(model_dir, in_process=True)
    served = start_gateway(model_dir, [engine.url], in_process=True)
    try:
        s = new_session(served)
        r1 = _chat(s, [_user("what is this?", pictures[0])], max_tokens=8, temperature=0.0)
        history = [_user("what is this?", pictures[0]),
                   {"role": "assistant", "content": r1.choices[0].message.content}]
        _chat(s, [*(history if continued else []), _user("and this?", pictures[1])], max_tokens=8)
        assert end(served, s)[0] == 200
        return episode(served, s)
    finally:
        served.stop()
        engine.stop()


def assert_scored_as_engine(model_dir: str, ep) -> None:
    """The trainer's path for a recorded episode (pool wire form, rank batch with the checkpoint's processor, tree
    forward with the tower) scores the sampled tokens as the engine did."""
    from forge_megatron.middleware.wire import episode_to_blob
    from tests.multimodal.test_gateway_images import _trainer_logprobs

    (result,) = run_distributed(_trainer_logprobs, world_size=1, hf_dir=model_dir, episode_blob=episode_to_blob(ep),
                                segments=len(ep.segments), timeout_s=300)
    logp, mask, rollout = result
    sampled = mask > 0
    assert int(sampled.sum()) >= 2
    assert (logp[sampled] - rollout[sampled]).abs().max().item() <= 1e-4


def random_pictures(seed: int, sizes) -> list:
    from tests.multimodal.test_vision_tree import png

    rng = np.random.default_rng(seed)
    return [png(rng, h, w) for h, w in sizes]
