# Ministral 3 (HF mistralai/Ministral-3-3B / 8B / 14B-*-2512 in bf16: Mistral3ForConditionalGeneration with a
# Ministral3 language model) and Ministral3ForCausalLM text checkpoints: the Llama layout with YaRN and Llama 4's
# attention temperature past the original 16k context (queries scaled by 1 + beta * log(1 + floor(p / 16384))), which
# no Megatron-LM flag expresses; the Pixtral tower is copied on export (forge-convert mcore-to-hf --vision-from
# HF_DIR). The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway
# are checked against it). FP8 releases are read only when block-wise scaled (the bridge names what it refuses):
# otherwise train the bf16 ones. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): [TOOL_CALLS] calls;
# the Reasoning models write [THINK] ... [/THINK] first (REASONING_PARSER=mistral).
TOOL_PARSER="${TOOL_PARSER:-mistral}"; REASONING_PARSER="${REASONING_PARSER:-}"
