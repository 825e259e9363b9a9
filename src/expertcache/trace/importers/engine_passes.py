"""Typing engine-iteration routing records (speculative decoding) into router passes: a pure
function from records to typed passes, and the canonical arrays of those passes.

An engine record is one (sequence, iteration, layer) routing event with a list of expert ids and
no event tag. Within one (sequence, iteration):

=======================  ==========================  ===============  ========
records per layer        width of the record         pass kind        accepted
=======================  ==========================  ===============  ========
one                      k                           ``normal``       1
one                      2k (two positions)          ``spec-accept``  2
two: the first           k or 2k                     ``spec-fail``    0
two: the second          k                           ``fallback``     1
=======================  ==========================  ===============  ========

A 2k record holds the first position's k ids, then the second position's k ids; ids are distinct
within a position (the two positions may share ids).

Invariants of what :func:`type_passes` returns (anything else is a one-line
:class:`~expertcache.errors.TraceError` naming ``file:line`` and the iteration and layer):

* every record's width is k or 2k; no layer is routed more than twice in one iteration;
* every iteration routes every layer of the log, and every layer the same number of times;
* the records of one pass have one width; a fallback pass has width k;
* a sequence's iteration indices never go backwards (records of an iteration may be interleaved
  with other sequences' records, and a failed speculation's records with its fallback's);
* passes come out sequence by sequence (first appearance), iterations ascending, a failed
  speculation's pass right before its fallback pass.

:func:`pass_arrays` turns the passes into the canonical rows: one row per pass, replayed as issued;
a two-position row holds the union of its positions' ids in first-seen order, -1 padded to
W = 2k when any pass has width 2k, else k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import numpy as np

from ...errors import TraceError
from .values import short

PASS_KINDS = ("normal", "spec-accept", "spec-fail", "fallback")
"""Pass kinds in the order of their codes in the ``pass_kind`` extra (0..3)."""
NORMAL, SPEC_ACCEPT, SPEC_FAIL, FALLBACK = range(4)
ACCEPTED = (1, 2, 0, 1)
"""Accepted tokens credited to a pass of each kind."""
NAMES = {"seq": "seq", "iteration": "iteration", "experts": "experts"}
"""Field names used in messages (the importer passes the ones in force)."""


class EngineRecord(NamedTuple):
    """One routing event: ``line`` (for messages), sequence id (``None``: the log has none),
    iteration index, layer id and the expert ids as recorded (ints in range, checked by the reader)."""

    line: int
    seq: int | str | None
    iteration: int
    layer: int
    ids: list[int]


@dataclass(frozen=True)
class TypedPass:
    """One router pass over every layer: ``ids`` maps layer id -> the ids as recorded (width k or 2k)."""

    seq: int | str | None
    iteration: int
    kind: int
    width: int
    line: int
    ids: dict[int, list[int]]

    @property
    def accepted(self) -> int:
        return ACCEPTED[self.kind]


@dataclass(frozen=True)
class TypedPasses:
    """The passes of a log, with the router's k (given or inferred: the smallest width)."""

    passes: list[TypedPass]
    top_k: int
    top_k_inferred: bool
    layer_ids: list[int]
    records: int
    sequences: list = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(PASS_KINDS, 0)
        for p in self.passes:
            out[PASS_KINDS[p.kind]] += 1
        return out

    def accepted_by_sequence(self) -> dict:
        out: dict = dict.fromkeys(self.sequences, 0)
        for p in self.passes:
            out[p.seq] += p.accepted
        return out


class _Group:
    __slots__ = ("iteration", "line", "layers")

    def __init__(self, iteration: int, line: int):
        self.iteration, self.line = iteration, line
        self.layers: dict[int, list[tuple[int, list[int]]]] = {}


def type_passes(records: Iterable[EngineRecord], *, top_k: int | None = None, src: str = "<records>",
                names: dict[str, str] = NAMES) -> TypedPasses:
    """Reconstruct the typed passes of ``records`` (in log order); see the module invariants.

    ``top_k`` is the router's k; ``None`` infers it as the smallest width (a log in which every
    record carries two positions then reads as k' = 2k: pass ``top_k``)."""
    groups: dict = {}
    layers: set[int] = set()
    smallest = 0
    n = 0
    for r in records:
        n += 1
        seq_groups = groups.setdefault(r.seq, [])
        last = seq_groups[-1] if seq_groups else None
        if last is None or r.iteration > last.iteration:
            last = _Group(r.iteration, r.line)
            seq_groups.append(last)
        elif r.iteration < last.iteration:
            raise TraceError(f"{src}:{r.line}: {_ctx(names, r.seq, r.iteration)}: comes after "
                             f"{names['iteration']} {last.iteration} (line {last.line}); a sequence's iterations never go back")
        routed = last.layers.setdefault(r.layer, [])
        if len(routed) == 2:
            raise TraceError(f"{src}:{r.line}: {_ctx(names, r.seq, r.iteration, r.layer)}: routed a third time "
                             f"(lines {routed[0][0]}, {routed[1][0]}); a layer is routed at most twice per iteration "
                             "(a failed speculation, then its fallback)")
        routed.append((r.line, r.ids))
        layers.add(r.layer)
        smallest = len(r.ids) if not smallest else min(smallest, len(r.ids))
    if not n:
        raise TraceError(f"{src}: no routing records")
    k = top_k if top_k is not None else smallest
    layer_ids = sorted(layers)
    passes: list[TypedPass] = []
    for s, seq_groups in groups.items():
        for g in seq_groups:
            passes.extend(_type_group(g, s, k, top_k is None, layer_ids, src, names))
    return TypedPasses(passes, k, top_k is None, layer_ids, n, list(groups))


