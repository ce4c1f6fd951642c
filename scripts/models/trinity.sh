# Arcee Trinity (HF arcee-ai/Trinity-Mini, Trinity-Nano-Preview, Trinity-Large: AfmoeForCausalLM). Sandwich norms, a
# sigmoid gate on every attention channel, window layers that rotate beside NoPE full-attention ones, dense first
# layers then sigmoid-routed experts beside shared ones: no Megatron-LM flags express these, so the trainer takes the
# whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against
# it). Add expert parallelism in the launch (EP; --routing-replay to train the experts the engines chose). Source it
# and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): tool calls as
# <tool_call>{JSON}</tool_call> (hermes); reasoning in <think>...</think> (qwen3).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
