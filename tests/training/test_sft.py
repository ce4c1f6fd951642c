"""Supervised warm-start: the loss mask covers exactly the assistant turns, and a short run on a Megatron model
lowers the loss and exports a HF checkpoint that transformers loads. CPU, 0 GPUs."""


import torch

from forge_megatron.agents import calculator
from forge_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer
from forge_megatron.training.sft import render, run_sft

from .pool_feed import free_port


def test_mask_covers_assistant_turns_only():
    tok = build_tiny_tokenizer()
    for chat in ([{"role": "user", "content": "12+7"}, {"role": "assistant", "content": "19"}],
                 [{"role": "user", "content": "12+7"}, calculator.tool_call_message()]):
        ids, mask = render(tok, chat, calculator.TOOLS)
        assert len(ids) == len(mask) and ids == tok.apply_chat_template(chat, tools=calculator.TOOLS, tokenize=True,
                                                                          return_dict=False)
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        want = "19" if chat[1]["content"] else '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>'
        assert trained == want + "<|im_end|>"


def test_short_sft_lowers_loss_and_exports_hf(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    base = build_tiny_model(str(tmp_path / "base"))
    tasks = calculator.make_tasks(64, seed=0)
    chats = [{"messages": c, "tools": calculator.TOOLS} for c in calculator.sft_conversations(tasks, 0.5)]
    losses = run_sft(base, chats, str(tmp_path / "out"), steps=30, lr=3e-3, batch_size=8, log_every=100)
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])  # the warm-up schedule ramps the LR over 20 steps
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    ref = AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)  # trained weights exported
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).chat_template is not None
