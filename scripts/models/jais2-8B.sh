# Jais 2 8B (HF inceptionai/Jais-2-8B-Chat, Jais2ForCausalLM): Llama's attention (26 heads of 128) with biases on every
# projection, LayerNorms with biases, a plain squared-ReLU MLP (26624 wide) with biases. The trainer takes the
# architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it); TP
# divides the key heads. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
