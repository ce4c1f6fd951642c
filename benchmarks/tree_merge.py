"""Prefix-tree merged training vs unmerged training of the same samples: one Megatron GPT forward+backward each.

Claim (docs/prefix_tree.md): merging samples that share prefixes cuts the work of linear layers by
``bound = sum_s |s| / |unique tokens|`` and attention from ``sum_s |s|^2 / 2`` to ``sum_t depth(t)``, while giving
the same per-sample logprobs. This script measures, on CPU in one process (TP = PP = 1):
- naive_s: the samples as ordinary causal sequences, sorted by length and cut into right-padded batches of at most
  ``--naive-batch-tokens`` padded tokens (padding costs a few percent; reported as naive_padded_tokens);
- naive_packed_s: a stricter baseline, the samples packed WITHOUT merging (a forest of disjoint chains, one per
  sample, so no padding) through the same tree model and attention kernel as tree_s: what is left is merging alone;
- tree_s: the whole workload as one prefix forest through the tree layer spec (TreeAttention, ``--backend``);
all forward + backward of ``sum_s sum_t mask_st * logp_st``, best of ``--repeats`` after one warm-up.
Prints ONE JSON line: total_tokens, unique_tokens, bound, naive_s, tree_s, speedup (naive_s / tree_s),
speedup_over_bound (speedup / bound), speedup_packed (naive_packed_s / tree_s), max_abs_logprob_diff (tree vs naive logprobs from the timed runs) and,
with --check, max_rel_grad_diff; --check exits 1 when logprobs differ by more than 1e-5 or gradients by more than
1e-5 (relative to each parameter's largest gradient).

``--arch qwen3_5``: the Qwen3.5 hybrid instead (every other layer, or three of every four, Gated DeltaNet linear
attention with gated full attention between; zero-centred norms): merging then saves the recurrence's work too,
the tree run carrying each segment's final state to its children. Its decay parameters' gradients (A_log, dt_bias)
are sums over every token that largely cancel, so they are checked apart (max_rel_grad_diff_decay, bound 1e-3;
tests/kernels/test_gated_delta.py shows them exact in fp64).

Workloads: ``grpo`` (one prompt, G completions), ``agentic`` (episodes of T calls, call k re-sending the system
prompt and the first k turns; episodes share the system prompt), ``preference`` (DPO / reward-model pairs: a shared
system prompt, each pair its own prompt and two answers, the loss on the answers), ``kto`` (KTO examples: a shared
system prompt, each example its own prompt and answer and its mismatched sample, the prompt followed by the next
example's answer, as forge-kto and ``--kto-data`` score them) or a JSONL file with one sample per line,
``{"tokens": [...], "loss_mask": [...]}`` (loss_mask optional, one 0/1 per token; token t's mask weights the
prediction of token t).

    OMP_NUM_THREADS=1 python benchmarks/tree_merge.py --workload agentic --check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch


LOGP_TOL = 1e-5
GRAD_TOL = 1e-5
DECAY_GRAD_TOL = 1e-3
DECAY = ("A_log", "dt_bias")


# ----------------------------------------------------------------------------------------------- workloads
def grpo_workload(args, rng):
    prompt = _tokens(rng, args.prompt_len, args.vocab)
    return [prompt + _tokens(rng, args.response_len, args.vocab) for _ in range(args.group)]


def agentic_workload(args, rng):
    system = _tokens(rng, args.system_len, args.vocab)
    samples = []
    for _ in range(args.episodes):
        history = list(system)
        for _ in range(args.calls):
            history = history + _tokens(rng, args.turn_len, args.vocab)  # tool result / user turn + completion
            samples.append(list(history))
    return samples


def preference_workload(args, rng):
    """``--pairs`` preference pairs (DPO / reward-model batches): a shared system prompt, each pair its own prompt,
    its chosen and rejected answers of ``--response-len``; the loss covers the answers only."""
    system = _tokens(rng, args.system_len, args.vocab)
    samples, masks = [], []
    for _ in range(args.pairs):
        prompt = system + _tokens(rng, args.prompt_len, args.vocab)
        for _ in range(2):
            samples.append(prompt + _tokens(rng, args.response_len, args.vocab))
            masks.append([0.0] * len(prompt) + [1.0] * args.response_len)
    return samples, masks


def kto_workload(args, rng):
    """``--examples`` KTO examples: a shared system prompt, each example its own prompt and an answer of
    ``--response-len``, and its mismatched sample (its prompt, the next example's answer); the loss on the answers."""
    system = _tokens(rng, args.system_len, args.vocab)
    prompts = [system + _tokens(rng, args.prompt_len, args.vocab) for _ in range(args.examples)]
    answers = [_tokens(rng, args.response_len, args.vocab) for _ in range(args.examples)]
    samples, masks = [], []
    for i, prompt in enumerate(prompts):
        for answer in (answers[i], answers[(i + 1) % len(answers)]):
            samples.append(prompt + answer)
            masks.append([0.0] * len(prompt) + [1.0] * len(answer))
    return samples, masks


def jsonl_workload(path):
    samples, masks = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "tokens" not in row or len(row["tokens"]) < 2:
                raise ValueError(f"{path}:{n}: every line needs a 'tokens' list of at least 2 token ids")
            mask = row.get("loss_mask", [1] * len(row["tokens"]))
            if len(mask) != len(row["tokens"]):
                raise ValueError(f"{path}:{n}: loss_mask has {len(mask)} entries for {len(row['tokens'])} tokens")
            samples.append([int(t) for t in row["tokens"]])
            masks.append([float(m) for m in mask])
    if not samples:
        raise ValueError(f"{path}: no samples")
    return samples, masks


def _tokens(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------------------- models
def build_models(args, samples):
    from forge_megatron.mcore.model import GPTConfig, build_gpt
    from forge_megatron.mcore.tree_attention import build_tree_gpt

    vocab = max(args.vocab, max(max(s) for s in samples) + 1)
    hybrid = {}
    if args.arch == "qwen3_5":
        every, head = min(4, args.layers), args.hidden // args.heads
        hybrid = dict(linear_attention=tuple((i + 1) % every != 0 for i in range(args.layers)),
                      zero_centered_norm=True, attention_output_gate=True, qk_layernorm=True, rotary_percent=0.25,
                      add_qkv_bias=False, linear_num_key_heads=args.kv_heads, linear_num_value_heads=args.heads,
                      linear_key_head_dim=head, linear_value_head_dim=head)
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    num_query_groups=args.kv_heads, ffn_hidden_size=4 * args.hidden, vocab_size=vocab,
                    max_position_embeddings=max(len(s) for s in samples), **hybrid)
    torch.manual_seed(0)
    tree = build_tree_gpt(cfg)
    naive = build_gpt(cfg)
    naive.load_state_dict(tree.state_dict())
    return tree, naive


# ------------------------------------------------------------------------------------------------ the runs
def tree_step(model, layout, mask_M, backend):
    """Forward + backward of the merged forest; returns logp_M (sample order of next_token_index)."""
    from forge_megatron.mcore.forward import tree_logprobs

    logp_M, _ = tree_logprobs(model, layout, backend=backend)
    (logp_M * mask_M).sum().backward()
    return logp_M.detach()


def unmerged_layout(samples):
    """The samples packed side by side as disjoint chains (no prefix sharing): token i of a sample sees 0..i."""
    from forge_megatron.tree import TreeLayout

    lengths_S = torch.tensor([len(s) for s in samples])
    offsets_S1 = torch.cat([torch.zeros(1, dtype=torch.int64), lengths_S.cumsum(0)])
    return TreeLayout(
        tokens=torch.tensor([t for s in samples for t in s]),
        position_ids=torch.cat([torch.arange(n) for n in lengths_S.tolist()]),
        sub_end=torch.repeat_interleave(offsets_S1[1:], lengths_S).to(torch.int32),
        sample_offsets=offsets_S1,
        sample_nodes=torch.arange(int(offsets_S1[-1])),
    )


def naive_batches(samples, max_tokens):
    """Sample indices sorted by length, cut into batches of at most max_tokens padded tokens."""
    order = sorted(range(len(samples)), key=lambda s: len(samples[s]))
    batches, current = [], []
    for s in order:
        if current and len(samples[s]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(s)
    return batches + [current]


def naive_step(model, samples, masks, batches):
    """Forward + backward of every sample as its own causal sequence (padded batches); logp in sample order."""
    from forge_megatron.mcore.forward import vocab_parallel_logprobs
    from forge_megatron.mcore.model import causal_mask

    logps = [None] * len(samples)
    for batch in batches:
        L = max(len(samples[s]) for s in batch)
        tokens_BL = torch.zeros(len(batch), L, dtype=torch.int64)
        rows, targets, weights, spans = [], [], [], []
        for b, s in enumerate(batch):
            n = len(samples[s])
            tokens_BL[b, :n] = torch.tensor(samples[s])
            rows.append(torch.arange(n - 1) + b * L)
            targets.append(tokens_BL[b, 1:n])
            weights.append(torch.tensor(masks[s][1:]))
            spans.append(n - 1)
        logits_BLV = model(tokens_BL, torch.arange(L)[None].expand(len(batch), L), causal_mask(L))
        logp, _ = vocab_parallel_logprobs(logits_BLV.reshape(len(batch) * L, -1), torch.cat(rows), torch.cat(targets))
        (logp * torch.cat(weights)).sum().backward()
        for s, part in zip(batch, logp.detach().split(spans)):
            logps[s] = part
    return torch.cat(logps)


def best_time(fn, model, repeats):
    """(best wall time of fn() over repeats after one warm-up, fn's last result)."""
    best, result = float("inf"), None
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        result = fn()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best, result


def max_rel_grad_diff(a, b, decay: bool = False):
    """Largest relative gradient difference over the parameters (``decay``: over the Gated DeltaNet decay
    parameters only; otherwise over all others)."""
    worst = 0.0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if name.endswith(DECAY) == decay:
            worst = max(worst, ((pa.grad - pb.grad).abs().max() / pb.grad.abs().max().clamp_min(1e-30)).item())
    return worst


# ---------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    from forge_megatron.tree import build_tree

    rng = random.Random(args.seed)
    if args.workload == "grpo":
        samples = grpo_workload(args, rng)
        masks = [[1.0] * len(s) for s in samples]
    elif args.workload == "agentic":
        samples = agentic_workload(args, rng)
        masks = [[1.0] * len(s) for s in samples]
    elif args.workload == "preference":
        samples, masks = preference_workload(args, rng)
    elif args.workload == "kto":
        samples, masks = kto_workload(args, rng)
    else:
        samples, masks = jsonl_workload(args.workload)
    tree, naive = build_models(args, samples)
    layout = build_tree(samples)
    mask_M = torch.cat([torch.tensor(m[1:]) for m in masks])
    batches = naive_batches(samples, args.naive_batch_tokens)

    naive_s, logp_naive = best_time(lambda: naive_step(naive, samples, masks, batches), naive, args.repeats)
    packed = unmerged_layout(samples)
    packed_s, logp_packed = best_time(lambda: tree_step(tree, packed, mask_M, args.backend), tree, args.repeats)
    tree_s, logp_tree = best_time(lambda: tree_step(tree, layout, mask_M, args.backend), tree, args.repeats)
    bound = layout.total_tokens / layout.unique_tokens
    out = {
        "workload": os.path.basename(args.workload), "samples": len(samples),
        "total_tokens": layout.total_tokens, "unique_tokens": layout.unique_tokens, "bound": round(bound, 3),
        "naive_s": round(naive_s, 6), "naive_packed_s": round(packed_s, 6), "tree_s": round(tree_s, 6),
        "speedup": round(naive_s / tree_s, 3), "speedup_over_bound": round(naive_s / tree_s / bound, 3),
        "speedup_packed": round(packed_s / tree_s, 3), "speedup_packed_over_bound": round(packed_s / tree_s / bound, 3),
        "max_abs_logprob_diff": max((logp_tree - logp_naive).abs().max().item(),
                                    (logp_packed - logp_naive).abs().max().item()),
        "naive_padded_tokens": sum(len(b) * max(len(samples[s]) for s in b) for b in batches),
        "backend": args.backend, "threads": torch.get_num_threads(), "arch": args.arch,
        "model": f"{args.layers}x{args.hidden} heads {args.heads}/{args.kv_heads} vocab {tree.vocab_size}",
    }
    if args.check:
        out["max_rel_grad_diff"] = max_rel_grad_diff(tree, naive)  # grads of the last timed runs
        if args.arch == "qwen3_5":
            out["max_rel_grad_diff_decay"] = max_rel_grad_diff(tree, naive, decay=True)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default="agentic",
                   help="'grpo', 'agentic', 'preference', 'kto' or a JSONL file of {'tokens': [...]}")
    p.add_argument("--check", action="store_true", help="also compare gradients; exit 1 if not exact")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (best is reported)")
    p.add_argument("--backend", default="segment", help="tree attention backend (see kernels/tree_attention)")
    p.add_argument("--naive-batch-tokens", type=int, default=4096, help="padded tokens per naive batch")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("model (a small Megatron GPT, RoPE, SwiGLU, GQA)")
    g.add_argument("--arch", default="gpt", choices=["gpt", "qwen3_5"],
                   help="gpt: attention in every layer; qwen3_5: Gated DeltaNet layers with gated attention between")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--vocab", type=int, default=1024)
    g = p.add_argument_group("grpo workload")
    g.add_argument("--prompt-len", type=int, default=256)
    g.add_argument("--group", type=int, default=8)
    g.add_argument("--response-len", type=int, default=64)
    g = p.add_argument_group("agentic workload (bound about (calls + 1) / 2 when turns dominate)")
    g.add_argument("--episodes", type=int, default=4)
    g.add_argument("--calls", type=int, default=20)
    g.add_argument("--system-len", type=int, default=64)
    g.add_argument("--turn-len", type=int, default=32)
    g = p.add_argument_group("preference workload (DPO / reward-model pairs: --system-len, --prompt-len, "
                             "--response-len per answer)")
    g.add_argument("--pairs", type=int, default=16)
    g = p.add_argument_group("kto workload (examples and their mismatched samples: --system-len, --prompt-len, "
                             "--response-len per answer)")
    g.add_argument("--examples", type=int, default=16)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from forge_megatron.mcore import parallel

    parallel.initialize(parallel.ParallelConfig())
    try:
        out = run(args)
    finally:
        parallel.destroy()
    print(json.dumps(out))
    exact = out["max_abs_logprob_diff"] <= LOGP_TOL and out.get("max_rel_grad_diff", 0.0) <= GRAD_TOL \
        and out.get("max_rel_grad_diff_decay", 0.0) <= DECAY_GRAD_TOL
    return 0 if exact or not args.check else 1




if __name__ == "__main__":
    sys.exit(main())
