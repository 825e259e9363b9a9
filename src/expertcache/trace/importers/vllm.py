"""``vllm-jsonl``: one JSON record per (sequence, token, layer), the shape vLLM routing-log
patches write::

    {"problem_id": 0, "layer": 3, "token_idx": 17, "experts": [5, 1], "gating_probs": [0.6, 0.4]}

Field names are configurable (:class:`JsonlFields`). The default gate-weight field is read when
present (in every record or in none); a gate-weight field named otherwise must be present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core import Trace
from .records import iter_records
from .registry import Importer, Options, register
from .table import RoutingTable, jsonl_meta, jsonl_names, write_jsonl_chunked
from .values import check_num_experts, check_phase, field, id_list, index_value, prob_list, seq_value

DEFAULT_PROBS = "gating_probs"


@dataclass(frozen=True)
class JsonlFields:
    """Field names of a per-(token, layer) JSONL routing record.

    The defaults are those the vLLM routing-log patches write::

        {"problem_id": 0, "layer": 3, "token_idx": 17, "experts": [5, 1], "gating_probs": [0.6, 0.4]}

    ``probs`` may be ``None`` (no gate weights are read).
    """

    seq: str = "problem_id"
    layer: str = "layer"
    token: str = "token_idx"
    experts: str = "experts"
    probs: str | None = DEFAULT_PROBS


def import_vllm_jsonl(
    path: str | os.PathLike,
    *,
    fields: JsonlFields = JsonlFields(),
    num_experts: int | None = None,
    drop_incomplete: bool = False,
    pad: bool = False,
    model: str | None = None,
    phase: str = "decode",
) -> Trace:
    """Read a JSONL routing log (plain, gzip or zstd) with one record per (sequence, token, layer).

    Sequences keep the order in which they first appear; tokens are ordered by their token index
    within a sequence (gaps are kept in the ``step`` extra array, as in the shared traces); layers
    are sorted. Every (token, layer) must be present once: a missing one is an error naming it,
    unless ``drop_incomplete`` drops such tokens (their count goes to ``meta['validation']``).
    Every id list must have the same length unless ``pad`` (shorter lists padded with -1).
    ``num_experts`` defaults to the largest id + 1.
    """
    check_phase(phase)
    check_num_experts(num_experts)
    src = str(path)
    table = RoutingTable(src, jsonl_names(fields), pad=pad)
    records = _feed(path, fields, num_experts, table)
    return table.build(num_experts=num_experts, drop_incomplete=drop_incomplete, records=records,
                       meta=jsonl_meta(path, "vllm-jsonl", fields, model, phase))


def _feed(path, f: JsonlFields, num_experts: int | None, table: RoutingTable) -> int:
    """Every record of ``path`` into ``table`` (its entries and gate-weight presence); the records read."""
    probs_required = f.probs is not None and f.probs != DEFAULT_PROBS
    records = 0
    for where, rec in iter_records(path):
        s = seq_value(field(rec, f.seq, where), f.seq, where)
        layer = index_value(field(rec, f.layer, where), f.layer, where)
        tok = index_value(field(rec, f.token, where), f.token, where)
        ids = id_list(field(rec, f.experts, where), f.experts, where, num_experts)
        probs = None
        if f.probs is not None:
            present = f.probs in rec or probs_required
            table.probs_present(present, where)
            if present:
                probs = prob_list(field(rec, f.probs, where), len(ids), f.probs, where)
        table.add(s, tok, layer, ids, probs, where)
        records += 1
    return records


def _fits(rec: dict, o: Options) -> bool:
    ex = rec.get(o.vllm_fields.experts)
    return o.vllm_fields.layer in rec and isinstance(ex, list) and not any(isinstance(x, (list, dict)) for x in ex)


def _shape(o: Options) -> str:
    f = o.vllm_fields
    return f"one JSON record per token and layer: {f.seq}/{f.layer}/{f.token}/{f.experts} with a flat id list"


def _read(path: str | os.PathLike, fmt: str, o: Options) -> Trace:
    return import_vllm_jsonl(path, fields=o.vllm_fields, **o.common())


def _write_chunked(path: str | os.PathLike, out: str | os.PathLike, fmt: str, o: Options, chunk_sequences: int):
    return write_jsonl_chunked(path, out, fmt, o.vllm_fields, lambda table: _feed(path, o.vllm_fields, o.num_experts, table),
                               chunk_sequences=chunk_sequences, **o.common())


register(Importer("vllm-jsonl", shape=_shape, read=_read, phase="decode", claims_record=_fits, loose=True,
                  write_chunked=_write_chunked))
