# Cohere Command A+ (HF CohereLabs/command-a-plus-05-2026: Cohere2MoeForCausalLM). Command A's parallel layers, window
# layers that rotate beside NoPE full-attention ones, and the logit scale; dense first layers (first_k_dense_replace,
# their own MLP width), then experts under a router that softmaxes its top-k logits (or scores them by sigmoid),
# averaged with a shared expert; RMSNorms where the config gives rms_norm_eps. No Megatron-LM flags express these, so
# the trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway
# are checked against it). Add expert parallelism in the launch (EP; --routing-replay to train the experts the engines
# chose). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Command A's.
TOOL_PARSER="${TOOL_PARSER:-cohere}"; REASONING_PARSER="${REASONING_PARSER:-cohere}"
