# OLMo Hybrid (HF allenai/Olmo-Hybrid-7B: OlmoHybridForCausalLM). Three of every four layers are Gated DeltaNet linear
# attention (pre-norm layers; separate q/k/v/gate/b/a projections and three convolutions on disk, regrouped per key
# head; beta = 2 sigmoid(b), so the state transition may have negative eigenvalues), every fourth OLMo 3's post-norm
# attention (q/k RMSNorms over all heads, no RoPE as released: NoPE). No Megatron-LM flags express these, so the
# trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). The 7B's 30 attention heads and 30 linear key heads: TP must divide both (1, 2, 3, 5, 6, ...),
# and CP the linear key heads per TP rank (30 / TP: under TP 2, CP 3 or 5). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): set TOOL_PARSER to
# the format the served checkpoint's chat template writes tool calls in (hermes: <tool_call>{JSON}</tool_call>).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
