"""The trainer on one CUDA GPU against the same steps on CPU. GPUs needed: 1 (marked gpu, skipped elsewhere).

The CUDA run takes every GPU code path the CPU tests cannot: NCCL process groups, the model, DDP buffers and the
optimizer on the device, tree attention through a compiled backend (Triton, or the CUDA extension when validated),
and bf16. Two steps of the tiny model on the same pool batches (a fresh pool per run, fed identically; two CPU runs
give identical metrics): fp32 on the GPU must reproduce the CPU run's loss and gradient norm to 1e-3 relative (no
TF32: torch leaves it off for matmuls and the kernels use IEEE fp32 dots for fp32 inputs); bf16 its gradient norm to
10 % and its loss to 0.02 absolute (the loss is a small difference of terms, as group advantages have zero mean, so a
relative bound would be meaningless). Needs megatron-core and pyzmq (benchmarks/gpu_wheels.sh fetches them for the
lent GPU image, benchmarks/gpu_check.sh installs them).
"""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core", reason="needs megatron-core")
pytest.importorskip("zmq", reason="needs pyzmq")

from forge_megatron.models.tiny import build_tiny_model, build_tiny_teacher  # noqa: E402

from .pool_feed import feed_groups  # noqa: E402
from .trainer_run import run_on_fresh_pool  # noqa: E402


def _run(tmp_path, model_dir, name: str, env_extra: dict, extra: list[str], same_group_twice: bool = False,
         lr: str = "1e-3", iters: int = 2, exits=(None,)) -> list[dict]:
    """Train ``iters`` steps in one process per entry of ``exits`` (--exit-interval, None: to the end)."""
    def feed(client):
        if same_group_twice:
            for _ in range(2):
                feed_groups(client, 1, np.random.default_rng(5))
        else:
            feed_groups(client, iters, np.random.default_rng(11), completion_len=(5, 9))

    steps, _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=iters, groups=1, extra=extra, exits=exits,
                                    env_extra=env_extra, lr=lr)
    assert len(steps) == iters, steps
    return steps


def test_gpu_steps_match_cpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = build_tiny_model(str(tmp_path / "model"))
    cpu = _run(tmp_path, model_dir, "cpu", {"CUDA_VISIBLE_DEVICES": ""}, [])
    gpu = _run(tmp_path, model_dir, "gpu", {}, [])
    bf16 = _run(tmp_path, model_dir, "bf16", {}, ["--bf16"])
    for steps, loss_tol, norm_rel in ((gpu, {"rel": 1e-3, "abs": 1e-4}, 1e-3), (bf16, {"abs": 2e-2}, 0.1)):
        for want, got in zip(cpu, steps):
            assert got["batch_id"] == want["batch_id"] and got["loss_tokens"] == want["loss_tokens"]
            assert got["loss"] == pytest.approx(want["loss"], **loss_tol)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=norm_rel)


def test_gpu_distributed_optimizer_resume_equals_an_uninterrupted_run(tmp_path):
    """--use-distributed-optimizer --bf16 (the slurm script's settings): its fp32 masters and Adam moments live outside
    state_dict() and must be checkpointed too. Four steps straight vs --exit-interval 2 and a restart: steps 3 and 4
    must match (lost masters or moments first show in step 4, after step 3's update)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = build_tiny_model(str(tmp_path / "model"))
    extra = ["--bf16", "--use-distributed-optimizer"]
    straight = _run(tmp_path, model_dir, "straight", {}, extra, iters=4)
    resumed = _run(tmp_path, model_dir, "resumed", {}, extra, iters=4, exits=(2, None))
    assert [s["batch_id"] for s in resumed] == [s["batch_id"] for s in straight]
    for a, b in zip(straight[2:], resumed[2:]):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)


def test_gpu_bf16_first_step_keeps_the_hf_weights(tmp_path):
    """--bf16: Megatron's optimizer keeps fp32 master weights made when it is built; after loading the HF checkpoint
    they must be refreshed, or the first step writes Megatron's random init back. Same group twice at lr 1e-9: the
    second step (after one update) must score it as the first did (it would not, on re-initialised weights)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = build_tiny_model(str(tmp_path / "model"))
    first, second = _run(tmp_path, model_dir, "bf16_same", {}, ["--bf16"], same_group_twice=True, lr="1e-9")
    assert second["loss"] == pytest.approx(first["loss"], abs=2e-3)
    assert second["grad_norm"] == pytest.approx(first["grad_norm"], rel=2e-2)


