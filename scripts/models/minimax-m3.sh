# MiniMax-M3 (HF MiniMaxAI/MiniMax-M3, MiniMaxM3SparseForConditionalGeneration): 60 layers of 64 query heads and 4 key
# heads of 128 channels (RoPE on 64 of them, per-head q/k norms); the first 3 layers dense, then 128 experts top-4
# under MiniMax-M2's sigmoid router, scaled by 2, beside one shared expert; every MLP a clamped SwiGLU; from layer 3 on
# block-sparse attention (each query keeps 16 blocks of 128 positions per key head; samples shorter than 2048 tokens
# attend densely). The trainer takes the language model (text-only RL); the vision tower is copied on export. No
# Megatron-LM flag expresses the block-sparse layers, so the architecture comes from --hf-checkpoint's config.json
# (MODEL_ARGS empty; flags given anyway are checked against it). TP must divide the 4 key heads (TP <= 4; spread the
# experts with EP); recompute whole layers (--recompute-granularity full), not core attention alone. Source it and
# pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): MiniMax-M2's tool-call
# and reasoning formats; check them against the checkpoint's chat_template and set TOOL_PARSER / REASONING_PARSER
# where it differs.
TOOL_PARSER="${TOOL_PARSER:-minimax-m2}"; REASONING_PARSER="${REASONING_PARSER:-minimax}"
