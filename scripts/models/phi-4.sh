# Phi-4 (HF microsoft/phi-4; Phi-4-reasoning and Phi-4-reasoning-plus the same layout: Phi3ForCausalLM, 14B): 40 layers
# of 40 query heads over 10 key/value heads (128 channels, RoPE over the whole head, base 250000; -reasoning: 500000,
# 32k context), q/k/v fused in qkv_proj and gate/up in gate_up_proj on disk (the bridge regroups them). The trainer
# takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against
# it). 40 layers split evenly for PP = 2, 4, 5 or 8; TP divides the 10 key heads (2, 5 or 10). Phi-4-mini: its own
# script (phi-4-mini.sh). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Phi-4-reasoning
# writes its thinking as <think>...</think> before the answer (Phi-4 itself does not think; the parser then finds no
# block and leaves the text alone); neither has a tool-call format of its own.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-deepseek-v3}"
