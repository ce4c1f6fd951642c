"""Command line of ``scripts/train_forge.py``: Megatron's flags plus forge's own, in one parser.

Megatron-LM programs take ``megatron.training.arguments.parse_args(extra_args_provider=...)``; forge plugs in the
same way (:func:`add_forge_args` is the ``extra_args_provider``). The megatron-core wheel does not ship
``megatron.training``, so when it is not importable :func:`parse_args` builds a parser that mirrors the Megatron flags
forge supports with Megatron's exact names and defaults (:func:`add_megatron_args`). Either way a launch script written
for one works with the other.

Forge flags live in their own argument group; their names never collide with a Megatron-LM flag (tested against the
option list of Megatron-LM's parser). Model architecture flags are kept as arrays in ``scripts/models/<model>.sh``.

Value syntax of the mapping flags: ``--reward-weights malformed_tool_calls=-0.1,language_mixing=-0.5`` and
``--domain-ratios math=0.7,qa=0.3`` (``name=float`` pairs separated by commas).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence

from forge_megatron.algo.losses import LOSS_TYPES, NORMS, RECOMMENDED_EPS
from forge_megatron.utils.cli import name_float_pairs

ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
OLD_LOGPROBS = ("rollout", "recompute")
SYNC_TRANSPORTS = ("distributed", "disk", "none")


def _url_list(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The subset of Megatron-LM's flags forge uses, with Megatron-LM's names and defaults."""
    par = parser.add_argument_group("distributed (Megatron)")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--sequence-parallel", action="store_true",
                     help="with TP > 1: outside attention each TP rank holds 1/TP of the tree's tokens (norms, "
                          "residual stream, MLP/MoE inputs; all-gathered into the TP-split linear layers and "
                          "reduce-scattered after them), so those activations shrink by TP. Megatron-Core's MoE layer "
                          "refuses to train with TP > 1 without it. Trees are padded to a multiple of TP (x 8 CP with CP)")
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--expert-model-parallel-size", type=int, default=1)
    par.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                     help="tensor parallelism inside the experts (MoE): the TP size (default) or 1, each expert "
                          "whole on its EP rank (no TP collectives inside the experts; the EP group then spans the "
                          "TP ranks, so EP may be as large as DP x CP x TP). Needed for experts with biases "
                          "(gpt-oss) under TP")
    par.add_argument("--context-parallel-size", type=int, default=1,
                     help="CP ranks per tree-packed micro-batch: each holds 1/CP of the tree's tokens (eight chunks, "
                          "zig-zag) outside attention; --cp-comm-type says how attention gets the other keys")
    par.add_argument("--cp-comm-type", default="auto", choices=["auto", "a2a", "all_gather", "allgather"],
                     help="context parallelism inside attention. a2a: trade tokens for heads (all-to-all; CP must "
                          "divide the query heads per TP rank and divide, or be a multiple of, the key/value heads "
                          "per TP rank); all_gather: all-gather keys and values, any head count (more memory: every "
                          "rank keeps all keys of its layer for the backward; allgather is the same). auto: a2a where the heads "
                          "allow it")
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                     help="interleaved pipeline: layers per virtual stage (each PP rank holds num_layers / (PP * this) "
                          "model chunks); needs PP >= 2. The number of micro-batches is then split up to a "
                          "multiple of PP, as the interleaved schedule requires (with PP = 2 they are also padded to "
                          "one length)")
    par.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                     help="interleaved pipeline: model chunks per PP rank (instead of "
                          "--num-layers-per-virtual-pipeline-stage)")
    par.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                     help="uneven pipeline stages: the first stage's transformer layers (it also holds the "
                          "embedding); the stages without their own count share the rest equally. For models whose "
                          "layers do not split evenly (DeepSeek-V3 / Kimi-K2: 61) or to lighten a stage. With "
                          "virtual stages give --num-virtual-stages-per-pipeline-rank: each stage's layers split "
                          "into its chunks")
    par.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                     help="uneven pipeline stages: the last stage's transformer layers (it also holds the output "
                          "layer and the loss); see --decoder-first-pipeline-num-layers")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    par.add_argument("--overlap-grad-reduce", action="store_true",
                     help="reduce (or, with the distributed optimizer, reduce-scatter) each gradient bucket over DP "
                          "as soon as the backward has filled it, overlapped with the rest of the backward")
    par.add_argument("--overlap-param-gather", action="store_true",
                     help="with --use-distributed-optimizer: all-gather each bucket of updated parameters during the "
                          "next forward (each layer waits for its own bucket) instead of right after the optimizer "
                          "step. An iteration that syncs weights to the engines or saves a checkpoint still gathers "
                          "right after its step (they read the whole parameters): it saves time with "
                          "--weight-sync-interval > 1")
    par.add_argument("--ddp-bucket-size", type=int, default=None,
                     help="gradient bucket size in elements (default: Megatron's, 40M with --overlap-grad-reduce)")
    par.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                     help="activation recomputation: 'full' re-runs whole transformer layers in the backward (memory "
                          "for long trees), 'selective' only core attention")
    par.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                     help="with --recompute-granularity full: recompute layers in uniform chunks, or the first "
                          "--recompute-num-layers layers of each pipeline stage")
    par.add_argument("--recompute-num-layers", type=int, default=None,
                     help="layers per recomputed chunk (uniform) or recomputed layers per stage (block)")

    net = parser.add_argument_group("network size (Megatron)")
    net.add_argument("--num-layers", type=int, default=None)
    net.add_argument("--hidden-size", type=int, default=None)
    net.add_argument("--ffn-hidden-size", type=int, default=None)
    net.add_argument("--num-attention-heads", type=int, default=None)
    net.add_argument("--kv-channels", type=int, default=None)
    net.add_argument("--group-query-attention", action="store_true")
    net.add_argument("--num-query-groups", type=int, default=1)
    net.add_argument("--seq-length", type=int, default=None)
    net.add_argument("--max-position-embeddings", type=int, default=None)
    net.add_argument("--vocab-size", type=int, default=None)
    net.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    net.add_argument("--norm-epsilon", type=float, default=1e-5)
    net.add_argument("--swiglu", action="store_true")
    net.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    net.add_argument("--position-embedding-type", default="learned_absolute",
                     choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"])
    net.add_argument("--rotary-base", type=int, default=10000)
    net.add_argument("--use-rope-scaling", action="store_true",
                     help="Llama 3.1-style RoPE scaling (Megatron's flag: low/high frequency factors 1 and 4 over "
                          "8192 original positions); the HF checkpoint's own rope_scaling is what the model uses, "
                          "this flag must agree with it. YaRN and linear scaling come from the checkpoint only")
    net.add_argument("--rope-scaling-factor", type=float, default=8.0, help="factor of --use-rope-scaling")
    net.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    net.add_argument("--add-qkv-bias", action="store_true")
    net.add_argument("--qk-layernorm", action="store_true")
    net.add_argument("--init-method-std", type=float, default=0.02)
    net.add_argument("--num-experts", type=int, default=None)
    net.add_argument("--moe-router-topk", type=int, default=2)
    net.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    net.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                     help="shared experts' MLP width (GLM-4.5: n_shared_experts x moe_intermediate_size)")
    net.add_argument("--moe-layer-freq", default="1",
                     help="which layers are MoE, as Megatron writes it: 1 (all), or '([0]*K+[1]*M)' for K dense "
                          "layers first (GLM-4.5's first_k_dense_replace); other patterns are refused")
    net.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    net.add_argument("--moe-router-enable-expert-bias", action="store_true",
                     help="the router's score-correction bias (GLM-4.5's e_score_correction_bias; kept fixed)")
    net.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    net.add_argument("--moe-router-num-groups", type=int, default=None,
                     help="expert groups of group-limited routing (DeepSeek-V3 / Kimi-K2: n_group)")
    net.add_argument("--moe-router-group-topk", type=int, default=None,
                     help="groups each token may choose from (DeepSeek-V3: topk_group)")
    net.add_argument("--moe-router-bias-update-rate", type=float, default=None,
                     help="let the router's score-correction bias keep balancing the experts during RL (Megatron's "
                          "auxiliary-loss-free balancing: bias += rate x sign(mean load - load) per step; the "
                          "biases are weight-synced to the engines). Default: kept as the checkpoint has it (0)")
    net.add_argument("--rotary-percent", type=float, default=1.0,
                     help="fraction of each head RoPE rotates (GLM-4.5: 0.5)")
    net.add_argument("--multi-latent-attention", action="store_true",
                     help="DeepSeek-V3 / Kimi-K2 multi-latent attention (with --q-lora-rank, --kv-lora-rank, "
                          "--qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim; YaRN comes from the checkpoint)")
    net.add_argument("--q-lora-rank", type=int, default=None, help="query latent width (none: queries projected "
                                                                    "directly)")
    net.add_argument("--kv-lora-rank", type=int, default=32, help="key/value latent width")
    net.add_argument("--qk-head-dim", type=int, default=128, help="query/key channels without RoPE per head")
    net.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="query/key channels with RoPE per head")
    net.add_argument("--v-head-dim", type=int, default=128, help="value channels per head")
    net.add_argument("--apply-layernorm-1p", action="store_true",
                     help="norms scale by (1 + weight), weights stored zero-centred (Qwen3.5)")
    net.add_argument("--attention-output-gate", action="store_true",
                     help="a sigmoid gate on every attention head's output, from the query projection (Qwen3.5)")
    net.add_argument("--moe-shared-expert-gate", action="store_true",
                     help="a sigmoid gate on the shared expert's output (Qwen3.5-MoE)")
    net.add_argument("--experimental-attention-variant", default=None, choices=["gated_delta_net", "dsa"],
                     help="gated_delta_net: Gated DeltaNet (linear attention) layers between full-attention ones "
                          "(Qwen3.5), trained on prefix trees along every root-to-leaf path; with --linear-*. dsa: "
                          "DeepSeek sparse attention on multi-latent attention (DeepSeek-V3.2, GLM-5): an indexer "
                          "picks the keys each query attends to; with --dsa-indexer-*")
    net.add_argument("--dsa-indexer-n-heads", type=int, default=64, help="DSA indexer heads (DeepSeek-V3.2: 64, "
                                                                         "GLM-5: 32)")
    net.add_argument("--dsa-indexer-head-dim", type=int, default=128, help="DSA indexer head size")
    net.add_argument("--dsa-indexer-topk", type=int, default=2048,
                     help="keys each query attends to under DSA (a sample's first topk tokens attend densely)")
    net.add_argument("--dsa-indexer-loss-coeff", type=float, default=0.0,
                     help="train the DSA indexer on its KL to the main attention (DeepSeek-V3.2's sparse-stage loss "
                          "over each query's selected keys) with this weight; 0 (default): the indexer stays as the "
                          "checkpoint has it. Logged as dsa_indexer_kl")
    net.add_argument("--linear-attention-freq", type=int, default=None,
                     help="every N-th layer is full attention, the others Gated DeltaNet (Qwen3.5: 4)")
    net.add_argument("--linear-conv-kernel-dim", type=int, default=4, help="Gated DeltaNet short convolution width")
    net.add_argument("--linear-key-head-dim", type=int, default=128)
    net.add_argument("--linear-value-head-dim", type=int, default=128)
    net.add_argument("--linear-num-key-heads", type=int, default=16)
    net.add_argument("--linear-num-value-heads", type=int, default=32)
    net.add_argument("--bf16", action="store_true")

    train = parser.add_argument_group("training (Megatron)")
    train.add_argument("--micro-batch-size", type=int, default=None,
                       help="accepted from Megatron launch lines as 1 only: forge packs each micro-batch as one "
                            "prefix forest of up to --tree-token-budget unique tokens")
    train.add_argument("--global-batch-size", type=int, default=None)
    train.add_argument("--train-iters", type=int, default=None)
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument("--lr-decay-style", default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--adam-eps", type=float, default=1e-08)
    train.add_argument("--seed", type=int, default=1234)

    io = parser.add_argument_group("checkpointing and logging (Megatron)")
    io.add_argument("--save", default=None)
    io.add_argument("--load", default=None)
    io.add_argument("--save-interval", type=int, default=None)
    io.add_argument("--async-save", action="store_true",
                    help="write checkpoints in a background thread: at the save each rank copies its state to host "
                         "memory (one more copy of it in RAM while it is written) and training goes on; latest "
                         "moves, and the data pool commits the checkpoint's batches, once every rank has written "
                         "(checked after each step), so an unfinished checkpoint never loads")
    io.add_argument("--exit-interval", type=int, default=None,
                    help="stop after an iteration divisible by this, saving a checkpoint first when --save is set "
                         "(e.g. to end inside a slurm time limit; resume with the same flags)")
    io.add_argument("--exit-duration-in-mins", type=float, default=None,
                    help="stop, with a checkpoint when --save is set, after the first iteration (or batch wait) that "
                         "ends this many minutes after the trainer started (e.g. below a slurm time limit)")
    io.add_argument("--exit-signal-handler", action="store_true",
                    help="on --exit-signal stop after the current iteration (or at once while waiting for a batch), "
                         "with a checkpoint when --save is set, and exit 0 (e.g. slurm's --signal before a time "
                         "limit or a preemption)")
    io.add_argument("--exit-signal", default="SIGTERM", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"),
                    help="the signal --exit-signal-handler catches (default SIGTERM)")
    io.add_argument("--log-interval", type=int, default=100)
    io.add_argument("--tensorboard-dir", default=None)
    io.add_argument("--wandb-project", default=None)
    io.add_argument("--wandb-exp-name", default="")
    io.add_argument("--tokenizer-model", default=None,
                    help="accepted from Megatron launch lines and not used: the tokenizer and chat template come "
                         "with --hf-checkpoint (and the gateway's --model-path)")
    return parser


def add_forge_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: forge's RL flags in their own group. Returns ``parser``."""
    g = parser.add_argument_group("forge (agent RL)")
    g.add_argument("--longrope-factors", choices=["long", "short"], default=None,
                   help="longrope checkpoints (Phi-3.5, Phi-4-mini): the one factor list every token is rotated "
                        "with (default: long when the checkpoint's context exceeds its original one, as vLLM "
                        "chooses). The engines must rotate alike: the reference engine takes the same option; "
                        "SGLang switches lists per batch unless both are pinned (forge-convert longrope-override "
                        "prints its --json-model-override-args)")
    g.add_argument("--hf-checkpoint", default=None,
                   help="HF model directory: tokenizer, architecture and initial weights (also what engines load)")
    g.add_argument("--pool-addr", default="tcp://127.0.0.1:5555", help="ZeroMQ address of the data pool")
    g.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                   help="keep only the newest K checkpoints under --save: once one is complete (latest), the "
                        "iteration directories older than the newest K are deleted (default: keep all)")
    g.add_argument("--exit-file", default=None, metavar="PATH",
                   help="stop after the current iteration (or at once while waiting for a batch), with a checkpoint "
                        "when --save is set, and exit 0 once this file exists (rank 0 looks after each iteration). "
                        "A file left from before the start is removed. forge.sbatch creates it on the signal "
                        "slurm sends before the time limit (sbatch --signal=B:USR1@SECONDS), while the data pool "
                        "is still up to take the checkpoint's commit")
    g.add_argument("--qk-layernorm-all-heads", action="store_true",
                   help="network size, with --qk-layernorm: one RMSNorm over all query heads of a token and one over "
                        "all key heads (MiniMax-M2's qk_norm_type per_layer; Megatron-LM has no such norm) instead "
                        "of one per head; checked against the checkpoint like Megatron's network flags")
    g.add_argument("--gateway-url", default=None, help="forge-gateway base URL (paused/resumed around weight sync)")
    g.add_argument("--engine-urls", type=_url_list, default=[],
                   help="comma-separated SGLang / forge-engine URLs that receive weight updates")
    g.add_argument("--rl-loss", default="cispo", choices=LOSS_TYPES, help="policy loss (default cispo)")
    g.add_argument("--rl-eps-low", type=float, default=None,
                   help="lower clip epsilon (default: the loss's recommended value, CISPO: off)")
    g.add_argument("--rl-eps-high", type=float, default=None,
                   help="upper clip epsilon (default: the loss's recommended value, CISPO: 0.28)")
    g.add_argument("--rl-loss-norm", default="token_mean", choices=NORMS,
                   help="loss normalisation over the whole batch (all micro-batches and DP ranks): token_mean (CISPO: "
                        "divide by all loss tokens), seq_mean (mean over sequences, weighted by sample weight, of "
                        "each sequence's token mean), or constant (divide by --rl-loss-norm-constant)")
    g.add_argument("--rl-loss-norm-constant", type=float, default=None,
                   help="divisor of the summed token loss over the whole batch with --rl-loss-norm constant, e.g. "
                        "the expected loss tokens per batch (invariant to how the batch is split)")
    g.add_argument("--rl-kl-coef", type=float, default=0.0,
                   help="KL-to-reference coefficient (0: off). The reference is a frozen copy of the model loaded "
                        "from --ref-hf-checkpoint (default --hf-checkpoint), with the policy's parallel layout: one "
                        "more copy of the weights and one forward-only pass per step")
    g.add_argument("--rl-kl-type", default="k3", choices=["k1", "k3"],
                   help="KL estimator per token: k3 = exp(ref - logp) - (ref - logp) - 1 (non-negative), k1 = logp - ref")
    g.add_argument("--ref-hf-checkpoint", default=None,
                   help="HF directory of the KL reference (same architecture); default --hf-checkpoint")
    g.add_argument("--sft-data", default=None, metavar="JSONL",
                   help="supervised fine-tuning offline on these conversations or token samples (forge-sft's data "
                        "forms) instead of RL on the pool's batches: no pool, no engines, no weight sync; "
                        "--train-batch-groups samples per step, the loss the token mean of the trained tokens' NLL "
                        "over the whole batch; export with forge-convert trainer-to-hf")
    g.add_argument("--preference-data", default=None, metavar="JSONL",
                   help="train DPO offline on these preference pairs (forge-dpo's data forms, docs/training.md) "
                        "instead of RL on the pool's batches: no pool, no engines, no weight sync; --train-batch-groups "
                        "pairs per step, a pair's two sides in one prefix forest, the reference a frozen copy of "
                        "--ref-hf-checkpoint (default --hf-checkpoint); export with forge-convert trainer-to-hf")
    g.add_argument("--kto-data", default=None, metavar="JSONL",
                   help="train KTO offline on these examples, each answer labelled desirable or undesirable "
                        "(forge-kto's data forms, docs/training.md; preference pairs give one of each) instead of RL "
                        "on the pool's batches: no pool, no engines, no weight sync; --train-batch-groups examples "
                        "per step, each with its mismatched answer for the KL reference point in one prefix tree, "
                        "the reference a frozen copy of --ref-hf-checkpoint (default --hf-checkpoint)")
    g.add_argument("--kto-beta", type=float, default=0.1, help="--kto-data: KTO's beta (default 0.1)")
    g.add_argument("--kto-desirable-weight", type=float, default=1.0,
                   help="--kto-data: the desirable examples' loss weight w_D (default 1)")
    g.add_argument("--kto-undesirable-weight", type=float, default=1.0,
                   help="--kto-data: the undesirable examples' loss weight w_U (default 1; the KTO paper suggests "
                        "w_D n_D / (w_U n_U) in [1, 4/3], printed at start-up)")
    g.add_argument("--kto-no-kl", action="store_true",
                   help="--kto-data: reference point 0 instead of the batch's KL estimate from mismatched answers "
                        "(no mismatched samples, no policy pre-pass)")
    g.add_argument("--offline-eval-data", default=None, metavar="JSONL",
                   help="with --sft-data / --preference-data / --kto-data: held-out samples, pairs or examples in the "
                        "same form, scored forward-only every --offline-eval-interval iterations and at the end: "
                        "val/loss (and val/accuracy, val/margin for pairs and examples)")
    g.add_argument("--offline-eval-interval", type=int, default=None,
                   help="iterations between held-out evaluations (default: at the end only)")
    g.add_argument("--reward-model", action="store_true",
                   help="with --preference-data: train a Bradley-Terry reward model instead of DPO: a score head on "
                        "the last hidden state (from a causal LM: drawn anew; or a sequence-classification "
                        "checkpoint's), no reference model; forge-convert trainer-to-hf exports a "
                        "*ForSequenceClassification checkpoint for SGLang's /classify")
    g.add_argument("--rm-center-coef", type=float, default=0.0,
                   help="--reward-model: weight of the (r(chosen) + r(rejected))^2 term that keeps scores centred")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="--preference-data: DPO's beta (default 0.1)")
    g.add_argument("--dpo-loss", default="sigmoid", choices=("sigmoid", "ipo", "simpo"),
                   help="--preference-data: sigmoid (DPO, default), ipo: (delta - 1/(2 beta))^2, or simpo: SimPO, "
                        "length-normalised and reference-free (no reference model: --dpo-beta ~2)")
    g.add_argument("--simpo-gamma", type=float, default=0.5,
                   help="--dpo-loss simpo: the target reward margin (default 0.5)")
    g.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                   help="--preference-data: conservative DPO's label-flip probability (sigmoid loss; default 0)")
    g.add_argument("--dpo-sft-coef", type=float, default=0.0,
                   help="--preference-data: weight of the chosen side's mean per-token NLL (default 0)")
    g.add_argument("--rollout-temperature", type=float, default=1.0,
                   help="score tokens under softmax(logits / T): the temperature the rollouts sample at (gateway "
                        "--policy-temperature with --policy-sampling), whose logprobs SGLang returns by default; "
                        "old, reference and entropy terms use it too")
    g.add_argument("--ref-offload", action="store_true",
                   help="keep the KL reference's weights in (pinned) host memory and copy them to the GPU only for "
                        "its forward pass each step: frees one copy of this rank's weights for training, costs one "
                        "host-to-device copy of them per step")
    g.add_argument("--teacher-hf-checkpoint", default=None, metavar="DIR",
                   help="on-policy distillation: a frozen teacher (an HF checkpoint of any size or family the bridge "
                        "reads, with the policy's tokenizer) scores every sampled token on the same prefix trees, "
                        "and each trained token's advantage gains --distill-coef * (teacher logprob - old logprob), "
                        "the negative of the sampled reverse KL to the teacher; split with the policy's TP / PP / EP "
                        "layout, one forward-only pass per step (docs/training.md)")
    g.add_argument("--teacher-from-gateway", action="store_true",
                   help="on-policy distillation from a teacher served by SGLang: the gateway (forge-node / "
                        "forge-gateway --teacher-urls) records the teacher's logprobs of every sampled token with the "
                        "episode, and the trainer uses them as --teacher-hf-checkpoint's (a teacher too large to "
                        "hold beside the policy, scored while the rollouts run); every sample must carry them")
    g.add_argument("--distill-coef", type=float, default=1.0,
                   help="with a teacher: weight of the teacher's per-token advantage (default 1)")
    g.add_argument("--distill-outcome-coef", type=float, default=1.0,
                   help="with a teacher: weight of the pool's outcome advantages (default 1; 0: learn from the "
                        "teacher alone, no verifier needed)")
    g.add_argument("--distill-kl", choices=("sampled", "forward", "reverse", "jsd"), default="sampled",
                   help="what the teacher teaches: 'sampled' (default) its logprob of each sampled token, in the "
                        "advantage (the sampled reverse KL); 'forward' / 'reverse' / 'jsd' a dense loss, "
                        "--distill-coef x the KL(teacher || student) / KL(student || teacher) / GKD's JSD(beta) over "
                        "the teacher's --distill-topk tokens and a bucket for the rest of the vocabulary at every "
                        "trained position (GKD on the student's own samples; more signal per token; a served teacher "
                        "needs the gateway's --teacher-topk)")
    g.add_argument("--distill-jsd-beta", type=float, default=0.5, metavar="BETA",
                   help="with --distill-kl jsd: the teacher's weight in the mixture m = beta teacher + (1 - beta) "
                        "student, in (0, 1) (default 0.5: the symmetric Jensen-Shannon divergence)")
    g.add_argument("--distill-topk", type=int, default=32, metavar="K",
                   help="with --distill-kl forward|reverse|jsd: the teacher's K most likely tokens at each trained "
                        "position (default 32; the KL over them and the rest bucket never exceeds the full KL and reaches it "
                        "once they hold all of the teacher's and student's mass)")
    g.add_argument("--teacher-offload", action="store_true",
                   help="keep the teacher's weights in (pinned) host memory, on the device only for its forward pass "
                        "each step (as --ref-offload)")
    g.add_argument("--critic", action="store_true",
                   help="PPO with a learned value function: a critic (a value model: the transformer of "
                        "--critic-hf-checkpoint and a one-output head read at every token) trains beside the policy "
                        "on the same prefix trees, and each trained token's advantage is GAE toward its segment's "
                        "return instead of the pool's group advantage (training/critic.py; docs/training.md)")
    g.add_argument("--critic-hf-checkpoint", default=None, metavar="DIR",
                   help="the critic's initial weights: a causal LM (its head drawn new) or a one-label reward model, "
                        "with the policy's tokenizer (default: --hf-checkpoint); implies --critic")
    g.add_argument("--critic-lr", type=float, default=None,
                   help="the critic's peak learning rate (default: --lr), on the policy's schedule (warm-up, decay; "
                        "its minimum scaled as --min-lr is to --lr)")
    g.add_argument("--critic-warmup-iters", type=int, default=0, metavar="N",
                   help="the first N iterations train the critic alone (the policy's loss is measured, not "
                        "stepped), so that the first policy updates see fitted values (default 0)")
    g.add_argument("--gae-gamma", type=float, default=1.0,
                   help="with --critic: GAE's discount per trained token (default 1)")
    g.add_argument("--gae-lambda", type=float, default=1.0,
                   help="with --critic: GAE's lambda (default 1: A_t = return - V_t; lower trades variance for the "
                        "critic's bias)")
    g.add_argument("--whiten-advantages", action=argparse.BooleanOptionalAction, default=None,
                   help="whiten the advantages over the whole batch's trained tokens, every DP rank's (zero mean, unit "
                        "variance): with --critic the GAE advantages (default on), without it the pool's group "
                        "advantages (default off; with the pool's --no-std-normalize this is REINFORCE++ with a "
                        "group baseline)")
    g.add_argument("--value-clip", type=float, default=None, metavar="EPS",
                   help="with --critic: PPO's value clipping, the value loss the larger of (V - R)^2 and "
                        "(V_old + clip(V - V_old, -EPS, EPS) - R)^2 with V_old the values before this step's updates "
                        "(default off; matters with --ppo-mini-batches / --ppo-epochs above 1)")
    g.add_argument("--ppo-mini-batches", type=int, default=1, metavar="M",
                   help="optimizer steps per batch: the batch's groups are shuffled into M mini-batches of near-equal "
                        "group counts, each one update (its own token-mean normaliser); pi_old, the reference's, "
                        "a teacher's and a critic's passes all run on the weights from before the first update "
                        "(default 1; needs M x data-parallel size <= groups per batch)")
    g.add_argument("--ppo-epochs", type=int, default=1, metavar="E",
                   help="passes over the batch's mini-batches per iteration (default 1), the mini-batches in a "
                        "new order each pass; the weights are synced and checkpointed once per iteration")
    g.add_argument("--ppo-target-kl", type=float, default=None, metavar="KL",
                   help="stop a batch's updates early once one of them measures the policy further than KL from "
                        "pi_old (ppo_kl, the k3 estimate over the batch's tokens, every DP rank's): that update is "
                        "not stepped, nor the ones after it; the first update always steps (default: off)")
    g.add_argument("--rl-entropy-coef", type=float, default=0.0, help="entropy bonus coefficient (0: off)")
    g.add_argument("--rl-tis-cap", type=float, default=None,
                   help="truncated importance weight cap on exp(old - rollout logprob) (default off)")
    g.add_argument("--rl-mismatch-band", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="mask the policy-gradient loss of tokens whose exp(old - rollout logprob) lies outside "
                        "[LOW, HIGH] (IcePop; e.g. 0.5 2.0); logs mismatch_masked_frac (default off)")
    g.add_argument("--old-logprobs", default="rollout", choices=OLD_LOGPROBS,
                   help="'rollout': the engines' recorded logprobs are pi_old (fully async); 'recompute': a "
                        "no-grad forward of the current weights before the update gives pi_old")
    # The pool (forge-node / forge-pool) computes rewards and advantages and applies the window; these flags must
    # agree with it. The trainer checks every one given here against the pool at start-up (check_pool_config), and
    # the launch scripts pass the same values to both.
    g.add_argument("--advantage-estimator", default=None, choices=ADVANTAGE_ESTIMATORS,
                   help="group baseline: grpo (mean) or rloo (leave-one-out); applied by the pool, checked here "
                        "(default: the pool's, grpo)")
    g.add_argument("--reward-weights", type=name_float_pairs, default=None,
                   help="process reward weights, e.g. malformed_tool_calls=-0.1,language_mixing=-0.5; applied by the "
                        "pool, checked here")
    g.add_argument("--completion-time-bound", type=float, default=None,
                   help="largest completion-time bonus for fast successful episodes (0: off); applied by the pool, "
                        "checked here (default: the pool's, 0)")
    g.add_argument("--overlong-max-tokens", type=int, default=None, metavar="L",
                   help="overlong penalty (DAPO's soft overlong punishment) on each episode's sampled tokens: "
                        "-penalty past L, a ramp over the --overlong-buffer-tokens before it; applied by the pool, "
                        "checked here (default: the pool's, off)")
    g.add_argument("--overlong-buffer-tokens", type=int, default=None, metavar="B",
                   help="the last B tokens before --overlong-max-tokens where the penalty ramps up (pool side)")
    g.add_argument("--overlong-penalty", type=float, default=None,
                   help="the largest overlong penalty (pool side; default 1)")
    g.add_argument("--window-fraction", type=float, default=None,
                   help="windowed FIFO: W = ceil(fraction * rollout batch groups); applied by the pool, checked here "
                        "(default: the pool's, 0.3)")
    g.add_argument("--rollout-batch-groups", type=int, default=16,
                   help="N: groups the rollout side generates per policy version")
    g.add_argument("--train-batch-groups", type=int, default=None,
                   help="groups per optimizer step (default: the global batch size, else rollout batch groups)")
    g.add_argument("--group-size", type=int, default=8, help="rollouts per task (GRPO group size)")
    g.add_argument("--tree-token-budget", type=int, default=8192,
                   help="unique (merged) tokens per micro-batch, the whole tree (under context parallelism each CP "
                        "rank holds 1/CP of them); one sample must fit")
    g.add_argument("--overlong-samples", default="drop", choices=["drop", "error"],
                   help="a sample longer than --tree-token-budget fits no micro-batch: drop leaves it out of training "
                        "(counted as overlong_samples, warned about), error stops the run (which would then meet the "
                        "same batch again after a restart)")
    g.add_argument("--no-tree-merging", action="store_false", dest="tree_merging",
                   help="train every sample as its own causal sequence (for comparison)")
    g.add_argument("--dp-balance", default="cost", choices=["cost", "cost-groups", "round-robin"],
                   help="how a batch's groups are split over the data-parallel ranks: 'cost' gives every rank work "
                        "of near-equal estimated compute (tree tokens and attended pairs), dealing the episodes of a "
                        "group that costs more than a rank's share to several ranks (logged as dp_split_groups); "
                        "'cost-groups' keeps every group on one rank; 'round-robin' deals groups in order")
    g.add_argument("--no-fused-logprobs", action="store_false", dest="fused_logprobs",
                   help="run Megatron's output layer and score its [tokens, vocabulary] logits (in chunks); by "
                        "default the output layer is fused into the logprobs, chunk by chunk, so those logits never "
                        "exist at once (same values; one extra output-layer matmul in the backward)")
    g.add_argument("--routing-replay", action="store_true",
                   help="MoE: route every token to the experts the rollout engine used for it (rollout routing replay, "
                        "R3), from the routed experts the gateway records (SGLang --enable-return-routed-experts, "
                        "gateway --return-routed-experts; forge.sbatch: ROUTING_REPLAY=1). Tokens without a record "
                        "are routed by the trainer. Logs routing_mismatch: the share of replayed (token, layer) "
                        "rows the trainer's router would have routed differently")
    g.add_argument("--routing-replay-split", action="store_true",
                   help="with --routing-replay: merge samples' shared prefixes only as far as their recorded experts "
                        "agree, so every sample is scored through exactly its engine's routing (costs the merging "
                        "lost where they disagree; routing_prefix_conflicts shows how often that is)")
    g.add_argument("--train-vision-tower", action="store_true",
                   help="vision-language checkpoints (Qwen3-VL, Qwen3.5, Qwen2.5-VL, GLM-4.xV, Gemma 3 / 4, Mistral 3, "
                        "Kimi-K2.5: multimodal.families.SUPPORTED): train the vision "
                        "tower with the language model (by default it stays frozen, the checkpoint's own). The tower "
                        "becomes part of the first pipeline stage's model: its gradients are reduced with the "
                        "language model's, its weights are in the optimizer, the checkpoints, the weight sync to the "
                        "engines (under the checkpoint's names, e.g. model.visual.*) and the HF export; the KL "
                        "reference keeps the checkpoint's. "
                        "Qwen3-VL's DeepStack layers must be on the first stage. A run saved with the tower frozen "
                        "may resume with it (the tower then starts from --hf-checkpoint's weights)")
    g.add_argument("--vision-lr", type=float, default=None, metavar="LR",
                   help="with --train-vision-tower: the tower's peak learning rate (default --lr; its minimum "
                        "--min-lr in the same proportion, the same warm-up and decay), e.g. a tenth of --lr to move "
                        "the pretrained encoder more gently than the language model; 0 keeps it as it is")
    g.add_argument("--vision-trainable", default="*", metavar="GLOBS",
                   help="with --train-vision-tower: which of the tower's parameters train, comma-separated shell "
                        "globs over their names as in the checkpoint after model.visual. (default '*': all), e.g. "
                        "'merger.*,deepstack_merger_list.*' (Qwen3-VL's projectors) to train the projection into the "
                        "language model and keep the encoder's blocks as they are; resume with the same globs")
    g.add_argument("--recompute-vision-tower", action="store_true",
                   help="with --train-vision-tower: the tower's blocks keep only their inputs for the backward and "
                        "run again there (activation checkpointing), for micro-batches of many or large images")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R instead of the whole model: the checkpoint's weights stay "
                        "frozen, each adapted linear gets y += (alpha / R) x A^T B^T (B starts at zero), and only "
                        "the adapters have gradients and optimizer state. Adapters follow the linears' TP split "
                        "(with sequence parallelism too); the weight sync and the HF export send the merged weights "
                        "W + (alpha / R) B A, so the engines need no LoRA support (or the adapters alone: "
                        "--weight-sync-lora adapter); checkpoints hold the adapters alone (the frozen weights read "
                        "from --hf-checkpoint again on resume). Attention and dense MLPs are "
                        "adapted (MoE experts when --lora-target-modules names them); linear-attention mixers, "
                        "embeddings, norms and the head are not (docs/training.md)")
    g.add_argument("--lora-alpha", type=float, default=None, metavar="ALPHA",
                   help="with --lora-rank: the adapters' scale numerator (default 2 x R; the update is scaled by "
                        "ALPHA / R)")
    g.add_argument("--lora-target-modules", default="all", metavar="NAMES",
                   help="with --lora-rank: which of each layer's linears get adapters, comma-separated Megatron "
                        "names (linear_qkv: q/k/v projections; multi-latent attention's linear_q_proj or "
                        "linear_q_up_proj and linear_kv_up_proj; linear_proj: attention output; linear_fc1: gate "
                        "and up; linear_fc2: down); all: every one of those a layer has (the default). A MoE "
                        "layer's experts are adapted only when named: experts (each routed expert's fc1 and fc2, "
                        "an adapter per expert), shared_experts, e.g. 'all,experts,shared_experts'")
    g.add_argument("--fp32-lm-head", action="store_true",
                   help="compute the output layer (LM head) in fp32 in the loss: the bf16 weight and the final hidden "
                        "states are upcast for its matmul (MiniMax-M1 traced most of the training/inference "
                        "probability mismatch of bf16 models to the head's precision). Pair it with SGLang's "
                        "--enable-fp32-lm-head (forge.sbatch: FP32_LM_HEAD=1). Needs the fused logprobs; costs an fp32 "
                        "copy of the head's vocabulary slice during the loss and fp32 matmuls there. Watch "
                        "rollout_logp_abs_diff and rollout_kl")
    g.add_argument("--weight-sync-interval", type=int, default=1, help="push weights to the engines every k steps")
    g.add_argument("--weight-sync-transport", default="distributed", choices=SYNC_TRANSPORTS,
                   help="distributed broadcast, safetensors on shared disk, or none")
    g.add_argument("--weight-sync-dir", default=None, help="directory for --weight-sync-transport disk, shared by the engines and "
                   "the trainer's nodes (each pipeline stage's lead writes its own files); with --weight-sync-lora "
                   "adapter, where rank 0 writes each version's adapter for the engines to load")
    g.add_argument("--weight-sync-master-addr", default="127.0.0.1",
                   help="address at which each pipeline stage's lead hosts its weight-update group (engines join "
                        "one group per stage); 'auto': each lead's own hostname (multi-node: use 'auto'). A lead that "
                        "cannot listen on the given address uses the one it routes to the engines through")
    g.add_argument("--weight-sync-bucket-mb", type=float, default=512.0, help="bucket size of the weight sync")
    g.add_argument("--weight-sync-fp8", default=None, metavar="CHECKPOINT",
                   help="the engines serve a block-wise FP8 checkpoint (its directory or config.json; e.g. made by "
                        "forge-convert hf-to-fp8): send projection weights quantized as that checkpoint stores them "
                        "(float8_e4m3fn + weight_scale_inv per block of its weight_block_size; embeddings, LM head, "
                        "norms, routers and its modules_to_not_convert unquantized). About half the bytes of a bf16 "
                        "sync; the FP8 rounding shows up in rollout_logp_abs_diff / rollout_kl")
    g.add_argument("--weight-sync-int4", default=None, metavar="CHECKPOINT",
                   help="the engines serve a compressed-tensors int4 checkpoint (its directory or config.json: "
                        "Kimi-K2-Thinking / Kimi-K2.5 as released): send the projection weights it quantizes as it "
                        "stores them (weight_packed + weight_scale + weight_shape, its group size; the modules in "
                        "its ignore list unquantized), computed as compressed-tensors does. Train from the bf16 copy "
                        "(forge-convert int4-to-bf16); the int4 rounding shows up in rollout_logp_abs_diff")
    g.add_argument("--int4-qat", nargs="?", const="", default=None, metavar="CHECKPOINT",
                   help="int4 quantization-aware training: compute the forward with the group-wise int4 rounding of "
                        "the weights the int4 release CHECKPOINT quantizes (default: --weight-sync-int4's), straight-"
                        "through gradients to the full-precision weights, so the trainer scores tokens with the "
                        "weights the engines sample from (mcore/int4_qat.py)")
    g.add_argument("--weight-sync-lora", default="merged", choices=["merged", "adapter"],
                   help="with --lora-rank, what a sync sends: 'merged' (default) the weights W + (alpha / R) B A "
                        "through --weight-sync-transport, engines paused meanwhile; 'adapter' the adapters alone, as "
                        "a PEFT adapter written into --weight-sync-dir (readable by the engines) and loaded by engines "
                        "that serve LoRA (SGLang --enable-lora --max-lora-rank >= R --lora-target-modules all): a few "
                        "MB per sync, no pause, each call sampled by one version (the gateway names the adapter). "
                        "Needs SGLang's LoRA support for the architecture; not with experts adapted")
    g.add_argument("--weight-sync-pause-mode", default="abort", choices=["abort", "retract", "in_place"],
                   help="SGLang /pause_generation mode around a sync: 'abort' ends in-flight calls and the gateway "
                        "goes on from their sampled tokens after the sync, so every token keeps the policy version "
                        "that sampled it; 'retract' (KV cache recomputed with the new weights) and 'in_place' keep "
                        "the calls inside the engine, which reports one version per call (its tokens sampled before "
                        "the sync are counted as the new version)")
    g.add_argument("--domain-ratios", type=name_float_pairs, default={},
                   help="task mix per domain, e.g. math=0.7,qa=0.3 (also sets the per-domain metrics)")
    g.add_argument("--batch-timeout-s", type=float, default=600.0, help="longest wait for a batch from the pool")
    g.add_argument("--metrics-jsonl", default=None, help="append one JSON line of metrics per step to this file")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The mirror parser (Megatron flags forge supports + forge flags)."""
    parser = argparse.ArgumentParser(
        prog="train_forge.py", description="forge_megatron agent-RL trainer (Megatron-Core)",
        allow_abbrev=False,
    )
    return add_forge_args(add_megatron_args(parser))


def megatron_lm_available() -> bool:
    try:
        import megatron.training.arguments  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate. Megatron-LM's own parser when it is importable, else the mirror."""
    if megatron_lm_available():
        import sys

        from megatron.training.arguments import parse_args as megatron_parse_args

        saved = sys.argv
        sys.argv = [saved[0], *(argv if argv is not None else saved[1:])]
        try:
            args = megatron_parse_args(extra_args_provider=add_forge_args)
        finally:
            sys.argv = saved
    else:
        args = build_parser().parse_args(argv)
    validate_args(args)
    return args


