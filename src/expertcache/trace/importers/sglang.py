"""``sglang``: the per-token dump of SGLang's expert-distribution recorder.

With ``--expert-distribution-recorder-mode per_token``, each rank's recorder writes, on
``/dump_expert_distribution_record``, ``torch.save(dict(records=[...],
last_physical_to_logical_map=<int [layers, physical experts]>))`` to
``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_<time>_<rank>.pt``. One
record per forward pass holds ``forward_pass_id``, ``rank``, ``input_ids``, ``positions``,
``extend_seq_lens`` (a list in extend passes, None in decode), ``forward_mode`` and
``topk_ids_of_layer``: int32 ``[layers, tokens of the pass, 8]``, physical expert ids, -1 where a
layer has no routed experts (dense layers) or k < 8. docs/importers.md gives the source.

Invariants of the trace built: tokens in dump order (files by rank then time, passes in record
order, tokens in batch order); layers that hold no id anywhere are left out, the rest keep their
index as layer id; physical ids become logical ones through the dump's map; each row's ids keep
their order, -1 trailing; extras ``position``, ``forward_pass``, ``rank``, ``token_ids`` per
token, and ``step``: the position when sequences follow positions, else the token's index in its
file. A file is read with :mod:`.torchzip`, never unpickled.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import numpy as np

from ...errors import ConfigError, TraceError
from ..core import Trace
from .records import ZIP_MAGIC, display_name, open_regular
from .registry import Importer, Options, register
from .torchzip import read_torch_save
from .values import INT32_MAX, MAX_EXPERTS, check_num_experts, check_phase, is_int, short

SEQUENCE_MODES = ("auto", "positions", "stream")
_NAME = re.compile(r"expert_distribution_recorder_(\d+(?:\.\d+)?)_(\d+)\.pt")


def dump_files(path: str | os.PathLike) -> list[Path]:
    """The dump itself, or a folder's ``*.pt`` files ordered by rank, then time, then name."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    files = [f for f in p.iterdir() if f.suffix == ".pt" and f.is_file()]
    if not files:
        raise TraceError(f"{path}: a folder without .pt dump files")

    def order(f: Path):
        m = _NAME.fullmatch(f.name)
        return (0, int(m.group(2)), float(m.group(1)), f.name) if m else (1, 0, 0.0, f.name)

    return sorted(files, key=order)


def _kept_ids(parts: list[dict], src: str, drop_incomplete: bool, pad: bool):
    """The dumps' ids at the layers that recorded any, each row's ids first and -1 after, cut to the
    widest row: ``(ids [T, L, k], cols, empty, short_rows, where)``; ``empty`` marks tokens lacking
    some kept layer (an error unless ``drop_incomplete``), ``short_rows`` rows with fewer ids than
    ``k`` (an error unless ``pad``)."""
    ids = np.concatenate([p["ids"] for p in parts])
    cols = np.flatnonzero((ids >= 0).any(axis=(0, 2)))
    if cols.size == 0:
        raise TraceError(f"{src}: no expert ids recorded at any layer")
    ids = ids[:, cols]
    valid = ids >= 0
    ids = np.take_along_axis(ids, np.argsort(~valid, axis=2, kind="stable"), axis=2)  # ids first, -1 after
    counts = valid.sum(axis=2)
    where = _Where(parts, cols)
    empty = (counts == 0).any(axis=1)  # a token without ids at some kept layer lacks that layer
    if empty.any() and not drop_incomplete:
        t = int(np.flatnonzero(empty)[0])
        raise TraceError(f"{where(t, int(np.flatnonzero(counts[t] == 0)[0]))}: no expert id (--drop-incomplete drops such tokens)")
    if empty.all():
        raise TraceError(f"{src}: every token lacks some layer; nothing left to import")
    k = int(counts[~empty].max())
    short_rows = (counts < k) & ~empty[:, None]
    if short_rows.any() and not pad:
        t, c = (int(v) for v in np.argwhere(short_rows)[0])
        raise TraceError(f"{where(t, c)}: {int(counts[t, c])} expert ids where others have {k} (--pad pads shorter rows with -1)")
    return ids[:, :, :k], cols, empty, short_rows, where


