# ERNIE 4.5 21B-A3B (HF baidu/ERNIE-4.5-21B-A3B-PT, Ernie4_5_MoeForCausalLM): 28 layers, the first dense, then 64
# experts top-6 plus two shared experts per layer, chosen by a softmax router steered by a score-correction bias
# (forge_megatron/mcore/ernie.py), RoPE on interleaved channel pairs, tied embeddings. The router has no Megatron-LM
# flag, so the trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given
# anyway are checked against it); the MTP layer is left out. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): the released chat
# template has no tool-call or reasoning format of its own; set TOOL_PARSER for a tool-tuned variant.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
