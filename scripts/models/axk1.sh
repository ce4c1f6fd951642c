# A.X K1 (HF skt/A.X-K1, AXK1ForCausalLM; 519B total, 33B active): DeepSeek-V3's layers (61; multi-latent attention
# with 64 heads, query latent 1536, key/value latent 512, 128 + 64 rotated query/key channels, 128 value channels),
# the first layer dense (18432 wide), then 192 experts (2048 wide) top-8 in 8 groups (4 chosen) under a sigmoid router
# (renormalised, scaled by 2.5; released without a score-correction bias: zeros) beside one shared expert, and an
# RMSNorm on each MoE layer's output (post_mlp_layernorm). The trainer takes the architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). 61 layers split over pipeline stages only
# unevenly: e.g. PP=4 with PP_FIRST_LAYERS=13 PP_LAST_LAYERS=12. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