def test_gpu_lora_steps_match_cpu(tmp_path):
    """--lora-rank 8 (adapters on every linear, everything else frozen) on the GPU: fp32 reproduces the CPU run (the
    adapters' hooks, the frozen embedding's output marked as needing a gradient, DDP over the adapters alone) and
    bf16 with the distributed optimizer stays within bf16's tolerance. Two steps at a learning rate that moves B
    off zero, so step 2 uses trained adapters."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = build_tiny_model(str(tmp_path / "model"))
    lora = ["--lora-rank", "8"]
    cpu = _run(tmp_path, model_dir, "lora_cpu", {"CUDA_VISIBLE_DEVICES": ""}, lora, lr="5e-3")
    gpu = _run(tmp_path, model_dir, "lora_gpu", {}, lora, lr="5e-3")
    bf16 = _run(tmp_path, model_dir, "lora_bf16", {}, lora + ["--bf16", "--use-distributed-optimizer"], lr="5e-3")
    for steps, loss_tol, norm_rel in ((gpu, {"rel": 1e-3, "abs": 1e-4}, 1e-3), (bf16, {"abs": 2e-2}, 0.1)):
        for want, got in zip(cpu, steps):
            assert got["batch_id"] == want["batch_id"] and got["loss_tokens"] == want["loss_tokens"]
            assert got["loss"] == pytest.approx(want["loss"], **loss_tol)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=norm_rel)


@pytest.mark.parametrize("mode", ["sft", "dpo", "rm"])
def test_gpu_offline_modes_match_cpu(tmp_path, mode):
    """The offline modes (--sft-data, --preference-data, --reward-model: training/offline.py) on the GPU: two fp32
    steps of the tiny model reproduce the CPU run's loss and gradient norm to 1e-3 relative (the score head and the
    reference model on the device too)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from .test_preference import _tool_pairs, _write
    from .test_trainer_offline import _run as run_offline
    from .test_trainer_offline import _sft_chats

    model_dir = build_tiny_model(str(tmp_path / "model"))
    if mode == "sft":
        data, extra = _write(tmp_path / "chats.jsonl", _sft_chats(8, seed=0)), ["--sft-data"]
        extra.append(data)
    else:
        data = _write(tmp_path / "pairs.jsonl", _tool_pairs(8, seed=0, mixed=True))
        extra = ["--reward-model"] if mode == "rm" else []
    runs = {}
    for device, env in (("cpu", {"CUDA_VISIBLE_DEVICES": ""}), ("gpu", {})):
        runs[device], _ = run_offline(tmp_path, f"{mode}-{device}", model_dir, data, extra=extra, iters=2,
                                      preference=mode != "sft", env_extra=env)
    for want, got in zip(runs["cpu"], runs["gpu"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-3, abs=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)



def test_gpu_distillation_teacher_matches_cpu(tmp_path):
    """On-policy distillation with a teacher of another size in the trainer (--teacher-hf-checkpoint, its weights
    offloaded to host memory between passes, pinned on the GPU's host): two steps on the GPU equal the same steps on
    CPU (loss, gradient norm, the reverse-KL and teacher metrics), fp32, and bf16 within its rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = build_tiny_model(str(tmp_path / "model"))
    teacher = build_tiny_teacher(str(tmp_path / "teacher"))
    flags = ["--teacher-hf-checkpoint", teacher, "--teacher-offload", "--old-logprobs", "recompute"]
    cpu = _run(tmp_path, model_dir, "distil_cpu", {"CUDA_VISIBLE_DEVICES": ""}, flags)
    gpu = _run(tmp_path, model_dir, "distil_gpu", {}, flags)
    bf16 = _run(tmp_path, model_dir, "distil_bf16", {}, flags + ["--bf16"])
    for steps, tol in ((gpu, {"rel": 1e-3, "abs": 1e-4}), (bf16, {"rel": 0.1, "abs": 3e-2})):
        for want, got in zip(cpu, steps):
            for key in ("loss", "grad_norm", "distill_reverse_kl", "distill_teacher_logp"):
                assert got[key] == pytest.approx(want[key], **tol), key


def test_gpu_dense_distillation_matches_cpu(tmp_path):
    """The dense KL (--distill-kl reverse --distill-topk 16: the teacher's vocabulary-parallel top-k and the
    student's logprobs of those tokens in the fused loss, on the GPU): two steps equal the same steps on CPU, fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = build_tiny_model(str(tmp_path / "model"))
    teacher = build_tiny_teacher(str(tmp_path / "teacher"))
    flags = ["--teacher-hf-checkpoint", teacher, "--distill-kl", "reverse", "--distill-topk", "16",
             "--old-logprobs", "recompute"]
    cpu = _run(tmp_path, model_dir, "dense_cpu", {"CUDA_VISIBLE_DEVICES": ""}, flags)
    gpu = _run(tmp_path, model_dir, "dense_gpu", {}, flags)
    for want, got in zip(cpu, gpu):
        for key in ("loss", "grad_norm", "distill_reverse_kl", "distill_forward_kl", "distill_topk_mass"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-4), key


def test_gpu_critic_matches_cpu(tmp_path):
    """PPO with a learned critic (--critic, its values on every trained token, GAE, its own optimizer step on the
    GPU): two steps equal the same steps on CPU (the policy's loss and gradient norm, the critic's value loss,
    gradient norm and explained variance), fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = build_tiny_model(str(tmp_path / "model"))
    flags = ["--critic", "--old-logprobs", "recompute"]
    cpu = _run(tmp_path, model_dir, "critic_cpu", {"CUDA_VISIBLE_DEVICES": ""}, flags)
    gpu = _run(tmp_path, model_dir, "critic_gpu", {}, flags)
    for want, got in zip(cpu, gpu):
        for key in ("loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/value_mean",
                    "critic/explained_variance"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-4), key
