# Hy3 preview (HF tencent/Hy3-preview, HYV3ForCausalLM): 80 layers of 64 query heads (8 key heads, 128 channels,
# per-head q/k RMSNorms before RoPE, base 11.2M), the first layer dense (13312 wide), then 192 experts (1536 wide) top-8
# under a sigmoid router choosing with a score-correction bias, renormalised and scaled by 2.826, beside one shared
# expert. The MTP layer is left out. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS
# empty; flags given anyway are checked against it). 80 layers split evenly for PP = 2, 4, 5, 8 or 10; TP divides the 8
# key heads. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
