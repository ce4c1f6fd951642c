# DeepSeek-V3 / V3.1 (HF deepseek-ai/DeepSeek-V3 config.json): multi-latent attention (query latent 1536, key/value
# latent 512, 128 + 64 rotated query/key channels, 128 value channels per head), 256 routed experts top-8 in 8 groups
# (4 chosen) with a sigmoid router and score-correction bias, one shared expert, the first 3 layers dense. YaRN
# (factor 40) comes from the checkpoint. The trainer checks these flags against the checkpoint's config and names any
# field that differs; the MTP layer is left out. 61 layers split over pipeline stages only unevenly: e.g. PP=4 with
# PP_FIRST_LAYERS=13 PP_LAST_LAYERS=12 (forge.sbatch: 13 + 18 + 18 + 12; the trainer's
# --decoder-first/last-pipeline-num-layers). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 61
  --hidden-size 7168
  --ffn-hidden-size 18432
  --num-attention-heads 128
  --max-position-embeddings 163840
  --seq-length 32768
  --vocab-size 129280
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 10000
  --disable-bias-linear
  --qk-layernorm
  --multi-latent-attention
  --q-lora-rank 1536
  --kv-lora-rank 512
  --qk-head-dim 128
  --qk-pos-emb-head-dim 64
  --v-head-dim 128
  --num-experts 256
  --moe-router-topk 8
  --moe-ffn-hidden-size 2048
  --moe-shared-expert-intermediate-size 2048
  --moe-layer-freq "([0]*3+[1]*58)"
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.5
  --moe-router-num-groups 8
  --moe-router-group-topk 4
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them).
TOOL_PARSER="${TOOL_PARSER:-deepseekv31}"; REASONING_PARSER="${REASONING_PARSER:-deepseek-v3}"
