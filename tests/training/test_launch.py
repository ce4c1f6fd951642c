"""scripts/slurm/forge.sbatch: bash -n, and --dry-run prints a consistent plan for several layouts. CPU, 0 GPUs."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from forge_megatron.training import arguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(ROOT, "scripts", "slurm", "forge.sbatch")


def _dry_run(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", SBATCH, "--dry-run"], capture_output=True, text=True, env=full, timeout=60)


def _local_dry_run(**env):
    """scripts/run_local.sh --dry-run with a tasks file and an agent URL set (``env`` over them)."""
    full = {**os.environ, "TASKS": "t.jsonl", "AGENT_URL": "http://127.0.0.1:9/", **{k: str(v) for k, v in env.items()}}
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_local.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=60, env=full)


def _commands(stdout: str) -> list[list[str]]:
    cmds = []
    for line in stdout.splitlines():
        if line.startswith("+ ") and not line.startswith("+ wait_http"):
            cmds.append(shlex.split(line[2:].split(" &> ")[0]))
    return cmds


def _trainer_args(cmd: list[str]):
    """The trainer's parsed arguments from its launch command (what follows train_forge.py)."""
    return arguments.parse_args(cmd[next(i for i, a in enumerate(cmd) if a.endswith("train_forge.py")) + 1:])


def _served_and_trained(stdout: str):
    """(the --model-path of every SGLang engine, the trainer's parsed arguments) of a dry run."""
    cmds = _commands(stdout)
    engines = [c[c.index("--model-path") + 1] for c in cmds if "sglang.launch_server" in c]
    (trainer,) = [c for c in cmds if "torchrun" in c]
    return engines, _trainer_args(trainer)


def test_bash_syntax_and_help():
    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
    shown = subprocess.run(["bash", SBATCH, "--help"], capture_output=True, text=True).stdout
    with open(SBATCH) as f:
        header = [line.rstrip("\n") for line in f.readlines()[1:] if line.startswith("#")]
    settings = header[:next(i for i, line in enumerate(header) if "Without slurm" in line) + 1]
    assert shown.splitlines() == settings  # --help shows the whole header, nothing cut off


