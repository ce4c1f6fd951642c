# Granite 3.3 8B (HF ibm-granite/granite-3.3-8b-instruct, GraniteForCausalLM; 2B the same layout, smaller): 40 layers of
# 32 query heads over 8 key/value heads (128 channels, RoPE base 1e7), the head tied, and muP-style scales (embedding x
# embedding_multiplier, attention x attention_multiplier, each branch x residual_multiplier, logits / logits_scaling)
# read from the config. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags
# given anyway are checked against it). 40 layers split evenly for PP = 2, 4, 5 or 8; TP divides the 8 key heads.
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Granite 3.x calls tools
# as <|tool_call|>[{JSON}, ...]; its optional thinking mode writes <think>...</think><response>...</response>, which no
# reasoning parser here splits (set REASONING_PARSER=qwen3 to take the <think> block out; <response> tags stay).
TOOL_PARSER="${TOOL_PARSER:-granite}"; REASONING_PARSER="${REASONING_PARSER:-none}"
