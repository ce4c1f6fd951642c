# EXAONE 4.0 32B (HF LGAI-EXAONE/EXAONE-4.0-32B, Exaone4ForCausalLM; EXAONE-4.0-1.2B the same without a window): 64
# layers of 40 query heads over 8 key/value heads (128 channels), norms after attention and MLP, per-head q/k norms;
# three of every four layers see a 4096-token window and rotate (RoPE base 1e6, llama3 scaling x16), the fourth sees
# everything without RoPE. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty;
# flags given anyway are checked against it). 64 layers split evenly for PP = 2, 4 or 8; TP divides the 8 key heads.
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): EXAONE 4.0 reasons in
# <think>...</think> and calls tools as <tool_call>{JSON}</tool_call>; not checked against the release's chat template
# (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
