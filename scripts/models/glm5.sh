# GLM-5 (HF zai-org/GLM-5: GlmMoeDsaForCausalLM): DeepSeek-V3.2's layout (multi-latent attention,
# 256 routed experts top-8 with a sigmoid router and score-correction bias, one shared expert, the first layers
# dense) with DeepSeek sparse attention whose indexer rotates interleaved pairs (indexer_rope_interleave); later
# releases' "shared" indexer layers (indexer_types / index_topk_freq) reuse the last full layer's selection, so a
# pipeline stage must begin at a full layer (the trainer checks; forge.sbatch's PP_FIRST_LAYERS / PP_LAST_LAYERS
# move the boundaries). Context parallelism gathers the keys over CP for each rank's queries. The trainer
# takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked
# against it). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): GLM-4.7's tool calls
# (<tool_call>f<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>, no newlines) after a <think> block.
TOOL_PARSER="${TOOL_PARSER:-glm47}"; REASONING_PARSER="${REASONING_PARSER:-glm45}"
