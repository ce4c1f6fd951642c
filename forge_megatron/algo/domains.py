"""Mixed-domain batches: draw tasks from per-domain pools by configured ratios, and report metrics per domain.

For a batch of B tasks and normalised ratios p_d the count of domain d is the largest-remainder apportionment
of the quotas ``B * p_d``: every domain gets ``floor(B * p_d)``, and the ``B - sum floor`` remaining slots go to
the largest fractional parts (ties: larger ratio first, then a seeded random order, so no domain is always the
one left out). Counts are exact and sum to B. Within a domain, tasks are taken from a seeded shuffle of the pool,
reshuffled each time the pool is exhausted (every task is seen once per pass). Same seed, same calls, same batches.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DomainMixer", "domain_means"]


class DomainMixer:
    """Fills batches from per-domain task pools by ratio, deterministically for a given seed."""

    def __init__(self, ratios: Mapping[str, float], seed: int = 0) -> None:
        if not ratios:
            raise ValueError("ratios must name at least one domain")
        for name, r in ratios.items():
            if not (math.isfinite(r) and r >= 0):
                raise ValueError(f"ratio of domain {name!r} is {r} (must be finite and >= 0)")
        total = math.fsum(ratios.values())
        if total <= 0:
            raise ValueError("ratios must not all be 0")
        self.ratios = {name: r / total for name, r in ratios.items()}
        self._rng = random.Random(seed)
        self._order: dict[str, list[int]] = {}
        self._cursor: dict[str, int] = {}

    def counts(self, batch_size: int) -> dict[str, int]:
        """Largest-remainder counts per domain for one batch (sums to ``batch_size``)."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        quotas = {name: batch_size * p for name, p in self.ratios.items()}
        counts = {name: math.floor(q) for name, q in quotas.items()}
        tiebreak = {name: self._rng.random() for name in quotas}
        by_remainder = sorted(quotas, key=lambda n: (quotas[n] - counts[n], self.ratios[n], tiebreak[n]), reverse=True)
        for name in by_remainder[: batch_size - sum(counts.values())]:
            counts[name] += 1
        return counts

    def _next_index(self, domain: str, pool_size: int) -> int:
        if self._cursor.get(domain, pool_size) >= pool_size or len(self._order.get(domain, ())) != pool_size:
            order = list(range(pool_size))
            self._rng.shuffle(order)
            self._order[domain], self._cursor[domain] = order, 0
        self._cursor[domain] += 1
        return self._order[domain][self._cursor[domain] - 1]

    def draw(self, pools: Mapping[str, Sequence[Any]], batch_size: int) -> list[tuple[str, Any]]:
        """One batch of ``(domain, task)`` pairs, domains mixed by ratio, in a seeded random order."""
        batch = []
        for domain, n in self.counts(batch_size).items():
            if n == 0:
                continue
            pool = pools.get(domain)
            if not pool:
                raise ValueError(f"domain {domain!r} needs {n} tasks but its pool is missing or empty")
            batch.extend((domain, pool[self._next_index(domain, len(pool))]) for _ in range(n))
        self._rng.shuffle(batch)
        return batch


def domain_means(values: Sequence[Mapping[str, float]], domains: Sequence[str]) -> dict[str, float]:
    """Mean of every metric per domain, keyed ``"<domain>/<metric>"``, plus ``"<domain>/count"``."""
    if len(values) != len(domains):
        raise ValueError(f"{len(values)} metric dicts for {len(domains)} domain labels")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics, domain in zip(values, domains):
        counts[domain] = counts.get(domain, 0) + 1
        for name, v in metrics.items():
            sums[f"{domain}/{name}"] = sums.get(f"{domain}/{name}", 0.0) + v
    out = {key: s / counts[key.rsplit("/", 1)[0]] for key, s in sums.items()}
    out.update({f"{d}/count": float(c) for d, c in counts.items()})
    return out
