"""DP load balancing (forge_megatron.training.balance): the cost model, the partition's guarantee against the best
split found by brute force, heavy-tailed batches against round-robin, and rank_batch's use of it."""

import itertools

import numpy as np
import pytest

from forge_megatron.training.balance import assign_episodes, balanced_partition, group_cost, imbalance


def assign_groups(group_samples, dp_size, mode, hidden_size):
    """Groups of each rank and their loads, one episode per group (so nothing can be split)."""
    shares, loads = assign_episodes({g: {"e": seqs} for g, seqs in group_samples.items()}, dp_size, mode, hidden_size)
    return [[u.group for u in part] for part in shares], loads


def _best_max_load(costs, parts):
    best = float("inf")
    for labels in itertools.product(range(parts), repeat=len(costs)):
        loads = [0.0] * parts
        for c, p in zip(costs, labels):
            loads[p] += c
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_a_partition_within_the_lpt_bound(seed):
    rng = np.random.default_rng(seed)
    parts = int(rng.integers(2, 4))
    costs = rng.lognormal(0.0, 1.0, int(rng.integers(parts, 8))).tolist()
    split = balanced_partition(costs, parts)
    assert sorted(i for p in split for i in p) == list(range(len(costs)))
    assert all(split) and all(p == sorted(p) for p in split)
    loads = [sum(costs[i] for i in p) for p in split]
    # Graham's bound for longest-processing-time-first: max load <= (4/3 - 1/(3k)) * optimum
    assert max(loads) <= (4 / 3 - 1 / (3 * parts)) * _best_max_load(costs, parts) + 1e-9
    assert balanced_partition(costs, parts) == split  # deterministic


def test_partition_edge_cases():
    assert balanced_partition([], 3) == [[], [], []]
    assert balanced_partition([5.0, 5.0, 5.0], 3) == [[0], [1], [2]]
    assert balanced_partition([1.0, 1.0], 1) == [[0, 1]]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        balanced_partition([1.0], 0)
    with pytest.raises(ValueError, match="finite and non-negative"):
        balanced_partition([1.0, float("nan")], 2)


def test_heavy_tailed_batches_balance_far_better_than_round_robin():
    """64 groups over 8 ranks with lognormal(sigma 1.5) costs: the balanced split's slowest rank is within 2 % of the
    lower bound max(largest group, mean load) on every draw; round-robin's is 60 % above it on average."""
    balanced, dealt = [], []
    for seed in range(20):
        costs = np.random.default_rng(seed).lognormal(0.0, 1.5, 64)
        bound = max(costs.max(), costs.sum() / 8)
        loads = [costs[p].sum() for p in balanced_partition(costs.tolist(), 8)]
        balanced.append(max(loads) / bound)
        dealt.append(max(costs[d::8].sum() for d in range(8)) / bound)
    assert max(balanced) < 1.02 and np.mean(dealt) > 1.4
    assert all(b <= d + 1e-9 for b, d in zip(balanced, dealt))


def test_group_cost_counts_tree_tokens_and_attended_pairs():
    prompt = list(range(10, 20))
    group = [prompt + [1, 2, 3], prompt + [1, 4], prompt + [5]]
    # tree: the prompt (10 tokens, depths 0-9), then 1 (depth 10) shared by two, 2, 3 (11, 12), 4 (11), 5 (10)
    depths = list(range(10)) + [10, 11, 12, 11, 10]
    tokens, pairs = len(depths), sum(d + 1 for d in depths)
    assert group_cost(group, hidden_size=32) == 6 * 32 * tokens + pairs
    lengths = [13, 12, 11]
    assert group_cost(group, hidden_size=32, merging=False) == 6 * 32 * sum(lengths) + sum(n * (n + 1) // 2
                                                                                           for n in lengths)


def test_assign_groups_modes():
    groups = {7: [[1] * 200], 3: [[1] * 10], 5: [[1] * 12], 9: [[1] * 11]}
    parts, loads = assign_groups(groups, 2, "cost", hidden_size=4)
    assert parts == [[7], [3, 5, 9]]  # the long group alone
    assert loads[0] == group_cost(groups[7], 4)
    parts, _ = assign_groups(groups, 2, "round-robin", hidden_size=4)
    assert parts == [[3, 7], [5, 9]]  # index order 3, 5, 7, 9 dealt
    with pytest.raises(ValueError, match="DP balance mode must be one of"):
        assign_groups(groups, 2, "random", hidden_size=4)
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        assign_groups(groups, 2, "cost", hidden_size=None)


