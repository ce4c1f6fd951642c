"""Rollout routing replay (forge_megatron.mcore.routing_replay) on a tree-packed Megatron MoE model, 1 rank, CPU.

The oracle is HF transformers with its routers forced to the same experts: per sample, a teacher-forced forward
whose every Qwen3-MoE router takes the given top-k ids (its own choice where a row is -1), with HF's routing
weights at those experts. The tree-packed Megatron model with the rows replayed must give the same logprobs, its
routers must still get gradients, activation recomputation in the backward must reuse each micro-batch's own rows
(two micro-batches forward, then both backward), and the mismatch counter must count exactly the rows where the
router's own top-k set differs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from forge_megatron.mcore.routing_replay import tree_routing
from forge_megatron.tree import build_tree
from tests.dist_utils import run_distributed

PROMPT = [5, 17, 42, 99, 7, 33]
SAMPLES = [PROMPT + [3, 1, 4, 1], PROMPT + [3, 1, 5], PROMPT + [9, 2, 6, 5, 3], [8, 8, 2]]


def _forced_rows(layout, layers: int, experts: int, top_k: int, seed: int, holes: bool = True):
    """Per tree token, distinct random experts per layer; some (token, layer) rows and every sample's last token
    left unrecorded (-1). Returns (tree rows [T, L, K], per-sample rows)."""
    g = np.random.default_rng(seed)
    T = layout.unique_tokens
    tree = np.stack([np.stack([g.permutation(experts)[:top_k] for _ in range(layers)]) for _ in range(T)])
    tree = tree.astype(np.int16)
    if holes:
        tree[g.random((T, layers)) < 0.2] = -1
    per_sample = []
    nodes = layout.sample_nodes.numpy()
    offsets = layout.sample_offsets.numpy()
    for s in range(layout.num_samples):
        rows = tree[nodes[offsets[s]:offsets[s + 1]]].copy()
        rows[-1] = -1  # the engine never routes a sample's last token
        per_sample.append(rows)
    return tree, per_sample


def _hf_logprobs_forced(model, samples, per_sample_rows):
    """HF teacher-forced logprobs of every sample's next tokens with its routers forced to the rows (-1: own)."""
    import torch.nn.functional as F

    out = []
    for tokens, rows in zip(samples, per_sample_rows):
        forced = torch.from_numpy(rows.astype(np.int64)) if rows is not None else None
        originals = []
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate

            def forward(hidden, gate=gate, i=i):
                hidden = hidden.reshape(-1, gate.hidden_dim)
                logits = F.linear(hidden, gate.weight)
                probs = torch.softmax(logits, dtype=torch.float, dim=-1)
                _, idx = torch.topk(probs, gate.top_k, dim=-1)
                if forced is not None:
                    want = forced[: idx.shape[0], i]
                    idx = torch.where((want >= 0).all(-1, keepdim=True), want, idx)
                w = probs.gather(1, idx)
                if gate.norm_topk_prob:
                    w = w / w.sum(-1, keepdim=True)
                return logits, w.to(logits.dtype), idx

            originals.append((gate, gate.forward))
            gate.forward = forward
        try:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0].double()
        finally:
            for gate, _ in originals:
                del gate.forward
        logp = torch.log_softmax(logits[:-1], -1)
        out.append(logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])])
    return torch.cat(out)


