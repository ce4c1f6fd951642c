# DeepSeek-V2.5 (HF deepseek-ai/DeepSeek-V2.5, DeepseekV2ForCausalLM; 236B total, 21B active; DeepSeek-V2-Chat and
# DeepSeek-Coder-V2-Instruct share the layout): 60 layers of multi-latent attention (128 heads, query latent 1536,
# key/value latent 512, 128 + 64 rotated query/key channels, 128 value channels; YaRN from the checkpoint), the first
# layer dense (12288 wide), then 160 experts (1536 wide) top-6 under a softmax router limited to 3 of 8 groups (a group
# scored by its best expert: forge's group-limited greedy router), the probabilities kept as they are and scaled by 16,
# beside two shared experts' width. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS
# empty; flags given anyway are checked against it). 60 layers split evenly for PP = 2, 4, 5, 6 or 10. Source it and
# pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against
# the release's chat template (none ships with this repository); none parses no tool calls (the agent parses them):
# read its chat_template and set both to match.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-}"
