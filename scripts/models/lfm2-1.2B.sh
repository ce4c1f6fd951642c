# LFM2 1.2B (HF LiquidAI/LFM2-1.2B, Lfm2ForCausalLM; 350M / 700M / 2.6B the same layout): 16 layers, 10 of them gated
# short convolutions (3 taps, mcore/short_conv.py: along each token's ancestors in a prefix tree) and 6 attention
# layers (32 query heads over 8 key/value heads, per-head q/k norms), SwiGLU MLPs, the head tied. The trainer takes
# the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it).
# 16 layers split evenly for PP = 2, 4 or 8; TP divides the 8 key heads. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): LFM2's tool calls,
# pythonic lists (or JSON) between <|tool_call_start|> / <|tool_call_end|> tokens (the lfm2 parser); it does not think
# in a block.
TOOL_PARSER="${TOOL_PARSER:-lfm2}"; REASONING_PARSER="${REASONING_PARSER:-none}"
