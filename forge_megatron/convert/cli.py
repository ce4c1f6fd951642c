"""``forge-convert``: convert checkpoints between Hugging Face safetensors and Megatron-Core, and reshard.

    forge-convert hf-to-mcore --hf-dir Qwen3-8B --out ckpt/qwen3 --tp 4 --pp 2
    forge-convert mcore-to-hf --mcore-dir ckpt/qwen3 --out Qwen3-8B-rl
    forge-convert reshard --mcore-dir ckpt/qwen3 --out ckpt/qwen3-tp8 --tp 8 --pp 1
    forge-convert trainer-to-hf --save-dir runs/x/checkpoints --out Qwen3-8B-rl-step500 [--iteration 500]
    forge-convert hf-to-fp8 --hf-dir Qwen3-30B-A3B --out Qwen3-30B-A3B-FP8 [--block 128 128]
    forge-convert mxfp4-to-bf16 --hf-dir gpt-oss-20b --out gpt-oss-20b-bf16
    forge-convert int4-to-bf16 --hf-dir Kimi-K2-Thinking --out Kimi-K2-Thinking-bf16
    forge-convert longrope-override --hf-dir Phi-4-mini-instruct [--factors long]   (JSON for SGLang's
        --json-model-override-args: every batch rotated with the trainer's factor list)

Megatron checkpoints are written in the per-rank ``torch`` format (``--ckpt-format torch``); for ``torch_dist`` run
``torchrun ... -m forge_megatron.convert.torch_dist`` (see docs/conversion.md).

Architectures: LlamaForCausalLM (Llama 3.1-3.3 RoPE scaling included), MistralForCausalLM, Qwen2ForCausalLM,
Ministral3ForCausalLM / Mistral3ForConditionalGeneration (Ministral 3, Mistral-Small 3.1 / 3.2: query scaling
past the original context; the Pixtral tower copied on export), Mistral4ForCausalLM (Mistral Small 4, and as
released inside Mistral3ForConditionalGeneration: multi-latent attention, a softmax router, experts stacked on
disk), Qwen3ForCausalLM, Qwen3VLForConditionalGeneration (Qwen3-VL dense; the vision tower copied on export),
Qwen3VLMoeForConditionalGeneration (Qwen3-VL-MoE; experts fused on disk; the vision tower copied on export),
Qwen2_5_VLForConditionalGeneration / Qwen2VLForConditionalGeneration (Qwen2.5-VL / Qwen2-VL as released: a flat
config, the language model under model.*, the vision tower under visual.* copied on export),
Qwen3MoeForCausalLM, Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7), DeepseekV3ForCausalLM (DeepSeek-V3 /
V3.1, Kimi-K2, Moonlight: multi-latent attention), KimiK25ForConditionalGeneration /
Kimi_K25ForConditionalGeneration (Kimi-K2.5 / K2.6: Kimi-K2 under language_model.*, the vision tower copied on
export; released int4: int4-to-bf16 first), DeepseekV32ForCausalLM (DeepSeek-V3.2: sparse attention, its indexer
converted too), GlmMoeDsaForCausalLM (GLM-5), Glm4MoeLiteForCausalLM (GLM-4.7-Flash), MiniMaxM2ForCausalLM
(MiniMax-M2 / M2.1 / M2.5), Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM and, as released,
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration (Qwen3.5: Gated DeltaNet layers; the vision
tower is not trained and is copied on export: mcore-to-hf --vision-from HF_DIR), Qwen3NextForCausalLM (Qwen3-Next),
GptOssForCausalLM (gpt-oss, bf16 copies; TP 1), Olmo2ForCausalLM / Olmo3ForCausalLM (OLMo 2 / 3: norms after
attention and MLP), OlmoHybridForCausalLM (OLMo Hybrid: OLMo 3 attention and Gated DeltaNet layers),
KimiLinearForCausalLM (Kimi Linear: Kimi Delta Attention and RoPE-less multi-latent attention, DeepSeek-V3's MoE),
GemmaForCausalLM (Gemma 2B / 7B, CodeGemma: Gemma's norms, GeGLU and scaled embedding in Llama's layers), Gemma2ForCausalLM (Gemma 2: soft-capped attention scores and logits), CohereForCausalLM / Cohere2ForCausalLM / Cohere2MoeForCausalLM (Command R, R7B / A, A+: attention and MLP in parallel on one bias-free LayerNorm, NoPE full layers beside rotating windows, experts averaged with a shared expert), ArceeForCausalLM (Arcee AFM: a squared-ReLU MLP), MinistralForCausalLM (Ministral 8B: sliding-window layers), CwmForCausalLM (Meta CWM: three of every four layers sliding windows), GraniteSWAForCausalLM / GraniteMoeSWAForCausalLM (Granite SWA: sliding windows, sinks, a RoPE base per layer), Exaone4_5_ForConditionalGeneration (EXAONE 4.5: its language model; the tower copied on export), Llama4ForCausalLM and, as released, Llama4ForConditionalGeneration (Llama 4 Scout / Maverick: chunked attention, NoPE layers with a temperature, top-1 experts fed scaled inputs; the vision model copied on export), Gemma3ForCausalLM and, as released, Gemma3ForConditionalGeneration (Gemma 3; the SigLIP tower copied on export), Gemma4ForCausalLM and, as released, Gemma4ForConditionalGeneration (Gemma 4 31B, 26B-A4B, E4B, E2B: global layers with their own head size, values = keys, proportional RoPE; experts beside the dense MLP; per-layer inputs, KV sharing; the vision and audio towers copied on export), SmolLM3ForCausalLM (NoPE layers), SeedOssForCausalLM (Seed-OSS), Ernie4_5ForCausalLM / Ernie4_5_MoeForCausalLM (ERNIE 4.5: interleaved RoPE, a softmax router choosing with a score-correction bias), HunYuanDenseV1ForCausalLM / HunYuanMoEV1ForCausalLM (Hunyuan: q/k norms after RoPE, an NTK-alpha RoPE base; a shared MLP beside the experts), OlmoeForCausalLM (OLMoE: q/k norms over all heads, softmax-routed experts), MiMoV2FlashForCausalLM (MiMo-V2-Flash: sliding-window layers with their own key heads and sinks, value heads narrower than the query / key heads, DeepSeek-V3's router without shared experts), MiniMaxM3SparseForConditionalGeneration (MiniMax-M3 as released: block-sparse attention layers whose indexer keeps each query's best blocks, M2's router with a shared expert and scaling, clamped SwiGLU; the vision tower, projector and patch merger copied on export) and MiniMaxM3VLForCausalLM (its language model under transformers' names), LongcatFlashForCausalLM (LongCat-Flash: two multi-latent attention and MLP sublayers per layer as two Megatron layers, a shortcut MoE with zero-computation experts), Dots1ForCausalLM (dots.llm1: GLM-4.5's MoE with per-head q/k norms), SolarOpenForCausalLM (Solar Open: GLM-4.5's MoE in every layer, Llama's attention), MixtralForCausalLM (Mixtral: softmax-routed experts under block_sparse_moe), MiniMaxText01ForCausalLM / MiniMaxM1ForCausalLM / MiniMaxForCausalLM (MiniMax-Text-01, MiniMax-M1 as released and as transformers names it: lightning-attention layers with a fixed decay per head beside a softmax one every eighth, Mixtral's experts, residuals from the norms' outputs, scaled), Phi3ForCausalLM (Phi-4, Phi-4-reasoning, Phi-4-mini: q/k/v and gate/up fused; longrope with one factor list per run), DeepseekV2ForCausalLM (DeepSeek-V2 / V2.5 / Coder-V2 236B with group-limited greedy routing, DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite: multi-latent attention, a softmax router whose top-k is kept as it is), Qwen2MoeForCausalLM (Qwen1.5-MoE, Qwen2-57B-A14B: a gated shared expert), Exaone4ForCausalLM (EXAONE 4.0: post-norm, sliding layers beside NoPE global ones), ExaoneMoeForCausalLM (K-EXAONE: the same attention, DeepSeek-V3's MoE), YoutuForCausalLM (Youtu-LLM: multi-latent attention, dense MLPs), AXK1ForCausalLM (A.X K1: DeepSeek-V3's layers, a norm after the experts), MiniCPM5MoeForCausalLM / MiniCPM5MoEForCausalLM (MiniCPM5-MoE: gated attention, DeepSeek-V3's MoE), MellumForCausalLM (Mellum 2: Qwen3-MoE with windowed layers and dense ones), Kolibri1ForCausalLM (Kolibri 1: sandwich norms, windows beside NoPE layers, experts chosen by logit plus bias), HYV3ForCausalLM (Hy3, Hunyuan 3: per-head q/k norms, sigmoid-routed experts beside a shared one), HyperCLOVAXForCausalLM (HyperCLOVA X SEED: Granite's scales, peri-layer norms, logits multiplied), Jais2ForCausalLM (Jais 2: biases and LayerNorms, a squared-ReLU MLP), Starcoder2ForCausalLM (StarCoder2: biases and LayerNorms, a tanh-GELU MLP, sliding windows), GlmForCausalLM (GLM-4 9B: GLM-4-0414's attention and fused MLP, pre-norm), GraniteForCausalLM / GraniteMoeForCausalLM / GraniteMoeSharedForCausalLM (Granite 3.x: muP-style scales; stacked experts), GraniteMoeHybridForCausalLM (Granite 4.0, and 4.0-H with Mamba-2 layers), NemotronHForCausalLM (Nemotron-H, Nemotron 3 Nano / Super / Ultra: Mamba-2, attention, MLP and MoE layers, LatentMoE), BambaForCausalLM (Bamba: Mamba-2 layers beside attention), ApertusForCausalLM (Apertus: xIELU MLPs with trained scalars, per-head q/k norms), FalconH1ForCausalLM (Falcon-H1 / H1R: attention and Mamba-2 side by side in every layer, muP multipliers), FlexOlmoForCausalLM (FlexOlmo: OLMo 2's post-norm layers with OLMoE's experts), AfmoeForCausalLM (Arcee Trinity: gated attention, sandwich norms, NoPE full layers beside rotating windows, sigmoid-routed experts), Lfm2ForCausalLM / Lfm2MoeForCausalLM (LFM2, LFM2-MoE: gated short convolutions beside attention), Lfm3ForCausalLM (LFM3: the same convolutions beside windowed and full attention with proportional RoPE, a gate per head, sandwich norms), FlintForCausalLM (Flint: sinks in every layer, rotating windows beside NoPE full layers, sigmoid-routed experts beside a shared one), LagunaForCausalLM (Laguna: query heads per layer, a softplus gate per head, windows beside full layers rotating half of each head, sigmoid-routed experts beside a shared one), Glm4ForCausalLM (GLM-4-0414 / GLM-Z1 dense), Glm4vForConditionalGeneration / Glm4vMoeForConditionalGeneration (GLM-4.1V / 4.6V-Flash, GLM-4.5V / 4.6V: the vision tower copied on export), Glm46VForConditionalGeneration (GLM-4.6V as transformers 5.x holds it, its dense glm4v_text language model); multi-token-prediction layers are left out; block-wise FP8 checkpoints (the DeepSeek-V3, Kimi-K2, MiniMax-M2 releases) are read dequantized. Options the
Megatron model cannot compute exactly are refused by name (docs/conversion.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from forge_megatron.bridge import MappingError, ParallelLayout, UnsupportedModelError


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the output (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the output (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size of the output, MoE only (default 1)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size of the output, MoE only: the TP size (default) or 1 (each "
                        "expert whole, Megatron-LM's --expert-tensor-parallel-size 1)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, dest="first",
                   help="uneven pipeline stages of the output: the first stage's layers (the stages without their "
                        "own count share the rest equally; Megatron-LM's flag of the same name)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, dest="last",
                   help="uneven pipeline stages of the output: the last stage's layers")


def _layout(args: argparse.Namespace) -> ParallelLayout:
    return ParallelLayout(args.tp, args.pp, args.ep, args.etp, args.first, args.last)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forge-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> Megatron torch checkpoint")
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="output Megatron checkpoint directory")
    _layout_args(p)
    p = sub.add_parser("mcore-to-hf", help="Megatron torch checkpoint (any layout) -> HF safetensors directory")
    p.add_argument("--mcore-dir", required=True, help="Megatron checkpoint written by forge-convert")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file in GiB (default 5)")
    p.add_argument("--vision-from", default=None,
                   help="vision-language checkpoints (Qwen3.5 as released): the HF checkpoint the model was converted "
                        "from, whose vision tower (not trained) is copied into the output")
    p = sub.add_parser("trainer-to-hf", help="forge trainer checkpoint (<save>/iter_N/rank_R.pt, any TP/PP/VPP/EP) "
                                             "-> HF safetensors directory with the tokenizer: the RL policy")
    p.add_argument("--save-dir", required=True, help="the trainer's --save directory")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--tokenizer-from", default=None,
                   help="copy tokenizer files from this directory (default: the run's --hf-checkpoint, if present)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file in GiB (default 5)")
    p.add_argument("--vision-from", default=None,
                   help="vision-language checkpoints (Qwen3.5 as released): copy the vision tower (not trained) from "
                        "this HF checkpoint (default: the run's --hf-checkpoint; a run with --train-vision-tower holds "
                        "its own, exported from the checkpoint)")
    p.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                   help="a --lora-rank run's checkpoints hold the adapters alone: the frozen weights they are merged "
                        "into come from this HF checkpoint (default: the run's --hf-checkpoint; checked to hold the "
                        "same weights)")
    p = sub.add_parser("trainer-to-peft", help="a --lora-rank run's trainer checkpoint -> its LoRA adapters as a PEFT "
                                               "adapter directory (adapter_config.json, adapter_model.safetensors) for "
                                               "the run's --hf-checkpoint")
    p.add_argument("--save-dir", required=True, help="the trainer's --save directory")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    p.add_argument("--out", required=True, help="output adapter directory")
    p = sub.add_parser("hf-to-fp8", help="HF directory -> block-wise FP8 copy for SGLang to serve (the trainer's "
                                         "--weight-sync-fp8 then sends weights in the same format)")
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors, unquantized)")
    p.add_argument("--out", required=True, help="output HF directory (with quantization_config and the tokenizer)")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"),
                   help="weight_block_size: one float32 scale per ROWS x COLS block (default 128 128)")
    p.add_argument("--skip", default="", help="comma-separated module names (or parts of names) to keep "
                                              "unquantized (modules_to_not_convert)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file in GiB (default 5)")
    p = sub.add_parser("mxfp4-to-bf16", help="MXFP4 HF checkpoint (gpt-oss as released) -> bf16 copy to train and "
                                             "serve for RL (tensor by tensor)")
    p.add_argument("--hf-dir", required=True, help="HF model directory with quantization_config quant_method mxfp4")
    p.add_argument("--out", required=True, help="output HF directory (bf16, no quantization_config, the tokenizer)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file in GiB (default 5)")
    p = sub.add_parser("int4-to-bf16", help="compressed-tensors int4 HF checkpoint (Kimi-K2-Thinking as released) -> "
                                            "bf16 copy to train and serve for RL (tensor by tensor)")
    p.add_argument("--hf-dir", required=True, help="HF model directory with quantization_config quant_method "
                                                   "compressed-tensors, format pack-quantized (int4, symmetric, groups)")
    p.add_argument("--out", required=True, help="output HF directory (bf16, no quantization_config, the tokenizer)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file in GiB (default 5)")
    p = sub.add_parser("longrope-override", help="longrope checkpoint (Phi-3.5, Phi-4-mini) -> the JSON for SGLang's "
                                                 "--json-model-override-args that pins it to one factor list")
    p.add_argument("--hf-dir", required=True, help="HF model directory whose config.json has longrope RoPE")
    p.add_argument("--factors", choices=["long", "short"], default=None,
                   help="the factor list every token is rotated with: the trainer's --longrope-factors (default: "
                        "its default, long when the context exceeds the original one)")
    p = sub.add_parser("reshard", help="Megatron torch checkpoint -> the same with another TP/PP/EP layout")
    p.add_argument("--mcore-dir", required=True, help="Megatron checkpoint written by forge-convert")
    p.add_argument("--out", required=True, help="output Megatron checkpoint directory")
    _layout_args(p)
    return parser


def longrope_override(hf_dir: str, factors: str | None) -> dict:
    """``{"rope_scaling": ...}`` (or ``rope_parameters``, as the checkpoint's config.json names it): its longrope
    entry with both factor lists the ``factors`` one (None: the trainer's default), for SGLang's
    ``--json-model-override-args``, which otherwise switches lists per batch (mcore/rope.py)."""
    import os

    from forge_megatron.mcore import rope

    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--hf-dir {hf_dir!r} has no config.json")
    with open(path) as f:
        hf = json.load(f)
    hf = hf.get("text_config") or hf
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if rope.rope_type(params) != "longrope":
        raise ValueError(f"{hf_dir} has no longrope RoPE ({key}: {rope.rope_type(params)})")
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    checked = rope.check({**params, "original_max_position_embeddings": original, "longrope_factors": factors},
                         int(hf.get("max_position_embeddings", 4096)))
    return {key: rope.pinned_longrope(params, checked["longrope_factors"])}


def main(argv: list[str] | None = None) -> int:
    from forge_megatron.convert import checkpoint

    args = build_parser().parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            checkpoint.hf_to_megatron(args.hf_dir, args.out, _layout(args))
        elif args.command == "mcore-to-hf":
            checkpoint.megatron_to_hf(args.mcore_dir, args.out, int(args.max_shard_gb * (1 << 30)), args.vision_from)
        elif args.command == "trainer-to-hf":
            from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

            summary = export_trainer_checkpoint(args.save_dir, args.out, args.iteration, args.tokenizer_from,
                                                int(args.max_shard_gb * (1 << 30)), args.vision_from,
                                                args.hf_checkpoint)
            print(f"forge-convert: iteration {summary['iteration']} (policy version {summary['policy_version']}), "
                  f"layout {summary['layout']}, {summary['tensors']} tensors, tokenizer from "
                  f"{summary['tokenizer_from'] or '(none found)'}")
        elif args.command == "trainer-to-peft":
            from forge_megatron.convert.trainer_checkpoint import export_lora_adapter

            summary = export_lora_adapter(args.save_dir, args.out, args.iteration)
            print(f"forge-convert: iteration {summary['iteration']}, LoRA rank {summary['r']} alpha "
                  f"{summary['lora_alpha']:g} on {', '.join(summary['target_modules'])} ({summary['tensors']} tensors)")
            if summary["note"]:
                print(f"forge-convert: note: {summary['note']}", file=sys.stderr)
        elif args.command == "hf-to-fp8":
            s = checkpoint.hf_to_fp8(args.hf_dir, args.out, tuple(args.block),
                                     tuple(x for x in args.skip.split(",") if x), int(args.max_shard_gb * (1 << 30)))
            print(f"forge-convert: {s['quantized']} of {s['tensors']} tensors to FP8 (block {args.block}), "
                  f"{s['bytes_in'] / 2**20:.1f} MiB -> {s['bytes_out'] / 2**20:.1f} MiB")
        elif args.command in ("mxfp4-to-bf16", "int4-to-bf16"):
            kind = "MXFP4" if args.command == "mxfp4-to-bf16" else "int4"
            convert = checkpoint.mxfp4_to_bf16 if kind == "MXFP4" else checkpoint.int4_to_bf16
            s = convert(args.hf_dir, args.out, int(args.max_shard_gb * (1 << 30)))
            print(f"forge-convert: {s['dequantized']} {kind} tensors to bf16 ({s['tensors']} tensors read), "
                  f"{s['bytes_out'] / 2**30:.2f} GiB written")
        elif args.command == "longrope-override":
            print(json.dumps(longrope_override(args.hf_dir, args.factors)))
            return 0
        else:
            checkpoint.reshard(args.mcore_dir, args.out, _layout(args))
    except (MappingError, UnsupportedModelError, ValueError, FileNotFoundError) as exc:
        print(f"forge-convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"forge-convert: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
