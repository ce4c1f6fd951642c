"""Random sample batches with the shapes prefix merging must handle (shared by the tree tests).

Each generator returns a list of token lists; ``all_kinds`` names one batch per shape.
"""

from __future__ import annotations

import random


def random_batch(rng: random.Random, n_samples: int, max_len: int, vocab: int) -> list[list[int]]:
    """Samples that often extend, copy or cut an earlier sample: random forests with every kind of sharing."""
    samples: list[list[int]] = []
    for _ in range(n_samples):
        fresh = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
        if not samples or rng.random() < 0.3:
            samples.append(fresh)
            continue
        base = rng.choice(samples)
        cut = rng.randint(1, len(base))
        samples.append(base[:cut] + fresh[: rng.randint(0, len(fresh))])
    return samples


def all_kinds(seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(50) for _ in range(40)]
    history: list[int] = []
    agentic = []
    for _ in range(6):
        history = history + [rng.randrange(50) for _ in range(rng.randint(5, 25))]
        agentic.append(list(history))
    return {
        "identical": [[3, 1, 4, 1, 5]] * 4,
        "prefix_of_another": [[7, 8], [7, 8, 9, 10], [7], [7, 8, 9]],
        "disjoint": [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]],
        "single_token_samples": [[t % 5] for t in range(12)],
        "deep_chain": [list(range(300))],
        "wide_fan": [prompt + [t] for t in range(60)],
        "grpo": [prompt + [rng.randrange(50) for _ in range(rng.randint(1, 30))] for _ in range(8)],
        "agentic": agentic,
        "binary_trie": random_batch(rng, 40, 8, 2),
        "random": random_batch(rng, 25, 30, 6),
    }
