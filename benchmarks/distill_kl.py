"""What dense on-policy distillation (``--distill-kl forward|reverse``) adds to the loss, at a real vocabulary size.

Side by side in one process, on the fused output layer (hidden states [rows, H] times an output weight [V, H], the
logits made chunk by chunk, never whole; mcore/logprobs.py), for ``--rows`` positions of which ``--trained`` are
trained:

- student: forward + backward of the sampled tokens' logprobs (``--distill-kl sampled``: the teacher's guidance is
  a per-token advantage, nothing more to score) vs the same plus the logprobs of the teacher's top ``--k`` tokens
  at every trained position and the top-k reverse KL on them (``--distill-kl reverse``);
- teacher: its forward-only logprobs of the sampled tokens vs the same pass also choosing its top-k
  (``vocab_parallel_topk``: what the teacher's pass does with a dense KL), which must give the same logprobs.

Times are medians of ``--repeats`` after one warm-up; fp32 (a CPU matmul); one JSON line.

    OMP_NUM_THREADS=2 python benchmarks/distill_kl.py [--vocab 151936 --hidden 512 --rows 256 --k 32]
"""

import argparse
import json
import statistics
import sys
import time


def median_time(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (default Qwen's 151936)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rows", type=int, default=256, help="positions scored (one target each)")
    p.add_argument("--trained", type=float, default=0.75, help="fraction of the positions trained (default 0.75)")
    p.add_argument("--k", type=int, default=32, help="the teacher's top-k (--distill-topk)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torch

    from forge_megatron.algo.losses import topk_kl
    from forge_megatron.mcore.logprobs import linear_vocab_parallel_logprobs, vocab_parallel_topk

    g = torch.Generator().manual_seed(a.seed)
    hidden = torch.randn(a.rows, a.hidden, generator=g)
    w_student = torch.randn(a.vocab, a.hidden, generator=g) * a.hidden ** -0.5 * 3
    w_teacher = torch.randn(a.vocab, a.hidden, generator=g) * a.hidden ** -0.5 * 3
    rows = torch.arange(a.rows)
    targets = torch.randint(0, a.vocab, (a.rows,), generator=g)
    index_X = torch.nonzero(torch.rand(a.rows, generator=g) < a.trained).flatten()

    def teacher_sampled():
        with torch.no_grad():
            return linear_vocab_parallel_logprobs(hidden, w_teacher, rows, targets)[0]

    def teacher_topk():
        return vocab_parallel_topk(rows, a.k, targets_U=targets, hidden_TH=hidden, weight_VH=w_teacher)

    ids_MK, teacher_MK, teacher_M = teacher_topk()
    ids_XK, teacher_XK = ids_MK[index_X], teacher_MK[index_X]

    def student_sampled():
        h, w = hidden.clone().requires_grad_(True), w_student.clone().requires_grad_(True)
        logp, _ = linear_vocab_parallel_logprobs(h, w, rows, targets)
        logp[index_X].sum().backward()

    def student_dense():
        h, w = hidden.clone().requires_grad_(True), w_student.clone().requires_grad_(True)
        extra_rows = index_X.repeat_interleave(a.k)
        logp, _ = linear_vocab_parallel_logprobs(h, w, torch.cat([rows, extra_rows]),
                                                 torch.cat([targets, ids_XK.reshape(-1)]))
        _, reverse_X = topk_kl(logp[a.rows:].reshape(-1, a.k), teacher_XK)
        (logp[:a.rows][index_X].sum() + reverse_X.sum()).backward()

    out = {"vocab": a.vocab, "hidden": a.hidden, "rows": a.rows, "trained": int(index_X.numel()), "k": a.k,
           "teacher_logp_abs_diff": float((teacher_M - teacher_sampled()).abs().max()),
           "teacher_topk_mass_mean": float(teacher_XK.exp().sum(-1).mean()),
           "topk_bytes_per_trained_token": a.k * 12}
    out["student_sampled_s"] = median_time(student_sampled, a.repeats)
    out["student_dense_s"] = median_time(student_dense, a.repeats)
    out["teacher_sampled_s"] = median_time(teacher_sampled, a.repeats)
    out["teacher_topk_s"] = median_time(teacher_topk, a.repeats)
    out["student_dense_over_sampled"] = out["student_dense_s"] / out["student_sampled_s"]
    out["teacher_topk_over_sampled"] = out["teacher_topk_s"] / out["teacher_sampled_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
