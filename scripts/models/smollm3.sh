# SmolLM3 (HF HuggingFaceTB/SmolLM3-3B: SmolLM3ForCausalLM): the Llama layout without RoPE in every fourth layer (NoPE
# layers), which no Megatron-LM flag expresses: the trainer takes the architecture from --hf-checkpoint's config.json
# (MODEL_ARGS empty; flags given anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): SmolLM3 thinks in
# <think>...</think> and calls tools as <tool_call>{JSON}</tool_call>.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