def _body(rank, world_size, hf_dir):
    from transformers import AutoModelForCausalLM

    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import routing_replay
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    layers, experts, top_k = hf.config.num_hidden_layers, hf.config.num_experts, hf.config.num_experts_per_tok

    def build(recompute: bool):
        cfg = bridge.cfg
        if recompute:
            cfg = dataclasses.replace(cfg, extra={**cfg.extra, "recompute_granularity": "full",
                                                  "recompute_method": "uniform", "recompute_num_layers": 1})
        model = build_tree_gpt(cfg)
        load_hf_weights([model], bridge, hf_dir)
        assert routing_replay.install([model]) == layers
        return model

    def run(model, layout, routing):
        routing_replay.set_micro_batch(model, routing, layout.unique_tokens)
        logp, _ = tree_logprobs(model, layout)
        routing_replay.after_forward(model)
        return logp

    layout = build_tree(SAMPLES)
    tree_rows, per_sample = _forced_rows(layout, layers, experts, top_k, seed=0)
    routing = tree_routing(layout, per_sample)
    out = {"tree_routing_exact": bool(
        (routing.numpy()[layout.sample_nodes.numpy()] == np.concatenate(per_sample)).all(axis=(1, 2))[
            np.concatenate([np.arange(len(s)) < len(s) - 1 for s in SAMPLES])].all())}

    model = build(recompute=False)
    natural = run(model, layout, None).detach()
    routing_replay.read_counts([model])
    forced = run(model, layout, routing)
    forced.sum().backward()
    out["router_grad"] = min(float(layer.mlp.router.weight.grad.abs().sum()) for layer in model.decoder.layers)
    rows, mismatched = routing_replay.read_counts([model])
    out["counts"] = (rows, mismatched)
    out["natural"] = (natural.double() - _hf_logprobs_forced(hf, SAMPLES, [None] * len(SAMPLES))).abs().max().item()
    want = _hf_logprobs_forced(hf, SAMPLES, per_sample)
    out["forced"] = (forced.detach().double() - want).abs().max().item()
    out["forced_vs_natural"] = (forced.detach() - natural).abs().max().item()
    # Replaying the model's own routing changes nothing and counts no mismatch.
    own = []
    for layer in model.decoder.layers:
        replay = layer.mlp.router.router_replay

        def record(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None, layer=layer):
            probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            own.append((layer.layer_number - 1, idx.clone()))
            return probs, idx

        replay.get_replay_topk = record
    run(model, layout, None)
    for layer in model.decoder.layers:
        del layer.mlp.router.router_replay.get_replay_topk
    own_rows = torch.full((layout.unique_tokens, layers, top_k), -1, dtype=torch.int16)
    for i, idx in own:
        own_rows[:, i] = idx.to(torch.int16)
    routing_replay.read_counts([model])
    again = run(model, layout, own_rows).detach()
    out["own"] = (again - natural).abs().max().item()
    out["own_counts"] = routing_replay.read_counts([model])
    out["expected_mismatch"] = int(sum(
        (np.sort(own_rows.numpy(), -1) != np.sort(routing.numpy(), -1)).any(-1)[(routing.numpy() >= 0).all(-1)]))

    # Two micro-batches forward, then both backward, with full recomputation: each recompute must replay its own
    # micro-batch's rows (the queue), giving the gradients of the same order without recomputation.
    other = build_tree([[4, 4, 1, 2, 3], [4, 4, 1, 7]])
    _, other_rows = _forced_rows(other, layers, experts, top_k, seed=1)
    other_routing = tree_routing(other, other_rows)
    grads = {}
    for recompute in (False, True):
        m = build(recompute)
        routing_replay.reset([m])
        a = run(m, layout, routing)
        b = run(m, other, other_routing)
        a.sum().backward()
        b.sum().backward()
        grads[recompute] = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    out["recompute"] = max((grads[True][k] - g).abs().max().item() for k, g in grads[False].items())
    out["recompute_params"] = len(grads[True]) == len(grads[False]) > 0
    return out


def _split_body(rank, world_size, hf_dir):
    """Two samples sharing a prompt whose records disagree at one prompt token: merged (one record replayed for the
    shared token) the second sample is scored through routing its engine did not use; split (--routing-replay-split)
    every sample equals HF forced to its own records."""
    from transformers import AutoModelForCausalLM

    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import routing_replay
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    layers, experts, top_k = hf.config.num_hidden_layers, hf.config.num_experts, hf.config.num_experts_per_tok
    model = build_tree_gpt(bridge.cfg)
    load_hf_weights([model], bridge, hf_dir)
    routing_replay.install([model])
    samples = SAMPLES[:2]
    layout = build_tree(samples)
    _, rows = _forced_rows(layout, layers, experts, top_k, seed=2, holes=False)
    rows[1][3] = (rows[0][3] + 1) % experts  # prompt token 3 disagrees (other distinct experts, every layer)
    want = _hf_logprobs_forced(hf, samples, rows)
    out = {}
    for name, lay in (("merged", layout), ("split", routing_replay.split_tree(samples, rows))):
        stats = {}
        routing = tree_routing(lay, rows, stats)
        routing_replay.set_micro_batch(model, routing, lay.unique_tokens)
        with torch.no_grad():
            logp, _ = tree_logprobs(model, lay)
        routing_replay.after_forward(model)
        n0 = len(samples[0]) - 1
        err = (logp.double() - want).abs()
        out[name] = {"first": err[:n0].max().item(), "second": err[n0:].max().item(), "tokens": lay.unique_tokens,
                     "conflicts": stats["conflicts"]}
    out["total"] = sum(len(x) for x in samples)
    return out