def weight_sync_fp8(path: str | None):
    """The :class:`Fp8Config` of the FP8 checkpoint at ``path`` (a directory or its config.json), None without a
    path; ValueError naming --weight-sync-fp8 when it is not a block-wise FP8 checkpoint."""
    from forge_megatron.weight_sync.fp8 import Fp8Config

    if path is None:
        return None
    config_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(config_path) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--weight-sync-fp8 {path}: cannot read {config_path}: {exc}") from exc
    try:
        fp8 = Fp8Config.from_hf(qc)
    except ValueError as exc:
        raise ValueError(f"--weight-sync-fp8 {path}: {exc}") from exc
    if fp8 is None:
        raise ValueError(f"--weight-sync-fp8 {path}: {config_path} has no quantization_config (not an FP8 checkpoint)")
    return fp8


def lora_config(args: argparse.Namespace):
    """The :class:`~forge_megatron.mcore.lora.LoraConfig` of --lora-rank / --lora-alpha / --lora-target-modules;
    None without --lora-rank."""
    if getattr(args, "lora_rank", None) is None:
        return None
    from forge_megatron.mcore.lora import TARGETS, LoraConfig

    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    targets = []
    for t in (t.strip() for t in args.lora_target_modules.split(",")):
        targets += TARGETS if t == "all" else [t] if t else []
    return LoraConfig(args.lora_rank, alpha, tuple(dict.fromkeys(targets)))


