# DeepSeek-V2-Lite / -Chat and DeepSeek-Coder-V2-Lite-Instruct (HF deepseek-ai/*: DeepseekV2ForCausalLM, 16B-A2.4B):
# multi-latent attention with queries projected directly (no query latent), key/value latent 512, YaRN (factor 40)
# from the checkpoint; layer 0 dense, then 64 experts of which a softmax router keeps the top 6 probabilities as
# they are (pre-softmax top-k, fp32 logits, no score-correction bias: taken from the checkpoint's config, as no flag
# here says them) beside two shared experts. The trainer checks these flags against the checkpoint's config and names
# any field that differs. Add expert parallelism in the launch
# (EP; --routing-replay to train the experts the engines chose). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 27
  --hidden-size 2048
  --ffn-hidden-size 10944
  --num-attention-heads 16
  --max-position-embeddings 8192
  --seq-length 8192
  --vocab-size 102400
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
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
  --moe-router-score-function softmax
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): the Lite chat models
# have no tool-call or reasoning format of their own (tool use is prompted; the agent parses it).
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-}"