@pytest.mark.parametrize("layout", [
    dict(ROLLOUT_NODES=2, TRAIN_NODES=2, GPUS_PER_NODE=8, ENGINE_TP=2, TP=2, PP=1, EP=1, CP=1, MODEL="qwen3-8B",
         MALFORMED_CALL_REWARD=-0.1),
    dict(ROLLOUT_NODES=1, TRAIN_NODES=4, GPUS_PER_NODE=8, ENGINE_TP=4, TP=2, PP=2, EP=4, CP=1, MODEL="qwen3-30B-A3B",
         FP32_LM_HEAD=1, OVERLAP_GRAD_REDUCE=1, OVERLAP_PARAM_GATHER=1, WEIGHT_SYNC_INTERVAL=2, POLICY_SAMPLING=0, ROLLOUT_TEMPERATURE=0.8, TRUST_REMOTE_CODE=1, GATEWAY_WORKERS=4,
         SAVE_INTERVAL=25, KEEP_CHECKPOINTS=3, ASYNC_SAVE=1, EXIT_DURATION_MINS=1410,
         TEACHER_CHECKPOINT="/models/teacher", DISTILL_OUTCOME_COEF=0, TEACHER_OFFLOAD=1, DISTILL_KL="forward",
         DISTILL_TOPK=16, CRITIC=1, CRITIC_LR=2e-6, CRITIC_WARMUP_ITERS=5, GAE_LAMBDA=0.95, VALUE_CLIP=0.2,
         PPO_MINI_BATCHES=2, PPO_EPOCHS=2, PPO_TARGET_KL=0.02),
    dict(ROLLOUT_NODES=3, TRAIN_NODES=1, GPUS_PER_NODE=4, ENGINE_TP=1, TP=1, PP=1, EP=1, CP=2, MODEL="tiny",
         USE_ROUTER=1, DOMAIN_RATIOS="math=0.7,qa=0.3", ROUTING_REPLAY=1, DROP_ZERO_ADVANTAGE_GROUPS=1, KEEP_TRAJECTORIES=1,
         EVAL_TASKS="/data/heldout.jsonl", EVAL_EVERY=5, RETIRE_SOLVED_AFTER=3),
    # experts whole, EP 16 over DP x TP = 4 x 4 (EP could not exceed DP = 4 with the experts split over TP)
    dict(ROLLOUT_NODES=1, TRAIN_NODES=2, GPUS_PER_NODE=8, ENGINE_TP=8, TP=4, PP=1, EP=16, CP=1, ETP=1,
         MODEL="qwen3-30B-A3B"),
])
def test_dry_run_plan_is_consistent(layout):
    out = _dry_run(**layout)
    assert out.returncode == 0, out.stderr
    cmds = _commands(out.stdout)
    nodes = [f"node{i}" for i in range(layout["ROLLOUT_NODES"] + 1 + layout["TRAIN_NODES"])]
    rollout, middle, train = nodes[:layout["ROLLOUT_NODES"]], nodes[layout["ROLLOUT_NODES"]], nodes[-layout["TRAIN_NODES"]:]

    engines = [c for c in cmds if "sglang.launch_server" in c]
    per_node = layout["GPUS_PER_NODE"] // layout["ENGINE_TP"]
    assert len(engines) == layout["ROLLOUT_NODES"] * per_node
    engine_urls = sorted(f"http://{c[c.index('-w') + 1]}:{c[c.index('--port') + 1]}" for c in engines)
    assert {c[c.index("-w") + 1] for c in engines} == set(rollout)
    for c in engines:  # every engine's GPUs lie on its node
        assert int(c[c.index("--base-gpu-id") + 1]) + layout["ENGINE_TP"] <= layout["GPUS_PER_NODE"]
    health = re.findall(r"^\+ wait_http (\S+)/health$", out.stdout, re.M)
    assert set(engine_urls) <= set(health)  # health waits before anything uses the engines

    (mid,) = [c for c in cmds if "forge_megatron.agents.middleware_node" in c]
    assert mid[mid.index("-w") + 1] == middle
    gateway_engines = mid[mid.index("--engines") + 1].split(",")
    if layout.get("USE_ROUTER"):
        (router,) = [c for c in cmds if "sglang_router.launch_router" in c]
        assert sorted(router[router.index("--worker-urls") + 1:]) == engine_urls
        assert gateway_engines == [f"http://{middle}:29000"]
    else:
        assert sorted(gateway_engines) == engine_urls

    (trainer,) = [c for c in cmds if "torchrun" in c]
    assert trainer[trainer.index("-w") + 1].split(",") == train
    nnodes, nproc = int(trainer[trainer.index("--nnodes") + 1]), int(trainer[trainer.index("--nproc-per-node") + 1])
    assert (nnodes, nproc) == (layout["TRAIN_NODES"], layout["GPUS_PER_NODE"])
    args = _trainer_args(trainer)  # the trainer command line is valid for train_forge.py
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size,
            args.context_parallel_size) == (layout["TP"], layout["PP"], layout["EP"], layout["CP"])
    assert args.expert_tensor_parallel_size == layout.get("ETP")
    assert sorted(args.engine_urls) == engine_urls
    assert args.pool_addr == f"tcp://{middle}:5555" and args.gateway_url == f"http://{middle}:8000"
    # engines join one weight-update group per pipeline stage, hosted by that stage's lead, which torchrun's c10d
    # rendezvous may put on any trainer node: every lead names itself
    assert args.weight_sync_master_addr == "auto"
    assert args.sequence_parallel is (layout["TP"] > 1)  # SP with TP (MoE under TP cannot train without it)
    fp32_head = layout.get("FP32_LM_HEAD") == 1  # both sides or neither
    assert args.fp32_lm_head is fp32_head and all(("--enable-fp32-lm-head" in c) is fp32_head for c in engines)
    assert args.overlap_grad_reduce is (layout.get("OVERLAP_GRAD_REDUCE") == 1)
    assert args.overlap_param_gather is (layout.get("OVERLAP_PARAM_GATHER") == 1) and args.use_distributed_optimizer
    assert args.weight_sync_interval == layout.get("WEIGHT_SYNC_INTERVAL", 1)
    assert (args.save_interval, args.keep_checkpoints, args.async_save) == (
        layout.get("SAVE_INTERVAL", 50), layout.get("KEEP_CHECKPOINTS"), layout.get("ASYNC_SAVE") == 1)
    teacher = layout.get("TEACHER_CHECKPOINT")  # on-policy distillation: the trainer's teacher, or none
    assert (args.teacher_hf_checkpoint, args.distill_outcome_coef, args.teacher_offload) == (
        teacher, float(layout.get("DISTILL_OUTCOME_COEF", 1)), layout.get("TEACHER_OFFLOAD") == 1)
    assert (args.distill_kl, args.distill_topk) == (layout.get("DISTILL_KL", "sampled"), layout.get("DISTILL_TOPK", 32))
    assert (args.critic, args.critic_lr, args.critic_warmup_iters, args.gae_lambda) == (
        layout.get("CRITIC") == 1, layout.get("CRITIC_LR"), layout.get("CRITIC_WARMUP_ITERS", 0),
        layout.get("GAE_LAMBDA", 1.0))
    assert (args.value_clip, args.ppo_mini_batches, args.ppo_epochs, args.ppo_target_kl) == (
        layout.get("VALUE_CLIP"), layout.get("PPO_MINI_BATCHES", 1), layout.get("PPO_EPOCHS", 1),
        layout.get("PPO_TARGET_KL"))
    assert args.exit_signal_handler and args.exit_duration_in_mins == layout.get("EXIT_DURATION_MINS")
    assert args.exit_file == f"{_run_dir(out.stdout)}/stop_training"  # what the USR1 trap creates
    replay = layout.get("ROUTING_REPLAY") == 1  # engines record, the gateway keeps, the trainer replays: all or none
    assert args.routing_replay is replay and all(("--enable-return-routed-experts" in c) is replay for c in engines)
    assert ("--return-routed-experts" in mid) is replay
    from forge_megatron.agents.middleware_node import build_parser as node_parser

    node = node_parser().parse_args(mid[mid.index("forge_megatron.agents.middleware_node") + 1:])  # valid flags
    remote = layout.get("TRUST_REMOTE_CODE") == 1  # the checkpoint's own code runs in the engines and the gateway
    assert node.trust_remote_code is remote and all(("--trust-remote-code" in c) is remote for c in engines)
    assert node.drop_zero_advantage_groups is (layout.get("DROP_ZERO_ADVANTAGE_GROUPS") == 1)
    assert node.keep_trajectories is (layout.get("KEEP_TRAJECTORIES") == 1)  # (forge-pool-export --sft / --pairs)
    assert node.policy_sampling is (layout.get("POLICY_SAMPLING", 1) == 1)  # on unless turned off
    assert node.gateway_workers == layout.get("GATEWAY_WORKERS", 1)
    assert node.malformed_call_reward == layout.get("MALFORMED_CALL_REWARD", 0.0)  # penalised per call, or not
    # the gateway samples training calls at the temperature the trainer scores them at
    assert node.policy_temperature == args.rollout_temperature == float(layout.get("ROLLOUT_TEMPERATURE", 1))
    # the model script's output formats (Qwen3: thinking blocks as reasoning_content)
    assert (node.tool_parser, node.reasoning_parser) == \
        ("hermes", "qwen3" if layout["MODEL"].startswith("qwen3") else None)
    (driver,) = [c for c in cmds if "forge_megatron.agents.driver" in c]
    assert driver[driver.index("--pool-addr") + 1] == args.pool_addr  # the driver obeys the pool's admission control
    from forge_megatron.agents.driver import build_parser as driver_parser

    rollout_args = driver_parser().parse_args(driver[driver.index("forge_megatron.agents.driver") + 1:])
    assert rollout_args.eval_tasks == layout.get("EVAL_TASKS")  # held-out evaluation only when asked for
    assert rollout_args.retire_solved_after == layout.get("RETIRE_SOLVED_AFTER", 0)
    assert (rollout_args.retired_tasks or "").endswith("retired_tasks.txt") is bool(layout.get("RETIRE_SOLVED_AFTER"))
    # the pool times out what a crashed driver leaves running, later than the driver itself would
    assert node.episode_timeout_s == node.session_idle_timeout_s == 2 * rollout_args.episode_timeout_s == 3600
    if layout.get("EVAL_TASKS"):
        assert rollout_args.eval_every_versions == layout["EVAL_EVERY"] and rollout_args.eval_output.endswith("evals.jsonl")
    if layout.get("DOMAIN_RATIOS"):
        assert driver[driver.index("--domain-ratios") + 1] == layout["DOMAIN_RATIOS"]
        assert args.domain_ratios == {"math": 0.7, "qa": 0.3}
    world = nnodes * nproc
    arguments.parallel_config(args).data_parallel_size(world)  # raises if the layout does not divide
    assert f"DP={world // (layout['TP'] * layout['PP'] * layout['CP'])}" in out.stdout
    assert set(rollout).isdisjoint(train) and middle not in rollout + train


