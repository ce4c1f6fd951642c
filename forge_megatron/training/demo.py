"""The end-to-end CPU demo behind ``bash scripts/demo.sh``: agent RL for real, every component its own process.

    1. model    a tiny Qwen2-style HF model with forge's byte-level BPE tokenizer (random weights); with ``--moe`` a
                tiny Qwen3-MoE model, and rollout routing replay on: the engine records every token's experts, the
                gateway keeps them, the trainer replays them (``routing_mismatch`` in the metrics)
    2. SFT      a short supervised warm-start on a Megatron model (forge_megatron.training.sft): the calculator
                task's format, tool call included, but only ``--sft-tool-fraction`` of the examples use the tool,
                the others answer directly (which a tiny model gets wrong), so RL has headroom
    3. serve    forge-engine (CPU reference engine, SGLang API) with the SFT weights (with ``--fp8`` a block-wise
                FP8 copy of them, and the trainer syncs FP8 weights); the middleware node
                (forge-gateway with the data pool embedded, ZeroMQ for the trainer); the calculator agent as a
                black-box HTTP service that only knows the official ``openai`` client
    4. RL       the rollout driver keeps the pool fed (groups of ``--group-size`` episodes per task); the Megatron
                trainer (scripts/train_forge.py) pulls batches, trains with CISPO on prefix trees and pushes its
                weights to the engine every step
    5. report   success rate of the first vs the last steps, ``reward_curve.png`` and ``metrics.json`` in ``--out``;
                how many engine calls the weight syncs cut and how many sampled tokens the gateway kept; pass@1 on
                ``--eval-tasks`` held-out tasks (never trained on: gateway eval sessions) before RL, every
                ``--eval-every`` versions during it (the rollout driver's periodic evaluation) and after it

``--distill`` trains by on-policy distillation instead of rewards: a teacher twice as wide, warm-started on examples
that all use the tool, scores every token the student samples (the trainer's --teacher-hf-checkpoint, on the same
prefix trees) and the student learns from it alone (--distill-outcome-coef 0): the verifier's rewards are measured,
never trained on. ``--distill served``: a second forge-engine serves the teacher and the gateway scores each episode
with it as the episode ends (--teacher-urls; the trainer's --teacher-from-gateway). ``--distill-kl reverse`` (or
``forward``) teaches with the dense KL over the teacher's top 32 tokens at every sampled token instead of the
sampled token's logprob (served: the gateway records them, --teacher-topk 32).

``--arch qwen3_vl`` swaps the task for the colour task (forge_megatron.agents.colors): a tiny Qwen3-VL, a warm-start on
chats with pictures, a colour agent that sends each picture inline; the pictures go through every process.
``--arch gemma3_vl`` does the same with a tiny Gemma 3 (a SigLIP tower, each picture's tokens seeing each other).

Every process is started in its own process group and stopped at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from forge_megatron.agents import calculator, colors
from forge_megatron.agents.tasks import write_tasks
from forge_megatron.utils.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --moe deepseek_v32: the keys each query attends to (the demo's prompts are a few hundred tokens: most of a sample's
# tokens attend sparsely)
DSA_TOPK = 64
# the colour task's vision-language models
VISION_ARCHS = ("qwen3_vl", "qwen2_5_vl", "gemma3_vl", "gemma4_vl", "ministral3_vl", "kimi_k25")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--steps", type=int, default=40, help="RL steps")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--sft-tool-fraction", type=float, default=0.3)
    p.add_argument("--distill", nargs="?", const="trainer", default=None, choices=["trainer", "served"],
                   help="on-policy distillation instead of rewards: a teacher twice as wide, warm-started with the "
                        "tool in every example, scores each token the student samples and the student learns from "
                        "it alone (--distill-outcome-coef 0); rewards are measured, not trained on (text archs). "
                        "trainer (default): the teacher runs in the trainer (--teacher-hf-checkpoint); served: a "
                        "forge-engine serves it and the gateway scores each episode as it ends (--teacher-urls, "
                        "--teacher-from-gateway)")
    p.add_argument("--distill-kl", choices=["sampled", "forward", "reverse", "jsd"], default="sampled",
                   help="with --distill: what the teacher teaches, as the trainer's --distill-kl: the sampled "
                        "token's logprob in the advantage (default), or a dense KL over its top 32 tokens (served: "
                        "the gateway records them, --teacher-topk 32)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=None,
                   help="RL learning rate (default 1e-3; 3e-4 with --arch olmo3 / olmo_hybrid / gemma3 / gemma4 / "
                        "gemma4_e and --moe gemma4_moe, whose norms after attention and MLP make these tiny models "
                        "collapse at 1e-3: success 0.31 -> 0.00 over 40 steps; their gradients equal transformers'; "
                        "and with --arch qwen3_vl / gemma3_vl, whose colour task swings at 1e-3: held-out 0.28 -> "
                        "0.75 at 20 steps -> 0.53 at 40 with qwen3_vl)")
    p.add_argument("--moe", nargs="?", const="qwen3_moe", default=None,
                   choices=["qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v32", "mistral4", "kimi_linear",
                            "gpt_oss", "minimax_m2", "gemma4_moe", "nemotron_h_moe"],
                   help="a tiny MoE model (4 experts, top-2) with rollout routing replay end to end: Qwen3-MoE "
                        "(default); glm4_moe: the GLM-4.5 layout (a dense first layer, a sigmoid router with "
                        "score-correction bias, a shared expert, RoPE on half of each head); deepseek_v3: the "
                        "DeepSeek-V3 / Kimi-K2 layout (the same MoE with grouped routing, multi-latent attention); "
                        f"deepseek_v32: DeepSeek-V3.2's (DeepSeek-V3's with sparse attention: each token past the "
                        f"{DSA_TOPK}th attends to the {DSA_TOPK} keys its indexer picks); mistral4: Mistral Small "
                        "4's (multi-latent attention with YaRN and queries scaled past position 64, a softmax "
                        "router, a shared expert); kimi_linear: Kimi Linear's (Kimi Delta Attention layers, a decay "
                        "per key channel, trained on prefix trees; every fourth layer, and the last, multi-latent "
                        "attention without RoPE; DeepSeek-V3's MoE after a dense first layer); "
                        "gpt_oss: attention sinks, a sliding window on every other layer, biased experts with the "
                        "clamped GLU; minimax_m2: the MiniMax-M2 layout (every layer MoE with the sigmoid router, "
                        "q/k RMSNorms over all heads); gemma4_moe: Gemma 4 26B-A4B's (--arch gemma4's layers with "
                        "routed experts beside the dense MLP in every layer); nemotron_h_moe: Nemotron 3 Nano's (one "
                        "sublayer per layer: Mamba-2 mixers trained on prefix trees and squared-ReLU experts "
                        "alternating, NoPE attention before the last)")
    p.add_argument("--arch", choices=["qwen2", "qwen3_5", "olmo3", "olmo_hybrid", "gemma3", "gemma4", "gemma4_e",
                                      "qwen3_vl", "qwen2_5_vl", "gemma3_vl", "gemma4_vl", "ministral3_vl",
                                      "kimi_k25"],
                   default="qwen2",
                   help="the dense model's layout: qwen2 (default); qwen3_5: the Qwen3.5 hybrid (Gated DeltaNet "
                        "linear-attention layers trained on prefix trees, every fourth layer, and the last, gated full "
                        "attention; zero-centred norms); olmo3: the OLMo 3 layout (norms after attention and MLP, "
                        "q/k norms over all heads, a 32-token sliding window on three of every four layers with "
                        "plain RoPE, YaRN on the full-attention ones); olmo_hybrid: OLMo Hybrid's (pre-norm Gated "
                        "DeltaNet layers with beta in (0, 2), every fourth layer, and the last, OLMo 3's post-norm "
                        "attention without RoPE); gemma3: the Gemma 3 text layout (norms before "
                        "and after attention and MLP, GeGLU, the scaled embedding, a 32-token window with RoPE base "
                        "10k on five of every six layers, base 1M on the others, tied embeddings); gemma4: the Gemma 4 "
                        "text layout (Gemma 3's with plain-weight norms and attention scaled by 1; every sixth layer, "
                        "and the last, global: twice the head size, half the key heads, values that are the keys, "
                        "proportional RoPE; normed values, a scalar per layer, logits soft-capped at 30); gemma4_e: "
                        "Gemma 4 E2B / E4B's (every other layer global, per-layer inputs, the second half of the "
                        "layers reusing the keys and values of the last of their kind before it, with double-wide "
                        "MLPs; needs an even --num-layers of 4 or more); qwen3_vl: a vision-language model "
                        "(Qwen3-VL's: a one-block vision tower, DeepStack, interleaved mRoPE) on the colour task "
                        "instead of the calculator (agents/colors.py: the agent sends a picture, the model names its "
                        "colour; the pictures travel through gateway, engine, pool and trainer); qwen2_5_vl: the same "
                        "task on Qwen2.5-VL's layout as released (a two-block tower, one attending in windows, "
                        "contiguous mRoPE sections, names under visual.*, the Qwen2 language model); gemma3_vl: the "
                        "same "
                        "task on Gemma 3's vision-language layout (a one-layer SigLIP tower pooled to 4 tokens per "
                        "16-pixel picture, each picture's tokens seeing each other, plain RoPE, --arch gemma3's "
                        "language model); gemma4_vl: the same on Gemma 4's (a one-layer tower on pictures of their "
                        "own sizes, 4-pixel patches pooled 2 x 2, up to 70 tokens, each picture's tokens seeing each "
                        "other in the sliding layers, --arch gemma4's language model); ministral3_vl: the same on "
                        "Mistral 3's (a one-layer Pixtral tower, pictures of their own sizes written row by row "
                        "between break tokens, Ministral 3's language model); kimi_k25: the same on Kimi-K2.5's (a "
                        "one-block MoonViT tower under the release's names, pictures of their own sizes, the "
                        "DeepSeek-V3 language model: multi-latent attention, 4 experts top-2 after a dense layer)")
    p.add_argument("--sft-correct-fraction", type=float, default=0.3,
                   help="the vision archs (qwen3_vl, gemma3_vl, ...): the fraction of warm-start answers that name "
                        "the picture's "
                        "colour (the others a random one), so RL has headroom")
    p.add_argument("--train-vision-tower", action="store_true",
                   help="the vision archs (qwen3_vl, gemma3_vl, ...): the trainer trains the vision tower with the "
                        "language model "
                        "(synced to the engine with it); by default it stays frozen")
    p.add_argument("--agent-api", choices=calculator.APIS, default="chat",
                   help="how the calculator agent calls the model: chat completions (default) or the OpenAI "
                        "Responses API (Codex-style agents); the gateway records and trains both alike")
    p.add_argument("--fp8", action="store_true",
                   help="the engine serves a block-wise FP8 copy of the SFT model (forge-convert hf-to-fp8, 32 x 32 "
                        "blocks) and the trainer syncs FP8 weights to it (--weight-sync-fp8)")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R over the frozen SFT model instead of every weight (the "
                        "trainer's --lora-rank): the engine receives the merged weights at each sync (see --lora-sync)")
    p.add_argument("--lora-sync", choices=["merged", "adapter"], default="merged",
                   help="with --lora-rank: sync the merged weights (default), or the adapters alone: the engine "
                        "serves LoRA (--enable-lora) and loads each version's adapter beside the SFT weights, "
                        "nothing paused (the trainer's --weight-sync-lora)")
    p.add_argument("--train-args", default="", metavar="FLAGS",
                   help="more flags for the trainer (scripts/train_forge.py), one shell-quoted string appended to "
                        "its command line, e.g. \"--rl-entropy-coef 0.01\" (as EXTRA_TRAIN_ARGS in forge.sbatch)")
    p.add_argument("--weight-sync-transport", default="disk", choices=["disk", "distributed"],
                   help="safetensors through a directory, or a gloo broadcast group with the engine")
    p.add_argument("--eval-tasks", type=int, default=32,
                   help="held-out tasks (no SFT or RL task among them) evaluated before, during and after RL "
                        "(0: no evaluation; at most 45)")
    p.add_argument("--eval-every", type=int, default=20, help="policy versions between evaluations during RL")
    p.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                   help="serve the agents' sessions from N gateway processes behind the gateway port (forge-node "
                        "--gateway-workers; the driver, trainer and weight sync use the one URL as before)")
    p.add_argument("--malformed-call-reward", type=float, default=None, metavar="R",
                   help="penalise each malformed tool call by R on the call that made it instead of the episode "
                        "(forge-node --malformed-call-reward, e.g. -0.1; default: the pool's episode-level weight)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up (and clean up) after this long")
    return p


class Processes:
    """Started subprocesses, each in its own process group; ``stop_all`` ends them (TERM, then KILL)."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def server(self, name: str, module: str, args: list[str]) -> str:
        from forge_megatron.rollout.launch import ProcessServer

        server = ProcessServer(module, args, env={"PYTHONUNBUFFERED": "1"})
        self.procs.append((name, server.proc))
        print(f"[demo] {name} ready at {server.url}", flush=True)
        return server.url

    def start(self, name: str, cmd: list[str], log_path: str | None = None, env: dict | None = None):
        out = open(log_path, "w") if log_path else subprocess.PIPE
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
        self.procs.append((name, proc))
        return proc

    def stop(self, name: str) -> None:
        """Stop the process started as ``name`` (TERM, then KILL after 10 s)."""
        for started, proc in self.procs:
            if started == name:
                self._stop(proc)

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        """Last started first, each waited for before the next: the rollout driver stops (an evaluation it is
        running is interrupted and not recorded) while the gateway and the agent it talks to still answer; stopped
        together, its episodes cut by the gateway's exit were scored as failures."""
        for _, proc in reversed(self.procs):
            self._stop(proc)


