# Qwen2-57B-A14B (HF Qwen/Qwen2-57B-A14B(-Instruct), Qwen2MoeForCausalLM; Qwen1.5-MoE-A2.7B the same layout, smaller):
# 28 layers of 28 query heads over 4 key/value heads (128 channels, biases on q/k/v), every layer 64 experts (2560
# wide; top 8 of a softmax, not renormalised) beside one shared expert (20480 wide) behind a sigmoid gate. The trainer
# takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against
# it). 28 layers split evenly for PP = 2, 4 or 7; TP divides the 4 key heads; EP divides the experts. Source it and
# pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Qwen2's ChatML template
# has no tool-call format (Qwen2.5's hermes one came later) and the model does not think in a block.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-none}"
