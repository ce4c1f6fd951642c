# Devstral-Small / Mistral-Small-3.x 24B text model (HF MistralForCausalLM config.json; sliding_window null).
# The gateway needs the checkpoint's HF tokenizer with a chat template. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 40
  --hidden-size 5120
  --ffn-hidden-size 32768
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --max-position-embeddings 131072
  --seq-length 32768
  --vocab-size 131072
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 1000000000
  --disable-bias-linear
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): [TOOL_CALLS] calls,
# as a JSON array (tokenizers up to v7) or NAME[ARGS]{...} (v11).
TOOL_PARSER="${TOOL_PARSER:-mistral}"; REASONING_PARSER="${REASONING_PARSER:-}"
