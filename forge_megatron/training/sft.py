"""A short supervised warm-start on a Megatron model, from chat conversations, exported back to HF for the engines.

Used by the demo (and handy for small experiments): RL from a random policy never finds the reward, so a few hundred
steps of next-token training on assistant turns teach the output format first. Every conversation is rendered with
the model's chat template (``tools`` included); the loss covers the assistant tokens, each turn up to and including
its end-of-turn token:

    L = - sum_t m_t log pi(x_t | x_<t) / sum_t m_t         (m_t = 1 on assistant tokens)

Batches are packed as one prefix forest (conversations share the long system/tools prefix), run through the same
tree-packed Megatron forward as RL training, optimised with Adam. Single process (TP = PP = 1), CPU or GPU; the
Megatron trainer takes the same data with every parallel layout (``--sft-data``, training/offline.py).

    python -m forge_megatron.training.sft --hf-checkpoint IN_DIR --data chats.jsonl --out OUT_DIR --steps 300

``chats.jsonl``: one ``{"messages": [...], "tools": [...]}`` per line (OpenAI chat format), or one token sample
``{"input_ids": [...], "loss_mask": [...]}`` per line, trained exactly as given (no chat template: e.g. the successful
episodes of an RL run, ``forge-pool-export --sft``, for rejection-sampling fine-tuning without re-tokenisation).
Vision-language checkpoints (those of ``multimodal.families.SUPPORTED``: Qwen3-VL, Qwen3.5, Qwen2.5-VL, GLM-4.xV, ...
with an image processor) also take image parts in user messages (``image_url`` with a data URL, or a file: a path
relative to the JSONL file, an absolute path or a ``file://`` URL): each image is normalised and expanded to its
tokens as the gateway does it (multimodal/images.py) and the model sees its features through the checkpoint's frozen
vision tower (mcore/vision.py; ``--train-vision-tower``: trained with the language model); the export keeps the
tower.

Legend: M = next-token targets of the samples of a batch.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time

import torch


def _inline_images(messages: list[dict], processor, placeholder: str) -> tuple[list[dict], list[bytes]]:
    """Messages with each image part made the model's image text, and the images (normalised), in order."""
    from forge_megatron.multimodal.images import IMAGE_MARK, content_parts

    out, images = [], []
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            text, raw = content_parts(m["content"], f"messages[{i}]", images_allowed=m.get("role") == "user")
            images += [processor.normalize(x) for x in raw]
            m = {**m, "content": text.replace(IMAGE_MARK, placeholder)}
        out.append(m)
    return out, images


def render(tokenizer, messages: list[dict], tools: list | None, processor=None) -> tuple[list[int], list[int], list]:
    """Token ids of a conversation, its loss mask (1 on assistant turns incl. their end-of-turn token) and its images
    (normalised PNGs; ``processor``: the checkpoint's multimodal ImageProcessor, needed for image parts)."""
    images = []
    if any(isinstance(m.get("content"), list) for m in messages):  # content parts: text, images in user messages
        has_images = any(p.get("type") == "image_url" for m in messages if isinstance(m.get("content"), list)
                         for p in m["content"])
        placeholder = processor.placeholder(tokenizer) if processor is not None and has_images else ""
        if has_images and placeholder is None:
            raise ValueError("a conversation has image parts, but the checkpoint takes no images")
        messages, images = _inline_images(messages, processor, placeholder)
    ids, mask = _render_text(tokenizer, messages, tools)
    if images:
        # (each placeholder becomes the image's tokens: Mistral 3's rows with their break tokens too; none trained)
        pad, lengths = processor.spec.image_token_id, iter([len(processor.image_ids(x)) for x in images])
        expanded = processor.expand(ids, images)
        mask = [x for t, m in zip(ids, mask) for x in ([0] * next(lengths) if t == pad else [m])]
        assert len(mask) == len(expanded)
        ids = expanded
    return ids, mask, images