def _group(prompt, completions, seed):
    rng = np.random.default_rng(seed)
    return {f"e{i}": [list(prompt) + rng.integers(100, 200, n).tolist()] for i, n in enumerate(completions)}


def test_assign_episodes_splits_a_group_over_its_share():
    """A group costing more than a rank's share is dealt out by episodes; each piece is costed as its own tree (the
    prompt paid once per piece); the pieces and the whole groups partition the batch's episodes."""
    from forge_megatron.training.balance import assign_episodes

    prompt = list(range(10, 60))
    batch = {0: _group(prompt, [400, 380, 420, 390], 0), 1: _group(prompt[:20], [30, 40], 1),
             2: _group(prompt[:20], [25], 2), 3: _group(prompt[:20], [50, 10], 3)}
    shares, loads = assign_episodes(batch, 2, "cost", hidden_size=4)
    whole, whole_loads = assign_episodes(batch, 2, "cost-groups", hidden_size=4)
    assert all(u.episodes is None for part in whole for u in part)
    assert max(loads) < max(whole_loads) and loads == [sum(u.cost for u in part) for part in shares]
    pieces = [u for part in shares for u in part if u.episodes is not None]
    assert {u.group for u in pieces} == {0} and len(pieces) == 2
    for u in pieces:
        assert u.cost == group_cost([q for e in sorted(u.episodes) for q in batch[0][e]], 4)
    held = sorted((u.group, e) for part in shares for u in part
                  for e in (sorted(batch[u.group]) if u.episodes is None else u.episodes))
    assert held == sorted((g, e) for g in batch for e in batch[g])  # every episode exactly once


def test_assign_episodes_keeps_a_group_whole_when_splitting_does_not_pay():
    """Two episodes sharing a 1000-token prompt: each piece would pay the prompt again, so the estimated slowest
    rank would not improve; a single-episode group (its segments share the history) is never split."""
    from forge_megatron.training.balance import assign_episodes

    shared = {0: _group(range(1000), [1, 1], 0), 1: _group(range(5), [5], 1)}
    shares, loads = assign_episodes(shared, 2, "cost", hidden_size=4)
    assert all(u.episodes is None for part in shares for u in part)
    assert loads == assign_episodes(shared, 2, "cost-groups", hidden_size=4)[1]
    one_episode = {0: {"e": [list(range(300)), list(range(320))]}, 1: _group(range(5), [5], 1)}
    shares, _ = assign_episodes(one_episode, 2, "cost", hidden_size=4)
    assert all(u.episodes is None for part in shares for u in part)
    with pytest.raises(ValueError, match="DP balance mode must be one of"):
        assign_episodes(one_episode, 2, "greedy", hidden_size=4)


def test_rank_batch_splits_the_same_way_on_every_rank():
    """Both DP ranks' shares of one batch are disjoint, cover every trainable sample, and the long group sits alone."""
    from forge_megatron.middleware.batch import TrainBatch, TrainSample
    from forge_megatron.training.trainer import rank_batch

    rng = np.random.default_rng(0)
    lengths = {0: 300, 1: 20, 2: 25, 3: 30, 4: 22}
    samples = []
    for g, n in lengths.items():
        for e in range(2):
            tokens = rng.integers(0, 50, n).astype(np.int32)
            mask = np.ones(n, dtype=np.uint8)
            samples.append(TrainSample(tokens=tokens, loss_mask=mask, rollout_logprobs=np.zeros(n, np.float32),
                                       policy_versions=np.zeros(n, np.int32), advantages=np.ones(n, np.float32),
                                       sample_weight=1.0, group_index=g, episode_id=f"{g}-{e}", domain="d",
                                       reward=1.0))
    batch = TrainBatch(batch_id=1, samples=samples, group_indices=list(lengths))
    shares = [rank_batch(batch, 4096, True, r, 2, [], balance="cost-groups", hidden_size=8) for r in range(2)]
    ids = [sorted(s.episode_id for s in rb.samples) for rb in shares]
    assert not set(ids[0]) & set(ids[1]) and len(ids[0]) + len(ids[1]) == len(samples)
    assert ids[0] == ["0-0", "0-1"]
    assert shares[0].dp_loads == shares[1].dp_loads  # every rank computes the same split
    assert shares[0].dp_loads[0] == group_cost([s.tokens for s in samples if s.group_index == 0], 8)
    assert shares[0].dp_split_groups == 0
    # cost (the default): group 0 costs more than a rank's share, so its two episodes go to different ranks
    split = [rank_batch(batch, 4096, True, r, 2, [], hidden_size=8) for r in range(2)]
    split_ids = [sorted(s.episode_id for s in rb.samples) for rb in split]
    assert sorted(split_ids[0] + split_ids[1]) == sorted(s.episode_id for s in samples)
    assert [i for i in split_ids[0] if i.startswith("0-")] and [i for i in split_ids[1] if i.startswith("0-")]
    assert split[0].dp_split_groups == split[1].dp_split_groups == 1
    assert max(split[0].dp_loads) < max(shares[0].dp_loads)
    # interleaved pipeline: micro-batches split to a multiple of PP; padded to one length only with PP = 2
    for pp, padded in ((2, True), (4, False)):
        rb = rank_batch(batch, 320, True, 0, 1, [], hidden_size=8, interleaved_pp=pp)
        lengths = {mb.layout.unique_tokens for mb in rb.micro_batches}
        assert len(rb.micro_batches) % pp == 0 and (len(lengths) == 1) == padded, (pp, lengths)
        assert all(mb.fixed_length == padded for mb in rb.micro_batches)
        # every real tree token lies on some sample; the padding roots (at the end) on none
        assert all(mb.layout.unique_tokens - mb.pad_tokens == int(mb.layout.sample_nodes.max()) + 1
                   for mb in rb.micro_batches)
        assert (sum(mb.pad_tokens for mb in rb.micro_batches) > 0) == padded
    dealt = rank_batch(batch, 4096, True, 0, 2, [], balance="round-robin", hidden_size=8)
    assert sorted({s.group_index for s in dealt.samples}) == [0, 2, 4]
    assert imbalance(dealt.dp_loads) > imbalance(shares[0].dp_loads)


