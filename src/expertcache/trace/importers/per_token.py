"""``token-jsonl``: one JSON record per (sequence, token) holding the experts of every layer::

    {"problem_id": 0, "token_idx": 5, "experts": [[1, 2], [3, 4]]}                        # layer i = position i
    {"problem_id": 0, "token_idx": 5, "experts": [[1, 2], [3, 4]], "layer_ids": [0, 3]}   # layers named
    {"problem_id": 0, "token_idx": 5, "experts": {"0": [1, 2], "3": [5, 6]}}             # keyed by layer

Gate weights, when present, have the same shape as the experts (a list of lists, or an object
with the same keys). Field names are configurable (:class:`TokenFields`); the default gate-weight
and layer-id fields are read when present (in every record or in none), fields named otherwise
must be present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import TraceError
from ..core import Trace
from .records import iter_records
from .registry import Importer, Options, register
from .table import RoutingTable, jsonl_meta, jsonl_names, write_jsonl_chunked
from .values import check_num_experts, check_phase, field, id_list, index_value, layer_key, prob_list, seq_value, short

DEFAULT_PROBS = "gating_probs"
DEFAULT_LAYERS = "layer_ids"


@dataclass(frozen=True)
class TokenFields:
    """Field names of a per-token JSONL routing record (``probs``/``layers`` may be ``None``)."""

    seq: str = "problem_id"
    token: str = "token_idx"
    experts: str = "experts"
    probs: str | None = DEFAULT_PROBS
    layers: str | None = DEFAULT_LAYERS


def import_token_jsonl(
    path: str | os.PathLike,
    *,
    fields: TokenFields = TokenFields(),
    num_experts: int | None = None,
    drop_incomplete: bool = False,
    pad: bool = False,
    model: str | None = None,
    phase: str = "decode",
) -> Trace:
    """Read a JSONL routing log (plain, gzip or zstd) with one record per (sequence, token).

    The same invariants as :func:`~expertcache.trace.importers.import_vllm_jsonl`: sequences in
    order of first appearance, tokens sorted by token index (gaps kept in ``step``), layers sorted,
    every token needs every layer unless ``drop_incomplete``, one k unless ``pad``.
    """
    check_phase(phase)
    check_num_experts(num_experts)
    src = str(path)
    table = RoutingTable(src, jsonl_names(fields), pad=pad)
    records = _feed(path, fields, num_experts, table)
    return table.build(num_experts=num_experts, drop_incomplete=drop_incomplete, records=records,
                       meta=jsonl_meta(path, "token-jsonl", fields, model, phase))


def _feed(path, f: TokenFields, num_experts: int | None, table: RoutingTable) -> int:
    """Every record of ``path`` into ``table`` (its entries and gate-weight presence); the records read."""
    need_probs = f.probs is not None and f.probs != DEFAULT_PROBS
    need_layers = f.layers is not None and f.layers != DEFAULT_LAYERS
    named: tuple[bool, str] | None = None  # (layer-id field present, where first seen)
    records = 0
    for where, rec in iter_records(path):
        s = seq_value(field(rec, f.seq, where), f.seq, where)
        tok = index_value(field(rec, f.token, where), f.token, where)
        experts = field(rec, f.experts, where)
        has_layers = f.layers is not None and (need_layers or f.layers in rec)
        if isinstance(experts, list) and f.layers is not None:
            if named is None:
                named = (has_layers, where)
            elif named[0] != has_layers:
                state = "present here but absent" if has_layers else "missing here but present"
                raise TraceError(f"{where}: field '{f.layers}' is {state} at {named[1]} (all records or none)")
        probs = None
        if f.probs is not None:
            present = need_probs or f.probs in rec
            table.probs_present(present, where)
            if present:
                probs = field(rec, f.probs, where)
        for layer, ids, pr in _layers(rec, experts, probs, f, has_layers, where, num_experts):
            table.add(s, tok, layer, ids, pr, where)
        records += 1
    return records


def _layers(rec: dict, experts: object, probs: object, f: TokenFields, has_layers: bool, where: str, num_experts: int | None):
    """Yield ``(layer id, ids, probs or None)`` for every layer of one record."""
    if isinstance(experts, dict):
        if f.layers is not None and f.layers != DEFAULT_LAYERS:
            raise TraceError(f"{where}: field '{f.experts}' is keyed by layer, so the layer-id field '{f.layers}' does not apply")
        if not experts:
            raise TraceError(f"{where}: field '{f.experts}' holds no layers")
        if probs is not None and (not isinstance(probs, dict) or probs.keys() != experts.keys()):
            raise TraceError(f"{where}: field '{f.probs}' must be an object with the same layer keys as '{f.experts}', got {short(probs)}")
        for key, ids in experts.items():
            layer = layer_key(key, f.experts, where)
            ids = id_list(ids, f"{f.experts}.{key}", where, num_experts)
            pr = None if probs is None else prob_list(probs[key], len(ids), f"{f.probs}.{key}", where)
            yield layer, ids, pr
        return
    if not isinstance(experts, list) or not experts or not all(isinstance(x, list) for x in experts):
        raise TraceError(
            f"{where}: field '{f.experts}' must be a list of id lists (one per layer) or an object keyed by layer, got {short(experts)}"
        )
    if has_layers:
        lids = field(rec, f.layers, where)
        if not isinstance(lids, list) or len(lids) != len(experts):
            raise TraceError(f"{where}: field '{f.layers}' must list {len(experts)} layer ids (one per id list), got {short(lids)}")
        lids = [index_value(x, f.layers, where) for x in lids]
        if len(set(lids)) != len(lids):
            raise TraceError(f"{where}: field '{f.layers}': a layer appears twice in {short(lids)}")
    else:
        lids = list(range(len(experts)))
    if probs is not None and (not isinstance(probs, list) or len(probs) != len(experts)):
        raise TraceError(f"{where}: field '{f.probs}' must be a list of {len(experts)} weight lists (one per layer), got {short(probs)}")
    for i, (layer, ids) in enumerate(zip(lids, experts)):
        ids = id_list(ids, f"{f.experts}[{i}]", where, num_experts)
        pr = None if probs is None else prob_list(probs[i], len(ids), f"{f.probs}[{i}]", where)
        yield layer, ids, pr


def _fits(rec: dict, o: Options) -> bool:
    ex = rec.get(o.token_fields.experts)
    return isinstance(ex, dict) or (isinstance(ex, list) and bool(ex) and all(isinstance(x, list) for x in ex))


def _shape(o: Options) -> str:
    f = o.token_fields
    return (f"one JSON record per token: {f.seq}/{f.token}/{f.experts} holding a list of id lists "
            "or an object keyed by layer")


def _read(path: str | os.PathLike, fmt: str, o: Options) -> Trace:
    return import_token_jsonl(path, fields=o.token_fields, **o.common())


def _write_chunked(path: str | os.PathLike, out: str | os.PathLike, fmt: str, o: Options, chunk_sequences: int):
    return write_jsonl_chunked(path, out, fmt, o.token_fields, lambda table: _feed(path, o.token_fields, o.num_experts, table),
                               chunk_sequences=chunk_sequences, **o.common())


register(Importer("token-jsonl", shape=_shape, read=_read, phase="decode", claims_record=_fits,
                  write_chunked=_write_chunked))
