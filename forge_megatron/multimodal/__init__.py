"""Vision-language RL: samples with images trained on prefix trees (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5,
GLM-4.xV).

``qwen_vl``: image tokens, 3-D mRoPE positions, the checkpoint's vision tower; ``tree``: image-aware prefix merging
(:func:`build_vision_tree`); forge_megatron.mcore.vision puts the images into a Megatron model's forward.
"""

from forge_megatron.multimodal.qwen_vl import VisionSpec, load_vision_tower, positions_3d, vision_spec
from forge_megatron.multimodal.tree import ImageInput, VisionTree, build_vision_tree

__all__ = ["ImageInput", "VisionSpec", "VisionTree", "build_vision_tree", "load_vision_tower", "positions_3d",
           "vision_spec"]
