# GLM-4.5V / GLM-4.6V (HF zai-org/GLM-4.5V, GLM-4.6V: Glm4vMoeForConditionalGeneration) and GLM-4.1V-Thinking /
# GLM-4.6V-Flash (Glm4vForConditionalGeneration). Their language models are GLM-4.5-Air's MoE and GLM-4-0414's dense
# layers under model.language_model.*, beside the vision tower (model.visual.*), frozen by default (copied on export:
# forge-convert mcore-to-hf --vision-from HF_DIR); EXTRA_TRAIN_ARGS="--train-vision-tower [--vision-lr LR]" trains it
# with the language model (docs/training.md "Images"); a text token's mRoPE is the language model's
# plain RoPE. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given
# anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): GLM-4.5's
# <tool_call>f<arg_key>..</arg_key><arg_value>..</arg_value></tool_call> after a <think> block.
TOOL_PARSER="${TOOL_PARSER:-glm45}"; REASONING_PARSER="${REASONING_PARSER:-glm45}"
