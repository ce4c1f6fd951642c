"""Tiny model assets: offline loading, determinism, special tokens, chat template (CPU, no GPU needed)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_megatron.models import load_causal_lm
from forge_megatron.models.tiny import ARCHS, SPECIAL_TOKENS, VOCAB_LIMIT, build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(str(d))
    return str(d)


def test_tokenizer_loads_offline_with_single_token_specials(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) <= VOCAB_LIMIT
    for s in SPECIAL_TOKENS:
        assert tok.encode(s, add_special_tokens=False) == [tok.convert_tokens_to_ids(s)]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Hi there!\n\tprice: $3.50 {\"a\": [1, 2]} ~`|\\ ünï"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_is_deterministic(tmp_path):
    a = build_tiny_tokenizer(str(tmp_path / "a"))
    b = build_tiny_tokenizer(str(tmp_path / "b"))
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_tokenizer_vocab_size_is_validated():
    with pytest.raises(ValueError, match="vocab_size must be in"):
        build_tiny_tokenizer(vocab_size=1000)


def test_chat_template_roles_tools_and_generation_prompt(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert json.dumps(tools[0]) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                                    add_generation_prompt=False, tokenize=False)
    assert plain == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_and_is_deterministic(tmp_path, arch):
    d1 = build_tiny_model(str(tmp_path / "m1"), arch=arch, seed=3)
    d2 = build_tiny_model(str(tmp_path / "m2"), arch=arch, seed=3, with_tokenizer=False)
    m1, m2 = load_causal_lm(d1), load_causal_lm(d2)  # Qwen3-VL: the image-text-to-text model
    text = m1.config.get_text_config()  # a vision-language model's language model
    # Gemma 4 E: two local/global pairs; MiMo-V2-Flash: full / sliding / full (a dense layer, then two MoE ones);
    # MiniMax-M3: a dense layer, then two MoE block-sparse ones; LongCat-Flash: two layers of two sublayers each
    layers = {"gemma4_e": 4, "mimo_v2_flash": 3, "minimax_m3": 3, "minimax_m3_text": 3, "longcat_flash": 4,
              "nemotron_h": 4, "nemotron_h_moe": 4, "nemotron_h_latent": 4, "cohere2_moe": 3, "afmoe": 3, "cwm": 4,
              "lfm3": 3, "minimax01": 3, "laguna": 3, "flint": 3}
    assert text.hidden_size == 64 and text.num_hidden_layers == layers.get(arch, 2)
    mla = arch in ("deepseek_v3", "glm4_moe_lite", "kimi_k25", "deepseek_v32", "glm_moe_dsa", "mistral4",
                   "mistral4_vl", "kimi_linear", "longcat_flash", "youtu", "deepseek_v2", "axk1")  # multi-latent attention:
    # a key/value head per query
    if arch.startswith("gemma4"):  # key heads per layer: 4 on the local layer, 2 on the global one (whose values
        # are its keys; the E layout's global layers keep 4 and their own values)
        assert [text.per_layer_config[i].num_key_value_heads for i in range(2)] == [4, 4 if arch == "gemma4_e" else 2]
    else:
        assert text.num_key_value_heads == (4 if mla else 1 if arch == "gemma" else 2)  # (gemma-2b's one key head)
    # Gemma, Youtu-LLM, Granite, LFM2, Cohere and Phi-4-mini tie them, as released
    assert m1.config.tie_word_embeddings is arch.startswith(("gemma", "youtu", "granite", "lfm",
                                                             "cohere", "phi4_mini"))
    assert text.vocab_size == len(AutoTokenizer.from_pretrained(d1))
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert m1(input_ids=ids).logits.shape == (1, 4, text.vocab_size)
    if arch == "qwen3_moe":
        assert m1.config.num_experts == 4 and m1.config.num_experts_per_tok == 2


def test_tied_embeddings_and_bad_arch(tmp_path):
    m = AutoModelForCausalLM.from_pretrained(build_tiny_model(str(tmp_path / "t"), tie_word_embeddings=True))
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="arch must be one of"):
        build_tiny_model(str(tmp_path / "x"), arch="gpt9")
