# Youtu-LLM 2B (HF tencent/Youtu-LLM-2B, YoutuForCausalLM): 32 layers of DeepSeek-V3's multi-latent attention (16 heads;
# query latent 1536, key/value latent 512, 128 + 64 rotated channels per query/key head, values of 128) with dense
# SwiGLU MLPs (6144 wide), the head tied to the embedding. The trainer takes the architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). 32 layers split evenly for PP = 2, 4 or 8;
# TP divides the 16 heads. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
