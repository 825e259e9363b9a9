"""Grid results on disk: a folder of Parquet parts, one row per finished cell (docs/grid.md).

Invariants:

* a part ``part-<hash>.parquet`` holds the rows of one finished task and is written atomically
  (:func:`expertcache._io.atomic_open`: temporary file, fsync, rename), so a killed run leaves
  whole parts only; temporaries of dead writers are removed when the store is opened;
* every part has the schema :data:`SCHEMA` (every :meth:`ReplayResult.to_dict` field, with
  ``per_layer`` as a JSON string, plus the cell's inputs and ``key``);
* a key is in at most one part: finished keys are skipped, and ``--force`` first rewrites the
  parts that hold keys of the grid without them;
* a part that cannot be read (truncated, not Parquet) is renamed to ``_<name>.corrupt`` (folder
  readers skip names starting with ``_``, globs on ``*.parquet`` miss it), with one warning line;
  its cells count as not done. A read-only store (``grid report``) skips it instead and changes
  nothing in the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import warnings
from pathlib import Path

from .._io import _TEMP, _alive, atomic_open
from ..errors import ConfigError

INSTALL = "pip install 'expertcache[grid]'"


def require_pyarrow():
    """The pyarrow modules, or a one-line ConfigError saying how to install them."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"grid: results are Parquet files and need pyarrow: {INSTALL}") from None
    return pa, pq


def schema():
    pa, _ = require_pyarrow()
    i, f, s = pa.int64(), pa.float64(), pa.string()
    return pa.schema([
        ("key", s), ("trace", s), ("trace_id", s), ("trace_name", s), ("version", s),
        ("budget", s), ("expert_mb", f),
        ("policy", s), ("needs_future", pa.bool_()), ("capacity", i), ("tokens", i), ("requests", i),
        ("copies_total", i), ("copies_steady", i), ("copies_fill", i), ("copies_per_token", f),
        ("iterations", i), ("copies_per_iteration", f), ("hit_rate", f), ("gap_recovered", f),
        ("budget_bytes", i), ("expert_bytes", i), ("budget_experts", i), ("budget_unused_experts", i),
        ("admission", s), ("pool", s), ("reset", s), ("warm", f), ("layers", pa.list_(i)),
        ("per_layer", s), ("engine", s), ("seconds", f),
    ])


class Store:
    """The results folder ``out`` (created when missing; its parent must exist)."""

    def __init__(self, out: str | os.PathLike, read_only: bool = False):
        """``read_only`` (``grid report``): the folder is only read: it must exist, and an unreadable
        part is skipped with a warning instead of renamed aside, and no temporary is cleaned."""
        require_pyarrow()
        self.out = Path(out)
        self.read_only = read_only
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out}: is a file, expected a folder for the results")
        if read_only:
            if not self.out.is_dir():
                raise ConfigError(f"{self.out}: no such results folder")
            return
        if not self.out.exists():
            parent = self.out.parent if str(self.out.parent) else Path(".")
            if not parent.is_dir():
                raise ConfigError(f"--out {self.out}: folder {parent} does not exist")
            self.out.mkdir()
        self._clean_temporaries()

    def parts(self) -> list[Path]:
        return sorted(self.out.glob("part-*.parquet"))

    def read_part(self, path: Path):
        """The part's table, or None (after renaming it aside with a warning) when unreadable."""
        _, pq = require_pyarrow()
        try:
            table = pq.read_table(path)
            if "key" not in table.column_names:
                raise ValueError("no key column")
            return table
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a torn file
            if self.read_only:
                warnings.warn(f"{path}: unreadable Parquet part ({type(exc).__name__}), skipped")
                return None
            aside = path.with_name(f"_{path.name}.corrupt")
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            warnings.warn(f"{path}: unreadable Parquet part ({type(exc).__name__}), moved to {aside.name}; "
                          "its cells are recomputed")
            return None

    def done_keys(self) -> dict[str, Path]:
        """Finished keys and the part holding each."""
        out = {}
        for path in self.parts():
            table = self.read_part(path)
            if table is not None:
                for k in table.column("key").to_pylist():
                    out[k] = path
        return out

    def drop(self, keys: set[str]) -> None:
        """Rewrite (atomically) every part holding some of ``keys`` without them (``--force``)."""
        pa, pq = require_pyarrow()
        import pyarrow.compute as pc

        for path in self.parts():
            table = self.read_part(path)
            if table is None:
                continue
            keep = pc.invert(pc.is_in(table.column("key"), value_set=pa.array(sorted(keys), pa.string())))
            if pc.all(keep).as_py():
                continue
            table = table.filter(keep)
            if table.num_rows == 0:
                os.unlink(path)
            else:
                self._write(path, table)

    def write(self, rows: list[dict]) -> Path:
        """Write one finished task's rows as a new part; returns its path."""
        pa, _ = require_pyarrow()
        keys = sorted(r["key"] for r in rows)
        path = self.out / f"part-{hashlib.sha256(''.join(keys).encode()).hexdigest()[:20]}.parquet"
        self._write(path, pa.Table.from_pylist(rows, schema=schema()))
        return path

    def read_rows(self) -> list[dict]:
        """Every row of every readable part, sorted by key."""
        rows = []
        for path in self.parts():
            table = self.read_part(path)
            if table is not None:
                rows.extend(table.to_pylist())
        return sorted(rows, key=lambda r: r["key"])

    def _write(self, path: Path, table) -> None:
        _, pq = require_pyarrow()
        with atomic_open(path, "wb", option="--out") as fh:
            pq.write_table(table, fh)

    def _clean_temporaries(self) -> None:
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.out):
                m = _TEMP.fullmatch(entry.name)
                if m and m.group("name").startswith("part-") and not _alive(int(m.group("pid"))):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def make_row(cell, result, trace_name: str) -> dict:
    """The stored row of one cell: its inputs and key, then every replay field."""
    rec = result.to_dict()
    row = {
        "key": cell.key, "trace": cell.trace.label, "trace_id": cell.trace.ident, "trace_name": trace_name,
        "version": _version(), "budget": cell.budget[0] if cell.budget else None, "expert_mb": cell.expert_mb,
        "budget_bytes": None, "expert_bytes": None, "budget_experts": None, "budget_unused_experts": None,
    }
    for k, v in rec.items():
        row[k] = json.dumps([{f: _finite(x) for f, x in c.items()} for c in v]) if k == "per_layer" else v
    if not set(row) <= set(schema().names):
        raise AssertionError(f"replay fields not in the grid schema: {sorted(set(row) - set(schema().names))}")
    return row


def _finite(x):
    """NaN and infinities as None (JSON has no NaN)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _version() -> str:
    from .cells import counts_version

    return counts_version()
