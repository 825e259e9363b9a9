"""Gap recovered: one definition and one tie rule for every caller (replay, curves, learn).

``gap_recovered(p) = (steady(lru) - steady(p)) / (steady(lru) - steady(belady))``: 0 for ``lru``, 1
for ``belady``, negative for a rule worse than LRU. Where ``lru`` and ``belady`` make the same number
of copies the gap is undefined: NaN in arrays (:func:`gap_recovered`), ``None`` in records and JSON
(:func:`as_record`) -- never 0, never a division error.
"""

from __future__ import annotations

import math

import numpy as np


def gap_recovered(copies, lru, belady):
    """``(lru - copies) / (lru - belady)`` elementwise (float64; a float for scalar inputs); NaN
    where ``lru == belady``."""
    copies, lru, belady = (np.asarray(a, dtype=np.float64) for a in (copies, lru, belady))
    den = lru - belady
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(den != 0, (lru - copies) / np.where(den != 0, den, 1.0), np.nan)
    return float(out) if out.ndim == 0 else out


def as_record(x) -> float | None:
    """A gap (or a difference of gaps) as a record holds it: ``None`` where undefined (NaN)."""
    x = float(x)
    return None if math.isnan(x) else x
