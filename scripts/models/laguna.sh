# Laguna XS.2 (HF poolside/laguna-XS.2, LagunaForCausalLM; transformers' LagunaConfig defaults are its sizes): 40
# layers of 48 query heads (8 key heads of 128; configs may give each layer its own count in
# num_attention_heads_per_layer), per-head q/k norms, a softplus gate per head; full-attention layers rotate the first
# half of each head (base 500k), sliding-window layers (if layer_types has them) whole heads (base 10k); the first layer
# dense (8192 wide), then 256 experts of 512, top 8 of a sigmoid choosing with its bias, beside a shared expert. The
# trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked
# against it). TP divides the 8 key heads; 40 layers split evenly for PP = 2, 4, 5, 8 or 10. Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): no tool-call or thinking
# format is assumed for Laguna; check the release's chat_template and set TOOL_PARSER / REASONING_PARSER.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-none}"
