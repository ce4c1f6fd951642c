# StarCoder2 15B (HF bigcode/starcoder2-15b, Starcoder2ForCausalLM; 3B / 7B alike): 40 layers, 48 heads of 128 (4 key
# heads), every layer a 4096-position window, RoPE base 100k, LayerNorms and every projection biased, a plain tanh-GELU
# MLP 24576 wide (c_fc / c_proj). Trained without dropout (the config's attention / residual / embedding dropout are
# not applied). The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given
# anyway are checked against it). TP divides the 4 key heads; 40 layers split evenly for PP = 2, 4, 5, 8 or 10. Source
# it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): a base code model, no
# tool-call or thinking format.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-none}"
