"""PEFT adapters for tests of LoRA serving, made by PEFT itself (the format SGLang and forge-engine load)."""

from __future__ import annotations

import torch


def write_peft_adapter(model_dir: str, out_dir: str, targets=("q_proj", "v_proj", "o_proj", "down_proj"),
                       rank: int = 4, alpha: float = 8.0, b_std: float = 0.3, seed: int = 0, **config) -> str:
    """A PEFT LoRA adapter of ``model_dir`` in ``out_dir``: A as PEFT draws it, B ~ N(0, b_std) (0: PEFT's zeros,
    the adapter then adds nothing). Returns ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), **config))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and b_std:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    model.save_pretrained(out_dir)
    return out_dir
