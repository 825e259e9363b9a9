"""Random demand streams small enough for the exact program: the instances of ``verify-greedy``.

Instance ``i`` of seed ``s`` is a pure function of ``(s, i)`` (:func:`make_instance`), so a run is
reproducible whatever the number of workers or the chunking, and any instance can be rebuilt
from its index alone.

Shape: ``k`` in 2..4 experts per token out of ``n`` (``C < n <=`` :data:`MAX_UNIVERSE`), pool
capacity ``C``, ``T`` in 12..40 tokens. Every other instance has a served ratio ``k / C`` in the
paper's band 1/4..1/3 (``3k <= C <= 4k``); the rest have tighter pools (``k < C < 3k``).

Families (``family = FAMILIES[i % 3]``); each token draws ``k`` distinct experts without
replacement, by the Gumbel top-k trick on per-expert log weights:

* ``uniform``: equal weights;
* ``zipf``: weight ``rank ** -a`` over a random ranking of the experts, ``a`` in [0.6, 1.6];
* ``bursty``: phases of geometric length (mean 3..10 tokens), each with a working set of
  ``k..C+1`` experts that holds 90% of the demand; consecutive working sets share members.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FAMILIES = ("uniform", "zipf", "bursty")
MAX_UNIVERSE = 18
"""Most distinct experts an instance draws from (keeps the exact program in milliseconds)."""


@dataclass(frozen=True)
class Instance:
    """One stream from an empty pool: ``groups[T, k]`` expert ids in ``0..n_items-1``."""

    seed: int
    index: int
    family: str
    capacity: int
    n_items: int
    groups: np.ndarray

    @property
    def k(self) -> int:
        return int(self.groups.shape[1])

    @property
    def tokens(self) -> int:
        return int(self.groups.shape[0])

    @property
    def served_ratio(self) -> float:
        return self.k / self.capacity

    def describe(self) -> dict:
        return {
            "seed": self.seed, "index": self.index, "family": self.family, "k": self.k,
            "capacity": self.capacity, "n_items": self.n_items, "tokens": self.tokens,
            "requests": [sorted(int(e) for e in row) for row in self.groups],
        }


def make_instance(seed: int, index: int) -> Instance:
    """Instance ``index`` of the stream of instances of ``seed`` (see the module docstring)."""
    rng = np.random.default_rng([int(seed), int(index)])
    family = FAMILIES[index % len(FAMILIES)]
    k = int(rng.choice([2, 3, 4], p=[0.45, 0.35, 0.20]))
    if (index // len(FAMILIES)) % 2 == 0:
        capacity = int(rng.integers(3 * k, 4 * k + 1))  # served ratio 1/4..1/3, as in the paper
    else:
        capacity = int(rng.integers(k + 1, 3 * k))
    n = int(rng.integers(capacity + 1, max(capacity + 2, min(capacity + 8, MAX_UNIVERSE) + 1)))
    tokens = int(rng.integers(12, 41))
    logits = _LOGITS[family](rng, tokens, n, k, capacity)
    groups = _top_k(logits + rng.gumbel(size=logits.shape), k)
    return Instance(seed=int(seed), index=int(index), family=family, capacity=capacity, n_items=n, groups=groups)


def _top_k(keys: np.ndarray, k: int) -> np.ndarray:
    """Per row, the ``k`` columns with the largest keys (largest first)."""
    return np.argsort(-keys, axis=1, kind="stable")[:, :k].astype(np.int32)


def _uniform(rng, tokens, n, k, capacity):
    return np.zeros((tokens, n))


def _zipf(rng, tokens, n, k, capacity):
    a = rng.uniform(0.6, 1.6)
    rank = rng.permutation(n) + 1
    return np.broadcast_to(-a * np.log(rank), (tokens, n)).copy()


def _bursty(rng, tokens, n, k, capacity):
    mean_phase = rng.uniform(3.0, 10.0)
    width = int(rng.integers(k, min(capacity + 1, n - 1) + 1))
    out_weight = np.log(0.1 * width / (0.9 * (n - width)))  # 10% of the mass outside the set
    logits = np.empty((tokens, n))
    members = rng.choice(n, width, replace=False)
    t = 0
    while t < tokens:
        length = int(rng.geometric(1.0 / mean_phase))
        row = np.full(n, out_weight)
        row[members] = 0.0
        logits[t : t + length] = row
        t += length
        outside = np.setdiff1d(np.arange(n), members)
        swap = min(int(rng.integers(1, width + 1)), outside.size)  # members the next set replaces
        keep = rng.choice(members, width - swap, replace=False)
        members = np.concatenate([keep, rng.choice(outside, swap, replace=False)])
    return logits


_LOGITS = {"uniform": _uniform, "zipf": _zipf, "bursty": _bursty}
