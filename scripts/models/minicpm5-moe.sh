# MiniCPM5-MoE (HF openbmb/MiniCPM5-15B-A2.5B, MiniCPM5MoeForCausalLM): 28 layers of Llama's attention (32 query heads
# of 128, 2 key heads, RoPE over the whole head) with a sigmoid gate on every query channel (q_proj holds each head's
# queries then its gate), the first layer dense (8192 wide), then 160 experts (512 wide) top-16 under DeepSeek-V3's
# sigmoid router (fp32, a score-correction bias, renormalised, scaled by 3.66) beside one shared expert. The trainer
# takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against
# it). 28 layers split evenly for PP = 2, 4 or 7; TP divides the 2 key heads. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
