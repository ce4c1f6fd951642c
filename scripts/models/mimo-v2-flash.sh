# MiMo-V2-Flash (HF XiaomiMiMo/MiMo-V2-Flash, MiMoV2FlashForCausalLM; 309B total, 15B active): 48 layers, the
# sliding-window ones (a query and the 128 keys before it, 8 key heads, a learned sink logit per head, RoPE base 10k)
# between full-attention ones (4 key heads, base 5M); 64 query heads of 192 channels whose values have 128 (scaled by
# attention_value_scale), RoPE on the first third of each head; the first layer dense, then 256 experts top-8 under
# DeepSeek-V3's sigmoid router (no shared expert). No Megatron-LM flag expresses the per-layer attention, so the
# trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked
# against it). The release is block-wise FP8: it is read dequantized (docs/conversion.md). TP must divide the full
# layers' 4 key heads (TP <= 4; spread the experts with EP). The MTP layers (model.mtp.*) are left out. Source it and
# pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): tool calls as JSON in
# <tool_call> tags and reasoning in <think> (the hermes / qwen3 formats); check them against the checkpoint's
# chat_template and set TOOL_PARSER / REASONING_PARSER where it differs.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
