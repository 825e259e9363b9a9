"""Locality statistics of a router trace: skew, recency, concentration, coverage, hot-set overlap.

Every number is defined in ``docs/locality.md`` (the contract); in short, per layer ``l``:

* ``zipf_alpha``: minus the least-squares slope of ``log count`` on ``log rank`` over the experts
  with a nonzero count at ``l`` (rank 1 = most selected); NaN with fewer than two such experts.
* ``reuse_w{W}``: mean over *scored* tokens of the fraction of the token's experts at ``l`` that
  the same sequence used at ``l`` within the ``W`` previous decode steps. A token is scored when
  the row of the step just before it is in the trace (same sequence, ``step`` one less), the
  ``reuse_prev_token`` convention of ``shared/traces``; rows are placed by the ``step`` extra when
  the trace has one (a jump marks dropped rows), else by position. The scored set does not depend
  on ``W``, so ``reuse_w{W}`` never decreases as ``W`` grows.
* ``top_share``: share of the layer's selections that went to its ``N`` most selected experts.
* ``distinct``: experts selected at least once; ``coverage`` = ``distinct / E``.

Overall values are the mean over layers of the per-layer values (layers where a value is
undefined are left out). ``coverage_curve`` is the share of the whole pool (``L * E`` pairs of
layer and expert) touched by the first ``n`` tokens in trace order. Hot sets (the top ``N``
experts of a layer, ties to the smaller id, zero counts never included) of two traces are
compared by Jaccard overlap per shared layer id.

All functions are vectorised with numpy. The primitives hold one layer's ``T * k`` selections in
int64 temporaries at a time; the reports work through runs of whole sequences of at most
:data:`BLOCK_SELECTIONS` token-slots (:func:`sequence_blocks`), so a report holds little beyond the
trace itself (counts, first uses and scored tokens add exactly over such runs, reuse sums up to float
rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..errors import ConfigError, is_int
from ..trace import Trace

DEFAULT_WINDOWS = (1, 8, 64)
"""Reuse windows (decode steps) reported by default: Table 1 of the tiering paper (seed 004)."""

DEFAULT_TOP = 8
"""Hot-set size N by default: the paper's top-8 share."""

BLOCK_SELECTIONS = 1 << 19
"""Token rows times k in one run of whole sequences that a report works through at a time: about
eight int64 temporaries of this size (32 MB) per layer, whatever the trace's length."""

NO_EARLIER_USE = np.iinfo(np.int64).max
"""Gap of a selection whose expert the sequence never used before at that layer (and of padding)."""


# ---------------------------------------------------------------------------- primitives
def token_steps(trace: Trace) -> np.ndarray:
    """int64 ``[T]``: each row's decode step inside its sequence.

    The ``step`` extra when the trace has one (validated when the trace was built: integer ``[T]``,
    strictly increasing within each sequence), else the row's position in its sequence (0, 1, 2, ...).
    """
    T = trace.num_tokens
    bounds = trace.seq_bounds
    step = trace.extras.get("step")
    if step is None:
        starts = np.repeat(bounds[:-1], np.diff(bounds))
        return np.arange(T, dtype=np.int64) - starts
    step = np.asarray(step, dtype=np.int64)  # validated at load: integer [T], rising in each sequence
    return step


def scored_tokens(trace: Trace, steps: np.ndarray | None = None) -> np.ndarray:
    """bool ``[T]``: rows whose previous decode step (same sequence, step - 1) is in the trace."""
    steps = token_steps(trace) if steps is None else steps
    out = np.zeros(trace.num_tokens, dtype=bool)
    out[1:] = (trace.seq[1:] == trace.seq[:-1]) & (steps[1:] - steps[:-1] == 1)
    return out


def expert_counts(trace: Trace) -> np.ndarray:
    """int64 ``[L, E]``: how many tokens selected each expert at each layer (padding ignored)."""
    L, E = trace.num_layers, trace.num_experts
    ex = trace.experts
    layer = np.broadcast_to(np.arange(L)[None, :, None], ex.shape)
    valid = ex >= 0
    keys = layer[valid].astype(np.int64) * E + ex[valid]
    return np.bincount(keys, minlength=L * E).reshape(L, E)


