# Qwen2.5-VL-3B / 7B / 32B / 72B (HF Qwen/Qwen2.5-VL-*-Instruct; Qwen2_5_VLForConditionalGeneration, the base of
# many GUI and computer-use agents) and Qwen2-VL (Qwen2VLForConditionalGeneration). As released: a flat config.json,
# the Qwen2 language model (biases on q/k/v) under model.*, the vision tower under visual.* (Qwen2.5-VL's attends in
# windows of 112 pixels but in its full-attention blocks), frozen by default (copied on export: forge-convert
# mcore-to-hf --vision-from HF_DIR); EXTRA_TRAIN_ARGS="--train-vision-tower [--vision-lr LR]" trains it with the
# language model (docs/training.md "Images"). mRoPE's sections are contiguous; a text token's rotation is plain RoPE.
# The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Hermes-style
# <tool_call>{json}</tool_call> where the chat template offers tools; GUI agents parse their own actions from the text.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
