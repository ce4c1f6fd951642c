# Granite 4.0-H Small (HF ibm-granite/granite-4.0-h-small, GraniteMoeHybridForCausalLM; -h-tiny / -h-micro the same
# kinds of layers, smaller): mostly Mamba-2 layers (forge's Mamba-2 mixer over prefix trees, mcore/mamba2.py) with an
# attention layer every few (no RoPE), routed experts beside a shared MLP in every layer, the head tied, muP-style
# scales read from the config. Its Mamba-2 layers have one group, so tensor parallelism cannot split them (TP 1):
# scale with --pipeline-model-parallel-size, --expert-model-parallel-size and data parallelism. The trainer takes the
# architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it).
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Granite 4.0 calls tools
# in Hermes' <tool_call>{JSON}</tool_call> blocks and does not think in a block.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
