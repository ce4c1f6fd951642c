# Phi-4-mini (HF microsoft/Phi-4-mini-instruct, Phi-4-mini-reasoning: Phi3ForCausalLM, 3.8B): 32 layers of 24 query
# heads over 8 key/value heads (128 channels, RoPE on three quarters of each), q/k/v and gate/up fused on disk, tied
# embeddings, and longrope (4096 original positions of 131072): one factor list for the whole run, LONGROPE_FACTORS
# (long, the default: the context exceeds the original one; short for runs that stay within 4096 positions). forge.sbatch
# and run_local.sh start SGLang pinned to it (--json-model-override-args from forge-convert longrope-override) and
# give it to the trainer; without the pin SGLang would rotate each batch with whichever list its positions call for.
# The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). TP divides the 8 key heads. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Phi-4-mini-reasoning
# writes its thinking as <think>...</think>; Phi-4-mini-instruct's tool calls (functools[...]) have no parser here, so
# the agent parses them from the text.
TOOL_PARSER="${TOOL_PARSER:-none}"; REASONING_PARSER="${REASONING_PARSER:-deepseek-v3}"
