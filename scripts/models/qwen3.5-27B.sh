# Qwen3.5-27B (HF Qwen/Qwen3.5-27B; released as a vision-language checkpoint, Qwen3_5ForConditionalGeneration: its
# language model trains, its vision tower is copied on export): 64 layers, every 4th gated full attention (24 query
# heads, 4 key/value heads of 256 channels, RoPE on a quarter of each head), the other 48 Gated DeltaNet linear
# attention (16 key heads, 48 value heads, 128 channels each) trained on prefix trees along every root-to-leaf path;
# norms scale by (1 + weight). TP must divide the 4 key/value heads and the 16 linear key heads, and CP the linear
# key heads per TP rank (each CP rank runs the whole tree for its share of them). The trainer
# checks these flags against the checkpoint's config and names any field that differs; the MTP layer is left out.
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 64
  --hidden-size 5120
  --ffn-hidden-size 17408
  --num-attention-heads 24
  --group-query-attention
  --num-query-groups 4
  --kv-channels 256
  --max-position-embeddings 262144
  --seq-length 32768
  --vocab-size 248320
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --apply-layernorm-1p
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 10000000
  --rotary-percent 0.25
  --disable-bias-linear
  --qk-layernorm
  --attention-output-gate
  --experimental-attention-variant gated_delta_net
  --linear-attention-freq 4
  --linear-conv-kernel-dim 4
  --linear-num-key-heads 16
  --linear-num-value-heads 48
  --linear-key-head-dim 128
  --linear-value-head-dim 128
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Qwen3.5 writes
# Qwen3-Coder's <tool_call><function=f><parameter=k>v</parameter></function></tool_call> after <think>.
TOOL_PARSER="${TOOL_PARSER:-qwen3_coder}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
