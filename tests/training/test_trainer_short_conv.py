"""The trainer on LFM2's layouts, as a real process against a real forge-pool process: a gated short-convolution layer
(y = C * conv(B * x), three taps along each token's ancestors) before an attention layer with per-head q/k norms. LFM2:
one rank, TP = 2 with sequence parallelism (each rank half the channels), CP = 2 (each rank every token of half the
channels) and PP = 2 train the same two steps. LFM2-MoE (the first layer's MLP dense, the second's experts under a
sigmoid router with its bias): PP = 2 and EP = 2 as one rank, routing replayed. LFM3 (a sliding-window layer, a
convolution, a full layer with proportional RoPE; a gate per head, sandwich norms): TP = 2 with sequence parallelism,
CP = 2 and PP = 2 as one rank. CPU, 0 GPUs (gloo)."""

import numpy as np
import pytest

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_on_fresh_pool

LAYOUTS = {
    "lfm2": [("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
             ("cp2", ["--context-parallel-size", "2"]), ("pp2", ["--pipeline-model-parallel-size", "2"])],
    "lfm2_moe": [("pp2", ["--pipeline-model-parallel-size", "2"]), ("ep2", ["--expert-model-parallel-size", "2"])],
    # LFM3: the gate per head split over TP with the heads (its input gathered over the sequence); the window and the
    # full layers' own RoPE over CP's gathered keys; the first layer alone on the first stage
    "lfm3": [("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
             ("cp2", ["--context-parallel-size", "2"]),
             ("pp2first1", ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"])],
}


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_lfm2_short_convolutions_train_the_same_under_parallelism(tmp_path, arch):
    model_dir = build_tiny_model(str(tmp_path / arch), arch=arch, seed=2)
    moe = arch == "lfm2_moe"
    routing = (2, 4, 2) if moe else None
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=routing)  # noqa
    replay = ["--routing-replay"] if moe else []
    steps = {}
    layouts = [("one", [])] + LAYOUTS[arch]
    for name, extra in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1,
                                              nproc=1 if name == "one" else 2,
                                              extra=extra + replay + ["--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, [name for name, _ in layouts[1:]], REPLAY_KEYS if moe else ("loss", "grad_norm"))
