# LongCat-Flash (HF meituan-longcat/LongCat-Flash-Chat or -Thinking, LongcatFlashForCausalLM; 560B total, about 27B
# active): 28 layers, each two sublayers of multi-latent attention (query latent 1536, key/value latent 512, 128 + 64
# rotated query/key channels, 128 value channels, 64 heads) and a dense MLP (12288 wide), plus a shortcut MoE from the
# first sublayer's MLP input to the layer's output: 512 experts (2048 wide) and 256 zero-computation (identity)
# experts, 12 per token under a softmax router with a score-correction bias, scaled by 6. Megatron builds each layer
# as two of its layers (56 in all: mcore/longcat.py), so pipeline stages must hold even numbers of them (PP=4: 14
# each, PP=7: 8 each; PP=8 only unevenly, e.g. PP_FIRST_LAYERS=4 PP_LAST_LAYERS=4 and 8 in each other). No
# Megatron-LM flag expresses the layer pairs, so the trainer takes the architecture from --hf-checkpoint's
# config.json (MODEL_ARGS empty; flags given anyway are checked against it). The MTP module (model.mtp.*) is left
# out. Source it and pass "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): LongCat's tool calls
# (<longcat_tool_call>) and, for -Thinking, its <longcat_think> blocks; check them against the checkpoint's
# chat_template and set TOOL_PARSER / REASONING_PARSER where it differs.
TOOL_PARSER="${TOOL_PARSER:-longcat}"; REASONING_PARSER="${REASONING_PARSER:-longcat}"