def test_dry_run_with_an_fp8_rollout_checkpoint(tmp_path):
    """ROLLOUT_FP8_CHECKPOINT: the engines serve it, the trainer syncs FP8 weights in its format, the gateway keeps
    the HF checkpoint's tokenizer and template."""
    import json

    fp8 = tmp_path / "Qwen3-30B-A3B-FP8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    out = _dry_run(MODEL="qwen3-30B-A3B", EP=4, ROLLOUT_FP8_CHECKPOINT=str(fp8), HF_CHECKPOINT="/models/Qwen3-30B-A3B")
    assert out.returncode == 0, out.stderr
    engines, args = _served_and_trained(out.stdout)
    assert engines and set(engines) == {str(fp8)}
    (mid,) = [c for c in _commands(out.stdout) if "forge_megatron.agents.middleware_node" in c]
    assert mid[mid.index("--model-path") + 1] == "/models/Qwen3-30B-A3B"
    assert args.weight_sync_fp8 == str(fp8) and args.hf_checkpoint == "/models/Qwen3-30B-A3B"


def test_driver_args_reach_the_rollout_driver():
    """DRIVER_ARGS (here an LLM judge as the verifier of one domain) go to the rollout driver of both launch scripts,
    whose own parser accepts them."""
    from forge_megatron.agents.driver import build_parser

    extra = "--verifier qa=judge --judge-url http://judge-host:30000/v1 --judge-model judge"
    local = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_local.sh"), "--dry-run"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "HF_CHECKPOINT": "/models/m", "TASKS": "t.jsonl",
                                                       "AGENT_URL": "http://127.0.0.1:9/", "MODEL": "tiny",
                                                       "DRIVER_ARGS": extra})
    for out in (_dry_run(MODEL="qwen3-30B-A3B", EP=4, HF_CHECKPOINT="/models/Qwen3-30B-A3B", DRIVER_ARGS=extra), local):
        assert out.returncode == 0, out.stderr
        (driver,) = [c for c in _commands(out.stdout) if "forge_megatron.agents.driver" in c]
        args = build_parser().parse_args(driver[driver.index("forge_megatron.agents.driver") + 1:])
        assert args.verifier == ["qa=judge"] and args.judge_url == "http://judge-host:30000/v1"
        assert args.judge_model == "judge"


def test_reward_model_and_judge_are_served_for_the_driver():
    """RM_CHECKPOINT / JUDGE_CHECKPOINT: forge.sbatch serves them with SGLang on the middleware node's GPUs (the
    reward model --is-embedding from GPU 0, the judge on the GPUs after it), run_local.sh on the GPUs after the engines
    (or with forge-engine on CPU); the driver scores with them (its parser takes the flags), each for its domain; two
    scorers of the same domains are refused before anything starts."""
    from forge_megatron.agents.driver import build_parser

    scorers = {"RM_CHECKPOINT": "/models/rm", "RM_DOMAIN": "chat", "JUDGE_CHECKPOINT": "/models/judge",
               "JUDGE_TP": "2", "CALL_RM_WEIGHT": "0.3"}
    local_env = {**os.environ, "HF_CHECKPOINT": "/models/m", "TASKS": "t.jsonl", "AGENT_URL": "http://127.0.0.1:9/",
                 "ENGINE": "sglang", "NPROC": "2", **scorers}
    local = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_local.sh"), "--dry-run"], capture_output=True,
                           text=True, timeout=60, env=local_env)
    sbatch = _dry_run(HF_CHECKPOINT="/models/Qwen3-8B", **scorers)
    for out, rm_gpu, judge_gpu in ((sbatch, ("--base-gpu-id", "0"), ("--base-gpu-id", "1")),
                                   (local, ("CUDA_VISIBLE_DEVICES=3",), ("CUDA_VISIBLE_DEVICES=4",))):
        assert out.returncode == 0, out.stderr
        cmds = _commands(out.stdout)
        (rm,) = [c for c in cmds if "sglang.launch_server" in c and "/models/rm" in c]
        (judge,) = [c for c in cmds if "sglang.launch_server" in c and "/models/judge" in c]
        assert "--is-embedding" in rm and "--is-embedding" not in judge
        assert judge[judge.index("--served-model-name") + 1] == "judge"
        for cmd, where in ((rm, rm_gpu), (judge, judge_gpu)):
            assert any(list(where) == cmd[i:i + len(where)] for i in range(len(cmd))), (where, cmd)
        (driver,) = [c for c in cmds if "forge_megatron.agents.driver" in c]
        args = build_parser().parse_args(driver[driver.index("forge_megatron.agents.driver") + 1:])
        assert args.verifier == ["chat=rm", "judge"] and args.rm_tokenizer == "/models/rm"
        assert args.rm_url.endswith(":30100") and args.judge_url.endswith(":30200/v1") and args.judge_model == "judge"
        # CALL_RM_WEIGHT: the reward model also rewards single calls (agents/call_rewards.py)
        assert (args.call_rm_url, args.call_rm_tokenizer, args.call_rm_weight) == (args.rm_url, "/models/rm", 0.3)
    lone = _dry_run(HF_CHECKPOINT="/models/Qwen3-8B", CALL_RM_WEIGHT="0.3")
    assert lone.returncode != 0 and "CALL_RM_WEIGHT needs RM_CHECKPOINT" in lone.stderr
    both = _dry_run(HF_CHECKPOINT="/models/Qwen3-8B", RM_CHECKPOINT="/models/rm", JUDGE_CHECKPOINT="/models/judge")
    assert both.returncode != 0 and "would both score every domain" in both.stderr
    big = _dry_run(HF_CHECKPOINT="/models/Qwen3-8B", RM_CHECKPOINT="/models/rm", RM_TP="8", RM_DOMAIN="a",
                   JUDGE_CHECKPOINT="/models/judge")
    assert big.returncode != 0 and "do not fit the middleware node's 8" in big.stderr


