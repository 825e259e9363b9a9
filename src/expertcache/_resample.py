"""Bootstrap resampling, one rule for every interval the project reports (``eval --bootstrap`` over
sequences, :mod:`expertcache.hf.intervals`; ``learn eval --bootstrap`` over test sequences,
:mod:`expertcache.learn.bootstrap`). Callers check their own inputs; this module only draws and
reads percentiles."""

from __future__ import annotations

import numpy as np

MAX_RESAMPLES = 100_000
"""The most bootstrap resamples accepted (``eval --bootstrap``, ``learn eval --bootstrap``)."""


def draws(n: int, resamples: int, seed: int = 0) -> np.ndarray:
    """int64 ``[resamples, n]``: ``n`` of ``n`` units drawn with replacement per resample, all at once
    with ``numpy.random.default_rng(seed).integers`` (the same seed gives the same resamples)."""
    return np.random.default_rng(seed).integers(0, n, size=(int(resamples), int(n)))


def percentile_interval(values, level: float = 0.95) -> list[float]:
    """The percentile interval of ``values``: their ``(1 - level) / 2`` and ``(1 + level) / 2``
    quantiles (numpy's linear interpolation)."""
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    return [float(x) for x in np.percentile(values, q)]
