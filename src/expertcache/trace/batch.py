"""Batch unions: b traces merged step by step into the trace a batch-b decode would request.

Batch-b decoding runs the b rows' tokens through each layer together, so one cache step per layer
serves the *union* of the rows' expert sets (docs/design.md section 2, "Batches"). :func:`batch_union`
merges b traces that way:

* Sequence ``s`` of the union merges sequence ``s`` (by position) of every input that has one; a
  row that has finished drops out of the batch, so the union runs as long as its longest row.
* Step by step: on token traces row ``i`` of every input; on engine traces (``iteration`` extra,
  :mod:`expertcache.trace.units`) iteration by iteration, pass by pass -- pass ``p`` of union
  iteration ``j`` is the union of the inputs' ``p``-th pass of their iteration ``j``, so every
  speculative and fallback pass is preserved, as issued.
* Each union row holds the union sorted ascending and -1 padded to ``min(sum of the inputs'
  widths, E)``: the live harness's batch capture (:mod:`expertcache.hf.recorder`) writes the
  same rows. The union of one trace is that trace with each row's ids sorted (same sets, same counts).
* Extras: ``accepted`` sums the merged rows' accepted tokens (the denominator of per-token figures:
  every row's tokens count), ``iteration`` numbers the union iterations, and ``batch_rows``
  ``[T, b]`` keeps the provenance: the row of input ``i`` merged into each union row (-1: none).
  ``probs`` and ``router_probs`` are per row and are dropped.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ConfigError
from .core import Trace
from .units import accepted_per_row, iteration_ids

MAX_INPUTS = 1024


def batch_union(traces: Sequence[Trace]) -> Trace:
    """The batch union of ``traces`` (see the module docstring)."""
    if not traces:
        raise ConfigError("batch: give at least one trace")
    if len(traces) > MAX_INPUTS:
        raise ConfigError(f"batch: {len(traces)} traces is more than {MAX_INPUTS}")
    first = traces[0]
    for t in traces[1:]:
        if t.num_experts != first.num_experts:
            raise ConfigError(f"batch: {t.source}: {t.num_experts} experts per layer, {first.source} has {first.num_experts}")
        if t.layer_ids != first.layer_ids:
            raise ConfigError(f"batch: {t.source}: layer ids differ from {first.source}'s")
    b, E = len(traces), first.num_experts
    plans = [_steps(t) for t in traces]  # per input: per sequence, per iteration, its rows
    rows_from: list[list[int]] = []
    union_iter: list[int] = []
    union_seq: list[int] = []
    n_seq = max(len(p) for p in plans)
    counter = -1
    for s in range(n_seq):
        n_it = max(len(p[s]) if s < len(p) else 0 for p in plans)
        for j in range(n_it):
            counter += 1
            passes = [p[s][j] if s < len(p) and j < len(p[s]) else [] for p in plans]
            for q in range(max(len(x) for x in passes)):
                rows_from.append([x[q] if q < len(x) else -1 for x in passes])
                union_iter.append(counter)
                union_seq.append(s)
    src = np.asarray(rows_from, dtype=np.int64).reshape(-1, b)
    width = min(sum(t.top_k for t in traces), E)
    experts = _unions(traces, src, width)
    accepted = np.zeros(src.shape[0], dtype=np.int64)
    for i, t in enumerate(traces):
        acc = accepted_per_row(t)
        hit = src[:, i] >= 0
        accepted[hit] += acc[src[hit, i]]
    meta = {
        "model": first.meta.get("model", ""),
        "num_experts": E,
        "layer_ids": first.layer_ids,
        "phase": first.meta.get("phase", "unknown"),
        "batch": b,
        "router_top_k": int(first.meta.get("router_top_k", first.top_k)),
        "accepted_tokens": int(accepted.sum()),
        "provenance": {
            "tool": "expertcache batch",
            "batch_of": [t.name for t in traces],
            "batch_rows": "union of the rows' experts per step, sorted, -1 padded",
        },
    }
    for key in ("expert_bytes",):
        if key in first.meta:
            meta[key] = first.meta[key]
    extras = {"accepted": accepted, "iteration": np.asarray(union_iter, dtype=np.int64), "batch_rows": src}
    return Trace.from_arrays(experts, np.asarray(union_seq, dtype=np.int64), meta=meta, extras=extras,
                             source=f"<batch of {b}>")


def _steps(trace: Trace) -> list[list[list[int]]]:
    """Rows of ``trace`` grouped as ``[sequence][iteration] -> [rows, in order]``."""
    it = iteration_ids(trace)
    out = []
    bounds = trace.seq_bounds
    for a, z in zip(bounds[:-1], bounds[1:]):
        seq: list[list[int]] = []
        for r in range(a, z):
            if r == a or it[r] != it[r - 1]:
                seq.append([])
            seq[-1].append(r)
        out.append(seq)
    return out


UNION_ROWS = 1 << 16
"""Union rows built at a time by :func:`_unions` (its temporaries are a few int64 copies of them)."""


def _unions(traces: Sequence[Trace], src: np.ndarray, width: int) -> np.ndarray:
    """``[T, L, width]`` sorted unions of the inputs' rows named by ``src`` (-1 padded), built
    :data:`UNION_ROWS` rows at a time."""
    T, L = src.shape[0], traces[0].num_layers
    out = np.full((T, L, width), -1, dtype=np.int64)
    for a in range(0, T, UNION_ROWS):
        ids = _union_rows(traces, src[a:a + UNION_ROWS], width)
        out[a:a + UNION_ROWS, :, : min(width, ids.shape[2])] = ids[..., :width]
    return out


def _union_rows(traces: Sequence[Trace], src: np.ndarray, width: int) -> np.ndarray:
    """The sorted unions of ``src``'s rows, -1 padded to the inputs' widths together (at most ``width``
    of them hold ids)."""
    T, L = src.shape[0], traces[0].num_layers
    parts = []
    for i, t in enumerate(traces):
        block = np.full((T, L, t.top_k), -1, dtype=np.int64)
        hit = src[:, i] >= 0
        block[hit] = t.experts[src[hit, i]]
        parts.append(block)
    ids = np.concatenate(parts, axis=2)
    big = np.iinfo(np.int64).max
    ids = np.sort(np.where(ids < 0, big, ids), axis=2)
    dup = np.zeros(ids.shape, dtype=bool)
    dup[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids[dup] = big
    ids = np.sort(ids, axis=2)
    ids = np.where(ids == big, -1, ids)
    widest = int(np.count_nonzero(ids >= 0, axis=2).max()) if ids.size else 0
    if widest > width:  # cannot happen: a union holds at most E distinct ids and the inputs' widths
        raise AssertionError("batch union wider than its bound")
    return ids
