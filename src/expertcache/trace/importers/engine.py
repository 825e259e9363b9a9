"""``engine-jsonl``: engine-iteration routing logs with speculative decoding, one JSON record per
(iteration, layer) routing event, with no event tag::

    {"seq": 0, "iteration": 17, "layer": 3, "experts": [5, 1, 9, 2]}

The reading is here; the typing of records into passes (normal, spec-accept, spec-fail,
fallback) and its validation are the pure functions of :mod:`.engine_passes`. Field names are
configurable (:class:`EngineFields`); the default sequence field is read when present (in every
record or in none: without it the log is one sequence); a sequence field named otherwise must be
present.

The trace built has one row per router pass (``meta['row_unit'] = 'pass'``), replayed as issued,
and keeps both units: the extras ``iteration`` (engine iteration per row) and ``accepted``
(accepted tokens credited per row), plus ``pass_kind`` (0 normal, 1 spec-accept, 2 spec-fail,
3 fallback); see :mod:`expertcache.trace.units`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Iterator

from ...errors import ConfigError, TraceError, is_int
from ..core import Trace
from ..validate import MAX_EXPERTS
from .engine_passes import PASS_KINDS, EngineRecord, TypedPasses, pass_arrays, type_passes
from .records import HugeInt, display_name, iter_records
from .registry import Importer, Options, register
from .values import check_num_experts, check_phase, field, index_value, seq_value, short

DEFAULT_SEQ = "seq"
MAX_TOP_K = 1 << 16


@dataclass(frozen=True)
class EngineFields:
    """Field names of an engine routing record (``seq`` is optional when left at its default)."""

    seq: str = DEFAULT_SEQ
    iteration: str = "iteration"
    layer: str = "layer"
    experts: str = "experts"


def read_engine_records(path: str | os.PathLike, *, fields: EngineFields = EngineFields(),
                        num_experts: int | None = None) -> Iterator[EngineRecord]:
    """Yield the records of a log (plain, gzip or zstd), every value checked (ids in range and
    integers, indices in [0, 2^31)); the typing is :func:`~.engine_passes.type_passes`'s."""
    f = fields
    src = str(path)
    seq_present: tuple[bool, str] | None = None
    for where, rec in iter_records(path):
        present = f.seq != DEFAULT_SEQ or f.seq in rec
        if seq_present is None:
            seq_present = (present, where)
        elif present != seq_present[0]:
            state = "present here but absent" if present else "missing here but present"
            raise TraceError(f"{where}: field '{f.seq}' is {state} at {seq_present[1]} (all records or none)")
        s = seq_value(field(rec, f.seq, where), f.seq, where) if present else None
        iteration = index_value(field(rec, f.iteration, where), f.iteration, where)
        layer = index_value(field(rec, f.layer, where), f.layer, where)
        ids = _ids(field(rec, f.experts, where), f.experts, where, num_experts)
        yield EngineRecord(int(where[len(src) + 1:]), s, iteration, layer, ids)


def _ids(x: object, name: str, where: str, num_experts: int | None) -> list[int]:
    """A non-empty list of expert ids in range (repeats are the typing's to judge: a two-position
    record may hold an id once per position)."""
    limit = num_experts if num_experts is not None else MAX_EXPERTS
    if not isinstance(x, list) or not x:
        raise TraceError(f"{where}: field '{name}' must be a non-empty list of expert ids, got {short(x)}")
    for v in x:
        if type(v) is not int or not 0 <= v < limit:
            if isinstance(v, HugeInt):
                raise TraceError(f"{where}: field '{name}': {v!r} is out of range")
            if not is_int(v):
                raise TraceError(f"{where}: field '{name}': expert id {short(v)} is not an integer")
            what = f"--num-experts {num_experts}" if num_experts is not None else f"MAX_EXPERTS = {MAX_EXPERTS}"
            raise TraceError(f"{where}: field '{name}': expert id {short(v)} is outside [0, {limit}) ({what})")
    return x