def zipf_alpha(counts: Sequence[int] | np.ndarray) -> float:
    """Rank-frequency slope of one layer's counts.

    Sort the nonzero counts in descending order, give them ranks 1..n, and fit
    ``log count = c - alpha * log rank`` by ordinary least squares; returns ``alpha``.
    NaN when fewer than two experts have a nonzero count (no slope to fit).
    """
    c = np.asarray(counts, dtype=np.float64).ravel()
    c = np.sort(c[c > 0])[::-1]
    if c.size < 2:
        return math.nan
    x = np.log(np.arange(1, c.size + 1, dtype=np.float64))
    y = np.log(c)
    x -= x.mean()
    return float(-(x @ (y - y.mean())) / (x @ x))


def top_share(counts: np.ndarray, n: int = DEFAULT_TOP) -> np.ndarray | float:
    """Share of selections taken by the ``n`` most selected experts, per row of ``counts``.

    ``counts`` is ``[E]`` (returns a float) or ``[L, E]`` (returns ``[L]``); NaN where a row is all zero.
    """
    if n < 1:
        raise ConfigError(f"top: expected a positive number of experts, got {n}")
    c = np.asarray(counts, dtype=np.float64)
    top = -np.sort(-c, axis=-1)[..., :n].sum(axis=-1)
    total = c.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, top / np.where(total > 0, total, 1), np.nan)
    return float(share) if share.ndim == 0 else share


def hot_sets(counts: np.ndarray, n: int = DEFAULT_TOP) -> np.ndarray:
    """bool ``[L, E]``: each layer's hot set, its ``n`` most selected experts.

    Ties go to the smaller expert id; experts never selected are never hot, so a layer that
    used fewer than ``n`` experts has a smaller hot set.
    """
    if n < 1:
        raise ConfigError(f"top: expected a positive number of experts, got {n}")
    c = np.atleast_2d(np.asarray(counts))
    L, E = c.shape
    # Stable sort on -count keeps ascending id order among equal counts.
    order = np.argsort(-c, axis=1, kind="stable")[:, :n]
    hot = np.zeros((L, E), dtype=bool)
    np.put_along_axis(hot, order, True, axis=1)
    return hot & (c > 0)


def reuse_gaps(trace: Trace, layer: int, steps: np.ndarray | None = None) -> np.ndarray:
    """int64 ``[T, k]`` for the layer at column ``layer``: steps since the same sequence last
    selected the same expert at that layer; :data:`NO_EARLIER_USE` for a first use and for padding.
    ``steps`` is :func:`token_steps` of the trace (computed when not given)."""
    ex = trace.experts[:, layer, :]
    T, k = ex.shape
    steps = token_steps(trace) if steps is None else steps
    bounds = trace.seq_bounds
    seq_index = np.repeat(np.arange(len(bounds) - 1, dtype=np.int64), np.diff(bounds))
    flat = ex.reshape(-1)
    pos = np.flatnonzero(flat >= 0)
    tok = pos // k
    key = seq_index[tok] * trace.num_experts + flat[pos]
    if key.size and key.max() < 2**16:
        key = key.astype(np.uint16)  # numpy sorts 16-bit keys by radix: several times faster
    order = np.argsort(key, kind="stable")  # within one key, tokens stay in trace order
    key_s, tok_s = key[order], tok[order]
    gap_s = np.full(pos.size, NO_EARLIER_USE, dtype=np.int64)
    same = key_s[1:] == key_s[:-1]
    gap_s[1:][same] = steps[tok_s[1:][same]] - steps[tok_s[:-1][same]]
    gaps = np.full(T * k, NO_EARLIER_USE, dtype=np.int64)
    gaps[pos[order]] = gap_s
    return gaps.reshape(T, k)


def reuse_within(trace: Trace, windows: Iterable[int] = DEFAULT_WINDOWS) -> np.ndarray:
    """float ``[len(windows), L]``: per layer, the mean over scored tokens of the fraction of a
    token's experts that its sequence used at that layer within the previous ``W`` steps.

    See the module docstring for which tokens are scored; NaN for a layer with none.
    """
    sums, counts = reuse_sums(trace, _check_windows(windows))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.where(counts > 0, counts, 1), np.nan)


