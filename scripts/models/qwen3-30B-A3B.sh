# Qwen3-30B-A3B MoE (HF Qwen/Qwen3-30B-A3B config.json): 128 experts, top-8. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 48
  --hidden-size 2048
  --ffn-hidden-size 6144
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 4
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
  --num-experts 128
  --moe-router-topk 8
  --moe-ffn-hidden-size 768
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them)
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
