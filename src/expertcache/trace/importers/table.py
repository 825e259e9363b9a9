"""The routing table the JSONL importers fill: (sequence, token) -> {layer: (ids, probs)}, then one
canonical :class:`~expertcache.trace.Trace`.

Invariants of the trace built:

* sequences keep the order in which they first appear; tokens are sorted by token index within a
  sequence, gaps kept in the ``step`` extra array; layers are sorted;
* every (sequence, token, layer) was given once; a token lacking a layer is an error unless
  ``drop_incomplete`` drops it (counted in ``meta['validation']``);
* every id list has the same length k, unless ``pad``: then k is the longest and shorter lists
  are padded with -1 (gate weights with NaN, which the trace ignores under padding);
* gate weights were given for every entry or for none.
"""

from __future__ import annotations

import numpy as np

from ...errors import TraceError
from ..core import Trace
from .values import short


class RoutingTable:
    """Collects routing entries from records; ``names`` maps roles (seq, token, experts, probs) to
    the field names used in messages."""

    def __init__(self, src: str, names: dict[str, str | None], *, pad: bool):
        self.src = src
        self.names = names
        self.pad = pad
        self.seqs: dict[int | str, int] = {}
        self.rows: dict[tuple[int, int], dict[int, tuple[list[int], list[float] | None]]] = {}
        self.layers: set[int] = set()
        self.k: int | None = None
        self.k_where = ""
        self.k_max = 0
        self.k_min = 0
        self.has_probs: bool | None = None
        self.probs_where = ""

    def probs_present(self, present: bool, where: str) -> None:
        """Record whether a record carries gate weights: all records or none must."""
        if self.has_probs is None:
            self.has_probs, self.probs_where = present, where
        elif present != self.has_probs:
            state = "present here but absent" if present else "missing here but present"
            raise TraceError(f"{where}: field '{self.names['probs']}' is {state} at {self.probs_where} (all records or none)")

    def add(self, seq: int | str, tok: int, layer: int, ids: list[int], probs: list[float] | None, where: str) -> None:
        n = len(ids)
        if self.k is None:
            self.k, self.k_where = n, where
        elif n != self.k and not self.pad:
            raise TraceError(
                f"{where}: field '{self.names['experts']}' holds {n} ids where {self.k_where} holds {self.k} "
                "(every id list needs the same length k; --pad pads shorter lists with -1)"
            )
        self.k_max = max(self.k_max, n)
        self.k_min = min(self.k_min, n) if self.k_min else n
        key = self.seqs.setdefault(seq, len(self.seqs))
        slot = self.rows.setdefault((key, tok), {})
        if layer in slot:
            raise TraceError(
                f"{where}: a second entry for {self.names['seq']}={short(seq)}, {self.names['token']}={tok}, layer {layer}"
            )
        slot[layer] = (ids, probs)
        self.layers.add(layer)

    def build(self, *, num_experts: int | None, drop_incomplete: bool, meta: dict, records: int) -> Trace:
        """The trace of everything added; ``meta`` adds name, model, phase, source, ..."""
        src, names = self.src, self.names
        if not self.rows:
            raise TraceError(f"{src}: no routing records")
        layer_ids = sorted(self.layers)
        L, k = len(layer_ids), self.k_max
        seq_names = {v: key for key, v in self.seqs.items()}
        kept, dropped = [], []
        for s, tok in sorted(self.rows):
            slot = self.rows[(s, tok)]
            if len(slot) == L:
                kept.append((s, tok))
                continue
            if not drop_incomplete:
                missing = next(lid for lid in layer_ids if lid not in slot)
                raise TraceError(
                    f"{src}: no entry for {names['seq']}={short(seq_names[s])}, {names['token']}={tok}, layer {missing} "
                    "(every token needs every layer; --drop-incomplete drops such tokens)"
                )
            dropped.append({"seq": seq_names[s], "token": tok})
        if not kept:
            raise TraceError(f"{src}: every token lacks some layer; nothing left to import")

        T = len(kept)
        experts = np.full((T, L, k), -1, dtype=np.int32)
        probs = np.full((T, L, k), np.nan, dtype=np.float32) if self.has_probs else None
        col = {lid: i for i, lid in enumerate(layer_ids)}
        for t, key in enumerate(kept):
            for lid, (ids, pr) in self.rows[key].items():
                experts[t, col[lid], : len(ids)] = ids
                if probs is not None:
                    probs[t, col[lid], : len(pr)] = pr
        renumber = {old: new for new, old in enumerate(dict.fromkeys(s for s, _ in kept))}
        seq = np.array([renumber[s] for s, _ in kept], dtype=np.int32)
        step = np.array([tok for _, tok in kept], dtype=np.int32)
        E = num_experts if num_experts is not None else int(experts.max()) + 1
        full = {
            **meta,
            "num_experts": E,
            "top_k": k,
            "num_layers": L,
            "layer_ids": layer_ids,
            "sequence_ids": {str(new): seq_names[old] for old, new in renumber.items()},
            "validation": {"records": records, "tokens_dropped": len(dropped), "dropped_tokens": dropped[:1000],
                           "padded": self.k_min < k},
        }
        if num_experts is None:
            full["num_experts_inferred"] = True
        return Trace.from_arrays(experts, seq, probs=probs, meta=full, extras={"step": step}, source=src)
