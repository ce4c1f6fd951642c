# Mellum 2 (HF JetBrains/Mellum2-12B-A2.5B-Base, MellumForCausalLM): 28 layers of Qwen3-MoE's attention (per-head q/k
# RMSNorms, 128-channel heads); the layers layer_types marks sliding_attention see a window of sliding_window positions
# and rotate with their own RoPE base (rope_parameters' sliding_attention), the others see every ancestor; MoE layers of
# 64 experts (896 wide) under a softmax router (top-k renormalised), dense layers where mlp_layer_types says. The MTP
# layer (mtp.*) is left out. The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty;
# flags given anyway are checked against it). 28 layers split evenly for PP = 2, 4 or 7. A base code model: RL on it
# usually starts from an instruction-tuned derivative. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): not checked against a
# chat template (the base release has none): set both to match the derivative you train.
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-none}"