def import_sglang(
    path: str | os.PathLike,
    *,
    num_experts: int | None = None,
    sequences: str = "auto",
    rank: int | None = None,
    pad: bool = False,
    drop_incomplete: bool = False,
    model: str | None = None,
    phase: str = "mixed",
) -> Trace:
    """Import a per-token SGLang dump (a ``.pt`` file, or a folder of them: one per rank and dump).

    ``sequences``: 'positions' starts a sequence wherever a token's position is not the previous
    token's + 1 (exact when every forward pass serves one request); 'stream' makes each file one
    sequence (what one rank's cache sees); 'auto' picks 'positions' when every pass serves one
    request, else 'stream'. ``rank`` keeps only that rank's records. A token with no id at some
    kept layer is an error unless ``drop_incomplete``; a row with fewer ids than k is an error
    unless ``pad``.
    """
    check_phase(phase)
    check_num_experts(num_experts)
    if sequences not in SEQUENCE_MODES:
        raise ConfigError(f"--sequences: {sequences!r} is not one of {', '.join(SEQUENCE_MODES)}")
    src = str(path)
    parts = [_read_dump(f, read_torch_save(f), rank) for f in dump_files(path)]
    parts = [p for p in parts if p["ids"].shape[0]]
    if not parts:
        raise TraceError(f"{src}: no tokens recorded" + (f" for rank {rank}" if rank is not None else ""))
    shapes = {p["ids"].shape[1:] for p in parts}
    if len(shapes) != 1:
        raise TraceError(f"{src}: the dump files disagree on [layers, 8] ({sorted(shapes)})")
    if sequences == "auto":
        sequences = "stream" if any(p["batched"] for p in parts) else "positions"

    ids, cols, empty, short_rows, where = _kept_ids(parts, src, drop_incomplete, pad)
    seq = np.concatenate([_sequences(p["position"], sequences) + i * (1 << 31) for i, p in enumerate(parts)])
    keep = ~empty
    dropped = [where.describe(int(t)) for t in np.flatnonzero(empty)[:1000]]
    ids, seq = ids[keep], seq[keep]
    seq = np.unique(seq, return_inverse=True)[1].astype(np.int32)
    extras = {name: np.concatenate([p[name] for p in parts])[keep] for name in ("position", "forward_pass", "rank", "token_ids")}
    if sequences == "positions":
        extras["step"] = extras["position"]  # increasing by one inside each sequence, by construction
    else:
        extras["step"] = np.concatenate([np.arange(p["ids"].shape[0], dtype=np.int64) for p in parts])[keep]

    maps = [p["map"] for p in parts if p["map"] is not None]
    if num_experts is not None:
        if ids.max() >= num_experts:
            raise TraceError(f"{src}: expert id {int(ids.max())} is outside [0, {num_experts}) (--num-experts {num_experts})")
        E = num_experts
    else:
        E = max(int(m.max()) for m in maps) + 1 if maps else int(ids.max()) + 1
    meta = {
        "name": display_name(path),
        "model": model or "unknown",
        "phase": phase,
        "num_experts": E,
        "layer_ids": [int(c) for c in cols],
        "source": {
            "format": "sglang", "path": src, "recorder_mode": "per_token",
            "files": [p["file"] for p in parts], "sequences": sequences,
            "expert_ids": "logical (through last_physical_to_logical_map)" if maps else "as recorded",
        },
        "validation": {"records": sum(p["records"] for p in parts), "tokens_dropped": int(empty.sum()),
                       "dropped_tokens": dropped, "padded": bool(short_rows.any())},
    }
    if num_experts is None and not maps:
        meta["num_experts_inferred"] = True
    return Trace.from_arrays(ids, seq, meta=meta, extras=extras, source=src)