def test_served_distillation_teacher():
    """TEACHER_SERVED=1: forge.sbatch serves TEACHER_CHECKPOINT with SGLang on the middleware node's GPUs after the
    reward model's, the gateway scores episodes with it (--teacher-urls) and the trainer distils from what the
    gateway records (--teacher-from-gateway, no teacher of its own); TEACHER_URLS does the same with engines already
    serving one. Contradictory settings are refused before anything starts."""
    from forge_megatron.agents.middleware_node import build_parser as node_parser

    out = _dry_run(HF_CHECKPOINT="/models/Qwen3-8B", RM_CHECKPOINT="/models/rm", TEACHER_CHECKPOINT="/models/big",
                   TEACHER_SERVED=1, TEACHER_TP=4, DISTILL_OUTCOME_COEF=0, DISTILL_KL="reverse", DISTILL_TOPK=20,
                   TEACHER_PROMPT="A correct final answer is {answer}.")
    assert out.returncode == 0, out.stderr
    cmds = _commands(out.stdout)
    (teacher,) = [c for c in cmds if "sglang.launch_server" in c and "/models/big" in c]
    assert teacher[teacher.index("--base-gpu-id") + 1] == "1" and teacher[teacher.index("--tp") + 1] == "4"
    (mid,) = [c for c in cmds if "forge_megatron.agents.middleware_node" in c]
    node = node_parser().parse_args(mid[mid.index("forge_megatron.agents.middleware_node") + 1:])
    middle = teacher[teacher.index("-w") + 1]
    assert node.teacher_urls == f"http://{middle}:30300"
    assert node.teacher_prompt == "A correct final answer is {answer}."
    assert node.teacher_topk == 20  # a dense KL: the gateway records the served teacher's top-k
    (trainer,) = [c for c in cmds if "torchrun" in c]
    args = _trainer_args(trainer)
    assert args.teacher_from_gateway and args.teacher_hf_checkpoint is None and args.distill_outcome_coef == 0.0
    assert (args.distill_kl, args.distill_topk) == ("reverse", 20)
    external = _dry_run(HF_CHECKPOINT="/models/Qwen3-8B", TEACHER_URLS="http://t1:30000,http://t2:30000")
    cmds = _commands(external.stdout)
    (mid,) = [c for c in cmds if "forge_megatron.agents.middleware_node" in c]
    external_node = node_parser().parse_args(mid[mid.index("forge_megatron.agents.middleware_node") + 1:])
    assert external_node.teacher_urls == "http://t1:30000,http://t2:30000" and external_node.teacher_topk == 0
    assert _trainer_args([c for c in cmds if "torchrun" in c][0]).teacher_from_gateway
    for env, message in ((dict(TEACHER_SERVED=1), "TEACHER_SERVED=1 needs TEACHER_CHECKPOINT"),
                         (dict(TEACHER_URLS="http://t:1", TEACHER_OFFLOAD=1), "a served teacher has no weights"),
                         (dict(TEACHER_CHECKPOINT="/m", TEACHER_SERVED=1, TEACHER_TP=9), "do not fit the middleware"),
                         (dict(DISTILL_COEF=2), "need TEACHER_CHECKPOINT or TEACHER_URLS"),
                         (dict(DISTILL_KL="reverse"), "need TEACHER_CHECKPOINT or TEACHER_URLS"),
                         (dict(TEACHER_URLS="http://t:1", DISTILL_KL="gkd"),
                          "DISTILL_KL=gkd: sampled, forward, reverse or jsd"),
                         (dict(TEACHER_CHECKPOINT="/m", TEACHER_PROMPT="x"), "TEACHER_PROMPT needs a served teacher"),
                         (dict(TEACHER_URLS="http://t:1", DROP_ZERO_ADVANTAGE_GROUPS=1), "still carry the teacher's"),
                         (dict(GAE_LAMBDA=0.9), "GAE_LAMBDA / VALUE_CLIP need CRITIC=1"),
                         (dict(VALUE_CLIP=0.2), "VALUE_CLIP need CRITIC=1"),
                         (dict(PPO_TARGET_KL=0.02), "PPO_TARGET_KL stops a batch's later updates"),
                         (dict(CRITIC=1, DROP_ZERO_ADVANTAGE_GROUPS=1), "still have advantages against the critic")):
        bad = _dry_run(HF_CHECKPOINT="/models/Qwen3-8B", **env)
        assert bad.returncode != 0 and message in bad.stderr, (env, bad.stderr)


def test_dry_run_with_a_trained_vision_tower_turns_sglangs_image_embedding_cache_off():
    """--train-vision-tower in EXTRA_TRAIN_ARGS: the engines start with SGLANG_VLM_CACHE_SIZE_MB=0 (no image
    embedding of an old tower served after a sync), unless the job sets it; a frozen tower keeps SGLang's cache."""
    def engine_env(**env):
        out = _dry_run(MODEL="qwen3-vl-30B-A3B", EP=4, HF_CHECKPOINT="/models/Qwen3-VL-30B-A3B", **env)
        assert out.returncode == 0, out.stderr
        engines = [c for c in _commands(out.stdout) if "sglang.launch_server" in c]
        assert engines
        return {tuple(c[c.index("env") + 1:c.index("python")]) for c in engines}

    assert engine_env(EXTRA_TRAIN_ARGS="--train-vision-tower --vision-lr 1e-6") == {("SGLANG_VLM_CACHE_SIZE_MB=0",)}
    assert engine_env(EXTRA_TRAIN_ARGS="--train-vision-tower", SGLANG_VLM_CACHE_SIZE_MB=512) == {
        ("SGLANG_VLM_CACHE_SIZE_MB=512",)}
    assert engine_env() == {()}


def test_dry_run_with_an_int4_rollout_checkpoint(tmp_path):
    """ROLLOUT_INT4_CHECKPOINT (Kimi-K2.5 as released): the engines serve it, the trainer trains HF_CHECKPOINT (its
    bf16 copy) and syncs int4 weights in the release's format; with ROLLOUT_FP8_CHECKPOINT too the job stops."""
    import json

    int4 = tmp_path / "Kimi-K2.5"
    int4.mkdir()
    (int4 / "config.json").write_text(json.dumps({"text_config": {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}}}))
    out = _dry_run(MODEL="kimi-k2.5", EP=4, ROLLOUT_INT4_CHECKPOINT=str(int4), HF_CHECKPOINT="/models/Kimi-K2.5-bf16")
    assert out.returncode == 0, out.stderr
    engines, args = _served_and_trained(out.stdout)
    assert engines and set(engines) == {str(int4)}
    assert args.weight_sync_int4 == str(int4) and args.hf_checkpoint == "/models/Kimi-K2.5-bf16"
    assert args.int4_qat is None
    qat = _dry_run(MODEL="kimi-k2.5", EP=4, ROLLOUT_INT4_CHECKPOINT=str(int4), INT4_QAT="1",
                   HF_CHECKPOINT="/models/Kimi-K2.5-bf16")
    args = _served_and_trained(qat.stdout)[1]
    assert args.int4_qat == "" and arguments.int4_qat_config(args).group == 32
    alone = _dry_run(MODEL="kimi-k2.5", EP=4, INT4_QAT="1", HF_CHECKPOINT="/models/Kimi-K2.5-bf16")
    assert alone.returncode == 2 and "needs ROLLOUT_INT4_CHECKPOINT" in alone.stderr
    both = _dry_run(MODEL="kimi-k2.5", EP=4, ROLLOUT_INT4_CHECKPOINT=str(int4), ROLLOUT_FP8_CHECKPOINT=str(int4),
                    HF_CHECKPOINT="/models/Kimi-K2.5-bf16")
    assert both.returncode == 2 and "not both" in both.stderr


