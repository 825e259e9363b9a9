"""The train / validation / test split of ``expertcache learn eval --split`` (docs/learn.md).

A split assigns whole sequences (documents) to three disjoint parts: the scorers are fitted on
``train``; every choice the protocol makes (decayed's beta, the learned kind it reports as
``learned (chosen)``) is made on ``validation``; ``test`` is scored once, at the end.

The spec is three numbers ``TRAIN,VALIDATION,TEST``: fractions of the sequences (each in (0, 1),
summing to 1; rounded by largest remainder, every part at least one sequence) or sequence counts
(integers >= 1 summing to at most the number of sequences; the rest stays unused). Sequences are
assigned in the order of a permutation drawn from ``numpy.random.default_rng(seed)`` (``seed`` None:
trace order), the first ones to train, then validation, then test; each part is kept in trace order.

Invariant: :class:`SealedTest` is the only holder of the test positions; the protocol builds the
train and validation traces from their own positions and reads the test rows only through
:meth:`SealedTest.open`, which works once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

PARTS = ("train", "validation", "test")


@dataclass(frozen=True)
class SplitSpec:
    """Three fractions (``counts`` False) or three sequence counts (``counts`` True)."""

    values: tuple[float, float, float]
    counts: bool

    def __str__(self) -> str:
        return ",".join(f"{v:g}" for v in self.values)


def parse_split(text: str) -> SplitSpec:
    """``"0.5,0.25,0.25"`` or ``"8,4,4"`` -> :class:`SplitSpec` (ConfigError naming ``--split`` otherwise)."""
    items = [s.strip() for s in str(text).split(",")]
    if len(items) != 3 or not all(items):
        raise ConfigError(f"--split: {text!r} is not three numbers TRAIN,VALIDATION,TEST (e.g. 0.5,0.25,0.25 or 8,4,4)")
    if all(s.isdigit() for s in items):
        vals = tuple(int(s) for s in items)
        if min(vals) < 1:
            raise ConfigError(f"--split: {text!r}: every part needs at least 1 sequence")
        return SplitSpec(vals, True)
    try:
        vals = tuple(float(s) for s in items)
    except ValueError:
        raise ConfigError(f"--split: {text!r} is not three numbers (fractions or sequence counts)") from None
    if not all(math.isfinite(v) and 0.0 < v < 1.0 for v in vals):
        raise ConfigError(f"--split: {text!r}: fractions must lie in (0, 1)")
    if abs(sum(vals) - 1.0) > 1e-6:
        raise ConfigError(f"--split: {text!r}: the fractions sum to {sum(vals):g}, not 1")
    return SplitSpec(vals, False)


def part_sizes(spec: SplitSpec, n: int) -> tuple[int, int, int]:
    """Sequences per part for a trace of ``n`` sequences (ConfigError if a part would be empty)."""
    if spec.counts:
        sizes = tuple(int(v) for v in spec.values)
        if sum(sizes) > n:
            raise ConfigError(f"--split {spec}: {sum(sizes)} sequences asked for, the trace has {n}")
        return sizes
    raw = [v * n for v in spec.values]
    sizes = [math.floor(r) for r in raw]
    for i in sorted(range(3), key=lambda i: (-(raw[i] - sizes[i]), i))[: n - sum(sizes)]:
        sizes[i] += 1  # largest remainder; ties to the earlier part
    if min(sizes) < 1:
        raise ConfigError(f"--split {spec}: {n} sequence(s) leave the {PARTS[sizes.index(min(sizes))]} part empty "
                          "(every part needs at least one sequence)")
    return tuple(sizes)


def assign(n: int, spec: SplitSpec, seed: int | None = 0) -> dict[str, list[int]]:
    """Sequence positions of each part (disjoint, each in trace order); ``unused`` holds the rest."""
    sizes = part_sizes(spec, n)
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    out, start = {}, 0
    for name, size in zip(PARTS, sizes):
        out[name] = sorted(int(i) for i in order[start : start + size])
        start += size
    out["unused"] = sorted(int(i) for i in order[start:])
    return out


class SealedTest:
    """The test sequences of a trace, unread until :meth:`open` (allowed once)."""

    def __init__(self, trace, positions):
        self._trace = trace
        self.positions = tuple(int(p) for p in positions)
        self.opened = False

    def open(self):
        """The test trace; a second call is a RuntimeError (the protocol reads the test split once)."""
        if self.opened:
            raise RuntimeError("the test split was already read: it is read once, for the final scoring")
        self.opened = True
        trace, self._trace = self._trace, None
        return trace.select_sequences(list(self.positions))
