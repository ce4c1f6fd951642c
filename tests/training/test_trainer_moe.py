"""The trainer with MoE models as a real process against a real forge-pool process: rollout routing replay under
pipeline, tensor, context, expert and interleaved-pipeline parallelism, and the model families with their own MoE
layouts (GLM-4.5, DeepSeek-V3, gpt-oss, MiniMax-M2, Hunyuan, OLMoE), each equal to one rank. Split from test_trainer.py so the two
pytest workers share the trainer runs. CPU, 0 GPUs (gloo)."""

import os

import numpy as np
import pytest
import torch

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_on_fresh_pool


def test_routing_replay_trains_the_same_under_pipeline_and_recomputation(tmp_path):
    """--routing-replay on the tiny MoE model, episodes carrying recorded experts: one rank, PP = 2 with several
    micro-batches in flight (1F1B) and full recomputation (each recompute in the backward must replay its own
    micro-batch's rows) train the same two steps (loss, grad norm, routing mismatch); replay under TP x SP (each TP
    rank's router replays its slice of the tokens), CP (each rank its shard's rows of the padded tree) and EP: the
    family tests below. Without replay the same data trains differently, and the logged mismatch says how many
    replayed rows the router would have routed otherwise."""
    model_dir = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    steps = {}
    for name, extra, nproc in (
            ("one", ["--routing-replay", "--tree-token-budget", "18"], 1),  # the same micro-batches as pp2
            ("pp2", ["--routing-replay", "--pipeline-model-parallel-size", "2", "--tree-token-budget", "18",
                     "--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"], 2),
            ("natural", [], 1)):
        # pi_old recomputed: a forward-only pass with replay before each update (its rows are not counted again)
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1,
                                              extra=extra + ["--old-logprobs", "recompute"], nproc=nproc, model=[])
    assert [len(v) for v in steps.values()] == [2, 2, 2]
    assert steps["pp2"][0]["micro_batches"] > 2  # several micro-batches in flight in the pipeline
    assert_same_as_one_rank(steps, ("pp2",), REPLAY_KEYS)
    first = steps["one"][0]
    assert 0 < first["routing_mismatch"] < 1  # random rows: many differ
    assert first["routing_prefix_conflicts"] == 0.0  # one set of prompt rows per group
    # Rows counted once per training pass (not again for pi_old's forward-only pass): a group of 4 episodes, 12
    # prompt + c completion tokens, one sample per micro-batch under the budget, the last token unrecorded:
    # 4 x (12 + c - 1) tokens x 2 layers, c = 4 and 5 for the two groups.
    assert sorted(s["routing_replayed_rows"] for s in steps["one"]) == [120, 128]
    assert abs(steps["natural"][0]["loss"] - first["loss"]) > 1e-4 and "routing_mismatch" not in steps["natural"][0]