def import_engine_jsonl(
    path: str | os.PathLike,
    *,
    fields: EngineFields = EngineFields(),
    num_experts: int | None = None,
    top_k: int | None = None,
    expect_tokens: int | None = None,
    model: str | None = None,
    phase: str = "decode",
) -> Trace:
    """Read an engine routing log into a trace of typed passes (module docstring).

    ``top_k`` is the router's k (default: the smallest record width, noted as ``top_k_inferred``
    in meta); ``expect_tokens``: every sequence's accepted tokens must add up to it. ``num_experts``
    defaults to the largest id + 1."""
    check_phase(phase)
    check_num_experts(num_experts)
    if top_k is not None and not (is_int(top_k) and 0 < top_k <= MAX_TOP_K):
        raise ConfigError(f"--top-k: {top_k!r} is outside [1, {MAX_TOP_K}]")
    if expect_tokens is not None and not is_int(expect_tokens, 1):
        raise ConfigError(f"--expect-tokens: {expect_tokens!r} is not a positive integer")
    src = str(path)
    f = fields
    names = {"seq": f.seq, "iteration": f.iteration, "experts": f.experts}
    typed = type_passes(read_engine_records(path, fields=f, num_experts=num_experts), top_k=top_k, src=src, names=names)
    per_seq = typed.accepted_by_sequence()
    if expect_tokens is not None:
        for s, n in per_seq.items():
            if n != expect_tokens:
                who = "the log" if s is None else f"sequence {f.seq}={short(s)}"
                raise TraceError(f"{src}: {who} accounts for {n} accepted tokens, expected {expect_tokens} (--expect-tokens)")
    return trace_of_passes(typed, src=src, num_experts=num_experts, meta={
        "name": display_name(path),
        "model": model or "unknown",
        "phase": phase,
        "source": {"format": "engine-jsonl", "path": src, "fields": asdict(f),
                   "sequence_field_present": typed.sequences != [None]},
    })


def trace_of_passes(typed: TypedPasses, *, src: str, num_experts: int | None, meta: dict) -> Trace:
    """The canonical trace of typed passes: one row per pass, the unit extras, and the unit meta
    (``iterations``, ``accepted_tokens``, ``passes``, ``row_unit``, ``router_top_k``, ``pass_kinds``)."""
    arrays = pass_arrays(typed)
    experts = arrays.pop("experts")
    seq = arrays.pop("seq")
    E = num_experts if num_experts is not None else int(experts.max()) + 1
    iterations = sum(1 for i, p in enumerate(typed.passes) if i == 0 or (p.seq, p.iteration) !=
                     (typed.passes[i - 1].seq, typed.passes[i - 1].iteration))
    full = {
        **meta,
        "num_experts": E,
        "num_layers": len(typed.layer_ids),
        "layer_ids": typed.layer_ids,
        "sequence_ids": {str(i): s for i, s in enumerate(typed.sequences)},
        "row_unit": "pass",
        "passes": len(typed.passes),
        "iterations": iterations,
        "accepted_tokens": int(arrays["accepted"].sum(dtype="int64")),
        "router_top_k": typed.top_k,
        "top_k_inferred": typed.top_k_inferred,
        "pass_kinds": typed.counts(),
        "validation": {"records": typed.records, "tokens_dropped": 0},
    }
    if num_experts is None:
        full["num_experts_inferred"] = True
    return Trace.from_arrays(experts, seq, meta=full, extras=arrays, source=src)


def _read(path: str | os.PathLike, fmt: str, o: Options) -> Trace:
    if o.pad or o.drop_incomplete:
        raise ConfigError(f"--{'pad' if o.pad else 'drop-incomplete'} does not apply to engine-jsonl "
                          "(its typing needs every record)")
    return import_engine_jsonl(path, fields=o.engine_fields, num_experts=o.num_experts, top_k=o.top_k,
                               expect_tokens=o.expect_tokens, model=o.model, phase=o.phase)


def _fits(rec: dict, o: Options) -> bool:
    f, ex = o.engine_fields, rec.get(o.engine_fields.experts)
    return (f.layer in rec and f.iteration in rec and o.vllm_fields.token not in rec and isinstance(ex, list)
            and not any(isinstance(x, (list, dict)) for x in ex))


def _shape(o: Options) -> str:
    f = o.engine_fields
    return (f"one JSON record per engine iteration and layer: {f.iteration}/{f.layer}/{f.experts} "
            f"with a flat id list and no {o.vllm_fields.token} (speculative decoding)")


register(Importer("engine-jsonl", shape=_shape, read=_read, phase="decode", claims_record=_fits))


__all__ = ["DEFAULT_SEQ", "PASS_KINDS", "EngineFields", "import_engine_jsonl", "read_engine_records", "trace_of_passes"]