def test_dry_run_of_a_lora_run_syncing_adapters():
    """LORA_RANK: the trainer trains adapters (LORA_ALPHA, LORA_TARGETS passed on); LORA_SYNC=adapter: the engines
    serve LoRA (rank up to LORA_RANK, every linear) and the trainer sends the adapters into RUN_DIR/adapters;
    the default merged sync leaves the engines as they are; LORA_SYNC=adapter without LORA_RANK stops the job."""
    out = _dry_run(MODEL="qwen3-8B", LORA_RANK=16, LORA_ALPHA=32, LORA_TARGETS="linear_qkv,linear_proj",
                   LORA_SYNC="adapter", RUN_DIR="/runs/r")
    assert out.returncode == 0, out.stderr
    cmds = _commands(out.stdout)
    engines = [c for c in cmds if "sglang.launch_server" in c]
    assert engines and all(c[c.index("--enable-lora"):c.index("--enable-lora") + 5] == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"] for c in engines)
    args = _served_and_trained(out.stdout)[1]
    assert (args.lora_rank, args.lora_alpha, args.lora_target_modules) == (16, 32.0, "linear_qkv,linear_proj")
    assert args.weight_sync_lora == "adapter" and args.weight_sync_dir == "/runs/r/adapters"
    merged = _dry_run(MODEL="qwen3-8B", LORA_RANK=16)
    assert merged.returncode == 0, merged.stderr
    assert not any("--enable-lora" in c for c in _commands(merged.stdout))
    assert _served_and_trained(merged.stdout)[1].weight_sync_lora == "merged"
    alone = _dry_run(MODEL="qwen3-8B", LORA_SYNC="adapter")
    assert alone.returncode != 0 and "LORA_SYNC=adapter needs LORA_RANK" in alone.stderr


def test_dry_run_checks_the_memory_plan(tmp_path):
    """With the checkpoint's config.json at hand the plan includes forge-plan's table; a layout that may not fit
    is warned of, one the model cannot take stops the job; without a config, or with GPU_MEMORY_GIB=off, the check
    is skipped, said so."""
    import json

    from forge_megatron.models.tiny import tiny_config

    hf = tmp_path / "tiny"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**tiny_config("qwen3").to_dict(),
                                                "architectures": ["Qwen3ForCausalLM"]}))
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # this venv's python
    base = dict(MODEL="tiny", HF_CHECKPOINT=str(hf), TRAIN_NODES=1, GPUS_PER_NODE=2, ENGINE_TP=1, TP=2, PP=1,
                EP=1, CP=1, PATH=path)
    out = _dry_run(**base)
    assert out.returncode == 0, out.stderr
    assert "plan: qwen3: world 2 = TP 2 x PP 1 x CP 1 x DP 1" in out.stdout and "plan: fits in 80 GiB" in out.stdout
    out = _dry_run(**base, GPU_MEMORY_GIB="0.000001")
    assert out.returncode == 0 and "plan: WARNING: the trainer may not fit" in out.stdout
    out = _dry_run(**{**base, "TP": 1, "PP": 2})  # the tiny model's 2 layers over PP 2 work; 3 heads would not
    assert out.returncode == 0, out.stderr
    (hf / "config.json").write_text(json.dumps({**tiny_config("qwen3", num_key_value_heads=1).to_dict(),
                                                "architectures": ["Qwen3ForCausalLM"]}))
    out = _dry_run(**base)
    assert out.returncode != 0 and "tp=2 does not divide num_query_groups=1" in out.stderr + out.stdout
    out = _dry_run(**{**base, "HF_CHECKPOINT": str(tmp_path / "absent")})
    assert out.returncode == 0 and "memory per trainer GPU not checked" in out.stdout
    out = _dry_run(**base, GPU_MEMORY_GIB="off")  # asked not to (the model's layout error above not seen)
    assert out.returncode == 0 and "memory per trainer GPU not checked (GPU_MEMORY_GIB=off)" in out.stdout
    # uneven pipeline stages: 3 layers over PP 2 stop the job unless a stage is given its own count
    (hf / "config.json").write_text(json.dumps({**tiny_config("qwen3", num_hidden_layers=3).to_dict(),
                                                "architectures": ["Qwen3ForCausalLM"]}))
    out = _dry_run(**{**base, "TP": 1, "PP": 2})
    assert out.returncode != 0 and "3 layers do not split into 2 pipeline stages" in out.stderr + out.stdout
    out = _dry_run(**{**base, "TP": 1, "PP": 2, "PP_LAST_LAYERS": 1})
    assert out.returncode == 0, out.stderr
    assert "PP_LAST_LAYERS=1" in out.stdout and "--decoder-last-pipeline-num-layers 1" in out.stdout


@pytest.mark.parametrize("env, message", [
    (dict(TP=3), "TP\\*PP\\*CP=3 must divide the 16 trainer GPUs"),
    (dict(ENGINE_TP=3), "ENGINE_TP=3 must divide GPUS_PER_NODE=8"),
    (dict(EP=3), "EP=3 must divide DP\\*CP=8"),
    (dict(EP=32, ETP=1), "EP=32 must divide DP\\*CP\\*TP=16 \\(ETP=1\\)"),
    (dict(ETP=4), "ETP=4: the experts' TP size is 1 or TP \\(2\\)"),
    (dict(DRY_NODES="a b c"), "need 5 nodes"),
])
def test_dry_run_rejects_inconsistent_layouts(env, message):
    out = _dry_run(**env)
    assert out.returncode != 0
    assert re.search(message, out.stderr), out.stderr


