# Gemma 3 (HF google/gemma-3-1b-it, gemma-3-270m: Gemma3ForCausalLM; gemma-3-4b/12b/27b-it:
# Gemma3ForConditionalGeneration, whose language model trains and syncs while its vision tower is kept as it is).
# Norms before and after attention and MLP, GeGLU, the embedding scaled by sqrt(hidden), local sliding-window layers
# with their own RoPE base: no Megatron-LM flags express these, so the trainer takes the whole architecture from
# --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it). Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Gemma 3 has no tool
# call tokens of its own; set TOOL_PARSER to the format the agent's prompts teach it (hermes: <tool_call>{JSON}).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
