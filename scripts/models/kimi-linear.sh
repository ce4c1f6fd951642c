# Kimi Linear (HF moonshotai/Kimi-Linear-48B-A3B-Instruct: KimiLinearForCausalLM). 27 layers: 20 Kimi Delta
# Attention (32 heads of 128 channels; the gated delta rule with a decay per key channel from a low-rank forget gate,
# trained on prefix trees along every root-to-leaf path) and 7 multi-latent attention layers without RoPE; every
# layer but the first a MoE (256 experts, 8 per token, sigmoid router with score-correction bias, one shared expert).
# No Megatron-LM flags express Kimi Delta Attention, so the trainer takes the whole architecture from
# --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it). TP must divide the 32
# heads (both kinds), CP the linear heads per TP rank; under TP the MoE layers need --sequence-parallel. forge-plan
# (bf16, distributed optimizer, 8192 tree tokens per micro-batch): 16 x 80 GiB as TP 2 x EP 8 fits with
# --recompute-granularity full (57 GiB per GPU), not without (74 GiB); 8 GPUs do not (experts alone 69 GiB of Adam).
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Kimi-K2's tool-call
# sections and <think> blocks.
TOOL_PARSER="${TOOL_PARSER:-kimi_k2}"; REASONING_PARSER="${REASONING_PARSER:-kimi_k2}"
