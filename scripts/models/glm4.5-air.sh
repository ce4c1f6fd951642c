# GLM-4.5-Air MoE (HF zai-org/GLM-4.5-Air config.json): 128 routed experts top-8 with a sigmoid router and score-
# correction bias, one shared expert, layer 0 dense, RoPE on half of each head. The trainer checks these flags
# against the checkpoint's config and names any field that differs. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 46
  --hidden-size 4096
  --ffn-hidden-size 10944
  --num-attention-heads 96
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --max-position-embeddings 131072
  --seq-length 32768
  --vocab-size 151552
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 1000000
  --rotary-percent 0.5
  --disable-bias-linear
  --add-qkv-bias
  --num-experts 128
  --moe-router-topk 8
  --moe-ffn-hidden-size 1408
  --moe-shared-expert-intermediate-size 1408
  --moe-layer-freq "([0]*1+[1]*45)"
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
)
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): GLM-4.5 writes
# <tool_call>f<arg_key>..</arg_key><arg_value>..</arg_value></tool_call> calls after a <think> block.
TOOL_PARSER="${TOOL_PARSER:-glm45}"; REASONING_PARSER="${REASONING_PARSER:-glm45}"