def _sft(args: argparse.Namespace, base: str, data: str, out_dir: str) -> None:
    """forge-sft's command line, run in this process on two threads (torch and transformers are imported here
    already, for the tiny model: a new interpreter for it imported them again, ~1.5 s of CPU a demo)."""
    import torch

    from forge_megatron.training import sft

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sft.main(["--hf-checkpoint", base, "--data", data, "--out", out_dir, "--steps", str(args.sft_steps),
                  "--seed", str(args.seed)])
    finally:
        torch.set_num_threads(threads)


def prepare_teacher(args: argparse.Namespace, tasks) -> str:
    """--distill: a teacher twice as wide as the student, warm-started on the same tasks with the tool in every
    example. Returns its directory."""
    from forge_megatron.models.tiny import build_tiny_model

    out = args.out
    with open(os.path.join(out, "sft_teacher.jsonl"), "w") as f:
        for chat in calculator.sft_conversations(tasks, 1.0, seed=args.seed):
            f.write(json.dumps({"messages": chat, "tools": calculator.TOOLS}) + "\n")
    hidden = 2 * args.hidden_size
    base = build_tiny_model(os.path.join(out, "teacher_base"), seed=args.seed + 1, hidden_size=hidden,
                            num_hidden_layers=args.num_layers, intermediate_size=2 * hidden)
    print(f"[demo]     the teacher for on-policy distillation: hidden {hidden}, {args.num_layers} layers, "
          f"{args.sft_steps} steps with the tool in every example", flush=True)
    teacher = os.path.join(out, "teacher_model")
    _sft(args, base, os.path.join(out, "sft_teacher.jsonl"), teacher)
    return teacher


