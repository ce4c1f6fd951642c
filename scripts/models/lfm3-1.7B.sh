# LFM3 1.7B (HF LiquidAI/LFM3-1.7B, Lfm3ForCausalLM): 24 layers; layer 2 of every 4 full attention (proportional RoPE
# over half the frequencies, base 1M), layer 0 of every 4 but the first a 256-position window (plain RoPE, base 10k),
# the others gated short convolutions (7 taps); 16 query heads of 128 (4 key heads) with per-head q/k norms and a
# sigmoid gate per head; norms before and after every mixer and MLP; MLPs 7680 wide; the head tied. The trainer takes the
# architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it). 24
# layers split evenly for PP = 2, 3, 4 or 6; TP divides the 4 key heads. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): LFM2's tool-call format
# is assumed (pythonic lists between <|tool_call_start|> / <|tool_call_end|>: the lfm2 parser); check the release's
# chat_template.
TOOL_PARSER="${TOOL_PARSER:-lfm2}"; REASONING_PARSER="${REASONING_PARSER:-none}"
