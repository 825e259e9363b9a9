"""Bootstrap confidence intervals over test sequences (``expertcache learn eval --bootstrap``; docs/learn.md).

Input: each policy's steady copies on each test sequence (pools restart at each sequence, so a
policy's copies on a set of sequences are the sum of its per-sequence copies; a learned policy's are
the mean over its training seeds). One resample draws ``n`` of the ``n`` test sequences with
replacement (``numpy.random.default_rng(seed).integers``, all resamples drawn at once, so the same
seed gives the same intervals); on it, every policy's gap recovered is ``(lru - p) / (lru - belady)``
of the resampled sums, and the difference to the reference policy (tuned decayed) is taken on the
same resample (paired). The interval is the percentile interval: the ``(1 - level) / 2`` and
``(1 + level) / 2`` quantiles (numpy's linear interpolation) of the resampled values. Resamples in
which LRU and Belady make the same copies have no gap and are left out (``resamples_used`` says how
many remained).
"""

from __future__ import annotations

import numpy as np

from .._resample import draws, percentile_interval
from ..sim.gap import gap_recovered as gap_of  # noqa: F401  (one definition: expertcache.sim.gap)

REFERENCE = "decayed (tuned)"


def intervals(per_sequence: dict[str, np.ndarray], resamples: int, seed: int = 0, level: float = 0.95,
              reference: str = REFERENCE) -> dict:
    """``{"gap": {policy: [lo, hi]}, "diff": {policy: [lo, hi]}, "resamples_used": int}``.

    ``per_sequence`` maps each policy (it must hold ``lru`` and ``belady``, and ``reference`` for the
    differences) to its copies on each test sequence, all of one length ``n``.
    """
    names = list(per_sequence)
    M = np.stack([np.asarray(per_sequence[p], dtype=np.float64) for p in names])  # [P, n]
    n = M.shape[1]
    if n < 1 or resamples < 1:
        raise ValueError("bootstrap needs at least one test sequence and one resample")
    idx = draws(n, resamples, seed)
    sums = np.stack([M[:, row].sum(axis=1) for row in idx], axis=1)  # [P, B], row by row: bounded memory
    lru, bel = sums[names.index("lru")], sums[names.index("belady")]
    gaps = gap_of(sums, lru, bel)
    ok = np.isfinite(gaps[0])

    def ci(values):
        v = values[ok]
        return percentile_interval(v, level) if v.size else None

    out = {"gap": {p: ci(gaps[i]) for i, p in enumerate(names)}, "diff": {}, "resamples_used": int(ok.sum()),
           "level": level}
    if reference in names:
        ref = gaps[names.index(reference)]
        out["diff"] = {p: ci(gaps[i] - ref) for i, p in enumerate(names)}
    return out
