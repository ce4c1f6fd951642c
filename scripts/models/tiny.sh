# Tiny Qwen2-style model of forge_megatron.models.tiny (the demo and CI). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 2
  --hidden-size 64
  --ffn-hidden-size 128
  --num-attention-heads 4
  --group-query-attention
  --num-query-groups 2
  --max-position-embeddings 2048
  --seq-length 2048
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 10000
  --disable-bias-linear
  --add-qkv-bias
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them)
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