class _Where:
    """Names token t (global index) and kept layer column c as file, record, pass, token, layer."""

    def __init__(self, parts: list[dict], cols: np.ndarray):
        self.parts, self.cols = parts, cols
        self.starts = np.cumsum([0] + [p["ids"].shape[0] for p in parts])

    def locate(self, t: int) -> tuple[dict, int]:
        i = int(np.searchsorted(self.starts, t, side="right")) - 1
        return self.parts[i], t - int(self.starts[i])

    def describe(self, t: int) -> dict:
        p, j = self.locate(t)
        return {"file": p["file"], "forward_pass_id": int(p["forward_pass"][j]), "token": int(p["token_in_pass"][j])}

    def __call__(self, t: int, c: int) -> str:
        p, j = self.locate(t)
        return (f"{p['file']}: records[{int(p['record'][j])}] (forward_pass_id {int(p['forward_pass'][j])}), "
                f"token {int(p['token_in_pass'][j])}, layer {int(self.cols[c])}")


def _sequences(positions: np.ndarray, mode: str) -> np.ndarray:
    """Sequence numbers (from 0) of one file's tokens."""
    if mode == "stream":
        return np.zeros(positions.size, dtype=np.int64)
    starts = np.r_[True, positions[1:] != positions[:-1] + 1]
    return np.cumsum(starts) - 1


def _read_dump(f: Path, obj: object, rank: int | None) -> dict:
    """Check one file's structure; return its tokens' arrays (physical ids mapped to logical)."""
    src = str(f)
    if isinstance(obj, dict) and "logical_count" in obj:
        raise TraceError(f"{src}: an SGLang 'stat' dump (expert counts per layer, no per-token ids); "
                         "record with --expert-distribution-recorder-mode per_token")
    if not isinstance(obj, dict) or not isinstance(obj.get("records"), list):
        raise TraceError(f"{src}: not an SGLang expert-distribution dump (expected a dict with a 'records' list)")
    pmap = obj.get("last_physical_to_logical_map")
    if pmap is not None:
        if not (isinstance(pmap, np.ndarray) and pmap.ndim == 2 and pmap.dtype.kind in "iu" and pmap.size):
            raise TraceError(f"{src}: last_physical_to_logical_map: expected an int [layers, physical experts] tensor")
        if pmap.min() < 0 or pmap.max() >= MAX_EXPERTS:
            raise TraceError(f"{src}: last_physical_to_logical_map: ids outside [0, {MAX_EXPERTS})")
    cols: dict[str, list] = {k: [] for k in ("ids", "position", "forward_pass", "rank", "token_ids", "record", "token_in_pass")}
    batched = False
    for i, rec in enumerate(obj["records"]):
        where = f"{src}: records[{i}]"
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: expected a dict, got {type(rec).__name__}")
        if "topk_ids_of_layer" not in rec:
            if "global_physical_count" in rec:
                raise TraceError(f"{where}: an SGLang 'per_pass' record (expert counts per pass, no per-token ids); "
                                 "record with --expert-distribution-recorder-mode per_token")
            raise TraceError(f"{where}: missing 'topk_ids_of_layer'")
        r = _int(rec, "rank", where)
        if rank is not None and r != rank:
            continue
        ids = rec["topk_ids_of_layer"]
        if not (isinstance(ids, np.ndarray) and ids.ndim == 3 and ids.dtype.kind in "iu"):
            raise TraceError(f"{where}: topk_ids_of_layer: expected an int [layers, tokens, k] tensor, got {short(getattr(ids, 'shape', ids))}")
        if cols["ids"] and (ids.shape[0], ids.shape[2]) != cols["ids"][0].shape[1:]:
            raise TraceError(f"{where}: topk_ids_of_layer is {list(ids.shape)}; earlier records have "
                             f"{cols['ids'][0].shape[1]} layers and {cols['ids'][0].shape[2]} slots")
        n = ids.shape[1]
        if ids.shape[2] == 0 or ids.shape[0] == 0:
            raise TraceError(f"{where}: topk_ids_of_layer is {list(ids.shape)}: no layers or no expert slots")
        positions = _int_list(rec, "positions", n, where)
        token_ids = _int_list(rec, "input_ids", n, where)
        extend = rec.get("extend_seq_lens")
        if extend is not None:
            lens = _int_list(rec, "extend_seq_lens", None, where)
            if int(lens.sum()) != n:
                raise TraceError(f"{where}: extend_seq_lens sum to {int(lens.sum())}, not the pass's {n} tokens")
            batched |= lens.size > 1
        else:
            batched |= n > 1
        fp = _int(rec, "forward_pass_id", where)
        ids = ids.astype(np.int64)
        if ids.min(initial=0) < -1:
            raise TraceError(f"{where}: topk_ids_of_layer: id {int(ids.min())} (only -1 marks an empty slot)")
        if pmap is not None and n:
            if ids.shape[0] != pmap.shape[0]:
                raise TraceError(f"{where}: topk_ids_of_layer has {ids.shape[0]} layers, the map {pmap.shape[0]}")
            if ids.max() >= pmap.shape[1]:
                raise TraceError(f"{where}: topk_ids_of_layer: id {int(ids.max())} is outside the map's {pmap.shape[1]} physical experts")
            ids = np.where(ids >= 0, pmap[np.arange(ids.shape[0])[:, None, None], ids.clip(0)], -1)
        elif ids.max(initial=-1) >= MAX_EXPERTS:
            raise TraceError(f"{where}: topk_ids_of_layer: id {int(ids.max())} is outside [0, {MAX_EXPERTS})")
        cols["ids"].append(ids.transpose(1, 0, 2).astype(np.int32))
        cols["position"].append(positions)
        cols["token_ids"].append(token_ids)
        for name, value in (("forward_pass", fp), ("rank", r), ("record", i)):
            cols[name].append(np.full(n, value, dtype=np.int64))
        cols["token_in_pass"].append(np.arange(n, dtype=np.int64))
    if not cols["ids"]:
        layers = pmap.shape[0] if pmap is not None else 0
        return {"ids": np.zeros((0, layers, 0), np.int32), "file": src}
    out = {name: np.concatenate(v) for name, v in cols.items()}
    out["position"] = out["position"].astype(np.int32)
    out["token_ids"] = out["token_ids"].astype(np.int32)
    out["rank"] = out["rank"].astype(np.int32)
    out.update(file=src, map=pmap, batched=batched, records=len(obj["records"]))
    return out


