# Llama 4 Scout (HF meta-llama/Llama-4-Scout-17B-16E-Instruct: Llama4ForConditionalGeneration; its language model
# trains and syncs, the vision model is kept as it is) and Maverick (Llama-4-Maverick-17B-128E-Instruct: dense and MoE
# layers interleaved). Chunked attention (8192 positions) on the layers that rotate, NoPE layers with an attention
# temperature, top-1 sigmoid experts fed scaled inputs beside a shared expert: no Megatron-LM flags express these, so
# the trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). The tree kernels chunk the attention (Triton on GPUs; the CUDA kernel has no chunks and is
# passed over). Train the bf16 releases (a quantized one other than block-wise fp8 is refused by name). Source it and
# pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Llama 4's tool calls
# as SGLang reads them (pythonic: a Python list of calls); no reasoning channel.
TOOL_PARSER="${TOOL_PARSER:-pythonic}"; REASONING_PARSER="${REASONING_PARSER:-}"
