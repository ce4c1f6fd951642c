"""Supervised warm-start: the loss mask covers exactly the assistant turns, and a short run on a Megatron model
lowers the loss and exports a HF checkpoint that transformers loads. CPU, 0 GPUs."""

import os

import torch

from forge_megatron.agents import calculator
from forge_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer
from forge_megatron.training.sft import render, run_sft


def test_mask_covers_assistant_turns_only():
    tok = build_tiny_tokenizer()
    for chat in ([{"role": "user", "content": "12+7"}, {"role": "assistant", "content": "19"}],
                 [{"role": "user", "content": "12+7"}, calculator.tool_call_message()]):
        ids, mask, images = render(tok, chat, calculator.TOOLS)
        assert images == []
        parts = [{**chat[0], "content": [{"type": "text", "text": "12"}, {"type": "text", "text": "+7"}]}, chat[1]]
        assert render(tok, parts, calculator.TOOLS)[:2] == (ids, mask)  # text parts: their text
        assert len(ids) == len(mask) and ids == tok.apply_chat_template(chat, tools=calculator.TOOLS, tokenize=True,
                                                                          return_dict=False)
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        want = "19" if chat[1]["content"] else '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>'
        assert trained == want + "<|im_end|>"


def test_short_sft_lowers_loss_and_exports_hf(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(str(tmp_path / "base"))
    tasks = calculator.make_tasks(64, seed=0)
    chats = [{"messages": c, "tools": calculator.TOOLS} for c in calculator.sft_conversations(tasks, 0.5)]
    dist_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    environ = {k: os.environ.get(k) for k in dist_env}
    losses = run_sft(base, chats, str(tmp_path / "out"), steps=30, lr=3e-3, batch_size=8, log_every=100)
    assert {k: os.environ.get(k) for k in dist_env} == environ  # a job of one: no port, no variables left behind
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])  # the warm-up schedule ramps the LR over 20 steps
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    ref = AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)  # trained weights exported
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).chat_template is not None


def test_sft_on_pictures_trains_with_the_vision_tower_and_keeps_it(tmp_path):
    """Chats with image parts (the vision demo's): images expanded to their tokens (mask 0 on them), the loss falls,
    and the export is a whole vision-language checkpoint (the tower as it was, the language model trained)."""
    import transformers
    from safetensors.torch import load_file

    from forge_megatron.agents import colors
    from forge_megatron.multimodal.images import ImageProcessor
    from forge_megatron.multimodal.families import image_runs

    base = build_tiny_model(str(tmp_path / "base"), "qwen3_vl", images=True)
    proc = ImageProcessor(base)
    tasks = colors.make_tasks(48, seed=1)
    chats = [{"messages": c} for c in colors.sft_conversations(tasks, 1.0)]
    tok = transformers.AutoTokenizer.from_pretrained(base)
    ids, mask, images = render(tok, chats[0]["messages"], None, proc)
    (run,) = image_runs(ids, proc.spec.image_token_id)
    assert run[1] - run[0] == proc.num_tokens(images[0]) and not any(mask[run[0]:run[1]])
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == tasks[0].answer + "<|im_end|>"
    losses = run_sft(base, chats, str(tmp_path / "out"), steps=30, lr=3e-3, batch_size=8, log_every=100)
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    import glob

    out = {k: v for f in glob.glob(str(tmp_path / "out" / "*.safetensors")) for k, v in load_file(f).items()}
    src = load_file(f"{base}/model.safetensors")
    visual = [n for n in src if n.startswith("model.visual.")]
    assert visual and all(torch.equal(out[n], src[n]) for n in visual)
    assert not torch.equal(out["model.language_model.embed_tokens.weight"],
                           src["model.language_model.embed_tokens.weight"])
    transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(tmp_path / "out"))  # loads whole


def test_sft_trains_the_vision_tower_when_asked(tmp_path):
    """``train_vision_tower=True``: the tower is trained with the language model and exported as trained (every tower
    tensor with a gradient moved), the export a whole checkpoint transformers loads."""
    import glob

    import transformers
    from safetensors.torch import load_file

    from forge_megatron.agents import colors

    base = build_tiny_model(str(tmp_path / "base"), "qwen3_vl", images=True)
    chats = [{"messages": c} for c in colors.sft_conversations(colors.make_tasks(16, seed=1), 1.0)]
    losses = run_sft(base, chats, str(tmp_path / "out"), steps=4, lr=3e-3, batch_size=4, log_every=100,
                     train_vision_tower=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    out = {k: v for f in glob.glob(str(tmp_path / "out" / "*.safetensors")) for k, v in load_file(f).items()}
    src = load_file(f"{base}/model.safetensors")
    visual = [n for n in src if n.startswith("model.visual.")]
    moved = [n for n in visual if not torch.equal(out[n], src[n])]
    assert visual and len(moved) >= len(visual) - 2, sorted(set(visual) - set(moved))
    assert set(out) == set(src)
    transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(tmp_path / "out"))


def test_image_parts_may_name_files(tmp_path):
    """SFT data with images as files (relative to the JSONL file, absolute, or file:// URLs) loads as the same data
    URLs as the inline images; a web URL or a missing file is refused naming the line and part; base64 stays."""
    import base64
    import json

    import numpy as np
    import pytest

    from forge_megatron.training.sft import load_chats
    from tests.multimodal.test_vision_tree import png

    picture = png(np.random.default_rng(1), 12, 20)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(picture)
    inline = "data:image/png;base64," + base64.b64encode(picture).decode()

    def chat(url):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                          {"type": "image_url", "image_url": {"url": url}}]},
                             {"role": "assistant", "content": "red"}]}

    data = tmp_path / "chats.jsonl"
    urls = ["img/a.png", str(tmp_path / "img" / "a.png"), (tmp_path / "img" / "a.png").as_uri(), inline,
            base64.b64encode(picture).decode()]
    data.write_text("\n".join(json.dumps(chat(u)) for u in urls))
    got = [c["messages"][0]["content"][1]["image_url"]["url"] for c in load_chats(str(data))]
    assert got[:4] == [inline] * 4 and got[4] == urls[4]
    for url, words in (("https://example.com/a.png", "not downloaded"), ("img/none.png", "no image file"),
                       ("file:///no/such.png", "no image file")):
        data.write_text(json.dumps(chat(url)))
        with pytest.raises(ValueError, match=f"chats.jsonl:1: messages\\[0\\].content\\[1\\]: .*{words}"):
            load_chats(str(data))
