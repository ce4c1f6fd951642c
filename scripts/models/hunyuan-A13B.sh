# Hunyuan-A13B (HF tencent/Hunyuan-A13B-Instruct, HunYuanMoEV1ForCausalLM): 32 layers, in each 64 experts top-8 beside
# one shared MLP, a softmax router in fp32, per-head q/k RMSNorms applied after RoPE (forge_megatron/mcore/qk_norm.py),
# RoPE whose base a fixed NTK alpha stretches. No Megatron-LM flag expresses the norms' place, so the trainer takes
# the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it).
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): its tool calls are a
# JSON list in <tool_calls>...</tool_calls> (the gateway's hunyuan parser, SGLang's --tool-call-parser hunyuan)
TOOL_PARSER="${TOOL_PARSER:-hunyuan}"; REASONING_PARSER="${REASONING_PARSER:-none}"
