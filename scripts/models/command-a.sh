# Cohere Command A / Command A Reasoning / Command R7B (HF CohereLabs/c4ai-command-a-03-2025,
# command-a-reasoning-08-2025, c4ai-command-r7b-12-2024: Cohere2ForCausalLM; Command R 08-2024: CohereForCausalLM).
# Attention and MLP in parallel on one bias-free LayerNorm, RoPE on interleaved pairs in the 4096-position window
# layers only (every fourth layer full attention without RoPE), the logits times logit_scale, the head tied: no
# Megatron-LM flags express these, so the trainer takes the whole architecture from --hf-checkpoint's config.json
# (MODEL_ARGS empty; flags given anyway are checked against it). The layers build with the local spec (Transformer
# Engine's fuses the input norm the MLP also reads). Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Command A's tool calls
# (<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>), its plans and reasoning
# (<|START_THINKING|>) and answers (<|START_RESPONSE|>).
TOOL_PARSER="${TOOL_PARSER:-cohere}"; REASONING_PARSER="${REASONING_PARSER:-cohere}"
