# DeepSeek-V3.2 (HF deepseek-ai/DeepSeek-V3.2: DeepseekV32ForCausalLM; also -Exp, -Speciale): DeepSeek-V3.1's layers
# with DeepSeek sparse attention: a lightning indexer (64 heads of 128 channels, RoPE on the first 64, over the two
# halves) picks the 2048 keys each query attends to; a sample's first 2048 tokens attend densely. The indexer is
# converted, synced and frozen in training (mcore/dsa.py). Released in block-wise FP8: read dequantized (train the bf16
# weights; --weight-sync-fp8 for engines serving the release). No context parallelism with DSA. The trainer checks
# these flags against the checkpoint's config and names any field that differs; the MTP layer is left out. Source it
# and pass "${MODEL_ARGS[@]}".
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
  --experimental-attention-variant dsa
  --dsa-indexer-n-heads 64
  --dsa-indexer-head-dim 128
  --dsa-indexer-topk 2048
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): DeepSeek-V3.2's DSML
# tool calls and <think> blocks.
TOOL_PARSER="${TOOL_PARSER:-deepseekv32}"; REASONING_PARSER="${REASONING_PARSER:-deepseek-v3}"
