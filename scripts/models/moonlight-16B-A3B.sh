# Moonlight-16B-A3B (HF moonshotai/Moonlight-16B-A3B config.json; Kimi-K2's layout at 16B): multi-latent attention
# with queries projected directly (no query latent), key/value latent 512, 64 routed experts top-6 with a sigmoid
# router and score-correction bias, two shared experts, layer 0 dense. The trainer checks these flags against the
# checkpoint's config and names any field that differs. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 27
  --hidden-size 2048
  --ffn-hidden-size 11264
  --num-attention-heads 16
  --max-position-embeddings 8192
  --seq-length 8192
  --vocab-size 163840
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 50000
  --disable-bias-linear
  --qk-layernorm
  --multi-latent-attention
  --kv-lora-rank 512
  --qk-head-dim 128
  --qk-pos-emb-head-dim 64
  --v-head-dim 128
  --num-experts 64
  --moe-router-topk 6
  --moe-ffn-hidden-size 1408
  --moe-shared-expert-intermediate-size 2816
  --moe-layer-freq "([0]*1+[1]*26)"
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.446
)
# Kimi-K2 shares this layout at 1T (64 heads, 384 experts top-8, YaRN from the checkpoint); its gateway formats:
TOOL_PARSER="${TOOL_PARSER:-kimi_k2}"; REASONING_PARSER="${REASONING_PARSER:-kimi_k2}"