def prepare(args: argparse.Namespace) -> tuple[str, str]:
    """Steps 1-2: the base model, the task files, the SFT model (and with --distill the teacher). Returns (sft model
    dir, RL tasks file)."""
    from forge_megatron.models.tiny import build_tiny_model

    out = args.out
    vision = args.arch in VISION_ARCHS
    task = colors if vision else calculator
    tasks = task.make_tasks(2400 + args.eval_tasks, seed=args.seed)  # the first 2400 do not depend on the count
    sft_tasks, rl_tasks, heldout = tasks[:2000], tasks[2000:2400], tasks[2400:]
    write_tasks(os.path.join(out, "rl_tasks.jsonl"), rl_tasks)
    if heldout:
        write_tasks(os.path.join(out, "heldout_tasks.jsonl"), heldout)
    with open(os.path.join(out, "sft.jsonl"), "w") as f:
        if vision:
            for chat in colors.sft_conversations(sft_tasks, args.sft_correct_fraction, seed=args.seed):
                f.write(json.dumps({"messages": chat}) + "\n")
        else:
            for chat in calculator.sft_conversations(sft_tasks, args.sft_tool_fraction, seed=args.seed):
                f.write(json.dumps({"messages": chat, "tools": calculator.TOOLS}) + "\n")
    kind = f"{args.moe} MoE, 4 experts top-2, " if args.moe else ""
    # gpt-oss and MiniMax-M2: every layer MoE, intermediate_size is the experts' width
    width = "intermediate_size" if args.moe in ("gpt_oss", "minimax_m2") else "moe_intermediate_size"
    arch = dict(arch=args.moe, **{width: args.hidden_size}) if args.moe else \
        dict(arch=args.arch, intermediate_size=2 * args.hidden_size)
    if args.moe == "deepseek_v32":  # sparse attention: each token past the 64th attends to 64 keys the indexer picks
        arch["index_topk"] = DSA_TOPK
    if args.moe == "mistral4":  # Llama 4's query temperature from position 64 on (most of a sample's tokens)
        arch["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    if args.moe == "kimi_linear":
        every = min(4, args.num_layers)
        arch.update(layer_types=["full_attention" if (i + 1) % every == 0 or i + 1 == args.num_layers
                                 else "linear_attention" for i in range(args.num_layers)],
                    mlp_layer_types=["dense"] + ["sparse"] * (args.num_layers - 1))
    if args.moe == "nemotron_h_moe":  # M E M E ... * E: Mamba-2 and experts alternating, attention before the last
        n = args.num_layers
        arch.update(hybrid_override_pattern="".join("*" if i == n - 2 else "ME"[i % 2] for i in range(n)),
                    mamba_head_dim=2 * args.hidden_size // 8, moe_shared_expert_intermediate_size=args.hidden_size)
        kind = "Nemotron 3 Nano layout: Mamba-2, NoPE attention and squared-ReLU expert layers, 4 experts top-2, "
    if args.arch in ("qwen3_5", "olmo_hybrid"):
        every = min(4, args.num_layers)
        arch["layer_types"] = ["full_attention" if (i + 1) % every == 0 or i + 1 == args.num_layers
                               else "linear_attention" for i in range(args.num_layers)]
        kind = "Qwen3.5 hybrid: Gated DeltaNet + gated attention, " if args.arch == "qwen3_5" else \
            "OLMo Hybrid: pre-norm Gated DeltaNet + post-norm NoPE attention, "
    if args.arch == "olmo3":
        arch.update(sliding_window=32, layer_types=["full_attention" if (i + 1) % 4 == 0 or i + 1 == args.num_layers
                                                    else "sliding_attention" for i in range(args.num_layers)])
        kind = "OLMo 3: post-norm layers, sliding windows, "
    if args.arch in ("gemma3", "gemma3_vl"):
        arch.update(sliding_window=32, layer_types=["full_attention" if (i + 1) % 6 == 0 or i + 1 == args.num_layers
                                                    else "sliding_attention" for i in range(args.num_layers)])
        kind = "Gemma 3: sandwich norms, GeGLU, sliding windows, "
    if args.arch in ("gemma4", "gemma4_vl") or args.moe == "gemma4_moe":  # the release's cap (the tiny arch's 0.5)
        arch.update(sliding_window=32, final_logit_softcapping=30.0,
                    layer_types=["full_attention" if (i + 1) % 6 == 0 or i + 1 == args.num_layers
                                 else "sliding_attention" for i in range(args.num_layers)])
        kind = ("Gemma 4 26B-A4B layout, 4 experts top-2 beside the dense MLP, " if args.moe else "Gemma 4: ") + \
            "global layers with their own heads (values = keys), proportional RoPE, soft-capped logits, "
    if args.arch == "gemma4_e":
        arch.update(sliding_window=32, final_logit_softcapping=30.0, num_kv_shared_layers=args.num_layers // 2,
                    layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(args.num_layers)])
        kind = "Gemma 4 E2B / E4B layout: per-layer inputs, KV shared by the second half of the layers, "
    if vision:
        arch["images"] = True
        kind = {"qwen3_vl": "Qwen3-VL: a one-block vision tower, DeepStack, interleaved mRoPE; the colour task, ",
                "qwen2_5_vl": "Qwen2.5-VL as released: a windowed vision tower, contiguous mRoPE sections; the "
                              "colour task, ",
                "gemma3_vl": "Gemma 3 vision-language: a SigLIP tower, bidirectional image attention, sliding "
                             "windows; the colour task, ",
                "gemma4_vl": "Gemma 4 vision-language: a tower on pictures of their own sizes, image attention both "
                             "ways in the sliding layers; the colour task, ",
                "ministral3_vl": "Mistral 3 vision-language: a Pixtral tower, pictures written row by row; the "
                                 "colour task, ",
                "kimi_k25": "Kimi-K2.5: a MoonViT tower, the DeepSeek-V3 language model (MLA, experts); the "
                            "colour task, "}[args.arch]
    print(f"[demo] 1/5 tiny model ({kind}hidden {args.hidden_size}, {args.num_layers} layers)", flush=True)
    base = build_tiny_model(os.path.join(out, "base_model"), seed=args.seed, hidden_size=args.hidden_size,
                            num_hidden_layers=args.num_layers, **arch)
    what = (f"the right colour in {args.sft_correct_fraction:.0%} of the answers" if vision else
            f"tool used in {args.sft_tool_fraction:.0%} of the examples")
    print(f"[demo] 2/5 supervised warm-start: {args.sft_steps} steps, {what}", flush=True)
    sft_dir = os.path.join(out, "sft_model")
    _sft(args, base, os.path.join(out, "sft.jsonl"), sft_dir)
    if args.distill:
        args.teacher_dir = prepare_teacher(args, sft_tasks)
    return sft_dir, os.path.join(out, "rl_tasks.jsonl")


def run_rl(args: argparse.Namespace, procs: Processes, sft_dir: str, tasks_path: str) -> str:
    """Steps 3-4. Returns the metrics JSONL path."""
    out, logs = args.out, os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    vision = args.arch in VISION_ARCHS
    print(f"[demo] 3/5 starting forge-engine, gateway + data pool, {'colour' if vision else 'calculator'} agent",
          flush=True)
    replay = ["--enable-return-routed-experts"] if args.moe else []
    served = sft_dir
    if args.fp8:
        from forge_megatron.convert.checkpoint import hf_to_fp8

        served = sft_dir + "_fp8"
        stats = hf_to_fp8(sft_dir, served, block=(32, 32))
        print(f"[demo]     FP8 copy for the engine: {stats['quantized']} weights quantized, "
              f"{stats['bytes_in'] / 2**20:.2f} -> {stats['bytes_out'] / 2**20:.2f} MiB", flush=True)
    adapter = args.lora_rank and args.lora_sync == "adapter"
    engine = procs.server("forge-engine", "forge_megatron.rollout.engine_server",
                          ["--model-path", served, *replay, *(["--enable-lora"] if adapter else [])])
    teacher_flags, distill_flags = [], []  # the gateway's and the trainer's with --distill
    if args.distill == "served":  # the gateway scores each ended episode with the teacher's engine
        teacher_flags = ["--teacher-urls", procs.server("teacher engine", "forge_megatron.rollout.engine_server",
                                                        ["--model-path", args.teacher_dir])]
        distill_flags = ["--teacher-from-gateway", "--distill-outcome-coef", "0", "--distill-kl", args.distill_kl]
        if args.distill_kl != "sampled":  # the gateway records the teacher's top-k at every sampled token
            teacher_flags += ["--teacher-topk", "32"]
    elif args.distill:  # the trainer runs the teacher
        distill_flags = ["--teacher-hf-checkpoint", args.teacher_dir, "--distill-outcome-coef", "0",
                         "--distill-kl", args.distill_kl]
    pool_addr = f"tcp://127.0.0.1:{free_port()}"
    gateway = procs.server("gateway+pool", "forge_megatron.agents.middleware_node",
                           ["--model-path", sft_dir, "--engines", engine, "--pool-bind", pool_addr,
                            "--pool-db", os.path.join(out, "pool.sqlite"), "--rollout-batch-groups",
                            str(args.groups_per_step), "--window-fraction", "1.0", "--max-staleness", "1",
                            "--train-batch-groups", str(args.groups_per_step), "--default-max-tokens", "48",
                            "--policy-sampling", "--gateway-workers", str(args.gateway_workers),
                            *(["--return-routed-experts"] if args.moe else []), *teacher_flags,
                            *([] if args.malformed_call_reward is None else
                              ["--malformed-call-reward", str(args.malformed_call_reward)])])
    agent = procs.server("colour agent", "forge_megatron.agents.colors", ["--serve"]) if vision else \
        procs.server("calculator agent", "forge_megatron.agents.calculator", ["--serve", "--api", args.agent_api])
    evals_path = os.path.join(out, "evals.jsonl")
    eval_flags = []
    if args.eval_tasks:
        heldout = os.path.join(out, "heldout_tasks.jsonl")
        held_out_eval(gateway, agent, heldout, evals_path)
        eval_flags = ["--eval-tasks", heldout, "--eval-every-versions", str(args.eval_every), "--no-eval-at-start",
                      "--eval-output", evals_path]
    what = "on-policy distillation" if args.distill else "RL"
    print(f"[demo] 4/5 {what}: {args.steps} steps x {args.groups_per_step} tasks x {args.group_size} episodes",
          flush=True)
    procs.start("rollout driver", [sys.executable, "-m", "forge_megatron.agents.driver", "--gateway-url", gateway,
                                   "--tasks", tasks_path, "--group-size", str(args.group_size),
                                   "--max-inflight-groups", str(args.groups_per_step), "--agent-url", agent + "/",
                                   "--pool-addr", pool_addr, "--seed", str(args.seed), *eval_flags],
                log_path=os.path.join(logs, "driver.log"))
    metrics = os.path.join(out, "metrics.jsonl")
    trainer = procs.start("trainer", [
        sys.executable, os.path.join(ROOT, "scripts", "train_forge.py"), "--hf-checkpoint", sft_dir,
        "--position-embedding-type", "rope", "--lr", str(args.lr), "--lr-decay-style", "constant",
        "--train-iters", str(args.steps), "--clip-grad", "1.0", "--weight-decay", "0.0",
        "--pool-addr", pool_addr, "--gateway-url", gateway, "--engine-urls", engine,
        "--weight-sync-transport", args.weight_sync_transport, "--weight-sync-dir", os.path.join(out, "weight_sync"),
        "--train-batch-groups", str(args.groups_per_step), "--tree-token-budget", "16384",
        "--metrics-jsonl", metrics, "--log-interval", "1", "--seed", str(args.seed),
        *(["--routing-replay"] if args.moe else []),
        *(["--train-vision-tower"] if args.train_vision_tower else []),
        *(["--weight-sync-fp8", served] if args.fp8 else []),
        *(["--lora-rank", str(args.lora_rank)] if args.lora_rank else []),
        *(["--weight-sync-lora", "adapter"] if adapter else []),
        *distill_flags,
        *shlex.split(args.train_args)],
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
             "LOCAL_RANK": "0"})
    deadline = time.time() + args.timeout_s
    for line in trainer.stdout:
        if line.startswith("[forge-train]") or "Error" in line or "Traceback" in line:
            print(line.rstrip(), flush=True)
        if time.time() > deadline:
            raise TimeoutError(f"the demo did not finish within {args.timeout_s:.0f}s")
    if trainer.wait() != 0:
        raise RuntimeError(f"the trainer failed (exit {trainer.returncode}); logs in {logs}")
    # the driver is done: stopped, its evaluation of the last version (if it started one) is not recorded, and the
    # one below, printed and in metrics.json, has the engine to itself
    procs.stop("rollout driver")
    if args.eval_tasks:
        held_out_eval(gateway, agent, os.path.join(out, "heldout_tasks.jsonl"), evals_path)
    with urllib.request.urlopen(gateway + "/forge/admin/state", timeout=10) as resp:
        state = json.loads(resp.read())
    return metrics, {k: state[k] for k in ("aborts", "resumed_tokens", "discarded_tokens", "teacher_scored_tokens")}


