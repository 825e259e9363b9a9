"""A generator of engine-iteration routing logs with speculative decoding (``engine-jsonl``), with
the ground truth the importer must reconstruct: for tests, examples and the docs.

Each sequence runs ``iterations`` engine iterations. An iteration is an accepted speculation with
probability ``p_accept`` (one record of 2k ids per layer: two positions), a failed speculation
with probability ``p_fail`` (a first routing of every layer, 2k or k ids with equal chance, then
the fallback pass of k ids), else a normal step (k ids per layer). A position's k ids are
distinct; each slot keeps an id of the previous position of its (sequence, layer) with
probability 1/2 (so the two positions of a record often share ids), the rest are drawn uniformly.

Records go out iteration by iteration, every sequence's records within an iteration in turn;
``order='pass'`` (the default, as an engine issues them) writes a failed speculation's routing of
every layer, then the fallback pass over every layer; ``order='layer'`` writes a layer's two
routings next to each other. Everything is a function of the seed (numpy's PCG64).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass

import numpy as np

from .._io import atomic_open
from ..errors import ConfigError, is_int
from .importers.engine import EngineFields
from .importers.engine_passes import ACCEPTED, FALLBACK, NORMAL, PASS_KINDS, SPEC_ACCEPT, SPEC_FAIL

ORDERS = ("pass", "layer")
MAX_RECORDS = 20_000_000
"""Refuse logs of more records than this (iterations x sequences x layers x 2)."""


@dataclass(frozen=True)
class EngineLog:
    """A generated log and its truth. Rows (one per pass, sequence by sequence, iterations in
    order, a failed speculation before its fallback) are what the importer must produce:
    ``experts`` ``[T, L, W]`` (a two-position row holds the union of its ids in first-seen order,
    -1 padded; W = 2k when any pass has two positions' width), ``seq``, ``iteration``,
    ``accepted`` and ``pass_kind`` per row."""

    lines: list[str]
    accepted: dict[int, int]
    kinds: dict[str, int]
    experts: np.ndarray
    seq: np.ndarray
    iteration: np.ndarray
    accepted_per_row: np.ndarray
    pass_kind: np.ndarray
    top_k: int
    num_experts: int

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted.values())

    @property
    def iterations(self) -> int:
        return len({(int(s), int(i)) for s, i in zip(self.seq, self.iteration)})


def generate_engine_jsonl(path: str | os.PathLike | None, *, iterations: int, layers: int, num_experts: int,
                          top_k: int, p_accept: float, p_fail: float, sequences: int = 1, seed: int = 0,
                          fields: EngineFields | None = None, order: str = "pass") -> EngineLog:
    """Generate a log (module docstring); write it to ``path`` when given (atomically; gzip when
    the name ends in ``.gz``). Layers are 0..layers-1, iterations 0..iterations-1, sequences
    0..sequences-1."""
    _check(iterations, layers, num_experts, top_k, p_accept, p_fail, sequences, order)
    f = fields or EngineFields()
    k, E = top_k, num_experts
    rng = np.random.default_rng(seed)
    prev = [[None] * layers for _ in range(sequences)]
    lines: list[str] = []
    rows: dict[int, list[tuple[int, int, list[list[int]]]]] = {s: [] for s in range(sequences)}

    def position(s: int, layer: int) -> list[int]:
        ids = _position(rng, prev[s][layer], k, E)
        prev[s][layer] = ids
        return ids

    for i in range(iterations):
        for s in range(sequences):
            u = rng.random()
            if u < p_accept:
                passes = [(SPEC_ACCEPT, 2)]
            elif u < p_accept + p_fail:
                passes = [(SPEC_FAIL, 2 if rng.random() < 0.5 else 1), (FALLBACK, 1)]
            else:
                passes = [(NORMAL, 1)]
            recs = [[position(s, layer) + (position(s, layer) if width == 2 else []) for layer in range(layers)]
                    for _, width in passes]
            for kind, per_layer in zip(passes, recs):
                rows[s].append((kind[0], i, per_layer))
            if order == "pass":
                emit = [(layer, per_layer[layer]) for per_layer in recs for layer in range(layers)]
            else:
                emit = [(layer, per_layer[layer]) for layer in range(layers) for per_layer in recs]
            for layer, ids in emit:
                lines.append(json.dumps({f.seq: s, f.iteration: i, f.layer: layer, f.experts: ids}))
    log = _truth(lines, rows, layers, k, E)
    if path is not None:
        data = "".join(line + "\n" for line in lines).encode()
        if str(path).endswith(".gz"):
            data = gzip.compress(data, mtime=0)
        with atomic_open(path, "wb") as fh:
            fh.write(data)
    return log


def _position(rng: np.random.Generator, prev: list[int] | None, k: int, E: int) -> list[int]:
    """k distinct ids: each slot keeps ``prev``'s id with probability 1/2, the others drawn uniformly."""
    keep = [] if prev is None else [x for x, c in zip(prev, rng.random(k) < 0.5) if c]
    taken = set(keep)
    need = k - len(keep)
    if E <= 4 * k:
        fresh = [int(x) for x in rng.permutation(E) if int(x) not in taken][:need]
    else:
        fresh = []
        while len(fresh) < need:
            x = int(rng.integers(E))
            if x not in taken:
                taken.add(x)
                fresh.append(x)
    out = keep + fresh
    rng.shuffle(out)
    return out


def _truth(lines, rows, layers: int, k: int, E: int) -> EngineLog:
    order = [(s, r) for s in sorted(rows) for r in rows[s]]
    W = 2 * k if any(len(per_layer[0]) == 2 * k for _, (_, _, per_layer) in order) else k
    experts = np.full((len(order), layers, W), -1, dtype=np.int32)
    for t, (_, (_, _, per_layer)) in enumerate(order):
        for layer, ids in enumerate(per_layer):
            row = list(dict.fromkeys(ids))
            experts[t, layer, : len(row)] = row
    kind = np.array([r[0] for _, r in order], dtype=np.int8)
    acc = np.array([ACCEPTED[c] for c in kind], dtype=np.int8)
    seq = np.array([s for s, _ in order], dtype=np.int32)
    return EngineLog(
        lines=lines,
        accepted={s: int(acc[seq == s].sum()) for s in sorted(rows)},
        kinds={name: int((kind == c).sum()) for c, name in enumerate(PASS_KINDS)},
        experts=experts, seq=seq, iteration=np.array([r[1] for _, r in order], dtype=np.int64),
        accepted_per_row=acc, pass_kind=kind, top_k=k, num_experts=E,
    )


def _check(iterations, layers, num_experts, top_k, p_accept, p_fail, sequences, order) -> None:
    for name, v in (("iterations", iterations), ("layers", layers), ("num_experts", num_experts), ("top_k", top_k),
                    ("sequences", sequences)):
        if not is_int(v, 1):
            raise ConfigError(f"{name}: expected a positive integer, got {v!r}")
    if top_k > num_experts:
        raise ConfigError(f"top_k: {top_k} is more than num_experts = {num_experts} (a position routes k distinct experts)")
    for name, v in (("p_accept", p_accept), ("p_fail", p_fail)):
        if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
            raise ConfigError(f"{name}: expected a probability in [0, 1], got {v!r}")
    if p_accept + p_fail > 1.0 + 1e-12:
        raise ConfigError(f"p_accept + p_fail = {p_accept + p_fail:g} is more than 1")
    if order not in ORDERS:
        raise ConfigError(f"order: {order!r} is not one of {', '.join(ORDERS)}")
    if iterations * sequences * layers * 2 > MAX_RECORDS:
        raise ConfigError(f"iterations x sequences x layers x 2 = {iterations * sequences * layers * 2:,} records "
                          f"is more than {MAX_RECORDS:,}")
