# Qwen3-VL-30B-A3B (HF Qwen/Qwen3-VL-30B-A3B-Instruct / -Thinking; a vision-language checkpoint,
# Qwen3VLMoeForConditionalGeneration: its language model trains on text, its vision tower is copied on export with
# forge-convert mcore-to-hf --vision-from HF_DIR): Qwen3-30B-A3B's layers (128 experts, top-8, renormalised), each
# layer's experts stored fused and transposed in the checkpoint (the bridge slices them per expert), a text token's
# mRoPE equal to plain RoPE. The trainer checks these flags against the checkpoint's config and names any field that
# differs. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 48
  --hidden-size 2048
  --ffn-hidden-size 6144
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 4
  --kv-channels 128
  --qk-layernorm
  --max-position-embeddings 262144
  --seq-length 32768
  --vocab-size 151936
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 5000000
  --disable-bias-linear
  --num-experts 128
  --moe-router-topk 8
  --moe-ffn-hidden-size 768
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Qwen3-VL writes
# Hermes-style <tool_call>{json}</tool_call>; the Thinking model opens with <think>.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
