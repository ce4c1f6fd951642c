"""Micro-batch packing under a unique-token budget. CPU only."""

import random

import pytest

from forge_megatron.tree import build_tree, pack_micro_batches
from tests.tree.forests import all_kinds, random_batch


def check_partition(samples, batches, budget):
    assert sorted(s for b in batches for s in b) == list(range(len(samples))), "every sample exactly once"
    for batch in batches:
        assert batch, "no empty micro-batch"
        assert build_tree([samples[s] for s in batch]).unique_tokens <= budget


@pytest.mark.parametrize("kind", sorted(all_kinds()))
def test_partition_respects_budget(kind):
    samples = all_kinds()[kind]
    budget = max(len(s) for s in samples) + 7
    check_partition(samples, pack_micro_batches(samples, budget), budget)


def test_random_batches_and_determinism():
    rng = random.Random(3)
    for _ in range(20):
        samples = random_batch(rng, rng.randint(1, 40), 30, rng.choice([2, 8, 100]))
        budget = rng.randint(max(len(s) for s in samples), 200)
        batches = pack_micro_batches(samples, budget)
        check_partition(samples, batches, budget)
        assert pack_micro_batches(samples, budget) == batches


def grpo_groups(rng, n_groups, group_size, prompt_len, completion_len):
    samples, keys = [], []
    for g in range(n_groups):
        prompt = [1000 + g] + [rng.randrange(50) for _ in range(prompt_len - 1)]
        for _ in range(group_size):
            samples.append(prompt + [rng.randrange(50) for _ in range(completion_len)])
            keys.append(g)
    return samples, keys


def test_sharing_is_detected_without_keys():
    rng = random.Random(0)
    samples, keys = grpo_groups(rng, n_groups=4, group_size=5, prompt_len=30, completion_len=10)
    order = list(range(len(samples)))
    rng.shuffle(order)
    shuffled = [samples[i] for i in order]
    budget = 30 + 5 * 10  # exactly one merged group
    batches = pack_micro_batches(shuffled, budget)
    assert len(batches) == 4
    for batch in batches:
        assert len({keys[order[s]] for s in batch}) == 1, "each micro-batch holds one GRPO group"


def test_keys_keep_groups_together():
    rng = random.Random(1)
    samples, keys = grpo_groups(rng, n_groups=3, group_size=4, prompt_len=20, completion_len=10)
    budget = 2 * (20 + 4 * 10) - 5  # one group fits, two do not: a group never straddles two micro-batches
    batches = pack_micro_batches(samples, budget, keys=keys)
    check_partition(samples, batches, budget)
    assert [sorted({keys[s] for s in b}) for b in batches] == [[0], [1], [2]]


def test_sample_over_budget_and_bad_arguments():
    with pytest.raises(ValueError, match="sample 2 has 9 tokens, more than the micro-batch token budget 8"):
        pack_micro_batches([[1] * 3, [2] * 8, [3] * 9], 8)
    with pytest.raises(ValueError, match="token_budget must be a positive integer, got 0"):
        pack_micro_batches([[1]], 0)
    with pytest.raises(ValueError, match="keys has 1 entries but there are 2 samples"):
        pack_micro_batches([[1], [2]], 4, keys=[0])


def test_padded_layout_keeps_every_sample_and_attention():
    """Padding a forest with single-token roots (fixed-length pipelines) changes no sample, no target and no output
    of the real tokens; each padding token sees only itself."""
    import torch

    from forge_megatron.kernels.tree_attention import tree_attention_reference
    from forge_megatron.tree import build_tree

    layout = build_tree([[1, 2, 3, 4], [1, 2, 5], [6, 7]])
    padded = layout.padded(layout.unique_tokens + 3)
    assert padded.unique_tokens == layout.unique_tokens + 3 and layout.padded(layout.unique_tokens) is layout
    for a, b in zip(layout.next_token_index(), padded.next_token_index()):
        assert torch.equal(a, b)
    T, P = layout.unique_tokens, padded.unique_tokens
    assert padded.sub_end[T:].tolist() == list(range(T + 1, P + 1)) and padded.position_ids[T:].tolist() == [0] * 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(P, 2, 8, generator=g) for _ in range(3))
    out_p = tree_attention_reference(q, k, v, padded.sub_end)
    out = tree_attention_reference(q[:T], k[:T], v[:T], layout.sub_end)
    torch.testing.assert_close(out_p[:T], out, rtol=0, atol=1e-6)
    torch.testing.assert_close(out_p[T:], v[T:], rtol=0, atol=1e-6)  # alone: attends to itself only
    with pytest.raises(ValueError, match="cannot pad a forest of 7 tokens to 5"):
        layout.padded(5)