def _render_text(tokenizer, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    end_id = tokenizer.eos_token_id
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
        if ids[:len(prefix)] != prefix:
            raise ValueError(f"chat template is not prefix-stable at message {i}: cannot place the loss mask")
        t = len(prefix)
        while t < len(ids) and ids[t] != end_id:
            mask[t] = 1
            t += 1
        if t == len(ids):
            raise ValueError(f"assistant message {i} has no end-of-turn token {tokenizer.eos_token!r}")
        mask[t] = 1
    return ids, mask


def load_chats(path: str) -> list[dict]:
    """The conversations (or token samples, :func:`check_token_sample`) of a JSONL file; image parts given as files (a
    path relative to the file's directory, an absolute one or a ``file://`` URL) read into data URLs."""
    from forge_megatron.utils.jsonl import read_records

    chats = []
    for where, record in read_records(path):
        if isinstance(record, dict) and "input_ids" in record:
            check_token_sample(record, where)
            chats.append(record)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise ValueError(f"{where}: each line needs a 'messages' list (or 'input_ids' and 'loss_mask')")
        _read_image_files(record["messages"], os.path.dirname(os.path.abspath(path)), where)
        chats.append(record)
    if not chats:
        raise ValueError(f"{path}: no conversations")
    return chats


def check_token_sample(record: dict, where: str) -> None:
    """ValueError naming ``where`` unless ``record`` is a token sample: ``input_ids`` (ints) and a ``loss_mask`` of
    0 / 1 as long, at least one token trained (the first cannot be: nothing predicts it)."""
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in ids)):
        raise ValueError(f"{where}: input_ids must be a non-empty list of token ids")
    if not (isinstance(mask, list) and len(mask) == len(ids) and all(m in (0, 1) for m in mask)):
        raise ValueError(f"{where}: loss_mask must be a list of 0 / 1 as long as input_ids ({len(ids)})")
    if not any(mask[1:]):
        raise ValueError(f"{where}: loss_mask trains no token after the first")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")


def _read_image_files(messages: list, base_dir: str, where: str) -> None:
    """Make each image part that names a file a data URL of the file's bytes (in place); nothing is downloaded."""
    import mimetypes
    import urllib.parse
    import urllib.request

    from forge_megatron.multimodal.images import MAX_IMAGE_BYTES, data_url

    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            url = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or url.startswith("data:"):
                continue
            at = f"{where}: messages[{i}].content[{j}]"
            if url.startswith(("http://", "https://")):
                raise ValueError(f"{at}: image URLs are not downloaded; give the image as a file (a path relative to "
                                 "the data file) or a data URL")
            path = urllib.request.url2pathname(urllib.parse.urlsplit(url).path) if url.startswith("file:") else url
            path = os.path.join(base_dir, path)  # (an absolute path stays as it is)
            if not os.path.isfile(path):
                if url.startswith("file:") or url.lower().endswith(IMAGE_SUFFIXES):
                    raise ValueError(f"{at}: no image file {path!r}")
                continue  # plain base64: the content parts' own check
            if os.path.getsize(path) > MAX_IMAGE_BYTES:
                raise ValueError(f"{at}: {path!r} is over {MAX_IMAGE_BYTES >> 20} MiB")
            with open(path, "rb") as f:
                part["image_url"] = {"url": data_url(f.read(), mimetypes.guess_type(path)[0] or "image/png")}


def batch_layout(batch: list[tuple[list[int], list[int], list]], processor=None):
    """The prefix forest of (ids, loss mask, images) samples: a vision tree when any has images."""
    from forge_megatron.tree import build_tree

    if any(images for _, _, images in batch):
        from forge_megatron.multimodal import build_vision_tree

        return build_vision_tree([ids for ids, _, _ in batch],
                                 [[processor.image_input(x) for x in images] for _, _, images in batch],
                                 processor.spec, samples_sampled=[mask for _, mask, _ in batch])
    return build_tree([ids for ids, _, _ in batch])


def sft_loss(model, batch: list[tuple[list[int], list[int], list]], processor=None) -> torch.Tensor:
    from forge_megatron.mcore.forward import tree_logprobs

    logp_M, _ = tree_logprobs(model, batch_layout(batch, processor))
    mask_M = torch.cat([torch.tensor(mask[1:], dtype=torch.float32) for _, mask, _ in batch])
    return -(logp_M * mask_M).sum() / mask_M.sum().clamp(min=1.0)


def export_hf(model, bridge, src_dir: str, out_dir: str) -> None:
    """Write the (TP = PP = 1) model as a HF checkpoint, with the tokenizer files of ``src_dir``."""
    from forge_megatron.convert.checkpoint import save_hf

    from forge_megatron.convert.checkpoint import vision_tower

    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    pairs = [(hf_name, t.detach().float().cpu()) for hf_name, t in bridge.export(state.items())]
    pairs += list(vision_tower(bridge, src_dir))  # a vision-language checkpoint's frozen tower, as it was
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    save_hf(pairs, out_dir, bridge.hf_config, total=len(pairs))
    copy_side_files(src_dir, out_dir)


