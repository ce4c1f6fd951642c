# Gemma 2 (HF google/gemma-2-2b-it, gemma-2-9b-it, gemma-2-27b-it: Gemma2ForCausalLM). Gemma 3's norms before and after
# attention and MLP, GeGLU, the embedding scaled by sqrt(hidden), every other layer a 4096-position sliding window,
# attention scores soft-capped at 50 and logits at 30: no Megatron-LM flags express these, so the trainer takes the
# whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it).
# The tree kernels cap the scores (Triton on GPUs; the CUDA kernel has no cap and is passed over). Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Gemma 2 has no tool
# call tokens or system role of its own; set TOOL_PARSER to the format the agent's prompts teach it (hermes:
# <tool_call>{JSON}).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
