# Flint (HF RecursiveSI/flint, FlintForCausalLM; transformers' FlintConfig defaults are its sizes): 49 layers of 32
# query heads (4 key heads of 128) with per-head q/k norms and a sink logit per head; full attention without RoPE on
# layers 0, 1, every fourth from 1 and the last, a 513-position window that rotates on the others; layers 0 and 1 dense
# (6144 wide), the others 256 experts of 512, top 6 of a sigmoid renormalised, beside a shared expert of 1024. The
# trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked
# against it). TP divides the 4 key heads; 49 layers split unevenly (--decoder-first-pipeline-num-layers). Source it and
# pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): no tool-call or thinking
# format is assumed for Flint; check the release's chat_template and set TOOL_PARSER / REASONING_PARSER.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-none}"
