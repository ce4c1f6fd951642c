# MiniMax-M1 (HF MiniMaxAI/MiniMax-M1-40k / -80k, MiniMaxM1ForCausalLM; MiniMax-Text-01 alike: 456B total, 46B
# active): 80 layers, seven lightning-attention layers (linear attention with a fixed decay per head, 64 heads of 128,
# their recurrence carried along every path of the prefix tree) then one softmax-attention layer (64 query heads, 8 key
# heads, RoPE on 64 of 128 channels, base 1e7); every layer 32 experts of 9216, top 2 of a softmax, renormalised; each
# sublayer's residual is its norm's output times 3.56 (postnorm). The trainer takes the architecture from
# --hf-checkpoint's config.json (MODEL_ARGS empty: Megatron's flags cannot say which layers are lightning ones; flags
# given anyway are checked against it). TP divides the 8 key heads; CP divides the 64 / TP lightning heads; 80 layers
# split evenly for PP = 2, 4, 5, 8, 10 or 16. SGLang serves it as MiniMaxText01ForCausalLM (the launch scripts pass
# --json-model-override-args renaming the architecture; a config.json naming its own code, auto_map, also needs
# TRUST_REMOTE_CODE=1).
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): M1 thinks in
# <think>...</think> (the minimax reasoning parser reads from the rendered prompt whether the block is open) and writes
# tool calls as JSON objects, one per line, between <tool_calls> and </tool_calls> (the minimax-m1 parser; vLLM calls
# it minimax; check the served chat template).
TOOL_PARSER="${TOOL_PARSER:-minimax-m1}"; REASONING_PARSER="${REASONING_PARSER:-minimax}"