def lora_reference(args: argparse.Namespace) -> bool:
    """Whether the KL reference of this run is the policy with its LoRA adapters off: --lora-rank, and the reference
    is the checkpoint the adapters start from (no --ref-hf-checkpoint, or the same directory)."""
    if getattr(args, "lora_rank", None) is None:
        return False
    ref = getattr(args, "ref_hf_checkpoint", None)
    return not ref or os.path.realpath(ref) == os.path.realpath(args.hf_checkpoint)


def int4_qat_config(args: argparse.Namespace):
    """The :class:`Int4Config` --int4-qat rounds by: its CHECKPOINT's, or --weight-sync-int4's; None without it."""
    if getattr(args, "int4_qat", None) is None:
        return None
    if args.int4_qat == "" and getattr(args, "weight_sync_int4", None) is None:
        raise ValueError("--int4-qat without a CHECKPOINT rounds as --weight-sync-int4's release: give one of them")
    return weight_sync_int4(args.int4_qat or args.weight_sync_int4, flag="--int4-qat" if args.int4_qat else
                            "--weight-sync-int4")


def weight_sync_int4(path: str | None, flag: str = "--weight-sync-int4"):
    """The :class:`Int4Config` of the compressed-tensors int4 checkpoint at ``path`` (a directory or its config.json;
    its quantization_config at the top level or in its text_config), None without a path; ValueError naming
    ``flag`` when it is not one."""
    from forge_megatron.weight_sync.int4 import Int4Config, quantization_config_of

    if path is None:
        return None
    config_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(config_path) as f:
            qc = quantization_config_of(json.load(f))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot read {config_path}: {exc}") from exc
    if not qc:
        raise ValueError(f"{flag} {path}: {config_path} has no quantization_config (not an int4 checkpoint)")
    try:
        return Int4Config.from_hf(qc)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from exc


