# Gemma 4 31B (HF google/gemma-4-31B-it: Gemma4ForConditionalGeneration, whose language model trains and syncs while
# its vision tower is kept as it is; Gemma4ForCausalLM for a text-only copy). 60 layers: 50 local (a 1024-token
# window, heads of 256, 16 key heads, RoPE base 10k) and every sixth global (heads of 512, 4 key heads whose
# projections are also the values: attention_k_eq_v; proportional RoPE over a quarter of each head, base 1M); plain-
# weight sandwich norms, normed values, attention scaled by 1, a scalar per layer, logits soft-capped at 30, tied
# embeddings. No Megatron-LM flags express these, so the trainer takes the whole architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). TP must divide the 4 global key heads
# (1, 2 or 4). forge-plan (bf16, distributed optimizer, 8192 tree tokens per micro-batch; geometry from public
# sources, not the release's config.json): 16 x 80 GiB as TP 4 + SP fits with --recompute-granularity full (66 GiB
# per GPU), not without (85 GiB); 8 x H200 (141 GiB) as TP 4 + SP fits without recompute (107 GiB; the activation
# estimate is rough, and low for the global layers, whose queries are 3x the hidden size wide). On GPU the global
# layers' heads of 512 run tree attention's segment backend (the Triton and CUDA kernels stop at 256).
# Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Gemma 4's own tool
# calls (<|tool_call>call:f{...}<tool_call|>) and, with enable_thinking, thought channels (<|channel>thought ...).
TOOL_PARSER="${TOOL_PARSER:-gemma4}"; REASONING_PARSER="${REASONING_PARSER:-gemma4}"
