# Llama-3.1-8B (HF meta-llama/Llama-3.1-8B-Instruct config.json). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 32
  --hidden-size 4096
  --ffn-hidden-size 14336
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --max-position-embeddings 131072
  --seq-length 32768
  --vocab-size 128256
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 500000
  --use-rope-scaling
  --rope-scaling-factor 8
  --disable-bias-linear
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them). Llama 3.1 writes
# tool calls as a bare {"name": ..., "parameters": ...} answer; <|eom_id|> / <|eot_id|> end its turns (the gateway
# reads them from generation_config.json).
TOOL_PARSER="${TOOL_PARSER:-llama3}"; REASONING_PARSER="${REASONING_PARSER:-}"
