# Gemma 7B (HF google/gemma-7b / gemma-7b-it, CodeGemma 7B; GemmaForCausalLM): 28 layers, 16 heads of 256 (16 key
# heads; gemma-2b: 18 layers, 8 heads, one key head), GeGLU MLPs 24576 wide, Gemma's (1 + w) RMSNorms, the embedding
# scaled by sqrt(3072), the head tied, RoPE base 10k, 8k context. The trainer takes the architecture from
# --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it). TP divides the key heads
# (gemma-2b: TP 1); 28 layers split evenly for PP = 2, 4, 7 or 14. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Gemma 1 has no tool-call
# or thinking format.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-none}"
