# MiniMax-M2 / M2.1 / M2.5 (HF MiniMaxAI/MiniMax-M2 config.json; 230B total, 10B active): every layer MoE with 256
# experts top-8 (sigmoid router with score-correction bias, no shared expert), RoPE on 64 of 128 channels per head,
# query/key RMSNorm over all heads of a token (forge's --qk-layernorm-all-heads; TP must divide the 8 key heads).
# The trainer checks these flags against the checkpoint's config and names any field that differs; the 3 MTP
# modules of the checkpoint are left out. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 62
  --hidden-size 3072
  --ffn-hidden-size 1536
  --num-attention-heads 48
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --max-position-embeddings 196608
  --seq-length 32768
  --vocab-size 200064
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 5000000
  --rotary-percent 0.5
  --disable-bias-linear
  --qk-layernorm
  --qk-layernorm-all-heads
  --num-experts 256
  --moe-router-topk 8
  --moe-ffn-hidden-size 1536
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): MiniMax-M2 writes
# <minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke></minimax:tool_call> after <think>.
TOOL_PARSER="${TOOL_PARSER:-minimax-m2}"; REASONING_PARSER="${REASONING_PARSER:-minimax}"
