# GLM-4 9B (HF THUDM/glm-4-9b-chat-hf, GlmForCausalLM; the transformers-format release): 40 layers of 32 query heads
# (2 key heads, 128 channels, biases on q/k/v, RoPE on interleaved pairs of half of each head), an MLP with gate and up
# fused (13696 wide), pre-norm. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty;
# flags given anyway are checked against it). 40 layers split evenly for PP = 2, 4, 5 or 8; TP divides the 2 key heads.
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): GLM-4's tool calls
# (the function name on its own line, then its JSON arguments) are not parsed here: none (the agent parses them).
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-}"
