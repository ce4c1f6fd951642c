# Mistral Small 4 (HF mistralai/Mistral-Small-4-119B-2603: Mistral3ForConditionalGeneration with a Mistral4 language
# model, or Mistral4ForCausalLM text checkpoints): DeepSeek-V3's multi-latent attention (query latent 1024, key/value
# latent 256, 64 + 64 rotated query/key channels, 128 value channels per head) with YaRN (factor 128 over 8192
# positions) and Llama 4's attention temperature past 8192 (queries scaled by 1 + 0.1 * log(1 + floor(p / 8192))),
# 128 softmax-routed experts top-4 (renormalised) plus one shared expert in every layer, the experts stacked on disk.
# The query temperature has no Megatron-LM flag, so the trainer takes the architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). Agents may send images (the Pixtral tower
# kept as it is, or trained with EXTRA_TRAIN_ARGS="--train-vision-tower"); the tower is copied on export
# (forge-convert mcore-to-hf --vision-from HF_DIR). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): [TOOL_CALLS] calls;
# with reasoning on it writes [THINK] ... [/THINK] first (a completion without the block is all content).
TOOL_PARSER="${TOOL_PARSER:-mistral}"; REASONING_PARSER="${REASONING_PARSER:-mistral}"
