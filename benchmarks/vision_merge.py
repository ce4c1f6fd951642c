"""Prefix-tree merging with images: a vision-language RL batch trained as one tree against each sample alone.

A GRPO group shares its prompt's picture; an agent's episode re-sends its history's screenshots with every call. The
trainer merges the samples where their tokens *and* images agree (multimodal/tree.py) and its vision tower encodes
each distinct image of a micro-batch once (mcore/vision.py), so both the language model's and the tower's work drop.
This script measures it on CPU in one process, side by side on the same model (a Qwen3-VL-shaped tree GPT with its
vision tower, random weights, fp32):

- ``per_sample_s``: every sample alone (its own tree: one chain), its images encoded for it: what a trainer that
  neither merges nor deduplicates images does;
- ``merged_s``: the whole batch as one prefix tree, each distinct image encoded once;

both forward + backward of the sum of the samples' logprobs, best of ``--repeats`` after one warm-up, the tower
trained with the language model (``--frozen-tower``: encoded without gradients, as by default in the trainer). The
logprobs of both are compared (``max_abs_logprob_diff``). One JSON line: samples, total and unique tokens, the token
bound (total / unique), image occurrences and distinct images, patches encoded each way, the times and the speedup.

Workloads: ``grpo`` (one prompt with a picture, ``--group`` completions) and ``agentic`` (``--episodes`` episodes of
``--calls`` calls; call k sends the system prompt, the first k turns and their k screenshots).

    OMP_NUM_THREADS=1 python benchmarks/vision_merge.py --workload agentic
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import numpy as np
import torch


IMAGE_TOKEN = 1000  # the image token id of the benchmark's config (its vocabulary: 1024)


def hf_config(args) -> dict:
    from forge_megatron.models.tiny import tiny_config

    cfg = tiny_config("qwen3_vl", vocab_size=1024).to_dict()
    cfg["architectures"] = ["Qwen3VLForConditionalGeneration"]
    cfg["image_token_id"] = IMAGE_TOKEN
    cfg["text_config"].update(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=4 * args.hidden,
                              vocab_size=1024)
    half = args.hidden // 8  # rotary frequencies of a head of hidden / 4: time, height and width sections
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [half - 2 * (half // 4), half // 4, half // 4]
    cfg["vision_config"].update(hidden_size=args.vision_hidden, depth=args.vision_depth, num_heads=2,
                                intermediate_size=4 * args.vision_hidden, out_hidden_size=args.hidden,
                                num_position_embeddings=64, deepstack_visual_indexes=[0])
    return cfg


def _text(rng, n):
    return [rng.randrange(1, 900) for _ in range(n)]


def _image(args, rng, tokens_per_image):
    from forge_megatron.multimodal.tree import ImageInput

    patches = args.side * args.side
    pixels = np.asarray(np.random.default_rng(rng.randrange(1 << 30)).standard_normal((patches, 3 * 2 * 4 * 4)),
                        dtype=np.float32)
    return ImageInput(pixels, (1, args.side, args.side)), [IMAGE_TOKEN] * tokens_per_image


def workload(args, tokens_per_image):
    """(samples' tokens, samples' images)."""
    rng = random.Random(args.seed)
    samples, images = [], []
    if args.workload == "grpo":
        picture, run = _image(args, rng, tokens_per_image)
        prompt = _text(rng, args.prompt_len) + run + _text(rng, 8)
        for _ in range(args.group):
            samples.append(prompt + _text(rng, args.response_len))
            images.append([picture])
        return samples, images
    for _ in range(args.episodes):
        history, shots = _text(rng, args.system_len), []
        for _ in range(args.calls):
            shot, run = _image(args, rng, tokens_per_image)
            history = history + _text(rng, args.turn_len // 2) + run + _text(rng, args.turn_len - args.turn_len // 2)
            shots = shots + [shot]
            samples.append(list(history))
            images.append(list(shots))
    return samples, images


def run(args) -> dict:
    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import vision
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.multimodal import build_vision_tree, vision_spec
    from forge_megatron.multimodal.families import build_vision_tower

    hf = hf_config(args)
    trained = not args.frozen_tower
    bridge = Bridge(hf, vision_tower=trained)
    spec = vision_spec(hf)
    torch.manual_seed(0)
    model = build_tree_gpt(bridge.cfg)
    if trained:
        vision.attach_tower(model, hf)
        tower = model.vision_tower
        vision.install(model, spec, key="policy", trained=True)
    else:
        tower = build_vision_tower(hf).eval()
        vision.install(model, spec, tower=lambda: tower)
    encoded = []
    tower.register_forward_hook(lambda m, a, k, out: encoded.append(int(k["grid_thw"].prod(-1).sum())),
                                with_kwargs=True)
    samples, images = workload(args, spec.tokens_per_image((1, args.side, args.side)))

    def step(batch):
        logps = []
        for tokens, ims in batch:
            logp, _ = tree_logprobs(model, build_vision_tree(tokens, ims, spec))
            logp.sum().backward()
            logps.append(logp.detach())
        return torch.cat(logps)

    def best(batch):
        times, out = [], None
        for i in range(args.repeats + 1):
            model.zero_grad(set_to_none=True)
            encoded.clear()
            t0 = time.perf_counter()
            out = step(batch)
            if i:
                times.append(time.perf_counter() - t0)
        return min(times), out, sum(encoded)

    per_sample_s, logp_alone, patches_alone = best([([s], [ims]) for s, ims in zip(samples, images)])
    merged_s, logp_merged, patches_merged = best([(samples, images)])
    layout = build_vision_tree(samples, images, spec)
    return {
        "workload": args.workload, "samples": len(samples), "tower": "trained" if trained else "frozen",
        "total_tokens": layout.total_tokens, "unique_tokens": layout.unique_tokens,
        "bound": round(layout.total_tokens / layout.unique_tokens, 3),
        "image_occurrences": sum(len(ims) for ims in images), "distinct_images": layout.vision.num_images,
        "patches_encoded_per_sample": patches_alone, "patches_encoded_merged": patches_merged,
        "per_sample_s": round(per_sample_s, 4), "merged_s": round(merged_s, 4),
        "speedup": round(per_sample_s / merged_s, 3),
        "scored_tokens": logp_merged.numel(), "max_abs_logprob_diff": (logp_merged - logp_alone).abs().max().item(),
        "model": f"LM {args.layers}x{args.hidden}, tower {args.vision_depth}x{args.vision_hidden}, "
                 f"images {args.side}x{args.side} patches", "threads": torch.get_num_threads(),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default="agentic", choices=["grpo", "agentic"])
    p.add_argument("--frozen-tower", action="store_true", help="the tower encodes without gradients (not trained)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("model (Qwen3-VL-shaped, random weights)")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--vision-depth", type=int, default=4)
    g.add_argument("--vision-hidden", type=int, default=128)
    g.add_argument("--side", type=int, default=16, help="image side in patches (merge 2: side^2 / 4 tokens)")
    g = p.add_argument_group("grpo workload")
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--group", type=int, default=8)
    g.add_argument("--response-len", type=int, default=64)
    g = p.add_argument_group("agentic workload")
    g.add_argument("--episodes", type=int, default=2)
    g.add_argument("--calls", type=int, default=6)
    g.add_argument("--system-len", type=int, default=64)
    g.add_argument("--turn-len", type=int, default=32)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from forge_megatron.mcore import parallel

    parallel.initialize(parallel.ParallelConfig())
    try:
        out = run(args)
    finally:
        parallel.destroy()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
