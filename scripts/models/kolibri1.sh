# Kolibri 1 (HF Aleph-Alpha/Kolibri-1, Kolibri1ForCausalLM): 50 layers of 48 query heads (128 channels, per-head q/k
# RMSNorms); four of every five layers see a 513-position window and rotate, every fifth sees every ancestor without
# RoPE; GLM-4's sandwich norms; every layer 384 experts (512 wide) top-6, chosen by logit plus bias and weighted by
# their sigmoids, beside a shared expert (512 wide). The trainer takes the architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). 50 layers split evenly for PP = 2, 5 or 10.
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
