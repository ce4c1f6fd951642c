# Qwen2.5-7B (HF Qwen/Qwen2.5-7B-Instruct config.json). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 28
  --hidden-size 3584
  --ffn-hidden-size 18944
  --num-attention-heads 28
  --group-query-attention
  --num-query-groups 4
  --max-position-embeddings 32768
  --seq-length 32768
  --vocab-size 152064
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 1000000
  --disable-bias-linear
  --add-qkv-bias
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them)
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