def copy_side_files(src_dir: str, out_dir: str) -> None:
    """Copy a checkpoint's other files (tokenizer, chat template, generation and processor configs) next to an
    export: everything but its weights and config.json."""
    for fname in os.listdir(src_dir):
        path = os.path.join(src_dir, fname)
        if os.path.isfile(path) and not fname.endswith(".safetensors") and fname not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(path, os.path.join(out_dir, fname))


def run_sft(hf_dir: str, chats: list[dict], out_dir: str, steps: int, lr: float, batch_size: int, seed: int = 0,
            log_every: int = 25, train_vision_tower: bool = False) -> list[float]:
    """Train, export to ``out_dir``; returns the loss per step. Initialises a 1-rank process group if needed.
    ``train_vision_tower``: a vision-language checkpoint's tower trains with the language model (and is exported as
    trained); by default it stays the checkpoint's, frozen."""
    from transformers import AutoTokenizer

    from forge_megatron.mcore import parallel

    parallel.initialize(seed=seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        processor = _image_processor(hf_dir)
        data = [(c["input_ids"], c["loss_mask"], []) if "input_ids" in c else
                render(tokenizer, c["messages"], c.get("tools"), processor) for c in chats]
        check_vocabulary(tokenizer, [ids for ids, _, _ in data])
        model, bridge = build_model(hf_dir, processor, any(images for _, _, images in data), train_vision_tower)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
        rng = random.Random(seed)
        losses, t0 = [], time.time()
        for step in range(steps):
            loss = sft_loss(model, rng.sample(data, min(batch_size, len(data))), processor)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if (step + 1) % log_every == 0 or step == 0:
                print(f"[sft] step {step + 1}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
        export_hf(model, bridge, hf_dir, out_dir)
        return losses
    finally:
        parallel.destroy()


def vocabulary_size(tokenizer) -> int:
    return max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))


def check_vocabulary(tokenizer, samples: list[list[int]], what: str = "sample") -> None:
    """ValueError naming the first sample with a token id outside ``tokenizer``'s vocabulary."""
    vocab = vocabulary_size(tokenizer)
    for i, ids in enumerate(samples):
        if max(ids) >= vocab:
            raise ValueError(f"{what} {i}: token id {max(ids)} is outside the tokenizer's vocabulary ({vocab})")


def build_model(hf_dir: str, processor, images: bool, train_vision_tower: bool = False, hf_config=None,
                **gpt_overrides):
    """(tree GPTModel loaded from ``hf_dir``, its Bridge) for a job of one rank; ``images``: the data has some (the
    checkpoint's frozen tower runs them, or the model's own with ``train_vision_tower``). ``hf_config`` (default
    ``hf_dir``'s) and ``gpt_overrides`` build the Bridge."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_config if hf_config is not None else hf_dir, vision_tower=train_vision_tower, **gpt_overrides)
    model = build_tree_gpt(bridge.cfg)
    if train_vision_tower:
        from forge_megatron.mcore import vision

        if processor is None:
            raise ValueError(f"--train-vision-tower: {hf_dir!r} has no image processor (preprocessor_config.json)")
        vision.attach_tower(model, bridge.hf_config)
        vision.install(model, processor.spec, key="policy", trained=True)
    load_hf_weights(model, bridge, hf_dir)
    if images and not train_vision_tower:
        from forge_megatron.mcore import vision
        from forge_megatron.multimodal import load_vision_tower

        tower = load_vision_tower(hf_dir, processor.spec)
        vision.install(model, processor.spec, lambda: tower)
    return model, bridge


def _image_processor(hf_dir: str):
    """The checkpoint's multimodal ImageProcessor, or None for a model that takes no images."""
    from forge_megatron.multimodal.images import ImageProcessor

    try:
        return ImageProcessor(hf_dir)
    except (ValueError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="forge-sft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--data", required=True,
                   help="JSONL of {messages, tools} or of token samples {input_ids, loss_mask}")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-vision-tower", action="store_true",
                   help="vision-language checkpoints: train the vision tower too (exported as trained); by default "
                        "it stays the checkpoint's")
    args = p.parse_args(argv)
    run_sft(args.hf_checkpoint, load_chats(args.data), args.out, args.steps, args.lr, args.batch_size, args.seed,
            train_vision_tower=args.train_vision_tower)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
