"""Vision-language RL: samples with images trained on prefix trees (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5,
Qwen2.5-VL, Qwen2-VL, GLM-4.xV, Gemma 3, Gemma 4, Mistral 3, Kimi-K2.5).

``families``: each family's image tokens and positions (Qwen's 3-D mRoPE) and the checkpoint's vision tower;
``images``: the gateway's normalised images and their patches; ``tree``: image-aware prefix merging
(:func:`build_vision_tree`); forge_megatron.mcore.vision puts the images into a Megatron model's forward.
"""

import importlib

_EXPORTS = {"VisionSpec": "families", "load_vision_tower": "families", "positions_3d": "families",
            "vision_spec": "families", "ImageInput": "tree", "VisionTree": "tree", "build_vision_tree": "tree"}


def __getattr__(name: str):
    """The exports, imported on first use: ``multimodal.images`` (the gateway's) stays free of torch."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = ["ImageInput", "VisionSpec", "VisionTree", "build_vision_tree", "load_vision_tower", "positions_3d",
           "vision_spec"]