def test_split_to_multiple_keeps_order_and_names_the_problem():
    from forge_megatron.training.trainer import split_to_multiple

    parts = [[0, 1, 2, 3], [4], [5, 6]]
    out = split_to_multiple(parts, 2)
    assert out == [[0, 1], [2, 3], [4], [5, 6]] and [i for p in out for i in p] == list(range(7))
    assert split_to_multiple(parts, 3) == parts
    assert len(split_to_multiple([[0, 1, 2, 3, 4]], 4)) == 4
    with pytest.raises(ValueError, match="needs a multiple of 2 micro-batches.*only 1 samples in 1 micro-batches"):
        split_to_multiple([[0]], 2, batch_id=7)


def test_samples_over_the_token_budget_are_left_out_or_refused():
    """A sample longer than the budget fits no micro-batch: by default every rank leaves it out alike (counted), and
    the rest of its group still trains; ``overlong="error"`` names the flags instead."""
    from forge_megatron.middleware.batch import TrainBatch, TrainSample
    from forge_megatron.training.metrics import batch_metrics
    from forge_megatron.training.trainer import rank_batch

    rng = np.random.default_rng(1)
    samples = []
    for g, n in enumerate((40, 500, 30, 35)):  # group 1's first sample is over the 256-token budget
        for e in range(2):
            length = n if e == 0 else 20
            samples.append(TrainSample(tokens=rng.integers(0, 50, length).astype(np.int32),
                                       loss_mask=np.ones(length, np.uint8), rollout_logprobs=np.zeros(length, np.float32),
                                       policy_versions=np.zeros(length, np.int32),
                                       advantages=np.ones(length, np.float32), sample_weight=1.0, group_index=g,
                                       episode_id=f"{g}-{e}", domain="d", reward=1.0))
    batch = TrainBatch(batch_id=7, samples=samples, group_indices=[0, 1, 2, 3])
    shares = [rank_batch(batch, 256, merging, r, 2, [], hidden_size=8) for merging in (True, False) for r in range(2)]
    for a, b in (shares[:2], shares[2:]):
        kept = sorted(s.episode_id for rb in (a, b) for s in rb.samples)
        assert kept == sorted(f"{g}-{e}" for g in range(4) for e in range(2) if (g, e) != (1, 0))
        assert a.overlong_samples == b.overlong_samples == 1
        assert all(mb.layout.unique_tokens <= 256 for rb in (a, b) for mb in rb.micro_batches)
    assert batch_metrics(shares[0], [], 0)["overlong_samples"] == 1
    with pytest.raises(ValueError, match="1 sample.* longer than --tree-token-budget 256 .*500 tokens.*--overlong"):
        rank_batch(batch, 256, True, 0, 2, [], hidden_size=8, overlong="error")
    assert rank_batch(batch, 512, True, 0, 1, [], hidden_size=8).overlong_samples == 0
