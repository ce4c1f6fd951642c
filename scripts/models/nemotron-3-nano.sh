# Nemotron 3 Nano (HF nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16, NemotronHForCausalLM; Nemotron-H and Nemotron Nano 2
# the same kinds of layers without experts): layers of one sublayer each as hybrid_override_pattern says (Mamba-2
# mixers, NoPE attention, squared-ReLU experts under a sigmoid router with a score-correction bias beside a shared
# expert). The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway
# are checked against it). TP must divide the Mamba-2 groups (n_groups) and the key heads; EP the experts; CP the
# groups per TP rank. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): it reasons in
# <think>...</think>; its tool calls are taken to be Qwen3-Coder's XML (<tool_call><function=...>); not checked against
# the release's chat template (none ships with this repository): read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-qwen3_coder}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
