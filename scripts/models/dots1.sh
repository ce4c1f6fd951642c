# dots.llm1 (HF rednote-hilab/dots.llm1.inst or .base, Dots1ForCausalLM; 142B total, 14B active): 62 layers of 32
# query heads (32 key heads, 128 channels, per-head q/k RMSNorms, RoPE base 1e7 over the whole head); the first layer
# dense (10944 wide), then 128 experts (1408 wide) top-6 under GLM-4.5's sigmoid router with a score-correction bias
# (renormalised, scaled by 2.5) beside two shared experts. The trainer takes the architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). 62 layers split over pipeline stages
# evenly for PP=2 (31 each); otherwise unevenly, e.g. PP=4 with PP_FIRST_LAYERS=14 PP_LAST_LAYERS=16 (16 in each
# middle stage). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Qwen's chat format,
# tool calls as JSON in <tool_call> tags; check them against the checkpoint's chat_template.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
