"""Importers: routing logs from other engines into the canonical :class:`~expertcache.trace.Trace`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TraceError
from .core import PHASES, Trace


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
    probs: str | None = "gating_probs"


def import_vllm_jsonl(
    path: str | os.PathLike,
    *,
    fields: JsonlFields = JsonlFields(),
    num_experts: int | None = None,
    drop_incomplete: bool = False,
    model: str | None = None,
    phase: str = "decode",
) -> Trace:
    """Read a JSONL routing log with one record per (sequence, token, layer).

    Sequences keep the order in which they first appear; tokens are ordered by their token index
    within a sequence (gaps are kept in the ``step`` extra array, as in the shared traces); layers
    are sorted. Every (token, layer) must be present once: a missing one is an error naming it,
    unless ``drop_incomplete`` drops such tokens (their count goes to ``meta['validation']``).
    Records with fewer than k ids are padded with -1. ``num_experts`` defaults to the largest id + 1.
    """
    if phase not in PHASES:
        raise TraceError(f"--phase: {phase!r} is not one of {', '.join(PHASES)}")
    src = str(path)
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{src}: no such file")
    seqs: dict[object, int] = {}
    rows: dict[tuple[int, int], dict[int, tuple[list[int], list[float] | None]]] = {}
    layers: set[int] = set()
    with_probs = 0
    n_records = 0
    with open(p, "r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{src}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{where}: expected a JSON object per line")
            s = _field(rec, fields.seq, where)
            layer = _int(_field(rec, fields.layer, where), fields.layer, where)
            tok = _int(_field(rec, fields.token, where), fields.token, where)
            ids = _field(rec, fields.experts, where)
            if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise TraceError(f"{where}: field '{fields.experts}' must be a non-empty list of integers, got {ids!r}")
            if min(ids) < 0 or (num_experts is not None and max(ids) >= num_experts):
                raise TraceError(f"{where}: field '{fields.experts}': id outside [0, {num_experts or 'E'}) in {ids}")
            if len(set(ids)) != len(ids):
                raise TraceError(f"{where}: field '{fields.experts}': an id appears twice in {ids}")
            probs = None
            if fields.probs is not None and fields.probs in rec:
                probs = rec[fields.probs]
                if not isinstance(probs, list) or len(probs) != len(ids) or not all(isinstance(x, (int, float)) for x in probs):
                    raise TraceError(f"{where}: field '{fields.probs}' must be {len(ids)} numbers, got {probs!r}")
                with_probs += 1
            key = seqs.setdefault(_hashable(s), len(seqs))
            slot = rows.setdefault((key, tok), {})
            if layer in slot:
                raise TraceError(f"{where}: a second record for {fields.seq}={s!r}, {fields.token}={tok}, {fields.layer}={layer}")
            slot[layer] = (ids, probs)
            layers.add(layer)
            n_records += 1
    if not rows:
        raise TraceError(f"{src}: no routing records")
    if 0 < with_probs < n_records:
        raise TraceError(f"{src}: field '{fields.probs}' is present in {with_probs} of {n_records} records (all or none)")

    layer_ids = sorted(layers)
    L = len(layer_ids)
    k = max(len(ids) for slot in rows.values() for ids, _ in slot.values())
    names = {v: k_ for k_, v in seqs.items()}
    kept, dropped = [], []
    for s, tok in sorted(rows):
        slot = rows[(s, tok)]
        if len(slot) == L:
            kept.append((s, tok))
            continue
        if not drop_incomplete:
            missing = next(lid for lid in layer_ids if lid not in slot)
            raise TraceError(
                f"{src}: no record for {fields.seq}={names[s]!r}, {fields.token}={tok}, {fields.layer}={missing} "
                "(every token needs every layer; --drop-incomplete drops such tokens)"
            )
        dropped.append({"seq": _jsonable(names[s]), "token": tok})
    if not kept:
        raise TraceError(f"{src}: every token lacks some layer; nothing left to import")

    T = len(kept)
    experts = np.full((T, L, k), -1, dtype=np.int32)
    probs = np.full((T, L, k), np.nan, dtype=np.float32) if with_probs else None
    col = {lid: i for i, lid in enumerate(layer_ids)}
    for t, key in enumerate(kept):
        for lid, (ids, pr) in rows[key].items():
            experts[t, col[lid], : len(ids)] = ids
            if probs is not None:
                probs[t, col[lid], : len(pr)] = pr
    renumber = {old: new for new, old in enumerate(dict.fromkeys(s for s, _ in kept))}
    seq = np.array([renumber[s] for s, _ in kept], dtype=np.int32)
    step = np.array([tok for _, tok in kept], dtype=np.int32)
    E = num_experts if num_experts is not None else int(experts.max()) + 1
    meta = {
        "name": p.stem,
        "model": model or "unknown",
        "num_experts": E,
        "top_k": k,
        "num_layers": L,
        "layer_ids": layer_ids,
        "phase": phase,
        "source": {"format": "vllm-jsonl", "path": src, "fields": dict(fields.__dict__)},
        "sequence_ids": {str(new): _jsonable(names[old]) for old, new in renumber.items()},
        "validation": {"records": n_records, "tokens_dropped": len(dropped), "dropped_tokens": dropped[:1000]},
    }
    if num_experts is None:
        meta["num_experts_inferred"] = True
    return Trace.from_arrays(experts, seq, probs=probs, meta=meta, extras={"step": step}, source=src)


def _field(rec: dict, name: str, where: str):
    if name not in rec:
        raise TraceError(f"{where}: missing field '{name}' (set the field names with --*-field options)")
    return rec[name]


def _int(x, name: str, where: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TraceError(f"{where}: field '{name}' must be an integer, got {x!r}")
    return x


def _jsonable(x):
    return x if isinstance(x, (int, str, float)) else str(x)


def _hashable(x):
    return json.dumps(x, sort_keys=True) if isinstance(x, (list, dict)) else x