def held_out_eval(gateway: str, agent: str, tasks_path: str, evals_path: str) -> dict:
    """Evaluate the served policy on the held-out tasks (gateway eval sessions); appended to ``evals_path``."""
    from forge_megatron.agents.evaluate import append_jsonl, evaluate, publish
    from forge_megatron.agents.gateway_api import GatewayClient
    from forge_megatron.agents.runner import HttpAgent
    from forge_megatron.agents.tasks import load_tasks

    client = GatewayClient(gateway)
    result = evaluate(client, HttpAgent(agent + "/"), load_tasks(tasks_path), samples=1, timeout_s=120.0,
                      concurrency=8)
    append_jsonl(evals_path, result)
    publish(client, result)  # the trainer logs it with its next step (eval/pass@1 in metrics.jsonl)
    print(f"[demo]     held-out evaluation at policy version {result['policy_version']}: pass@1 "
          f"{result['pass@1']:.2f} on {result['tasks']} tasks never trained on ({result['wall_s']:.0f}s)", flush=True)
    return result


def summarise(args: argparse.Namespace, metrics_path: str, wall_s: float, gateway: dict | None = None) -> dict:
    """Step 5: metrics.json and reward_curve.png. ``gateway``: its abort counters (calls cut by weight syncs)."""
    with open(metrics_path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    if not steps:
        raise RuntimeError(f"{metrics_path} is empty: no training step finished")
    k = max(1, len(steps) // 4)
    first = sum(s["success_rate"] for s in steps[:k]) / k
    last = sum(s["success_rate"] for s in steps[-k:]) / k
    summary = {"first_success_rate": first, "last_success_rate": last, "steps": len(steps), "wall_s": wall_s,
               "window_steps": k, "success_rate": [s["success_rate"] for s in steps],
               "reward_mean": [s["reward_mean"] for s in steps], "merge_ratio": [s["merge_ratio"] for s in steps],
               "staleness_mean": [s["staleness_mean"] for s in steps]}
    if "distill_reverse_kl" in steps[0]:  # per token, on the student's own samples: falls as it learns
        summary["distill_reverse_kl"] = [s["distill_reverse_kl"] for s in steps]
        summary["first_reverse_kl"] = sum(summary["distill_reverse_kl"][:k]) / k
        summary["last_reverse_kl"] = sum(summary["distill_reverse_kl"][-k:]) / k
    if "routing_mismatch" in steps[0]:
        summary["routing_mismatch"] = [s["routing_mismatch"] for s in steps]
    # engine vs trainer logprob gap on tokens the trained weights sampled (None where a step had none): numerics only
    summary["onpolicy_logp_abs_diff"] = [s.get("onpolicy/rollout_logp_abs_diff") for s in steps]
    summary.update(gateway or {})
    evals_path = os.path.join(args.out, "evals.jsonl")
    if os.path.exists(evals_path):  # before RL, the driver's periodic ones, after RL
        with open(evals_path) as f:  # one per version: the driver's own evaluation at the last one may be there too
            by_version = {r["policy_version"]: r for r in map(json.loads, filter(str.strip, f))}
        evals = [by_version[v] for v in sorted(by_version)]
        summary["evals"] = [{k: r[k] for k in ("policy_version", "policy_versions", "pass@1", "mean_reward", "tasks")}
                            for r in evals]
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(steps, os.path.join(args.out, "reward_curve.png"), summary.get("evals", []))
    return summary


def plot(steps: list[dict], path: str, evals: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, [s["success_rate"] for s in steps], marker="o", label="task success rate")
    ax.plot(xs, [s["reward_mean"] for s in steps], linestyle="--", label="mean reward")
    if evals:
        ax.plot([e["policy_version"] for e in evals], [e["pass@1"] for e in evals], marker="s", linestyle=":",
                label="held-out pass@1")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("forge_megatron demo: calculator agent, CISPO on CPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _interrupt(*_):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.eval_tasks <= 45 or args.eval_every < 1:
        raise SystemExit("--eval-tasks must lie in [0, 45] (the calculator has 2445 tasks, 2400 go to SFT and RL) "
                         "and --eval-every must be >= 1")
    if args.moe and args.arch != "qwen2":
        raise SystemExit(f"--moe {args.moe} and --arch {args.arch}: the MoE layouts are their own architectures; "
                         "give one of the two")
    if args.lora_sync != "merged" and not args.lora_rank:
        raise SystemExit("--lora-sync adapter needs --lora-rank")
    if args.train_vision_tower and args.arch not in VISION_ARCHS:
        raise SystemExit(f"--train-vision-tower needs a vision-language --arch: one of {', '.join(VISION_ARCHS)}")
    if args.arch in VISION_ARCHS and args.agent_api != "chat":
        raise SystemExit(f"--arch {args.arch} runs the colour agent, which calls chat completions only")
    if args.distill_kl != "sampled" and not args.distill:
        raise SystemExit("--distill-kl needs --distill (the teacher it learns from)")
    if args.distill and (args.arch in VISION_ARCHS or args.moe):
        raise SystemExit("--distill runs the calculator task with a dense teacher: a text --arch, no --moe")
    if args.moe == "nemotron_h_moe" and (args.num_layers < 4 or args.num_layers % 2):
        raise SystemExit("--moe nemotron_h_moe needs an even --num-layers of 4 or more (Mamba-2 and expert layers "
                         "alternating, attention before the last)")
    if args.arch == "gemma4_e" and (args.num_layers < 4 or args.num_layers % 2):
        raise SystemExit("--arch gemma4_e needs an even --num-layers of 4 or more (every other layer global, the "
                         "second half reusing the keys and values of the first half's last two)")
    if args.lr is None:
        args.lr = 3e-4 if args.arch in ("olmo3", "olmo_hybrid", "gemma3", "gemma4", "gemma4_e", *VISION_ARCHS) \
            or args.moe == "gemma4_moe" else 1e-3
        if args.lora_rank:  # adapters starting at zero move the model more slowly than its weights would
            args.lr *= 5
    start = time.time()
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)  # idempotent: every run starts from scratch
    os.makedirs(args.out)
    procs = Processes()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sft_dir, tasks_path = prepare(args)
        metrics_path, gateway = run_rl(args, procs, sft_dir, tasks_path)
    finally:
        procs.stop_all()
    summary = summarise(args, metrics_path, time.time() - start, gateway)
    print(f"[demo] 5/5 success rate: first {summary['window_steps']} steps {summary['first_success_rate']:.2f} -> "
          f"last {summary['window_steps']} steps {summary['last_success_rate']:.2f} over {summary['steps']} RL steps "
          f"in {summary['wall_s']:.0f}s", flush=True)
    if "distill_reverse_kl" in summary:
        where = (f"served by its own engine, {summary['teacher_scored_tokens']} sampled tokens scored by the gateway"
                 if args.distill == "served" else "in the trainer")
        per = ("per sampled token" if args.distill_kl == "sampled" else
               f"over its top-k tokens (--distill-kl {args.distill_kl})")
        print(f"[demo] on-policy distillation (the teacher {where}): reverse KL to the teacher {per} "
              f"{summary['first_reverse_kl']:.3f} -> {summary['last_reverse_kl']:.3f} (first vs last "
              f"{summary['window_steps']} steps; the rewards were never trained on)", flush=True)
    if "routing_mismatch" in summary:
        mismatch = summary["routing_mismatch"]
        print(f"[demo] routing replay: {sum(mismatch) / len(mismatch):.3f} of the replayed (token, layer) rows would "
              "have gone to other experts without it (tokens sampled before the last update)", flush=True)
    if len(summary.get("evals", [])) >= 2:
        first_eval, last_eval = summary["evals"][0], summary["evals"][-1]
        print(f"[demo] held-out tasks (never trained on): pass@1 {first_eval['pass@1']:.2f} at policy version "
              f"{first_eval['policy_version']} -> {last_eval['pass@1']:.2f} at version {last_eval['policy_version']}",
              flush=True)
    print(f"[demo] partial rollout: the weight syncs cut {summary['aborts']} engine calls; the gateway kept their "
          f"{summary['resumed_tokens']} sampled tokens and went on from them", flush=True)
    diff = [d for d in summary["onpolicy_logp_abs_diff"] if d is not None]
    if args.lora_rank and diff:
        served = "the merged weights" if args.lora_sync == "merged" else "the SFT weights + each version's adapter"
        print(f"[demo] LoRA rank {args.lora_rank}: the engine serves {served}; |engine - trainer| logprob "
              f"{max(diff):.1e} at most per on-policy token", flush=True)
    if args.fp8 and diff:
        print(f"[demo] FP8 engine: |engine - trainer| logprob {sum(diff) / len(diff):.4f} per on-policy token (the FP8 "
              "rounding of the weights; an fp32 engine shows ~1e-6)", flush=True)
    print(f"[demo] wrote {args.out}/metrics.json and {args.out}/reward_curve.png; every process stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