def test_run_local_dry_run_is_consistent():
    script = os.path.join(ROOT, "scripts", "run_local.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    env = {**os.environ, "HF_CHECKPOINT": "/models/m", "TASKS": "tasks.jsonl", "AGENT_URL": "http://127.0.0.1:9/",
           "NUM_ENGINES": "2", "NPROC": "4", "TP": "2", "MODEL": "tiny"}
    out = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    cmds = _commands(out.stdout)
    engines = [c for c in cmds if "forge_megatron.rollout.engine_server" in c]
    urls = [f"http://127.0.0.1:{c[c.index('--port') + 1]}" for c in engines]
    assert len(set(urls)) == 2
    (trainer,) = [c for c in cmds if c[0] == "torchrun"]
    args = _trainer_args(trainer)
    assert args.engine_urls == urls and args.tensor_model_parallel_size == 2 and args.num_layers == 2
    # SGLang engines for a trained vision tower: their image embedding cache off (as forge.sbatch's)
    out = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=60,
                         env={**env, "ENGINE": "sglang", "EXTRA_TRAIN_ARGS": "--train-vision-tower"})
    assert out.returncode == 0, out.stderr
    engines = [c for c in _commands(out.stdout) if "sglang.launch_server" in c]
    assert len(engines) == 2 and all("SGLANG_VLM_CACHE_SIZE_MB=0" in c for c in engines)
    # LORA_SYNC=adapter: the engines (forge's, SGLang) serve LoRA, the trainer sends adapters into RUN_DIR/adapters
    for engine, module in (("forge", "forge_megatron.rollout.engine_server"), ("sglang", "sglang.launch_server")):
        out = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=60,
                             env={**env, "ENGINE": engine, "LORA_RANK": "8", "LORA_SYNC": "adapter",
                                  "RUN_DIR": "/runs/l"})
        assert out.returncode == 0, out.stderr
        cmds_lora = _commands(out.stdout)
        assert all("--enable-lora" in c for c in cmds_lora if module in c)
        (lora_trainer,) = [c for c in cmds_lora if c[0] == "torchrun"]
        lora_args = _trainer_args(lora_trainer)
        assert (lora_args.lora_rank, lora_args.weight_sync_lora, lora_args.weight_sync_dir) == (8, "adapter",
                                                                                                "/runs/l/adapters")
    assert args.sequence_parallel and not args.critic
    arguments.parallel_config(args).data_parallel_size(int(trainer[trainer.index("--nproc-per-node") + 1]))
    assert args.ppo_target_kl is None
    out = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=60,
                         env={**env, "PPO_EPOCHS": "2", "PPO_TARGET_KL": "0.05"})
    ppo = _trainer_args([c for c in _commands(out.stdout) if c[0] == "torchrun"][0])
    assert (ppo.ppo_epochs, ppo.ppo_target_kl) == (2, 0.05)
    # CRITIC=1: the trainer's --critic and its flags (a critic of its own checkpoint)
    out = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=60,
                         env={**env, "CRITIC_CHECKPOINT": "/models/v", "GAE_LAMBDA": "0.95"})
    assert out.returncode == 0, out.stderr
    critic_args = _trainer_args([c for c in _commands(out.stdout) if c[0] == "torchrun"][0])
    assert (critic_args.critic, critic_args.critic_hf_checkpoint, critic_args.gae_lambda) == (True, "/models/v", 0.95)
    bad = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=60,
                         env={**env, "CRITIC_LR": "1e-5"})
    assert bad.returncode == 2 and "need CRITIC=1" in bad.stderr
    from forge_megatron.agents.driver import build_parser as driver_parser
    from forge_megatron.agents.middleware_node import build_parser as node_parser

    (mid,) = [c for c in cmds if "forge_megatron.agents.middleware_node" in c]
    node = node_parser().parse_args(mid[mid.index("forge_megatron.agents.middleware_node") + 1:])
    assert node.policy_sampling and node.gateway_workers == 1
    with_eval = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=60,
                               env={**env, "EVAL_TASKS": "heldout.jsonl", "POLICY_SAMPLING": "0",
                                    "ROLLOUT_TEMPERATURE": "0.6", "TOOL_PARSER": "qwen3_coder",
                                    "REASONING_PARSER": "qwen3", "CHAT_TEMPLATE_KWARGS": '{"enable_thinking": false}',
                                    "GATEWAY_WORKERS": "3"})
    cmds = _commands(with_eval.stdout)
    (mid,) = [c for c in cmds if "forge_megatron.agents.middleware_node" in c]
    node = node_parser().parse_args(mid[mid.index("forge_megatron.agents.middleware_node") + 1:])
    assert not node.policy_sampling and node.policy_temperature == 0.6 and node.gateway_workers == 3
    assert (node.tool_parser, node.reasoning_parser, node.chat_template_kwargs) == \
        ("qwen3_coder", "qwen3", {"enable_thinking": False})
    (trainer,) = [c for c in cmds if "train_forge.py" in " ".join(c)]
    assert trainer[trainer.index("--rollout-temperature") + 1] == "0.6"
    (driver,) = [c for c in cmds if "forge_megatron.agents.driver" in c]
    rollout = driver_parser().parse_args(driver[driver.index("forge_megatron.agents.driver") + 1:])
    assert (rollout.eval_tasks, rollout.eval_every_versions) == ("heldout.jsonl", 10)
    bad = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, env={**env, "TP": "3"})
    assert bad.returncode != 0 and "TP*PP*CP=3 must divide NPROC=4" in bad.stderr
    # TEACHER_CHECKPOINT: in the trainer; with TEACHER_SERVED=1 served beside the engines, the gateway scoring with it
    for served in (0, 1):
        out = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=60,
                             env={**env, "TEACHER_CHECKPOINT": "/models/big", "TEACHER_SERVED": str(served),
                                  "DISTILL_OUTCOME_COEF": "0", "DISTILL_KL": "reverse", "DISTILL_TOPK": "12"})
        assert out.returncode == 0, out.stderr
        cmds = _commands(out.stdout)
        (mid,) = [c for c in cmds if "forge_megatron.agents.middleware_node" in c]
        node = node_parser().parse_args(mid[mid.index("forge_megatron.agents.middleware_node") + 1:])
        (trainer,) = [c for c in cmds if c[0] == "torchrun"]
        targs = _trainer_args(trainer)
        teacher_engines = [c for c in cmds if "engine_server" in " ".join(c) and "/models/big" in c]
        assert targs.distill_outcome_coef == 0.0 and len(teacher_engines) == served
        assert (node.teacher_urls, targs.teacher_from_gateway, targs.teacher_hf_checkpoint) == (
            ("http://127.0.0.1:30300", True, None) if served else ("", False, "/models/big"))
        assert (targs.distill_kl, targs.distill_topk, node.teacher_topk) == ("reverse", 12, 12 if served else 0)


def test_auto_weight_sync_master_addr_is_this_host():
    import socket

    from forge_megatron.training.trainer import weight_sync_master_addr

    assert weight_sync_master_addr("auto") == socket.gethostname()
    assert weight_sync_master_addr("10.0.0.5") == "10.0.0.5"


def _run_dir(stdout: str) -> str:
    (trainer,) = [c for c in _commands(stdout) if "torchrun" in c]
    return os.path.dirname(trainer[trainer.index("--save") + 1])