def validate_args(args: argparse.Namespace) -> None:
    """Cross-flag checks; raises ValueError naming the flag."""
    if args.hf_checkpoint is None:
        raise ValueError("--hf-checkpoint is required (the HF model directory with tokenizer and config)")
    for flag in ("tree_token_budget", "weight_sync_interval", "rollout_batch_groups", "group_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.train_batch_groups is not None and args.train_batch_groups < 1:
        raise ValueError(f"--train-batch-groups must be >= 1, got {args.train_batch_groups}")
    if args.window_fraction is not None and not 0 < args.window_fraction:
        raise ValueError(f"--window-fraction must be > 0, got {args.window_fraction}")
    if args.rl_mismatch_band is not None and not 0 < args.rl_mismatch_band[0] < 1 < args.rl_mismatch_band[1]:
        raise ValueError(f"--rl-mismatch-band LOW HIGH needs 0 < LOW < 1 < HIGH, got {args.rl_mismatch_band}")
    try:
        loss_config(args)
    except ValueError as exc:
        raise ValueError(f"the --rl-* loss flags: {exc}") from exc
    if args.routing_replay_split and not args.routing_replay:
        raise ValueError("--routing-replay-split needs --routing-replay")
    vision_lr = getattr(args, "vision_lr", None)
    if vision_lr is not None and (not getattr(args, "train_vision_tower", False) or vision_lr < 0):
        raise ValueError(f"--vision-lr needs --train-vision-tower and a value >= 0, got {vision_lr}")
    if getattr(args, "vision_trainable", "*") != "*" and not getattr(args, "train_vision_tower", False):
        raise ValueError("--vision-trainable needs --train-vision-tower")
    if getattr(args, "recompute_vision_tower", False) and not getattr(args, "train_vision_tower", False):
        raise ValueError("--recompute-vision-tower needs --train-vision-tower (a frozen tower keeps no activations)")
    if getattr(args, "lora_rank", None) is not None:
        lora_config(args)
        clash = [flag for flag, on in (("--train-vision-tower", getattr(args, "train_vision_tower", False)),
                                       ("--int4-qat", getattr(args, "int4_qat", None) is not None)) if on]
        if clash:
            raise ValueError(f"--lora-rank trains adapters over frozen weights; it does not combine with {clash[0]}")
        if getattr(args, "ref_offload", False) and lora_reference(args):
            raise ValueError("--ref-offload: with --lora-rank the KL reference is the policy with its adapters off "
                             "(no copy of the weights to offload)")
    elif getattr(args, "lora_alpha", None) is not None:
        raise ValueError("--lora-alpha needs --lora-rank")
    if getattr(args, "weight_sync_lora", "merged") == "adapter":
        if getattr(args, "lora_rank", None) is None:
            raise ValueError("--weight-sync-lora adapter sends a LoRA run's adapters: it needs --lora-rank")
        if "experts" in lora_config(args).targets:
            raise ValueError("--weight-sync-lora adapter: the routed experts' adapters (--lora-target-modules "
                             "experts) have no PEFT form for the engines to load; use --weight-sync-lora merged")
        if args.weight_sync_transport == "none":
            raise ValueError("--weight-sync-lora adapter needs a weight sync (drop --weight-sync-transport none)")
        if not args.weight_sync_dir:
            raise ValueError("--weight-sync-lora adapter needs --weight-sync-dir (a directory the engines read the "
                             "adapters from)")
        quantized = [f for f in ("--weight-sync-fp8", "--weight-sync-int4")
                     if getattr(args, f[2:].replace("-", "_"), None) is not None]
        if quantized:
            raise ValueError(f"--weight-sync-lora adapter sends no base weights: {quantized[0]} (how full weights "
                             "are quantized) does not apply")
    first, last = getattr(args, "decoder_first_pipeline_num_layers", None), \
        getattr(args, "decoder_last_pipeline_num_layers", None)
    if first is not None or last is not None:  # the layer counts are checked once the model is known
        from forge_megatron.mcore.parallel import check_pipeline_split

        check_pipeline_split(args.pipeline_model_parallel_size, first, last)
        if args.pipeline_model_parallel_size > 1:
            virtual_pipeline_size(args, None)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if etp is not None and etp not in (1, args.tensor_model_parallel_size):
        raise ValueError(f"--expert-tensor-parallel-size {etp}: forge supports 1 (experts whole) or the TP size "
                         f"({args.tensor_model_parallel_size})")
    if getattr(args, "overlap_param_gather", False) and not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (only its parameters are "
                         "all-gathered after the step)")
    if args.micro_batch_size not in (None, 1):
        raise ValueError(f"--micro-batch-size {args.micro_batch_size}: forge packs every micro-batch as one prefix "
                         "forest; size them with --tree-token-budget (unique tokens per micro-batch)")
    preference = getattr(args, "preference_data", None)
    sft_data = getattr(args, "sft_data", None)
    modes = [flag for flag, value in OFFLINE_DATA_FLAGS if getattr(args, value, None) is not None]
    if len(modes) > 1:
        raise ValueError(f"{modes[0]} and {modes[1]}: one offline mode per run")
    if modes:
        _validate_offline(args, modes[0])
    _validate_kto(args)
    if sft_data is not None and args.ref_hf_checkpoint:
        raise ValueError("--sft-data trains supervised: drop --rl-kl-coef, --old-logprobs and --ref-hf-checkpoint")
    held_out = getattr(args, "offline_eval_data", None)
    if held_out is not None:
        if not modes:
            raise ValueError("--offline-eval-data needs --sft-data, --preference-data or --kto-data (the mode it "
                             "evaluates)")
        if not os.path.isfile(held_out):
            raise ValueError(f"--offline-eval-data {held_out!r} is not a file")
    if getattr(args, "offline_eval_interval", None) is not None and (held_out is None or args.offline_eval_interval < 1):
        raise ValueError("--offline-eval-interval needs --offline-eval-data and a value >= 1")
    if preference is not None:
        if not args.dpo_beta > 0:
            raise ValueError(f"--dpo-beta must be > 0, got {args.dpo_beta}")
        if not 0 <= args.dpo_label_smoothing < 0.5:
            raise ValueError(f"--dpo-label-smoothing must be in [0, 0.5), got {args.dpo_label_smoothing}")
        if args.dpo_sft_coef < 0:
            raise ValueError(f"--dpo-sft-coef must be >= 0, got {args.dpo_sft_coef}")
        if args.reward_model:
            unused = [f for f, on in (("--ref-hf-checkpoint", args.ref_hf_checkpoint),
                                      ("--ref-offload", getattr(args, "ref_offload", False)),
                                      ("--train-vision-tower", getattr(args, "train_vision_tower", False)),
                                      ("--lora-rank", getattr(args, "lora_rank", None) is not None))
                      if on]
            if unused:
                raise ValueError(f"--reward-model trains a whole text reward model (its new score head too) without a "
                                 f"reference: drop {unused[0]}")
            if args.context_parallel_size > 1:
                raise ValueError("--reward-model: not under context parallelism (a sample's last token, where its "
                                 "score is read, lives on one CP rank)")
            if args.rm_center_coef < 0:
                raise ValueError(f"--rm-center-coef must be >= 0, got {args.rm_center_coef}")
    elif getattr(args, "reward_model", False):
        raise ValueError("--reward-model needs --preference-data (the pairs it learns from)")
    if preference and args.dpo_loss == "simpo" and (args.ref_hf_checkpoint or getattr(args, "ref_offload", False)):
        raise ValueError("--dpo-loss simpo has no reference model: drop --ref-hf-checkpoint / --ref-offload")
    if args.ref_hf_checkpoint and not uses_reference_policy(args):
        raise ValueError("--ref-hf-checkpoint is used only with --rl-kl-coef > 0, --preference-data or --kto-data")
    if not 0 < getattr(args, "rollout_temperature", 1.0) <= 2:
        raise ValueError(f"--rollout-temperature must be in (0, 2], got {args.rollout_temperature}")
    _validate_critic(args)
    _validate_updates(args)
    teacher = getattr(args, "teacher_hf_checkpoint", None)
    if teacher is not None and getattr(args, "teacher_from_gateway", False):
        raise ValueError("--teacher-hf-checkpoint and --teacher-from-gateway: one teacher (in the trainer, or served "
                         "and recorded by the gateway)")
    if distills(args):
        flag = "--teacher-hf-checkpoint" if teacher is not None else "--teacher-from-gateway"
        if preference is not None or getattr(args, "kto_data", None) is not None or (
                sft_data is not None and teacher is None):
            raise ValueError(f"{flag} distils on the policy's own rollouts (RL), or with --teacher-hf-checkpoint on "
                             "--sft-data: not with --preference-data, --kto-data or a served teacher offline")
        if sft_data is not None and getattr(args, "distill_kl", "sampled") == "sampled":
            raise ValueError("--sft-data with --teacher-hf-checkpoint is supervised distillation: it needs a dense "
                             "--distill-kl forward, reverse or jsd (the sampled form's advantage is for the "
                             "student's own samples)")
        if teacher is None and getattr(args, "teacher_offload", False):
            raise ValueError("--teacher-offload: with --teacher-from-gateway the teacher is served elsewhere (no "
                             "weights here to offload)")
        if not args.distill_coef > 0 or not args.distill_outcome_coef >= 0:
            raise ValueError(f"--distill-coef must be > 0 and --distill-outcome-coef >= 0, got {args.distill_coef} "
                             f"and {args.distill_outcome_coef}")
        if getattr(args, "distill_kl", "sampled") != "sampled":
            if not args.distill_topk >= 1:
                raise ValueError(f"--distill-topk must be >= 1, got {args.distill_topk}")
        elif getattr(args, "distill_topk", 32) != 32:
            raise ValueError("--distill-topk sets the dense KL's top-k: it needs --distill-kl forward, reverse or "
                             "jsd")
        if getattr(args, "distill_jsd_beta", 0.5) != 0.5 and args.distill_kl != "jsd":
            raise ValueError("--distill-jsd-beta weighs the JSD's mixture: it needs --distill-kl jsd")
    else:
        given = [f for f, on in (("--teacher-offload", getattr(args, "teacher_offload", False)),
                                 ("--distill-kl", getattr(args, "distill_kl", "sampled") != "sampled"),
                                 ("--distill-topk", getattr(args, "distill_topk", 32) != 32),
                                 ("--distill-jsd-beta", getattr(args, "distill_jsd_beta", 0.5) != 0.5),
                                 ("--distill-coef", getattr(args, "distill_coef", 1.0) != 1.0),
                                 ("--distill-outcome-coef", getattr(args, "distill_outcome_coef", 1.0) != 1.0)) if on]
        if given:
            raise ValueError(f"{given[0]} needs --teacher-hf-checkpoint or --teacher-from-gateway (the teacher it "
                             "distils from)")
    if getattr(args, "ref_offload", False) and not uses_reference_policy(args):
        raise ValueError("--ref-offload offloads the reference model, which exists only with --rl-kl-coef > 0, "
                         "--preference-data or --kto-data")
    if args.fp32_lm_head and not args.fused_logprobs:
        raise ValueError("--fp32-lm-head needs the fused logprobs (drop --no-fused-logprobs): Megatron's own output "
                         "layer computes in the weight's dtype")
    if args.weight_sync_fp8 is not None:
        if args.weight_sync_transport == "none":
            raise ValueError("--weight-sync-fp8 needs a weight sync (--weight-sync-transport distributed or disk)")
        weight_sync_fp8(args.weight_sync_fp8)
    if getattr(args, "weight_sync_int4", None) is not None:
        if args.weight_sync_transport == "none":
            raise ValueError("--weight-sync-int4 needs a weight sync (--weight-sync-transport distributed or disk)")
        if args.weight_sync_fp8 is not None:
            raise ValueError("--weight-sync-int4 and --weight-sync-fp8: the engines serve one checkpoint")
        weight_sync_int4(args.weight_sync_int4)
    int4_qat_config(args)
    if args.weight_sync_transport == "disk" and not args.weight_sync_dir:
        raise ValueError("--weight-sync-transport disk needs --weight-sync-dir")
    if args.weight_sync_transport != "none" and not args.engine_urls:
        raise ValueError(f"--weight-sync-transport {args.weight_sync_transport} needs --engine-urls "
                         "(or use --weight-sync-transport none)")
    if args.rl_loss_norm_constant is not None and args.rl_loss_norm != "constant":
        raise ValueError(f"--rl-loss-norm-constant is used only with --rl-loss-norm constant (got --rl-loss-norm "
                         f"{args.rl_loss_norm})")
    if args.lr is None:
        raise ValueError("--lr is required")
    if args.train_iters is None or args.train_iters < 1:
        raise ValueError(f"--train-iters must be >= 1, got {args.train_iters}")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save")
    if args.async_save and args.save is None:
        raise ValueError("--async-save needs --save")
    if args.keep_checkpoints is not None:
        if args.keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
        if args.save is None:
            raise ValueError("--keep-checkpoints needs --save")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ValueError(f"--exit-interval must be >= 1, got {args.exit_interval}")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ValueError(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    for name, ratio in args.domain_ratios.items():
        if ratio < 0:
            raise ValueError(f"--domain-ratios: ratio of {name!r} is negative ({ratio})")


def _validate_critic(args: argparse.Namespace) -> None:
    """--critic and its flags (--critic-hf-checkpoint implies --critic)."""
    if getattr(args, "critic_hf_checkpoint", None):
        args.critic = True
    if getattr(args, "whiten_advantages", None) is None:  # the GAE advantages by default, the pool's not
        args.whiten_advantages = bool(getattr(args, "critic", False))
    if not getattr(args, "critic", False):
        given = [f for f, v, default in (("--critic-lr", getattr(args, "critic_lr", None), None),
                                         ("--critic-warmup-iters", getattr(args, "critic_warmup_iters", 0), 0),
                                         ("--gae-gamma", getattr(args, "gae_gamma", 1.0), 1.0),
                                         ("--gae-lambda", getattr(args, "gae_lambda", 1.0), 1.0)) if v != default]
        if given:
            raise ValueError(f"{given[0]} is a flag of the learned critic: add --critic")
        if args.whiten_advantages and offline_data(args):
            raise ValueError(f"--whiten-advantages whitens RL advantages: not with {offline_data(args)}")
        return
    if offline_data(args):
        raise ValueError(f"--critic trains a value function for RL on the pool's episodes: not with "
                         f"{offline_data(args)}")
    if getattr(args, "train_vision_tower", False):
        raise ValueError("--critic: the value model reads text only (not with --train-vision-tower)")
    for name in ("gae_gamma", "gae_lambda"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must lie in [0, 1], got {getattr(args, name)}")
    if args.critic_lr is not None and args.critic_lr < 0:
        raise ValueError(f"--critic-lr must be >= 0, got {args.critic_lr}")
    if args.critic_warmup_iters < 0:
        raise ValueError(f"--critic-warmup-iters must be >= 0, got {args.critic_warmup_iters}")


OFFLINE_DATA_FLAGS = (("--sft-data", "sft_data"), ("--preference-data", "preference_data"), ("--kto-data", "kto_data"))
"""The offline modes' data flags (training/offline.py): batches from a file in place of the pool's."""


def offline_data(args: argparse.Namespace) -> str | None:
    """The offline mode's data flag given (``--sft-data``, ``--preference-data``, ``--kto-data``), None for RL."""
    return next((flag for flag, name in OFFLINE_DATA_FLAGS if getattr(args, name, None) is not None), None)


def uses_reference_policy(args: argparse.Namespace) -> bool:
    """Whether the run holds a frozen reference policy: the KL term's (--rl-kl-coef > 0), DPO's / IPO's (not SimPO's,
    not a reward model's) or KTO's."""
    return (args.rl_kl_coef > 0 or getattr(args, "kto_data", None) is not None
            or (getattr(args, "preference_data", None) is not None and not getattr(args, "reward_model", False)
                and getattr(args, "dpo_loss", "sigmoid") != "simpo"))


_OFFLINE_LOSS = {"--sft-data": ("trains supervised", "drop --rl-kl-coef, --old-logprobs and --ref-hf-checkpoint"),
                 "--preference-data": ("trains DPO, whose reference term is its own",
                                       "drop --rl-kl-coef and --old-logprobs"),
                 "--kto-data": ("trains KTO, whose reference term is its own", "drop --rl-kl-coef and --old-logprobs")}


def _validate_offline(args: argparse.Namespace, flag: str) -> None:
    """What every offline mode needs: its file, no RL loss terms, no engines, gateway or weight sync (the default
    transport, distributed, needs engines: set to none)."""
    path = getattr(args, dict(OFFLINE_DATA_FLAGS)[flag])
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is not a file")
    if args.rl_kl_coef > 0 or args.old_logprobs != "rollout":
        what, fix = _OFFLINE_LOSS[flag]
        raise ValueError(f"{flag} {what}: {fix}")
    if args.engine_urls or args.weight_sync_transport == "disk" or args.gateway_url:
        raise ValueError(f"{flag} trains offline: no --engine-urls, --gateway-url or weight sync (export the "
                         "checkpoint with forge-convert trainer-to-hf)")
    args.weight_sync_transport = "none"


def _validate_kto(args: argparse.Namespace) -> None:
    """--kto-data and its flags."""
    kto = getattr(args, "kto_data", None)
    if kto is None:
        given = [f for f, on in (("--kto-beta", getattr(args, "kto_beta", 0.1) != 0.1),
                                 ("--kto-desirable-weight", getattr(args, "kto_desirable_weight", 1.0) != 1.0),
                                 ("--kto-undesirable-weight", getattr(args, "kto_undesirable_weight", 1.0) != 1.0),
                                 ("--kto-no-kl", getattr(args, "kto_no_kl", False))) if on]
        if given:
            raise ValueError(f"{given[0]} is a flag of KTO: it needs --kto-data")
        return
    if getattr(args, "reward_model", False):
        raise ValueError("--reward-model learns from pairs (--preference-data), not from KTO's examples")
    if not args.kto_beta > 0:
        raise ValueError(f"--kto-beta must be > 0, got {args.kto_beta}")
    if not (args.kto_desirable_weight > 0 and args.kto_undesirable_weight > 0):
        raise ValueError(f"--kto-desirable-weight and --kto-undesirable-weight must be > 0, got "
                         f"{args.kto_desirable_weight} and {args.kto_undesirable_weight}")


def _validate_updates(args: argparse.Namespace) -> None:
    """--ppo-mini-batches and --ppo-epochs: several optimizer steps per RL batch; --value-clip (the critic's)."""
    m, e = getattr(args, "ppo_mini_batches", 1), getattr(args, "ppo_epochs", 1)
    if m < 1 or e < 1:
        raise ValueError(f"--ppo-mini-batches and --ppo-epochs must be >= 1, got {m} and {e}")
    several = updates_per_iteration(args) > 1
    if offline_data(args) and several:
        raise ValueError("--ppo-mini-batches / --ppo-epochs split an RL batch into several updates; offline modes "
                         "(--sft-data, --preference-data, --kto-data) take a smaller --train-batch-groups instead")
    if m > train_batch_groups(args):
        raise ValueError(f"--ppo-mini-batches {m}: more mini-batches than the batch's {train_batch_groups(args)} "
                         "groups (--train-batch-groups)")
    target = getattr(args, "ppo_target_kl", None)
    if target is not None and (not target > 0 or not several):
        raise ValueError(f"--ppo-target-kl {target}: stops the later updates of a batch, so it needs a value > 0 and "
                         "--ppo-mini-batches x --ppo-epochs above 1")
    clip = getattr(args, "value_clip", None)
    if clip is not None:
        if not getattr(args, "critic", False):
            raise ValueError("--value-clip clips the learned critic's value loss: add --critic")
        if not clip > 0:
            raise ValueError(f"--value-clip must be > 0, got {clip}")


def updates_per_iteration(args: argparse.Namespace) -> int:
    """The policy's optimizer steps per iteration: --ppo-mini-batches x --ppo-epochs."""
    return getattr(args, "ppo_mini_batches", 1) * getattr(args, "ppo_epochs", 1)


def train_batch_groups(args: argparse.Namespace) -> int:
    """Groups per optimizer step: --train-batch-groups, else --global-batch-size, else --rollout-batch-groups."""
    return args.train_batch_groups or args.global_batch_size or args.rollout_batch_groups


def distills(args: argparse.Namespace) -> bool:
    """On-policy distillation: a teacher in the trainer (--teacher-hf-checkpoint) or recorded by the gateway."""
    return bool(getattr(args, "teacher_hf_checkpoint", None) or getattr(args, "teacher_from_gateway", False))


def loss_config(args: argparse.Namespace):
    """``algo.LossConfig`` from the --rl-* flags (unset epsilons take the loss's recommended values)."""
    from forge_megatron.algo.losses import LossConfig

    eps_low, eps_high = RECOMMENDED_EPS[args.rl_loss]
    return LossConfig(
        loss_type=args.rl_loss,
        eps_low=eps_low if args.rl_eps_low is None else args.rl_eps_low,
        eps_high=eps_high if args.rl_eps_high is None else args.rl_eps_high,
        norm=args.rl_loss_norm,
        norm_constant=args.rl_loss_norm_constant,
        kl_coef=args.rl_kl_coef,
        kl_type=args.rl_kl_type,
        entropy_coef=args.rl_entropy_coef,
        tis_cap=args.rl_tis_cap,
        mismatch_band=tuple(args.rl_mismatch_band) if args.rl_mismatch_band else None,
        distill_coef=args.distill_coef if distills(args) else 0.0,
        outcome_coef=args.distill_outcome_coef if distills(args) else 1.0,
        distill_kl=getattr(args, "distill_kl", "sampled") if distills(args) else "sampled",
        distill_jsd_beta=getattr(args, "distill_jsd_beta", 0.5),
    )


def reward_config(args: argparse.Namespace):
    """``algo.RewardConfig`` from --advantage-estimator, --reward-weights, --completion-time-bound and the
    --overlong-* flags (unset: defaults)."""
    from forge_megatron.algo.rewards import RewardConfig

    kwargs = {}
    if args.advantage_estimator is not None:
        kwargs["estimator"] = args.advantage_estimator
    if args.completion_time_bound is not None:
        kwargs["completion_time_bound"] = args.completion_time_bound
    for name in ("overlong_max_tokens", "overlong_buffer_tokens", "overlong_penalty"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if "overlong_max_tokens" not in kwargs and ("overlong_buffer_tokens" in kwargs or "overlong_penalty" in kwargs):
        raise ValueError("--overlong-buffer-tokens / --overlong-penalty need --overlong-max-tokens")
    cfg = RewardConfig(**kwargs)
    cfg.process_weights.update(args.reward_weights or {})
    return cfg


def check_pool_config(args: argparse.Namespace, pool: dict) -> None:
    """Raise if a pool-side setting given to the trainer differs from what the pool (``metrics()["config"]``) uses."""
    wanted = {"advantage_estimator": args.advantage_estimator, "completion_time_bound": args.completion_time_bound,
              "window_fraction": args.window_fraction,
              **{k: getattr(args, k, None) for k in ("overlong_max_tokens", "overlong_buffer_tokens",
                                                      "overlong_penalty")}}
    wrong = [f"--{k.replace('_', '-')} {v} (pool: {pool.get(k)})" for k, v in wanted.items()
             if v is not None and pool.get(k) != v]
    weights = pool.get("process_weights", {})
    wrong += [f"--reward-weights {k}={v} (pool: {weights.get(k)})" for k, v in (args.reward_weights or {}).items()
              if weights.get(k) != v]
    if wrong:
        raise ValueError("the data pool is configured differently from these trainer flags: " + "; ".join(wrong)
                         + ". Pass the same values to forge-node / forge-pool, or drop them here.")
    if getattr(args, "critic", False) and pool.get("drop_zero_advantage_groups"):
        raise ValueError("--critic, but the data pool drops groups whose group advantages are all zero "
                         "(--drop-zero-advantage-groups): with a learned critic those groups still have advantages "
                         "(their returns against the critic's values) and teach the critic; start forge-node / "
                         "forge-pool without it")
    if distills(args) and pool.get("drop_zero_advantage_groups"):
        raise ValueError("on-policy distillation, but the data pool drops groups whose outcome advantages are all "
                         "zero (--drop-zero-advantage-groups): those groups still carry the teacher's per-token "
                         "signal (with --distill-outcome-coef 0, every group would be dropped). Start forge-node / "
                         "forge-pool without it")


def check_gateway_config(args: argparse.Namespace, gateway: dict) -> None:
    """Raise if the gateway (``/forge/admin/state``'s ``config``) samples training calls at another temperature than
    the one this trainer scores them at (every importance ratio would be off without any error), or records a served
    teacher's logprobs when this trainer does not distil from them, or the other way round."""
    temperature = gateway.get("policy_temperature")
    if temperature is not None and float(temperature) != float(getattr(args, "rollout_temperature", 1.0)):
        raise ValueError(f"the gateway's --policy-temperature is {temperature} but this trainer's "
                         f"--rollout-temperature is {args.rollout_temperature}: give both the same value (the "
                         "launchers' ROLLOUT_TEMPERATURE does)")
    teacher = gateway.get("teacher")
    if teacher is not None and bool(teacher) != bool(getattr(args, "teacher_from_gateway", False)):
        raise ValueError("the gateway records a served teacher's logprobs (--teacher-urls) but this trainer does not "
                         "distil from them: add --teacher-from-gateway (or start the gateway without --teacher-urls)"
                         if teacher else
                         "--teacher-from-gateway, but the gateway records no teacher logprobs: start it (forge-node / "
                         "forge-gateway) with --teacher-urls")
    topk = gateway.get("teacher_topk")
    if topk is not None and teacher and getattr(args, "distill_kl", "sampled") != "sampled" \
            and int(topk) < args.distill_topk:
        raise ValueError(f"--distill-kl {args.distill_kl} --distill-topk {args.distill_topk}, but the gateway records "
                         f"the served teacher's top {topk} tokens (--teacher-topk {topk}): start it with "
                         f"--teacher-topk {args.distill_topk} (or more), or lower --distill-topk")


def parallel_config(args: argparse.Namespace, num_layers: int | None = None):
    """Model-parallel sizes from the flags; ``num_layers`` (the model's) is needed for virtual pipeline stages."""
    from forge_megatron.mcore.parallel import ParallelConfig

    parallel = ParallelConfig(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                              ep=args.expert_model_parallel_size, cp=args.context_parallel_size,
                              etp=getattr(args, "expert_tensor_parallel_size", None),
                              vpp=virtual_pipeline_size(args, num_layers),
                              first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
                              last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None))
    if num_layers is not None:
        parallel.layer_chunks(num_layers)  # the layers split into the stages (ValueError naming the counts)
    return parallel


def virtual_pipeline_size(args: argparse.Namespace, num_layers: int | None) -> int | None:
    """Model chunks per PP rank from --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank
    (None: no interleaving)."""
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    chunks = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if per_stage is None and chunks is None:
        return None
    if per_stage is not None and chunks is not None:
        raise ValueError("give --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank, "
                         "not both")
    pp = args.pipeline_model_parallel_size
    if pp < 2:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size >= 2")
    uneven = getattr(args, "decoder_first_pipeline_num_layers", None) is not None or \
        getattr(args, "decoder_last_pipeline_num_layers", None) is not None
    if uneven:  # each stage's layers split into the chunks (mcore/parallel.pipeline_chunks checks them)
        if per_stage is not None:
            raise ValueError("with uneven pipeline stages give --num-virtual-stages-per-pipeline-rank (the stages "
                             "hold different numbers of layers per chunk), not --num-layers-per-virtual-pipeline-stage")
        if chunks < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank {chunks}: must be >= 1")
        return chunks if chunks > 1 else None
    if num_layers is None:
        raise ValueError("the model's number of layers is needed to lay out virtual pipeline stages")
    if per_stage is not None:
        if per_stage < 1 or num_layers % (pp * per_stage):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: the model's {num_layers} layers "
                             f"do not split into {pp} pipeline ranks x chunks of {per_stage} layers")
        chunks = num_layers // (pp * per_stage)
    if chunks < 1 or num_layers % (pp * chunks):
        raise ValueError(f"{chunks} virtual stages per pipeline rank: the model's {num_layers} layers do not split "
                         f"into {pp} x {chunks} equal chunks")
    return chunks if chunks > 1 else None


def dense_prefix(moe_layer_freq: str, num_layers: int) -> int:
    """The number of dense layers before the MoE ones that Megatron's ``--moe-layer-freq`` describes."""
    text = str(moe_layer_freq).replace(" ", "")
    if text == "1":
        return 0
    m = re.fullmatch(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?", text)
    if m is None:
        raise ValueError(f"--moe-layer-freq {moe_layer_freq!r}: only 1 or '([0]*K+[1]*M)' (K dense layers, then "
                         "MoE layers) are supported")
    dense, moe = int(m.group(1)), int(m.group(2))
    if dense + moe != num_layers or moe < 1:
        raise ValueError(f"--moe-layer-freq {moe_layer_freq!r} describes {dense + moe} layers ({moe} MoE); the model "
                         f"has {num_layers}")
    return dense


def gpt_config(args: argparse.Namespace, vocab_size: int):
    """``mcore.model.GPTConfig`` from Megatron's network-size flags (the arrays of scripts/models/<model>.sh)."""
    from forge_megatron.mcore.model import GPTConfig

    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required (source a scripts/models/<model>.sh array)")
    if args.position_embedding_type != "rope":
        raise ValueError(f"forge models use --position-embedding-type rope (tree positions are depths), "
                         f"got {args.position_embedding_type!r}")
    variant = {}  # the attention variant's fields: Gated DeltaNet layers or DeepSeek sparse attention
    if args.experimental_attention_variant == "gated_delta_net":
        freq = args.linear_attention_freq
        if not freq or freq < 1:
            raise ValueError("--experimental-attention-variant gated_delta_net needs --linear-attention-freq N (every "
                             "N-th layer full attention; Qwen3.5: 4)")
        variant = dict(linear_attention=tuple((i + 1) % freq != 0 for i in range(args.num_layers)),
                       linear_num_key_heads=args.linear_num_key_heads,
                       linear_num_value_heads=args.linear_num_value_heads,
                       linear_key_head_dim=args.linear_key_head_dim, linear_value_head_dim=args.linear_value_head_dim,
                       linear_conv_kernel=args.linear_conv_kernel_dim)
    if args.experimental_attention_variant == "dsa":
        if not args.multi_latent_attention:
            raise ValueError("--experimental-attention-variant dsa needs --multi-latent-attention (and --q-lora-rank)")
        variant = dict(dsa_index_heads=args.dsa_indexer_n_heads, dsa_index_head_dim=args.dsa_indexer_head_dim,
                       dsa_index_topk=args.dsa_indexer_topk)
    extra = {"moe_router_score_function": args.moe_router_score_function,
             "moe_router_enable_expert_bias": args.moe_router_enable_expert_bias,
             "moe_router_topk_scaling_factor": args.moe_router_topk_scaling_factor,
             "moe_router_num_groups": args.moe_router_num_groups,
             "moe_router_group_topk": args.moe_router_group_topk} \
        if args.num_experts and args.moe_router_score_function == "sigmoid" else {}
    if args.num_experts and args.moe_shared_expert_gate:
        extra["moe_shared_expert_gate"] = True
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        kv_channels=args.v_head_dim if args.multi_latent_attention else args.kv_channels,
        **(dict(kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim)
           if args.multi_latent_attention else {}),
        vocab_size=args.vocab_size or vocab_size,
        max_position_embeddings=args.max_position_embeddings or args.seq_length or 4096,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        add_qkv_bias=args.add_qkv_bias,
        add_bias_linear=args.add_bias_linear,
        qk_layernorm=args.qk_layernorm,
        qk_layernorm_all_heads=args.qk_layernorm_all_heads,
        rotary_base=float(args.rotary_base),
        rope_scaling={"rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if args.use_rope_scaling else None,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_ffn_hidden_size=args.moe_shared_expert_intermediate_size,
        moe_dense_layers=dense_prefix(args.moe_layer_freq, args.num_layers) if args.num_experts else 0,
        rotary_percent=args.rotary_percent,
        zero_centered_norm=args.apply_layernorm_1p,
        attention_output_gate=args.attention_output_gate,
        extra=extra,
        bf16=args.bf16,
        **variant,
    )
