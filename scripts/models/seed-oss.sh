# Seed-OSS (HF ByteDance-Seed/Seed-OSS-36B-*: SeedOssForCausalLM): the Qwen2 layout (biases on q/k/v) with 128-channel
# heads and a 512k context. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty;
# flags given anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Seed-OSS thinks in
# <seed:think>...</seed:think> and calls tools as <seed:tool_call><function=f><parameter=k>v</parameter>...
TOOL_PARSER="${TOOL_PARSER:-seed_oss}"; REASONING_PARSER="${REASONING_PARSER:-seed_oss}"
