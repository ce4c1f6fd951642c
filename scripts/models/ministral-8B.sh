# Ministral 8B (HF mistralai/Ministral-8B-Instruct-2410: MinistralForCausalLM): Mistral's layer with sliding-window
# layers beside full-attention ones (layer_types); the trainer takes the whole architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Mistral's
# [TOOL_CALLS] format; no reasoning channel.
TOOL_PARSER="${TOOL_PARSER:-mistral}"; REASONING_PARSER="${REASONING_PARSER:-}"