def _function(name: str) -> str:
    """The definition of a bash function of forge.sbatch (from ``name() {`` to the first line that is ``}``)."""
    lines = open(SBATCH).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}() {{"))
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return "\n".join(lines[start:end + 1])


def test_the_time_limit_signal_reaches_a_trainer_that_is_running(tmp_path):
    """slurm signals the batch script before the time limit (#SBATCH --signal=B:USR1@600). The script's USR1 trap
    must run while the trainer runs (bash holds traps back until a foreground command ends, so the trainer runs in
    the background and is waited for): it creates the trainer's --exit-file. Here the "trainer" waits for that file
    and exits 3; the script's functions run it, the test sends USR1 to the script: the file appears, the script
    goes on waiting and ends with the trainer's status."""
    assert "#SBATCH --signal=B:USR1@600" in open(SBATCH).read()
    stop = tmp_path / "stop_training"
    trainer = (f"import os, time\nwhile not os.path.exists({str(stop)!r}): time.sleep(0.05)\n"
               "time.sleep(0.5)\nprint('trainer: saved and stopped', flush=True)\nraise SystemExit(3)\n")
    script = "\n".join([
        "set -euo pipefail", "DRY_RUN=0", f"STOP_FILE={shlex.quote(str(stop))}", "show() { :; }",
        _function("run_until_done"), _function("time_limit_near"), "trap time_limit_near USR1",
        f"run_until_done {shlex.quote(sys.executable)} -c {shlex.quote(trainer)}", "echo not reached"])
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import signal
        import time

        time.sleep(1.5)
        assert proc.poll() is None and not stop.exists()
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stop.exists()
    assert "SIGUSR1 (the time limit is near)" in out and "trainer: saved and stopped" in out, out
    assert proc.returncode == 3 and "not reached" not in out


def test_dry_run_of_a_gemma3_vision_language_checkpoint_uses_sglangs_triton_attention(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint: SGLang starts with --attention-backend triton (its only backend
    whose prefill lets an image's tokens see each other) and SGLANG_MM_AVOID_RETOKENIZE=1, in forge.sbatch and
    run_local.sh; another checkpoint keeps SGLang's defaults; SGLANG_ATTENTION_BACKEND overrides it."""
    import json

    from forge_megatron.models.tiny import tiny_config

    gemma, other = tmp_path / "gemma", tmp_path / "qwen"
    for d, tiny, arch in ((gemma, "gemma3_vl", "Gemma3ForConditionalGeneration"), (other, "qwen3", "Qwen3ForCausalLM")):
        d.mkdir()  # (whole configs: forge.sbatch plans the memory from them where forge_megatron imports)
        (d / "config.json").write_text(json.dumps({**tiny_config(tiny).to_dict(), "architectures": [arch]}))

    def backends(script_env, **env):
        if script_env == "sbatch":
            out = _dry_run(MODEL="tiny", GPU_MEMORY_GIB="off", **env)  # (the memory plan: tested above)
        else:
            out = _local_dry_run(ENGINE="sglang", MODEL="tiny", **env)
        assert out.returncode == 0, out.stderr
        engines = [c for c in _commands(out.stdout) if "sglang.launch_server" in c]
        assert engines
        # (images as token ids, one placeholder each: SGLang writes them out in token space)
        token_space = {"SGLANG_MM_AVOID_RETOKENIZE=1" in c for c in engines}
        assert token_space == {bool(env["HF_CHECKPOINT"] == str(gemma))}, engines[0]
        return {c[c.index("--attention-backend") + 1] if "--attention-backend" in c else None for c in engines}

    for script in ("sbatch", "local"):
        assert backends(script, HF_CHECKPOINT=str(gemma)) == {"triton"}
        assert backends(script, HF_CHECKPOINT=str(other)) == {None}
        assert backends(script, HF_CHECKPOINT=str(gemma), SGLANG_ATTENTION_BACKEND="flashinfer") == {"flashinfer"}


OFFLINE_SBATCH = os.path.join(ROOT, "scripts", "slurm", "offline.sbatch")


def test_offline_sbatch_dry_run_launches_the_trainer_on_pairs_and_chats(tmp_path):
    """scripts/slurm/offline.sbatch: bash -n, --help shows the whole header, and a dry run's torchrun command is a trainer
    command line that parses and validates (the pairs, DPO's flags, sequence parallelism under TP); bad settings are
    refused by name."""
    assert subprocess.run(["bash", "-n", OFFLINE_SBATCH]).returncode == 0
    shown = subprocess.run(["bash", OFFLINE_SBATCH, "--help"], capture_output=True, text=True).stdout
    assert "PAIRS_PER_STEP" in shown and shown.rstrip().endswith("node0, node1, ...")
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "chosen": "2", "rejected": "3"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_NODES="a b", TRAIN_NODES="2", GPUS_PER_NODE="8", TP="2", PP="2", PREFERENCE_DATA=str(data),
               DPO_BETA="0.2", DPO_LOSS="ipo", PAIRS_PER_STEP="32", REF_CHECKPOINT=str(tmp_path), LORA_RANK="8")
    out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "DP=4" in out.stdout and "reference " + str(tmp_path) in out.stdout
    (cmd,) = _commands(out.stdout)
    assert cmd[:2] == ["srun", "--nodes=2"] and "torchrun" in cmd
    args = _trainer_args(cmd)
    assert args.preference_data == str(data) and args.train_batch_groups == 32 and args.dpo_loss == "ipo"
    assert args.dpo_beta == 0.2 and args.sequence_parallel and args.tensor_model_parallel_size == 2
    assert args.ref_hf_checkpoint == str(tmp_path) and args.lora_rank == 8 and args.weight_sync_transport == "none"
    assert "plan: memory per GPU not checked" in out.stdout
    from forge_megatron.models.tiny import build_tiny_model

    tiny = build_tiny_model(str(tmp_path / "tiny"))  # its config here: forge-plan checks the layout first
    out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**env, "MODEL": "tiny", "HF_CHECKPOINT": tiny, "TP": "1", "LORA_RANK": ""})
    assert out.returncode == 0 and "plan: " in out.stdout and "fits in 80 GiB per GPU" in out.stdout, out.stderr
    out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**env, "REWARD_MODEL": "1", "REF_CHECKPOINT": "", "LORA_RANK": "", "RM_CENTER_COEF": "0.01"})
    assert out.returncode == 0 and "a Bradley-Terry reward model" in out.stdout, out.stderr
    args = _trainer_args(_commands(out.stdout)[0])
    assert args.reward_model and args.rm_center_coef == 0.01 and args.lr == 1e-5 and args.ref_hf_checkpoint is None
    out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**env, "DPO_LOSS": "simpo", "SIMPO_GAMMA": "0.8", "REF_CHECKPOINT": "", "LORA_RANK": ""})
    assert out.returncode == 0 and "no reference (gamma 0.8)" in out.stdout, out.stderr
    args = _trainer_args(_commands(out.stdout)[0])
    assert args.dpo_loss == "simpo" and args.simpo_gamma == 0.8
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n')
    out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**env, "PREFERENCE_DATA": "", "SFT_DATA": str(chats), "REF_CHECKPOINT": "",
                              "EVAL_DATA": str(chats), "EVAL_INTERVAL": "25"})
    assert out.returncode == 0 and "supervised fine-tuning on " + str(chats) in out.stdout, out.stderr
    args = _trainer_args(_commands(out.stdout)[0])
    assert args.sft_data == str(chats) and args.preference_data is None and args.lr == 1e-5
    assert args.offline_eval_data == str(chats) and args.offline_eval_interval == 25
    assert args.teacher_hf_checkpoint is None
    out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**env, "PREFERENCE_DATA": "", "SFT_DATA": str(chats), "REF_CHECKPOINT": "",
                              "TEACHER_CHECKPOINT": "/models/big", "DISTILL_KL": "jsd", "DISTILL_TOPK": "16",
                              "DISTILL_OUTCOME_COEF": "0"})
    assert out.returncode == 0 and "plan: distilling /models/big (jsd over its top 16 tokens)" in out.stdout, out.stderr
    args = _trainer_args(_commands(out.stdout)[0])  # supervised distillation: a trainer command line that validates
    assert (args.teacher_hf_checkpoint, args.distill_kl, args.distill_topk, args.distill_outcome_coef) == (
        "/models/big", "jsd", 16, 0.0)
    examples = tmp_path / "examples.jsonl"
    examples.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "completion": "2", "label": true}\n')
    out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**env, "PREFERENCE_DATA": "", "KTO_DATA": str(examples), "KTO_BETA": "0.3",
                              "KTO_UNDESIRABLE_WEIGHT": "1.5", "KTO_NO_KL": "1", "EVAL_DATA": str(examples)})
    assert out.returncode == 0 and "plan: KTO (beta 0.3, reference point 0) on " + str(examples) in out.stdout, \
        out.stderr
    args = _trainer_args(_commands(out.stdout)[0])  # a KTO command line that validates
    assert (args.kto_data, args.kto_beta, args.kto_undesirable_weight, args.kto_no_kl) == (str(examples), 0.3, 1.5, True)
    assert args.preference_data is None and args.offline_eval_data == str(examples) and args.lr == 1e-6
    for bad, message in ((dict(DPO_LOSS="kto"), "DPO_LOSS=kto"), (dict(TP="3"), "TP*PP*CP=6 must divide"),
                         (dict(KTO_DATA=str(examples)), "set one of SFT_DATA, PREFERENCE_DATA and KTO_DATA"),
                         (dict(PREFERENCE_DATA="", KTO_DATA=str(examples), REWARD_MODEL="1", REF_CHECKPOINT=""),
                          "REWARD_MODEL=1 learns from PREFERENCE_DATA"),
                         (dict(PAIRS_PER_STEP="2"), "gives some of the DP=4 ranks nothing to train"),
                         (dict(DRY_NODES="a"), "need TRAIN_NODES=2 nodes"),
                         (dict(REWARD_MODEL="1"), "REWARD_MODEL=1 trains without a reference"),
                         (dict(DPO_LOSS="simpo"), "DPO_LOSS=simpo has no reference"),
                         (dict(PREFERENCE_DATA=""), "set SFT_DATA (supervised), PREFERENCE_DATA"),
                         (dict(SFT_DATA=str(data)), "set one of SFT_DATA, PREFERENCE_DATA and KTO_DATA"),
                         (dict(TEACHER_CHECKPOINT="/t"), "TEACHER_CHECKPOINT distils on SFT_DATA"),
                         (dict(PREFERENCE_DATA="", SFT_DATA=str(data), REF_CHECKPOINT="", TEACHER_CHECKPOINT="/t",
                               DISTILL_KL="sampled"), "DISTILL_KL=sampled: forward, reverse or jsd")):
        out = subprocess.run(["bash", OFFLINE_SBATCH, "--dry-run"], capture_output=True, text=True,
                             env={**env, **bad}, timeout=60)
        assert out.returncode == 1 and message in out.stderr, (bad, out.stderr)


