# DeepSeek-V3.2 (HF deepseek-ai/DeepSeek-V3.2: DeepseekV32ForCausalLM; also -Exp, -Speciale): DeepSeek-V3.1's layers
# (deepseek-v3.sh's flags) with DeepSeek sparse attention: a lightning indexer (64 heads of 128 channels, RoPE on the
# two halves of the first 64) picks the 2048 keys each query attends to; a sample's first 2048 tokens attend densely.
# The indexer is converted, synced and frozen in training (mcore/dsa.py). Released in block-wise FP8: read dequantized
# (train the bf16 weights; --weight-sync-fp8 for engines serving the release). Under context parallelism each rank's
# queries select among keys gathered over CP; 61 layers need uneven pipeline stages (deepseek-v3.sh says how). The
# trainer checks these flags against the checkpoint's config and names any field that differs; the MTP layer is left
# out. Source it and pass "${MODEL_ARGS[@]}".
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): DeepSeek-V3.2's DSML
# tool calls and <think> blocks (read before deepseek-v3.sh sets DeepSeek-V3.1's).
_tool_parser="${TOOL_PARSER:-deepseekv32}"; _reasoning_parser="${REASONING_PARSER:-deepseek-v3}"
# shellcheck source=deepseek-v3.sh
source "$(dirname "${BASH_SOURCE[0]}")/deepseek-v3.sh"
MODEL_ARGS+=(
  --experimental-attention-variant dsa
  --dsa-indexer-n-heads 64
  --dsa-indexer-head-dim 128
  --dsa-indexer-topk 2048
)
TOOL_PARSER="$_tool_parser"; REASONING_PARSER="$_reasoning_parser"
unset _tool_parser _reasoning_parser
