# gpt-oss-20b (HF openai/gpt-oss-20b config.json; gpt-oss-120b: --num-layers 36 --num-experts 128): 64 query and 8
# key/value heads of 64 channels with biases and a learned sink per head, a 128-token sliding window on every other
# layer (from the checkpoint's layer_types), 32 biased experts top-4 with the clamped GLU, YaRN (factor 32) from the
# checkpoint. Train (and serve) a bf16 copy: the released checkpoint is MXFP4 (forge-convert mxfp4-to-bf16 --hf-dir
# gpt-oss-20b --out gpt-oss-20b-bf16); TP > 1 needs --expert-tensor-parallel-size 1 (Megatron has expert biases only with
# whole experts), EP / PP / CP as usual. The trainer checks these flags against the
# checkpoint's config and names any field that differs. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
  --num-layers 24
  --hidden-size 2880
  --ffn-hidden-size 2880
  --num-attention-heads 64
  --group-query-attention
  --num-query-groups 8
  --kv-channels 64
  --max-position-embeddings 131072
  --seq-length 32768
  --vocab-size 201088
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --swiglu
  --untie-embeddings-and-output-weights
  --position-embedding-type rope
  --rotary-base 150000
  --add-qkv-bias
  --num-experts 32
  --moe-router-topk 4
  --moe-ffn-hidden-size 2880
)
# Output formats for the gateway: harmony (analysis -> reasoning_content, recipients -> tool calls).
TOOL_PARSER="${TOOL_PARSER:-gpt-oss}"; REASONING_PARSER="${REASONING_PARSER:-gpt-oss}"