def test_longrope_checkpoints_pin_sglang_and_the_trainer_to_one_factor_list(tmp_path):
    """A longrope checkpoint (Phi-4-mini's layout): both launch scripts start SGLang with --json-model-override-args
    holding the checkpoint's longrope entry with both lists the chosen one (default long; LONGROPE_FACTORS=short: the
    short list, the trainer and run_local.sh's reference engine told so too); other checkpoints get no override."""
    import json

    from forge_megatron.models.tiny import build_tiny_model

    ckpt = build_tiny_model(str(tmp_path / "phi4_mini"), arch="phi4_mini", seed=1)
    with open(os.path.join(ckpt, "config.json")) as f:
        params = json.load(f)["rope_parameters"]

    def local(**env):
        return _local_dry_run(HF_CHECKPOINT=ckpt, **env)

    # (each run reads the checkpoint with torch imported: one of each script and factor list)
    for factors, out in (("short", _dry_run(HF_CHECKPOINT=ckpt, LONGROPE_FACTORS="short", GPU_MEMORY_GIB="off")),
                         ("", local(ENGINE="sglang"))):
        assert out.returncode == 0, out.stderr
        cmds = _commands(out.stdout)
        (engine, *_) = [c for c in cmds if "sglang.launch_server" in c]
        override = json.loads(engine[engine.index("--json-model-override-args") + 1])["rope_parameters"]
        chosen = params[f"{factors or 'long'}_factor"]
        assert override["short_factor"] == override["long_factor"] == chosen
        (trainer,) = [c for c in cmds if "torchrun" in c]
        assert _trainer_args(trainer).longrope_factors == (factors or None)
    forge = local(ENGINE="forge", LONGROPE_FACTORS="short")
    assert forge.returncode == 0, forge.stderr
    (engine,) = [c for c in _commands(forge.stdout) if "forge_megatron.rollout.engine_server" in c]
    assert engine[engine.index("--longrope-factors") + 1] == "short"
    plain = _dry_run(MODEL="qwen3-8B", HF_CHECKPOINT="/models/Qwen3-8B")
    assert plain.returncode == 0 and "sglang.launch_server" in plain.stdout
    assert "--json-model-override-args" not in plain.stdout


def test_minimax_m1_checkpoints_are_served_by_sglang_under_minimax_text_01s_name(tmp_path):
    """MiniMax-M1 as released (MiniMaxM1ForCausalLM): SGLang registers the lightning-attention model as
    MiniMaxText01ForCausalLM only, so both launch scripts start it with that architecture in
    --json-model-override-args; a MiniMax-Text-01 checkpoint, and forge's own engine, get no override."""
    import json

    from forge_megatron.models.tiny import tiny_config

    dirs = {}
    for arch in ("MiniMaxM1ForCausalLM", "MiniMaxText01ForCausalLM"):
        d = tmp_path / arch
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**tiny_config("minimax01").to_dict(), "architectures": [arch]}))
        dirs[arch] = str(d)

    for arch, ckpt in dirs.items():
        for out in (_dry_run(MODEL="minimax-m1", HF_CHECKPOINT=ckpt, GPU_MEMORY_GIB="off"),
                    _local_dry_run(HF_CHECKPOINT=ckpt, ENGINE="sglang")):
            assert out.returncode == 0, out.stderr
            engines = [c for c in _commands(out.stdout) if "sglang.launch_server" in c]
            assert engines
            for engine in engines:
                if arch == "MiniMaxM1ForCausalLM":
                    override = json.loads(engine[engine.index("--json-model-override-args") + 1])
                    assert override == {"architectures": ["MiniMaxText01ForCausalLM"]}
                else:
                    assert "--json-model-override-args" not in engine
    forge = _local_dry_run(HF_CHECKPOINT=dirs["MiniMaxM1ForCausalLM"], ENGINE="forge")
    assert forge.returncode == 0, forge.stderr
    (engine,) = [c for c in _commands(forge.stdout) if "forge_megatron.rollout.engine_server" in c]
    assert "--json-model-override-args" not in engine
