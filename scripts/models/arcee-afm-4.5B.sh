# Arcee AFM-4.5B (HF arcee-ai/AFM-4.5B: ArceeForCausalLM): Llama's layer with a plain squared-ReLU MLP (no gate) and
# YaRN RoPE; the trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given
# anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): no tool-call tokens of
# its own; set TOOL_PARSER to the format the agent's prompts teach it (hermes: <tool_call>{JSON}).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
