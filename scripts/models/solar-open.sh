# Solar Open (HF upstage/Solar-Open-100B, SolarOpenForCausalLM; 102B total, 12B active): 48 layers of 64 query heads
# over 8 key/value heads (128 channels, RoPE over the whole head, base 1e6), every layer 128 experts (1280 wide) top-8
# under GLM-4.5's sigmoid router with a score-correction bias (renormalised; groups of one) beside one shared expert.
# The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). 48 layers split evenly for PP = 2, 3, 4, 6 or 8. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
