# Apertus (HF swiss-ai/Apertus-8B-Instruct-2509, Apertus-70B-Instruct-2509: ApertusForCausalLM). Llama's layer with
# per-head q/k RMSNorms and a plain MLP whose xIELU activation has two trained scalars per layer: no Megatron-LM flags
# express these, so the trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty;
# flags given anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): no parser reads
# Apertus's own tool-call format yet; set TOOL_PARSER to the format the agent's prompts teach it (hermes:
# <tool_call>{JSON}).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
