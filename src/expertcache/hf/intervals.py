"""Bootstrap intervals of a policy's dNLL over the evaluated sequences (``expertcache eval --bootstrap N``).

Input: the reference's and the policy's summed NLL on each sequence, and each sequence's predicted
tokens (both passes see the same sequences in the same order). One resample draws ``n`` of the
``n`` sequences with replacement (``numpy.random.default_rng(seed).integers``, all resamples drawn
at once: the same seed gives the same interval, and every policy of one evaluation is resampled
on the same draws, so their intervals are paired); on it, dNLL = (sum of the policy's NLL - sum of
the reference's) / sum of the predictions: the evaluation's own dNLL, per token, of the resampled
sequences. The interval is the percentile interval: the ``(1 - level) / 2`` and ``(1 + level) / 2``
quantiles (numpy's linear interpolation). With one sequence every resample is that sequence: the
interval is one point and says nothing about sequences (the record's ``sequences`` says so).
"""

from __future__ import annotations

import numpy as np

from .. import _resample
from .._resample import MAX_RESAMPLES
from ..errors import ConfigError, is_int


def draws(n: int, resamples: int, seed: int = 0) -> np.ndarray:
    """int64 ``[resamples, n]``: the sequences of each resample."""
    if n < 1:
        raise ConfigError("--bootstrap: no sequence was evaluated")
    if not is_int(resamples, 1, MAX_RESAMPLES):
        raise ConfigError(f"--bootstrap: expected 1 to {MAX_RESAMPLES:,} resamples, got {resamples!r}")
    return _resample.draws(n, resamples, seed)


def dnll_interval(run_nll, ref_nll, predictions, idx: np.ndarray, level: float = 0.95) -> list[float]:
    """``[lo, hi]`` of the resampled dNLL (see the module docstring); ``idx`` from :func:`draws`."""
    run_nll, ref_nll, pred = (np.asarray(a, dtype=np.float64) for a in (run_nll, ref_nll, predictions))
    if not run_nll.shape == ref_nll.shape == pred.shape or run_nll.ndim != 1 or idx.shape[1] != run_nll.size:
        raise ConfigError("--bootstrap: the policy's and the reference's passes saw different sequences")
    diff = run_nll - ref_nll
    out = np.empty(idx.shape[0])
    for b, row in enumerate(idx):  # row by row: memory bounded by one resample
        out[b] = diff[row].sum() / pred[row].sum()
    return _resample.percentile_interval(out, level)
