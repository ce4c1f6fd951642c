# Granite 4.0 micro (HF ibm-granite/granite-4.0-micro, GraniteMoeHybridForCausalLM without Mamba-2 layers or experts:
# 3B dense): attention layers with RoPE, the shared MLP as each layer's MLP, the head tied, muP-style scales read
# from the config. Granite 4.0-H (hybrid Mamba-2) models are refused by name. The trainer takes the architecture from
# --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it). Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Granite 4.0 calls tools
# in Hermes' <tool_call>{JSON}</tool_call> blocks and does not think in a block.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