def test_split_trees_replay_every_samples_own_record(hf_dir):
    (res,) = run_distributed(_split_body, world_size=1, hf_dir=hf_dir)
    merged, split = res["merged"], res["split"]
    assert merged["conflicts"] == 1 and merged["first"] <= 1e-5 and merged["second"] > 1e-4, res
    assert split["conflicts"] == 0 and split["first"] <= 1e-5 and split["second"] <= 1e-5, res
    # the prompt is shared up to the disagreeing token (3 tokens), then the samples part
    assert split["tokens"] == res["total"] - 3 and merged["tokens"] < split["tokens"], res


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("r3")), arch="qwen3_moe", seed=7)


def test_replayed_routing_equals_hf_with_the_same_experts(hf_dir):
    (res,) = run_distributed(_body, world_size=1, hf_dir=hf_dir)
    assert res["tree_routing_exact"]
    assert res["natural"] <= 1e-5, res  # without rows: the model's own routing, as HF's
    assert res["forced"] <= 1e-5, res  # with rows: HF forced to the same experts
    assert res["forced_vs_natural"] > 1e-3, res  # the forced experts really differ from the router's choice
    assert res["router_grad"] > 0, res  # the router still learns through the replayed experts' weights
    rows, mismatched = res["counts"]
    assert rows > 0 and mismatched == res["expected_mismatch"] > 0, res
    assert res["own"] <= 1e-6 and res["own_counts"][1] == 0, res  # replaying its own routing changes nothing
    assert res["recompute_params"] and res["recompute"] <= 1e-6, res


def test_tree_routing_takes_the_first_recorded_row():
    layout = build_tree([[1, 2, 3], [1, 2, 4], [1, 5]])
    a = np.array([[[0, 1]], [[2, 3]], [[-1, -1]]], np.int16)  # 1, 2, 3 (last token unrecorded)
    b = np.array([[[5, 6]], [[7, 8]], [[-1, -1]]], np.int16)  # disagrees on the shared 1, 2: the first sample wins
    c = np.array([[[-1, -1]], [[-1, -1]]], np.int16)  # nothing recorded
    stats = {}
    got = tree_routing(layout, [a, b, c], stats).numpy()
    assert stats == {"shared": 2, "conflicts": 2}  # tokens 1 and 2: recorded by a and b, differently
    nodes = layout.sample_nodes.numpy()
    assert got[nodes[0]].tolist() == [[0, 1]] and got[nodes[1]].tolist() == [[2, 3]]
    assert got[nodes[4]].tolist() == [[2, 3]]  # b's view of the shared token 2 is the same tree token
    assert got[nodes[2]].tolist() == [[-1, -1]] and got[nodes[5]].tolist() == [[-1, -1]]  # last tokens
    assert got[nodes[7]].tolist() == [[-1, -1]]  # c recorded nothing
    # a -1 row earlier in sample order does not hide a recorded one
    stats = {}
    got = tree_routing(layout, [c[:1].repeat(3, 0), b, None], stats).numpy()
    assert got[nodes[0]].tolist() == [[5, 6]] and stats == {"shared": 0, "conflicts": 0}
    stats = {}
    tree_routing(layout, [a, np.array([[[1, 0]], [[3, 2]], [[9, 9]]], np.int16), None], stats)
    assert stats == {"shared": 2, "conflicts": 0}  # the same experts in another order agree
    assert tree_routing(layout, [None, None, None]) is None
    with pytest.raises(ValueError, match="sample 0 has 3 tokens but 2 recorded rows"):
        tree_routing(layout, [a[:2], b, c])


def test_rank_batch_packs_and_merges_by_records_with_split():
    """rank_batch with routing_split: the packer and the trie see (token, expert set) keys, so a sample whose prompt
    record disagrees from one position on gets its own copy of the rest of the prompt, and no shared tree token
    keeps disagreeing records; without split the trie merges the prompt and counts the conflict."""
    from forge_megatron.middleware.batch import TrainBatch, TrainSample
    from forge_megatron.training.trainer import rank_batch

    g = np.random.default_rng(0)
    prompt = g.integers(10, 200, 12)
    prompt_rows = np.argsort(g.random((12, 2, 4)), axis=-1)[..., :2].astype(np.int8)
    samples = []
    for e in range(4):
        tokens = np.r_[prompt, g.integers(10, 200, 4)].astype(np.int32)
        rows = np.concatenate([prompt_rows, np.argsort(g.random((4, 2, 4)), -1)[..., :2].astype(np.int8)])
        if e == 2:
            rows[5] = (rows[5] + 1) % 4  # this episode's engine routed prompt token 5 elsewhere
        rows[-1] = -1
        mask = np.r_[np.zeros(12), np.ones(4)].astype(np.uint8)
        samples.append(TrainSample(tokens=tokens, loss_mask=mask, rollout_logprobs=np.zeros(16, np.float32),
                                   policy_versions=np.zeros(16, np.int32), advantages=np.zeros(16, np.float32),
                                   sample_weight=1.0, group_index=0, episode_id=str(e), domain="d", reward=0.0,
                                   routed_experts=rows))
    batch = TrainBatch(batch_id=1, samples=samples, group_indices=[0])
    merged = rank_batch(batch, 4096, True, 0, 1, [], routing_replay=True)
    split = rank_batch(batch, 4096, True, 0, 1, [], routing_replay=True, routing_split=True)
    (m,), (s_,) = merged.micro_batches, split.micro_batches
    assert m.layout.unique_tokens == 12 + 4 * 4 and m.routing_stats == {"shared": 12, "conflicts": 1}
    assert s_.layout.unique_tokens == 12 + 4 * 4 + (12 - 5) and s_.routing_stats["conflicts"] == 0
    for mb in (m, s_):  # the layout carries the real token ids either way (samples in packing order)
        lay = mb.layout
        got = [tuple(lay.tokens.numpy()[lay.sample_nodes.numpy()[lay.sample_slice(i)]]) for i in range(4)]
        assert sorted(got) == sorted(tuple(x.tokens.tolist()) for x in samples)


