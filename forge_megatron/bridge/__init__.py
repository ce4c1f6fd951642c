"""HF <-> Megatron-Core parameter mapping per model family (used by ``convert`` and ``weight_sync``)."""

from forge_megatron.bridge.families import (
    FAMILIES, Family, UnsupportedModelError, gpt_config_from_hf, load_hf_config,
)
from forge_megatron.bridge.mapping import Bridge, MappingError, ParallelLayout, Rule

__all__ = [
    "FAMILIES", "Family", "UnsupportedModelError", "gpt_config_from_hf", "load_hf_config",
    "Bridge", "MappingError", "ParallelLayout", "Rule",
]