def _int(rec: dict, key: str, where: str) -> int:
    x = rec.get(key)
    if not is_int(x) or not 0 <= x <= (1 << 62):
        raise TraceError(f"{where}: {key}: expected a non-negative integer, got {short(x)}")
    return x


def _int_list(rec: dict, key: str, n: int | None, where: str) -> np.ndarray:
    x = rec.get(key)
    if not isinstance(x, list) or (n is not None and len(x) != n):
        want = f"a list of {n} integers (one per token)" if n is not None else "a list of integers"
        raise TraceError(f"{where}: {key}: expected {want}, got {short(x)}")
    if not all(type(v) is int for v in x):
        bad = next(v for v in x if type(v) is not int)
        raise TraceError(f"{where}: {key}: {short(bad)} is not an integer")
    if x and (min(x) < 0 or max(x) > INT32_MAX):
        raise TraceError(f"{where}: {key}: value outside [0, 2^31)")
    return np.asarray(x, dtype=np.int64)


def _holds_dump(path: str | os.PathLike, head: bytes) -> bool:
    """A folder, or a zip archive holding ``data.pkl`` (a ``torch.save`` file)."""
    if Path(path).is_dir():
        return True
    if not head.startswith(ZIP_MAGIC):
        return False
    with open_regular(path) as fh:
        try:
            names = zipfile.ZipFile(fh).namelist()
        except (zipfile.BadZipFile, OSError, ValueError):
            names = []
    return any(n == "data.pkl" or n.endswith("/data.pkl") for n in names)


def _read(path: str | os.PathLike, fmt: str, o: Options) -> Trace:
    return import_sglang(path, sequences=o.sequences, rank=o.rank, **o.common())


register(Importer("sglang", shape=lambda o: "a torch.save dump of SGLang's expert-distribution recorder in per_token "
                                            "mode, or a folder of them",
                  read=_read, phase="mixed", claims_path=_holds_dump))