def _hf_longcat_forced(model, samples, per_sample_rows):
    """LongCat-Flash's teacher-forced logprobs with each router's top-k (over routed and identity experts) forced to
    the rows (-1: its own), its weights transformers' own at those experts."""
    out = []
    for tokens, rows in zip(samples, per_sample_rows):
        forced = torch.from_numpy(rows.astype(np.int64)) if rows is not None else None
        routers = [layer.mlp.router for layer in model.model.layers]
        for i, router in enumerate(routers):
            def get_topk_indices(scores, router=router, i=i):
                idx = torch.topk(scores + router.e_score_correction_bias, k=router.top_k, dim=-1)[1]
                if forced is not None:
                    want = forced[: idx.shape[0], i]
                    idx = torch.where((want >= 0).all(-1, keepdim=True), want, idx)
                return idx

            router.get_topk_indices = get_topk_indices
        try:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0].double()
        finally:
            for router in routers:
                del router.get_topk_indices
        logp = torch.log_softmax(logits[:-1], -1)
        out.append(logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])])
    return torch.cat(out)


def _longcat_body(rank, world_size, hf_dir):
    from transformers import AutoModelForCausalLM

    from forge_megatron.bridge import Bridge
    from forge_megatron.mcore import routing_replay
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    layers, top_k = hf.config.num_layers, hf.config.moe_topk
    experts = hf.config.n_routed_experts + hf.config.zero_expert_num
    model = build_tree_gpt(bridge.cfg)
    load_hf_weights([model], bridge, hf_dir)
    out = {"routers": routing_replay.install([model]),
           "columns": [r.router_replay.layer for _, r in routing_replay.moe_routers(model)]}
    layout = build_tree(SAMPLES)
    tree_rows, per_sample = _forced_rows(layout, layers, experts, top_k, seed=3)
    out["identity_rows"] = int((tree_rows >= hf.config.n_routed_experts).any(-1).sum())
    routing = tree_routing(layout, per_sample)
    for name, rows, tree_routing_rows in (("natural", [None] * len(SAMPLES), None), ("forced", per_sample, routing)):
        routing_replay.set_micro_batch(model, tree_routing_rows, layout.unique_tokens)
        logp, _ = tree_logprobs(model, layout)
        routing_replay.after_forward(model)
        out[name] = (logp.detach().double() - _hf_longcat_forced(hf, SAMPLES, rows)).abs().max().item()
        out[name + "_logp"] = logp.detach()
    out["forced_vs_natural"] = (out.pop("forced_logp") - out.pop("natural_logp")).abs().max().item()
    return out


def test_longcat_replay_reads_its_checkpoint_layers_columns_and_identity_experts(tmp_path):
    """LongCat-Flash: one router per checkpoint layer (Megatron layers 2i), replaying column i of the recorded rows
    (the engine's layer), over the routed and the identity experts alike; equal to transformers forced to the same
    experts."""
    from forge_megatron.models.tiny import build_tiny_model

    hf_dir = build_tiny_model(str(tmp_path / "longcat"), arch="longcat_flash", seed=9)
    (res,) = run_distributed(_longcat_body, world_size=1, hf_dir=hf_dir)
    assert res["routers"] == 2 and res["columns"] == [0, 1], res
    assert res["identity_rows"] > 0, res  # the rows choose identity experts too
    assert res["natural"] <= 1e-5 and res["forced"] <= 1e-5, res
    assert res["forced_vs_natural"] > 1e-3, res
