"""The units of a trace: rows (cache steps), engine iterations and accepted tokens.

A trace row is one router pass, a cache step replayed as issued. Engine traces with speculative
decoding (``engine-jsonl``, :mod:`expertcache.trace.importers.engine`) carry optional extras,
each of shape ``[T]``:

* ``iteration`` (int): engine iteration index of the row; consecutive rows of one sequence with
  the same value form one engine iteration (a failed speculation and its fallback pass);
  non-decreasing within a sequence;
* ``accepted`` (int, >= 0): accepted tokens credited to the row (normal 1, spec-accept 2,
  spec-fail 0, fallback 1);
* ``pass_kind`` (int8): 0 normal, 1 spec-accept, 2 spec-fail, 3 fallback.

Without them every row is one iteration and one accepted token. Replay timing and I/O follow
iterations; serving arithmetic (per-token costs) divides by accepted tokens; every per-x figure
states which. A malformed extra is a one-line :class:`~expertcache.errors.TraceError` naming it.
"""

from __future__ import annotations

import numpy as np

from ..errors import TraceError

UNIT_EXTRAS = ("iteration", "accepted", "pass_kind")


def check_unit_extra(name: str, arr: np.ndarray, bounds: np.ndarray, T: int, src: str) -> np.ndarray:
    """Validate one of :data:`UNIT_EXTRAS` (shape ``[T]``, integers; ``iteration`` non-decreasing
    within each sequence, ``accepted`` in 0..:data:`MAX_ACCEPTED`, ``pass_kind`` in 0..3); returns it (int64 for
    ``iteration``). ``bounds``: the sequences' row offsets (``[S + 1]``)."""
    if arr.shape != (T,) or arr.dtype.kind not in "iu":
        raise TraceError(f"{src}: {name}: expected integer shape ({T},), got {arr.dtype} {arr.shape}")
    if name == "iteration":
        it = arr.astype(np.int64, copy=False)
        first = np.zeros(T, dtype=bool)
        first[bounds[:-1]] = True
        bad = np.flatnonzero(~first[1:] & (it[1:] < it[:-1])) + 1
        if bad.size:
            t = int(bad[0])
            raise TraceError(f"{src}: iteration: goes back inside a sequence at row {t} "
                             f"(iteration {int(it[t - 1])} then {int(it[t])})")
        return it
    lo, hi = (0, MAX_ACCEPTED) if name == "accepted" else (0, 3)
    bad = (arr < lo) | (arr > hi)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise TraceError(f"{src}: {name}: value {int(arr[t])} at row {t} is not in [{lo}, {hi:,}]")
    return arr


MAX_ACCEPTED = 1 << 20
"""Most accepted tokens one row may credit (a batch row's or a speculative step's are a few): three
rows of 2**62 had summed past int64, a negative token count."""


def _extra(trace, name: str) -> np.ndarray | None:
    arr = trace.extras.get(name)
    if arr is None:
        return None
    return check_unit_extra(name, np.asarray(arr), trace.seq_bounds, trace.num_tokens, trace.source)


def iteration_ids(trace) -> np.ndarray:
    """int64 ``[T]``: the engine iteration of each row, numbered 0, 1, ... across the whole trace
    (unique across sequences, non-decreasing); ``arange(T)`` without the ``iteration`` extra."""
    it = _extra(trace, "iteration")
    T = trace.num_tokens
    if it is None:
        return np.arange(T, dtype=np.int64)
    new = np.ones(T, dtype=bool)
    new[1:] = (it[1:] != it[:-1]) | (trace.seq[1:] != trace.seq[:-1])
    return np.cumsum(new, dtype=np.int64) - 1


def iterations(trace) -> int:
    """Engine iterations: distinct (sequence, iteration) runs; T without the ``iteration`` extra."""
    ids = iteration_ids(trace)
    return int(ids[-1]) + 1 if ids.size else 0


def accepted_per_row(trace) -> np.ndarray:
    """int64 ``[T]``: accepted tokens credited to each row (all ones without the ``accepted`` extra)."""
    acc = _extra(trace, "accepted")
    if acc is None:
        return np.ones(trace.num_tokens, dtype=np.int64)
    return acc.astype(np.int64)


def accepted_tokens(trace) -> int:
    """Accepted tokens of the whole trace: the sum of ``accepted``; T without it."""
    return int(accepted_per_row(trace).sum())


def accepted_by_sequence(trace) -> np.ndarray:
    """int64 ``[S]``: accepted tokens of each sequence, in trace order."""
    acc = accepted_per_row(trace)
    bounds = trace.seq_bounds
    return np.add.reduceat(acc, bounds[:-1]) if acc.size else np.zeros(0, dtype=np.int64)
