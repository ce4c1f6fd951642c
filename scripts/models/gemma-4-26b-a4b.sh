# Gemma 4 26B-A4B (HF google/gemma-4-26B-A4B-it: Gemma4ForConditionalGeneration, whose language model trains and
# syncs while its vision tower is kept as it is; Gemma4ForCausalLM for a text-only copy). 30 layers of Gemma 4's
# attention (25 local: a 1024-token window, heads of 256, 8 key heads; every sixth global: heads of 512, 2 key heads
# whose projections are also the values, proportional RoPE) and, in every layer, 128 routed experts (8 per token, 704
# wide) beside a dense GeGLU MLP, each branch with its own input and output norms, the router on the un-normalised
# input with its own input and per-expert scales. No Megatron-LM flags express these, so the trainer takes the whole
# architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it). TP
# must divide the 2 global key heads (1 or 2); under TP the MoE layers need --sequence-parallel. forge-plan (bf16,
# distributed optimizer, 8192 tree tokens per micro-batch; geometry from public sources, not the release's
# config.json: 25.2B parameters, 22.8B of them experts): 8 x 80 GiB fit as EP 8 with --recompute-granularity full
# (67 GiB per GPU) or TP 2 x EP 4 + SP with it (59 GiB), not without (94 / 73 GiB); 8 x H200 (141 GiB) as EP 8
# without recompute (94 GiB). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Gemma 4's own tool
# calls (<|tool_call>call:f{...}<tool_call|>) and, with enable_thinking, thought channels (<|channel>thought ...).
TOOL_PARSER="${TOOL_PARSER:-gemma4}"; REASONING_PARSER="${REASONING_PARSER:-gemma4}"
