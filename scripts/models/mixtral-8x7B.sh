# Mixtral 8x7B (HF mistralai/Mixtral-8x7B-v0.1 or -Instruct-v0.1, MixtralForCausalLM; 47B total, 13B active; 8x22B
# the same layout, larger): 32 layers of 32 query heads over 8 key/value heads (128 channels, RoPE base 1e6); every
# layer 8 experts (14336 wide) under block_sparse_moe, the top 2 of a softmax router renormalised; no shared expert,
# no sliding window. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags
# given anyway are checked against it). 32 layers split evenly for PP = 2, 4 or 8; EP divides the 8 experts. Source
# it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): 8x22B-Instruct writes
# [TOOL_CALLS] calls (v3 tokenizer); 8x7B-Instruct has no tool format of its own. Neither reasons in a block.
TOOL_PARSER="${TOOL_PARSER:-mistral}"; REASONING_PARSER="${REASONING_PARSER:-none}"
