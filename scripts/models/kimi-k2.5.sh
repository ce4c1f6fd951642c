# Kimi-K2.5 / K2.6 (HF moonshotai/Kimi-K2.5: KimiK25ForConditionalGeneration). Its language model is Kimi-K2's
# (DeepSeek-V3's layout at 1T: multi-latent attention, 384 routed experts top-8 with a sigmoid router, one shared
# expert, layer 0 dense, YaRN) under language_model.*, beside the MoonViT vision tower: agents may send images (the
# tower kept as it is and copied on export, forge-convert mcore-to-hf --vision-from HF_DIR; or trained with
# EXTRA_TRAIN_ARGS="--train-vision-tower", then synced and exported under the release's names). Released with int4 routed experts: make the
# bf16 copy once (forge-convert int4-to-bf16 --hf-dir Kimi-K2.5 --out Kimi-K2.5-bf16) and train from it; the engines
# serve the copy, or the release itself with int4 weight updates (forge.sbatch ROLLOUT_INT4_CHECKPOINT=Kimi-K2.5).
# The trainer takes the architecture from --hf-checkpoint's config.json (MODEL_ARGS empty; flags given anyway are
# checked against it). 61 layers split over pipeline stages only unevenly: e.g. PP=4 with PP_FIRST_LAYERS=13
# PP_LAST_LAYERS=12 (forge.sbatch; the trainer's --decoder-first/last-pipeline-num-layers). Source it and pass
# "${MODEL_ARGS[@]}".
MODEL_ARGS=()
# Output formats for the gateway (forge.sbatch / run_local.sh; the environment overrides them): Kimi-K2's tool-call
# sections and <think> blocks.
TOOL_PARSER="${TOOL_PARSER:-kimi_k2}"; REASONING_PARSER="${REASONING_PARSER:-kimi_k2}"
