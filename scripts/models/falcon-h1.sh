# Falcon-H1 / Falcon-H1R (HF tiiuae/Falcon-H1-7B-Instruct, Falcon-H1-34B-Instruct, Falcon-H1R-7B:
# FalconH1ForCausalLM). Attention and a Mamba-2 mixer side by side in every layer with muP multipliers on the
# embedding, both mixers, the keys, the Mamba projection, the MLP and the logits: no Megatron-LM flags express these,
# so the trainer takes the whole architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway
# are checked against it). TP must divide mamba_n_groups and CP the groups per TP rank. Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): tool calls as
# <tool_call>{JSON}</tool_call> (hermes); Falcon-H1R thinks in <think>...</think> (set REASONING_PARSER=qwen3).
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"
