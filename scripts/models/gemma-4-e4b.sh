# Gemma 4 E4B / E2B (HF google/gemma-4-E4B-it, gemma-4-E2B-it: Gemma4ForConditionalGeneration, whose language model
# trains and syncs while its vision and audio towers are kept as they are). E4B: 42 layers (every sixth global), 8
# heads, 2 key heads; E2B: 35 layers (every fifth global), 1 key head. Besides Gemma 4's attention (global layers with
# heads of 512 and proportional RoPE, normed values, attention scaled by 1, layer scalars, logits soft-capped at 30),
# per-layer inputs: a 256-wide input per layer and token from its own 262144-row table (replicated on every TP rank:
# 2.8B parameters for E4B) and the hidden state, gated into each layer's output; and KV sharing: the last 18 (E2B:
# 20) layers reuse the keys and values of the last earlier layer of their kind (E2B's with MLPs twice as wide). No
# Megatron-LM flags express these, so the trainer takes the whole architecture from --hf-checkpoint's config.json
# (MODEL_ARGS empty; flags given anyway are checked against it). Neither PP nor (with KV sharing)
# --recompute-granularity: the trainer refuses them for this layout; TP must divide the key heads (E4B 1 or 2, E2B 1).
# forge-plan for E4B (bf16, distributed optimizer, 8192 tree tokens per micro-batch; geometry from public sources,
# not the release's config.json: 7.5B parameters with the per-layer table): 8 x 80 GiB as TP 2 + SP fit (57 GiB per
# GPU), as DP 8 not (80 GiB). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Gemma 4's own tool
# calls (<|tool_call>call:f{...}<tool_call|>) and, with enable_thinking, thought channels (<|channel>thought ...).
TOOL_PARSER="${TOOL_PARSER:-gemma4}"; REASONING_PARSER="${REASONING_PARSER:-gemma4}"
