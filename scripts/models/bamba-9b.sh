# Bamba (HF ibm-ai-platform/Bamba-9B-v2: BambaForCausalLM). Mamba-2 layers (forge's Mamba-2 mixer over prefix trees)
# with attention at attn_layer_indices (RoPE on half of each head), SwiGLU MLPs: no Megatron-LM flags express these, so
# the trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). TP must divide mamba_n_groups (the release: 1, so TP 1 for it; use PP / DP). Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Bamba has no tool call
# tokens of its own; set TOOL_PARSER to the format the agent's prompts teach it (hermes: <tool_call>{JSON}).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
