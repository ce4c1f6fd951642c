# Meta CWM (HF facebook/cwm, Code World Model, 32B: CwmForCausalLM): Llama's layer, three of every four layers in
# 8192-position sliding windows (the first of each four full), Llama 3's RoPE scaling: no Megatron-LM flags express
# the per-layer windows, so the trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS
# empty; flags given anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): CWM's agent format
# is its own (tools as text in its chat template); no parser here reads it, so the agent parses its replies.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-}"
