# OLMoE-1B-7B (HF allenai/OLMoE-1B-7B-0125-Instruct, OlmoeForCausalLM): 16 layers, 64 experts top-8 (softmax, not
# renormalised), q/k RMSNorms over all heads of a token (forge_megatron/mcore/qk_norm.py). No Megatron-LM flag
# expresses those norms, so the trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty;
# flags given anyway are checked against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): the released chat
# template has no tool-call format of its own; set TOOL_PARSER for a tool-tuned variant.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