def _type_group(g: _Group, s, k: int, inferred: bool, layer_ids: list[int], src: str, names: dict) -> list[TypedPass]:
    """The one or two passes of one (sequence, iteration)."""
    for lid in sorted(g.layers):
        for line, ids in g.layers[lid]:
            _check_width(ids, k, inferred, f"{src}:{line}", _ctx(names, s, g.iteration, lid), names)
    missing = [lid for lid in layer_ids if lid not in g.layers]
    if missing:
        raise TraceError(f"{src}:{g.line}: {_ctx(names, s, g.iteration)} (records from this line) has no record "
                         f"for layer {missing[0]}; every iteration routes every layer ({_span(layer_ids)})")
    twice = [lid for lid in layer_ids if len(g.layers[lid]) == 2]
    if twice and len(twice) < len(layer_ids):
        once = next(lid for lid in layer_ids if len(g.layers[lid]) == 1)
        lid = twice[0]
        raise TraceError(f"{src}:{g.layers[lid][1][0]}: {_ctx(names, s, g.iteration, lid)}: routed a second time, "
                         f"but layer {once} only once (line {g.layers[once][0][0]}); a failed speculation "
                         "re-routes every layer in its fallback pass")
    first = _one_pass(g, s, 0, k, src, names)
    if not twice:
        kind = NORMAL if first.width == k else SPEC_ACCEPT
        return [TypedPass(s, g.iteration, kind, first.width, first.line, first.ids)]
    second = _one_pass(g, s, 1, k, src, names)
    if second.width != k:
        lid = next(lid for lid in layer_ids if len(second.ids[lid]) != k)
        raise TraceError(f"{src}:{g.layers[lid][1][0]}: {_ctx(names, s, g.iteration, lid)}: the second routing "
                         f"(a fallback pass) holds {2 * k} ids; a fallback pass routes one position (k = {k})")
    return [TypedPass(s, g.iteration, SPEC_FAIL, first.width, first.line, first.ids),
            TypedPass(s, g.iteration, FALLBACK, k, second.line, second.ids)]


class _Pass(NamedTuple):
    width: int
    line: int
    ids: dict[int, list[int]]


def _one_pass(g: _Group, s, which: int, k: int, src: str, names: dict) -> _Pass:
    """The ``which``-th routing of every layer as one pass of one width."""
    entries = sorted(((lid, routed[which]) for lid, routed in g.layers.items()), key=lambda e: e[1][0])
    lid0, (line0, ids0) = entries[0]
    for lid, (line, ids) in entries[1:]:
        if len(ids) != len(ids0):
            what = "the first" if which == 0 else "the second"
            raise TraceError(f"{src}:{line}: {_ctx(names, s, g.iteration, lid)}: {len(ids)} ids where layer {lid0} "
                             f"(line {line0}) holds {len(ids0)} in {what} routing of this iteration; one pass has "
                             f"one width (k = {k} for one position, {2 * k} for two)")
    return _Pass(len(ids0), line0, {lid: ids for lid, (_, ids) in entries})


def _check_width(ids: list[int], k: int, inferred: bool, where: str, ctx: str, names: dict) -> None:
    w = len(ids)
    if w not in (k, 2 * k):
        how = " (inferred: the smallest width; --top-k sets it)" if inferred else ""
        raise TraceError(f"{where}: {ctx}: field '{names['experts']}' holds {w} ids; a record holds k = {k}{how} "
                         f"ids (one position) or 2k = {2 * k} (two positions)")
    for pos in range(w // k):
        part = ids[pos * k:(pos + 1) * k]
        if len(set(part)) != k:
            which = f" in position {pos + 1} of 2" if w == 2 * k else ""
            raise TraceError(f"{where}: {ctx}: field '{names['experts']}': an id appears twice{which} in {short(ids)}")


def _ctx(names: dict, s, iteration: int, layer: int | None = None) -> str:
    parts = [] if s is None else [f"{names['seq']}={short(s)}"]
    parts.append(f"{names['iteration']} {iteration}")
    if layer is not None:
        parts.append(f"layer {layer}")
    return ", ".join(parts)


def _span(layer_ids: list[int]) -> str:
    if layer_ids == list(range(layer_ids[0], layer_ids[-1] + 1)):
        return f"layers {layer_ids[0]}-{layer_ids[-1]}" if len(layer_ids) > 1 else f"layer {layer_ids[0]}"
    return f"{len(layer_ids)} layers"


def pass_arrays(typed: TypedPasses) -> dict[str, np.ndarray]:
    """The canonical arrays of the passes: ``experts`` int32 ``[T, L, W]``, ``seq`` (0, 1, ... in
    first-appearance order), ``iteration`` int64, ``accepted`` int8 and ``pass_kind`` int8, each [T]."""
    k, layer_ids = typed.top_k, typed.layer_ids
    W = 2 * k if any(p.width == 2 * k for p in typed.passes) else k
    T, L = len(typed.passes), len(layer_ids)
    experts = np.full((T, L, W), -1, dtype=np.int32)
    code = {s: i for i, s in enumerate(typed.sequences)}
    for t, p in enumerate(typed.passes):
        for c, lid in enumerate(layer_ids):
            ids = p.ids[lid]
            row = list(dict.fromkeys(ids)) if p.width == 2 * k else ids
            experts[t, c, : len(row)] = row
    return {
        "experts": experts,
        "seq": np.array([code[p.seq] for p in typed.passes], dtype=np.int32),
        "iteration": np.array([p.iteration for p in typed.passes], dtype=np.int64),
        "accepted": np.array([p.accepted for p in typed.passes], dtype=np.int8),
        "pass_kind": np.array([p.kind for p in typed.passes], dtype=np.int8),
    }
