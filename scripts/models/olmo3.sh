# OLMo 3 (HF allenai/Olmo-3-*: Olmo3ForCausalLM) and OLMo 2 (Olmo2ForCausalLM), any size. Their layers normalise the
# attention and MLP outputs instead of their inputs, q and k over all heads, and OLMo 3 adds sliding-window layers
# whose RoPE stays plain while the full-attention layers' is YaRN-scaled: no Megatron-LM flags express these, so the
# trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): set TOOL_PARSER to
# the format the served checkpoint's chat template writes tool calls in (hermes: <tool_call>{JSON}</tool_call>).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