def reuse_sums(trace: Trace, windows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(sums [len(windows), L], counts [L])`` behind :func:`reuse_within`: the fractions summed
    over each layer's scored tokens, and how many there are (traces of whole sequences add up)."""
    steps = token_steps(trace)
    scored = scored_tokens(trace, steps)
    sums = np.zeros((len(windows), trace.num_layers))
    counts = np.zeros(trace.num_layers, dtype=np.int64)
    for col in range(trace.num_layers):
        gaps = reuse_gaps(trace, col, steps)
        n_valid = np.count_nonzero(trace.experts[:, col, :] >= 0, axis=1)
        rows = scored & (n_valid > 0)
        counts[col] = np.count_nonzero(rows)
        if not counts[col]:
            continue
        g, nv = gaps[rows], n_valid[rows]
        for i, w in enumerate(windows):
            sums[i, col] = float(np.sum(np.count_nonzero(g <= w, axis=1) / nv))
    return sums, counts


def coverage_curve(trace: Trace, checkpoints: Iterable[int] | None = None) -> list[tuple[int, float]]:
    """``(n, share)`` pairs: the share of the pool's ``L * E`` (layer, expert) pairs selected by
    the first ``n`` tokens in trace order. Default checkpoints: 16, 64, 256, ... below ``T``, and ``T``."""
    first_token = np.full(trace.num_layers * trace.num_experts, trace.num_tokens, dtype=np.int64)
    first_tokens(trace, 0, first_token)
    return _coverage(first_token, trace.num_tokens, checkpoints)


def first_tokens(trace: Trace, offset: int, out: np.ndarray) -> None:
    """Lower ``out[l * E + e]`` to the first token (counted from ``offset``) selecting expert e at
    layer column l (a running minimum over a trace's pieces)."""
    E = trace.num_experts
    for col in range(trace.num_layers):
        ex = trace.experts[:, col, :]
        tok, slot = np.nonzero(ex >= 0)
        ids = ex[tok, slot].astype(np.int64)
        np.minimum.at(out, col * E + ids, tok + offset)


def sequence_blocks(trace: Trace, selections: int | None = None):
    """Views of ``trace`` (no copy) over consecutive runs of whole sequences, each of at most
    ``selections // k`` tokens (default :data:`BLOCK_SELECTIONS`), or one sequence that is longer by
    itself; together they hold every row once, in trace order, with the ``step`` extra where the
    trace has one."""
    bounds = trace.seq_bounds
    per = max(1, (BLOCK_SELECTIONS if selections is None else selections) // max(1, trace.top_k))
    step = trace.extras.get("step")
    i, S = 0, len(bounds) - 1
    while i < S:
        j = max(i + 1, int(np.searchsorted(bounds, bounds[i] + per, side="right")) - 1)
        a, b = int(bounds[i]), int(bounds[j])
        yield Trace._trusted(experts=trace.experts[a:b], seq=trace.seq[a:b], meta=trace.meta,
                             extras={} if step is None else {"step": step[a:b]}, source=trace.source)
        i = j


def _coverage(first_token: np.ndarray, T: int, checkpoints: Iterable[int] | None) -> list[tuple[int, float]]:
    if checkpoints is None:
        checkpoints = [4**i for i in range(2, 40) if 4**i < T] + [T]
    points = sorted({min(int(n), T) for n in checkpoints if int(n) > 0})
    seen_by = np.cumsum(np.bincount(first_token, minlength=T + 1)[:T])  # seen_by[n-1]: touched by n tokens
    return [(n, float(seen_by[n - 1]) / first_token.size) for n in points]


MAX_WINDOW = 1 << 62
"""Largest reuse window: a first use's gap is int64's largest, so a window of that many steps had
counted first uses as reuses (1.0 where 0.5 is right)."""


def _check_windows(windows: Iterable[int]) -> list[int]:
    windows = list(windows)
    if not windows or any(not is_int(w, 1, MAX_WINDOW) for w in windows):
        raise ConfigError(f"windows: expected step counts, integers in [1, 2**62], got {str(windows)[:80]}")
    return sorted({int(w) for w in windows})


# ---------------------------------------------------------------------------- reports
@dataclass
class LayerLocality:
    """The locality statistics of one layer (definitions in the module docstring)."""

    layer: int
    selections: int
    distinct: int
    coverage: float
    zipf_alpha: float
    top_share: float
    reuse: dict[int, float]

    def to_dict(self, top: int) -> dict:
        return {
            "layer": self.layer,
            "selections": self.selections,
            "distinct": self.distinct,
            "coverage": self.coverage,
            "zipf_alpha": self.zipf_alpha,
            f"top{top}_share": self.top_share,
            **{f"reuse_w{w}": v for w, v in self.reuse.items()},
        }


@dataclass
class LocalityReport:
    """Per-layer and overall locality of one trace; overall values are means over layers."""

    name: str
    num_experts: int
    top_k: int
    tokens: int
    sequences: int
    scored_tokens: int
    windows: list[int]
    top: int
    layers: list[LayerLocality]
    coverage: list[tuple[int, float]] = field(default_factory=list)
    hot: np.ndarray | None = field(default=None, repr=False)
    """bool ``[L, E]`` hot sets (top ``top`` experts per layer), kept for overlap comparisons."""
    layer_ids: list[int] = field(default_factory=list)
    model: str | None = None

    @property
    def zipf_alpha(self) -> float:
        return _mean(x.zipf_alpha for x in self.layers)

    @property
    def top_share(self) -> float:
        return _mean(x.top_share for x in self.layers)

    def reuse(self, window: int) -> float:
        return _mean(x.reuse[window] for x in self.layers)

    @property
    def distinct(self) -> tuple[float, int, int]:
        """(mean, min, max) distinct experts per layer."""
        d = [x.distinct for x in self.layers]
        return float(np.mean(d)), int(min(d)), int(max(d))

    @property
    def coverage_final(self) -> float:
        return self.coverage[-1][1] if self.coverage else math.nan

    def summary(self) -> dict:
        """Overall values, keyed as in the JSON record."""
        mean, lo, hi = self.distinct
        return {
            "zipf_alpha": self.zipf_alpha,
            **{f"reuse_w{w}": self.reuse(w) for w in self.windows},
            f"top{self.top}_share": self.top_share,
            "distinct_mean": mean,
            "distinct_min": lo,
            "distinct_max": hi,
            "coverage": self.coverage_final,
        }

    def to_dict(self) -> dict:
        """The JSON record of ``expertcache stats --json`` (one per trace)."""
        return {
            "kind": "trace",
            "trace": self.name,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layers": [x.layer for x in self.layers],
            "num_layers": len(self.layers),
            "tokens": self.tokens,
            "sequences": self.sequences,
            "scored_tokens": self.scored_tokens,
            "windows": self.windows,
            "top": self.top,
            **self.summary(),
            "coverage_curve": [{"tokens": n, "coverage": c} for n, c in self.coverage],
            "per_layer": [x.to_dict(self.top) for x in self.layers],
        }


def locality_report(
    trace: Trace,
    *,
    windows: Iterable[int] = DEFAULT_WINDOWS,
    top: int = DEFAULT_TOP,
    checkpoints: Iterable[int] | None = None,
) -> LocalityReport:
    """Every locality statistic of ``trace`` (per layer, overall, coverage curve, hot sets), worked
    through in runs of whole sequences (:func:`sequence_blocks`)."""
    return _accumulated(trace, sequence_blocks(trace), windows, top, checkpoints)


def locality_report_chunked(ct, *, windows: Iterable[int] = DEFAULT_WINDOWS, top: int = DEFAULT_TOP,
                            checkpoints: Iterable[int] | None = None) -> LocalityReport:
    """:func:`locality_report` of a chunked trace (:mod:`expertcache.trace.chunked`), one chunk in
    memory at a time, each worked through as the in-memory report works through its runs."""
    return _accumulated(ct, (b for chunk in ct.iter_chunks() for b in sequence_blocks(chunk)), windows, top,
                        checkpoints)


def _accumulated(whole, pieces, windows, top, checkpoints) -> LocalityReport:
    """The report of ``whole`` (a trace or a chunked trace) from ``pieces``, its runs of whole
    sequences in order: counts, reuse sums and first uses add over them (the reuse means equal the
    whole trace's up to float rounding; the rest exactly)."""
    windows = _check_windows(windows)
    L, E, T = whole.num_layers, whole.num_experts, whole.num_tokens
    counts = np.zeros((L, E), dtype=np.int64)
    sums, n = np.zeros((len(windows), L)), np.zeros(L, dtype=np.int64)
    first_token = np.full(L * E, T, dtype=np.int64)
    scored, offset = 0, 0
    for piece in pieces:
        counts += expert_counts(piece)
        s, c = reuse_sums(piece, windows)
        sums, n = sums + s, n + c
        first_tokens(piece, offset, first_token)
        scored += int(np.count_nonzero(scored_tokens(piece)))
        offset += piece.num_tokens
    with np.errstate(invalid="ignore", divide="ignore"):
        reuse = np.where(n > 0, sums / np.where(n > 0, n, 1), np.nan)
    return _report(whole.name, E, whole.top_k, T, whole.num_sequences, scored, windows, top, counts, reuse,
                   _coverage(first_token, T, checkpoints), whole.layer_ids, whole.meta.get("model"))


def _report(name, E, k, tokens, sequences, scored, windows, top, counts, reuse, coverage, layer_ids, model):
    shares = top_share(counts, top)
    layers = []
    for col, lid in enumerate(layer_ids):
        distinct = int(np.count_nonzero(counts[col]))
        layers.append(LayerLocality(
            layer=lid,
            selections=int(counts[col].sum()),
            distinct=distinct,
            coverage=distinct / E,
            zipf_alpha=zipf_alpha(counts[col]),
            top_share=float(shares[col]),
            reuse={w: float(reuse[i, col]) for i, w in enumerate(windows)},
        ))
    return LocalityReport(name=name, num_experts=E, top_k=k, tokens=tokens, sequences=sequences, scored_tokens=scored,
                          windows=windows, top=top, layers=layers, coverage=coverage, hot=hot_sets(counts, top),
                          layer_ids=list(layer_ids), model=model)


# ---------------------------------------------------------------------------- hot-set overlap
@dataclass
class PairOverlap:
    """Jaccard overlap of two traces' hot sets, per layer id the two share.

    ``jaccard`` maps layer id to ``|A & B| / |A | B|`` (NaN when both hot sets are empty);
    ``reason`` says why the pair is not comparable (then ``jaccard`` is empty).
    """

    a: str
    b: str
    top: int
    jaccard: dict[int, float]
    reason: str | None = None

    @property
    def mean(self) -> float:
        return _mean(self.jaccard.values())

    @property
    def min(self) -> float:
        return min(self._defined, default=math.nan)

    @property
    def max(self) -> float:
        return max(self._defined, default=math.nan)

    @property
    def _defined(self) -> list[float]:
        return [v for v in self.jaccard.values() if not math.isnan(v)]

    def to_dict(self) -> dict:
        return {
            "kind": "overlap",
            "a": self.a,
            "b": self.b,
            "top": self.top,
            "layers": list(self.jaccard),
            "jaccard_mean": self.mean,
            "jaccard_min": self.min,
            "jaccard_max": self.max,
            "per_layer": [{"layer": lid, "jaccard": v} for lid, v in self.jaccard.items()],
            "reason": self.reason,
        }


def hot_set_overlap(a: LocalityReport, b: LocalityReport) -> PairOverlap:
    """Jaccard overlap of the hot sets of two reports (built with the same ``top``).

    Comparable only when both traces come from the same model (their ``meta["model"]`` agree when
    both have one), have the same number of experts and share at least one layer id; otherwise
    ``reason`` says why and ``jaccard`` is empty.
    """
    if a.top != b.top:
        raise ConfigError(f"hot sets of different sizes ({a.top} and {b.top}) cannot be compared")
    pair = PairOverlap(a=a.name, b=b.name, top=a.top, jaccard={})
    if a.model and b.model and a.model != b.model:
        pair.reason = f"different models ({_short(a.model)} vs {_short(b.model)})"
        return pair
    if a.num_experts != b.num_experts:
        pair.reason = f"different expert counts (E={a.num_experts} vs E={b.num_experts})"
        return pair
    shared = [lid for lid in a.layer_ids if lid in set(b.layer_ids)]
    if not shared:
        pair.reason = "no layer id in common"
        return pair
    for lid in shared:
        ha, hb = a.hot[a.layer_ids.index(lid)], b.hot[b.layer_ids.index(lid)]
        union = np.count_nonzero(ha | hb)
        pair.jaccard[lid] = np.count_nonzero(ha & hb) / union if union else math.nan
    return pair


def _short(model: str) -> str:
    """A model name without its parenthesised details."""
    return model.split(" (")[0]


def _mean(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(vals)) if vals else math.nan