def test_sigmoid_router_moe_trains_the_same_under_pipeline_tensor_and_expert_parallelism(tmp_path):
    """The DeepSeek-V3 layout (dense layer 0, then a MoE layer with a sigmoid router, score-correction bias, grouped
    routing, routed scaling and a shared expert; multi-latent attention) through the trainer with routing replay:
    one rank, PP = 2 (the dense and the MoE layer on different stages), TP = 2 with sequence parallelism (MLA's down
    projections split and gathered), CP = 2 and EP = 2 train the same two steps; only the MoE layer replays rows.
    (GLM-4.5's MoE layer is this one without groups; its partial RoPE under CP is MiniMax-M2's, tested below.)"""
    model_dir = build_tiny_model(str(tmp_path / "deepseek_v3"), arch="deepseek_v3", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    steps = {}
    for name, extra, nproc in (
            ("one", [], 1),
            ("pp2", ["--pipeline-model-parallel-size", "2"], 2),
            ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
            ("cp2", ["--context-parallel-size", "2"], 2),  # partial RoPE indexed by depth on each CP shard
            ("ep2", ["--expert-model-parallel-size", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--routing-replay", "--tree-token-budget", "18"],
                                              model=[])
    assert [len(v) for v in steps.values()] == [2, 2, 2, 2, 2]
    assert_same_as_one_rank(steps, ("pp2", "tp2sp", "cp2", "ep2"), REPLAY_KEYS)
    # one MoE layer of two: half the rows the two-layer Qwen3-MoE test replays on the same data
    assert sorted(s["routing_replayed_rows"] for s in steps["one"]) == [60, 64]
    assert steps["one"][0]["grad_norm"] > 0 and 0 < steps["one"][0]["routing_mismatch"] < 1


def test_gpt_oss_trains_the_same_under_pipeline_expert_context_and_tensor_parallelism(tmp_path):
    """The gpt-oss layout (sinks, a sliding window on layer 0, biased router and experts, the clamped GLU) through
    the trainer with routing replay: one rank, PP = 2, CP = 2 (sinks and windows on each CP rank's shard) and TP = 2
    with the experts whole (--expert-tensor-parallel-size 1: Megatron has expert biases only then; the sinks split
    with the heads), alone and with EP = 2 over the two TP ranks (the biased experts split by EP), train the same
    two steps, with the
    gradient clipped (every rank must clip by the same norm, or the expert replicas of TP ranks drift apart); TP = 2
    with the experts split is refused by name."""
    model_dir = build_tiny_model(str(tmp_path / "gpt_oss"), arch="gpt_oss", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    steps = {}
    for name, extra, nproc in (
            ("one", [], 1),
            ("pp2", ["--pipeline-model-parallel-size", "2"], 2),
            ("cp2", ["--context-parallel-size", "2"], 2),
            ("tp2_etp1", tp2, 2),
            ("tp2_ep2_etp1", tp2 + ["--expert-model-parallel-size", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--routing-replay", "--tree-token-budget", "18",
                                                             "--clip-grad", "0.5"], model=[])
    assert [len(v) for v in steps.values()] == [2] * 5
    assert steps["one"][0]["grad_norm"] > 0.5  # clipped
    # the TP ranks' copies of the whole experts stayed equal (both reduced and clipped the same)
    states = [torch.load(tmp_path / "tp2_etp1" / "ckpt" / "iter_0000002" / f"rank_{r:05d}.pt", weights_only=False)
              for r in range(2)]
    experts = [k for k in states[0]["model"] if ".mlp.experts." in k and not k.endswith("_extra_state")]
    assert any(k.endswith("linear_fc2.bias") for k in experts)
    for k in experts:
        assert torch.equal(states[0]["model"][k], states[1]["model"][k]), k
    # the offline export joins a layout where not every (TP, EP) pair is a rank (the EP group over the TP ranks)
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    exported = {}
    for name in ("one", "tp2_ep2_etp1"):
        export_trainer_checkpoint(str(tmp_path / name / "ckpt"), str(tmp_path / f"{name}_hf"))
        exported[name] = {k: v for f in sorted((tmp_path / f"{name}_hf").glob("*.safetensors"))
                          for k, v in load_file(f).items()}
    assert set(exported["one"]) == set(exported["tp2_ep2_etp1"])
    for k, v in exported["one"].items():  # the same two steps, trained in another reduction order
        torch.testing.assert_close(exported["tp2_ep2_etp1"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert_same_as_one_rank(steps, ("pp2", "cp2", "tp2_etp1", "tp2_ep2_etp1"), REPLAY_KEYS)
    assert steps["one"][0]["grad_norm"] > 0 and 0 < steps["one"][0]["routing_mismatch"] < 1
    from forge_megatron.bridge import Bridge
    from forge_megatron.training import arguments
    from forge_megatron.training.trainer import model_config

    args = arguments.parse_args(["--hf-checkpoint", model_dir, "--lr", "1e-4", "--train-iters", "3",
                                 "--weight-sync-transport", "none", "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel"])
    with pytest.raises(ValueError, match="experts with biases.*add --expert-tensor-parallel-size 1"):
        model_config(args, Bridge(model_dir))


def test_minimax_m2_trains_the_same_under_tensor_context_and_expert_parallelism(tmp_path):
    """The MiniMax-M2 layout (q/k RMSNorms over all heads, every layer sigmoid-routed MoE, RoPE on half of each head)
    through the trainer with routing replay: TP = 2 with sequence parallelism (each rank normalises its heads by the
    all-reduced sum of squares, whose backward all-reduces too), CP = 2, and all of TP = 2 x SP x CP = 2 with the
    experts whole over EP = 2 (--expert-tensor-parallel-size 1: the experts' group spans the TP and CP ranks) train
    the same two steps as one rank (its experts are Qwen3-MoE's: EP also in the DeepSeek-V3 and gpt-oss tests)."""
    model_dir = build_tiny_model(str(tmp_path / "minimax_m2"), arch="minimax_m2", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    steps, logs = {}, {}
    for name, extra, nproc in (
            ("one", [], 1),
            ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
            ("cp2", ["--context-parallel-size", "2"], 2),  # each CP rank normalises its own tokens' heads
            ("tp2sp_cp2_ep2_etp1", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--context-parallel-size", "2", "--expert-model-parallel-size", "2",
                                    "--expert-tensor-parallel-size", "1"], 4)):
        steps[name], logs[name], _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1,
                                                       nproc=nproc, model=[],
                                                       extra=extra + ["--routing-replay", "--tree-token-budget", "18"])
    # the start-up log says what forge-plan says each GPU holds
    from forge_megatron.bridge import Bridge
    from forge_megatron.training.plan import rank_params

    held = rank_params(Bridge(model_dir), 2, 1, 1, 0)
    assert f"memory plan, pipeline rank 0: {held['dense'] + held['expert']:,} parameters per GPU" in logs["tp2sp"][0]
    assert [len(v) for v in steps.values()] == [2, 2, 2, 2]
    assert_same_as_one_rank(steps, ("tp2sp", "cp2", "tp2sp_cp2_ep2_etp1"), REPLAY_KEYS)
    assert sorted(s["routing_replayed_rows"] for s in steps["one"]) == [120, 128]  # both layers MoE
    assert steps["one"][0]["grad_norm"] > 0 and 0 < steps["one"][0]["routing_mismatch"] < 1


LAYOUTS = {"tp2sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
           "cp2": (["--context-parallel-size", "2"], 2), "pp2": (["--pipeline-model-parallel-size", "2"], 2),
           "ep2": (["--expert-model-parallel-size", "2"], 2),
           "pp2first1": (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"], 2),
           # every layer recomputed in its own chunk (LongCat-Flash: a chunk boundary inside each layer pair)
           "recompute1": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"], 1)}


@pytest.mark.parametrize("arch,layouts", [("hunyuan_v1_moe", ("tp2sp", "cp2", "pp2", "ep2")),
                                          ("olmoe", ("tp2sp", "ep2")),
                                          ("mimo_v2_flash", ("tp2sp", "cp2", "pp2first1", "ep2")),
                                          ("minimax_m3", ("tp2sp", "cp2", "pp2first1", "ep2")),
                                          ("longcat_flash", ("tp2sp", "cp2", "pp2", "ep2", "recompute1")),
                                          ("axk1", ("tp2sp",)), ("kolibri1", ("tp2sp",))])
def test_hunyuan_olmoe_mimo_minimax_m3_and_longcat_train_the_same_under_tensor_context_and_expert_parallelism(
        tmp_path, arch, layouts):
    """Hunyuan's MoE layout (per-head q/k RMSNorms after RoPE, applied by the tree attention on the rotated queries
    and keys; every layer's experts beside a shared MLP), OLMoE's (q/k RMSNorms over all heads, softmax experts
    not renormalised) and MiMo-V2-Flash's (a sliding-window layer with its own key heads and sinks between full
    ones, narrower scaled values, a dense first layer) through the trainer: TP = 2 with sequence parallelism (the
    norms' gradients, a part from each rank's heads, summed over TP; MiMo's sinks split with the heads), CP = 2
    (each rank's tokens; MiMo's window and sinks over the gathered keys), PP = 2 and EP = 2 train the same two steps
    as one rank. MiniMax-M3's block-sparse layers (blocks of 2 positions, 2 kept: these samples' later tokens drop
    blocks) choose per key head on each TP rank, from the gathered keys and indexer inputs under CP. LongCat-Flash's
    layer pairs (the shortcut MoE's output carried beside the hidden states, identity experts) on each SP rank's
    tokens, one pair per pipeline stage, and through full recomputation in one-layer chunks (each pair split across
    two checkpoints). A.X K1's norm after the experts normalises each SP rank's tokens, its gradient summed over
    TP; Kolibri 1's router (logit plus bias) chooses the same on each rank's tokens."""
    model_dir = build_tiny_model(str(tmp_path / arch), arch=arch, seed=2)
    # LongCat-Flash with routing replay: rows of its 2 checkpoint layers over 4 routed + 2 identity experts, 3 a token
    # and Kolibri 1 (its own router: routing replay replaces its choice as Megatron's): 2 layers of 4 experts, top 2
    routing = {"longcat_flash": (2, 6, 3), "kolibri1": (2, 4, 2)}.get(arch)
    replay = ["--routing-replay"] if routing else []
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(7), completion_len=(4, 5), routing=routing)  # noqa: E731
    steps = {}
    for name, (extra, nproc) in [("one", ([], 1))] + [(k, LAYOUTS[k]) for k in layouts]:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              model=[], extra=extra + replay + ["--tree-token-budget", "18"])
    assert [len(v) for v in steps.values()] == [2] * (1 + len(layouts))
    assert_same_as_one_rank(steps, layouts, REPLAY_KEYS if routing else ("loss", "grad_norm"))
    assert steps["one"][0]["grad_norm"] > 0
    if routing:  # both routers replayed every recorded row (a router per checkpoint layer, identity experts too)
        assert all(s["routing_replayed_rows"] > 0 and 0 < s["routing_mismatch"] < 1 for s in steps["one"])


def test_glm_router_biases_stay_or_keep_balancing_as_asked(tmp_path):
    """The score-correction biases of a GLM-4.5 router stay as the checkpoint has them by default; with
    --moe-router-bias-update-rate r Megatron's auxiliary-loss-free balancing moves each by -r, 0 or +r per step,
    and the trainer's checkpoint (what forge-convert exports, what the syncer sends) holds the moved biases."""
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    model_dir = build_tiny_model(str(tmp_path / "glm"), arch="glm4_moe", seed=2)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    base = load_file(os.path.join(model_dir, "model.safetensors"))[name]
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5))  # noqa
    moved = {}
    for run, extra in (("frozen", []), ("balancing", ["--moe-router-bias-update-rate", "0.01"])):
        run_on_fresh_pool(tmp_path, run, model_dir, feed, iters=2, groups=1, model=[],
                          extra=extra + ["--tree-token-budget", "18"])
        export_trainer_checkpoint(str(tmp_path / run / "ckpt"), str(tmp_path / f"{run}_hf"))
        moved[run] = load_file(str(tmp_path / f"{run}_hf" / "model-00001-of-00001.safetensors"))[name] - base
    assert torch.equal(moved["frozen"], torch.zeros_like(base))
    steps = moved["balancing"] / 0.01  # two updates of -1, 0 or +1 each
    assert steps.abs().max() > 0.5 and torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() < 2.001


def test_routing_replay_under_the_interleaved_pipeline(tmp_path):
    """--routing-replay with PP = 2 x VPP = 2 on a 4-layer DeepSeek-V3-layout model: each model chunk's routers take
    their own layers' rows, micro-batches padded to one length (padding rows routed by the router), and the step
    equals one rank's (loss, grad norm, routing counts). Layer 0 (the first chunk of rank 0) is dense, so each chunk
    builds its own layers from Megatron's block spec (GLM-4.5's layout does the same), with multi-latent attention
    (each chunk's per-layer depth rotary tables)."""
    arch = "deepseek_v3"
    model_dir = build_tiny_model(str(tmp_path / "moe4"), arch=arch, seed=3, num_hidden_layers=4)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(8), completion_len=(4, 5), routing=(4, 4, 2))  # noqa
    steps = {}
    for name, extra, nproc in (("one", [], 1), ("vpp", ["--pipeline-model-parallel-size", "2",
                                                        "--num-virtual-stages-per-pipeline-rank", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=1, groups=2, nproc=nproc,
                                              extra=["--routing-replay", "--tree-token-budget", "18", *extra],
                                              model=[])
    one, vpp = steps["one"][0], steps["vpp"][0]
    assert vpp["pad_tokens"] == 4  # the four 16-token micro-batches padded to the 17-token ones
    for key in ("loss", "grad_norm", "routing_mismatch", "routing_replayed_rows"):
        assert vpp[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    # 8 samples, one per micro-batch; recorded tokens (the last unrecorded) x the 3 MoE layers
    assert one["routing_replayed_rows"] == (4 * (12 + 3) + 4 * (12 + 4)) * 3


def test_moe_resumes_under_another_layout(tmp_path):
    """A Qwen3-MoE run saved after iteration 2 of 4 under TP = 2 x EP = 2 with whole experts (the EP group over the
    two TP ranks) and the distributed optimizer (a chain of two: dense and expert parameters), resumed under PP = 2
    with the plain optimizer: the dense weights are joined over TP, the experts over EP (global expert numbers), then
    split by stage, with their Adam moments; iterations 3 and 4 equal the uninterrupted one-rank run's, routing replay
    included."""
    model_dir = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", seed=2)
    feed = lambda c: feed_groups(c, 4, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    extra = ["--routing-replay", "--tree-token-budget", "18"]
    whole = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
             "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    steps = {}
    steps["one"], _, _ = run_on_fresh_pool(tmp_path, "one", model_dir, feed, iters=4, groups=1, extra=extra, model=[])
    steps["moved"], stdouts, counts = run_on_fresh_pool(
        tmp_path, "moved", model_dir, feed, iters=4, groups=1, extra=extra, model=[],
        exits=[(2, whole, 2), (None, ["--pipeline-model-parallel-size", "2"], 2)])
    assert counts[0] == 2 and "saved under another parallel layout (tp 2 -> 1, pp 1 -> 2, ep 2 -> 1)" in stdouts[1]
    assert_same_as_one_rank(steps, ("moved",), REPLAY_KEYS)
