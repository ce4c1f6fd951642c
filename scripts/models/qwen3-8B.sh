# Qwen3-8B (HF Qwen/Qwen3-8B config.json). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 36
  --hidden-size 4096
  --ffn-hidden-size 12288
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --qk-layernorm
  --max-position-embeddings 40960
  --seq-length 40960
  --vocab-size 151936
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 1000000
  --disable-bias-linear
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them)
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
