# Nemotron 3 Super / Ultra (NemotronHForCausalLM with moe_latent_size): Nemotron 3 Nano's layers (Mamba-2 mixers, NoPE
# attention, squared-ReLU experts under a sigmoid router with a score-correction bias beside a shared expert) with
# LatentMoE: the routed experts work in a narrower latent space between two projections that every TP rank holds whole
# (Megatron's latent MoE; forge builds the projections itself where Transformer Engine is absent). The trainer takes
# the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are checked against it).
# TP must divide the Mamba-2 groups and the key heads, EP the experts. Add expert parallelism in the launch (EP;
# ROUTING_REPLAY=1 to train the experts the engines chose). The MTP layers are left out. Release configs were not
# seen here (tested on a tiny model of the layout). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): as Nemotron 3 Nano's
# (reasoning in <think>...</think>, tool calls taken to be Qwen3-Coder's XML); check the release's chat template.
TOOL_PARSER="${TOOL_PARSER:-qwen3_coder}"; REASONING_PARSER="${REASONING_PARSER:-qwen3}"
