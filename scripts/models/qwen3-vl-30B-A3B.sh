# Qwen3-VL-30B-A3B / 235B-A22B (HF Qwen/Qwen3-VL-*-A*B-Instruct / -Thinking; vision-language checkpoints,
# Qwen3VLMoeForConditionalGeneration: the language model trains on text and on the agents' images, through the frozen
# vision tower, which is copied on export with forge-convert mcore-to-hf --vision-from HF_DIR; to train the tower too:
# EXTRA_TRAIN_ARGS="--train-vision-tower [--vision-lr LR]", docs/training.md "Images"): Qwen3-MoE layers (top-k
# renormalised), each layer's experts stored
# fused and transposed in the checkpoint (the bridge slices them per expert), a text token's mRoPE equal to plain
# RoPE. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway
# are checked against it: scripts/models/qwen3-30B-A3B.sh's, with --rotary-base 5000000 and the 262144 context, are
# the 30B's). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Qwen3-VL writes
# Hermes-style <tool_call>{json}</tool_call>; the Thinking models open with <think>.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
