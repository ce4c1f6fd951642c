# HyperCLOVA X SEED Think 14B (HF naver-hyperclovax/HyperCLOVAX-SEED-Think-14B, HyperCLOVAXForCausalLM): Granite's layer
# with muP-style scales (embedding, attention, residual multipliers; the logits multiplied by logits_scaling) and an
# RMSNorm after attention and after the MLP too (peri-layer normalisation). The trainer takes the architecture from
# --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it). Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
