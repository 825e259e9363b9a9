"""The scorer file: a small ``.npz`` (no pickle) read back by ``learned:PATH``.

Fields: ``format_version`` (int, :data:`FORMAT_VERSION`), ``kind`` (``linear`` or ``mlp``),
``features`` (feature names, :data:`expertcache.scorer.features.FEATURES`), ``mean`` and ``scale``
(the normalisation, one value per feature), ``w0``.. (the weights, shapes as in
:class:`~expertcache.scorer.models.Scorer`) and ``meta`` (a JSON string: how it was trained).
Version 2 adds the model-side routing tables (``sig_*`` fields, :mod:`.signals`) a scorer of the
token / next / hidden / ahead features replays with; version 3 the prior group's transitions
(``sig_trans``, :mod:`.prior`). Files of versions 1 (no tables) and 2 still load.
Loading validates every field; any problem is one :class:`~expertcache.errors.ConfigError` line
naming the file and the field. Each array is size-checked before it is read (bounded memory).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from .._io import numpy_reason, open_npz, write_npz
from ..errors import ConfigError
from .features import FEATURES, PRIOR, TABLED
from .models import KINDS, Scorer
from .signals import FoldedTables, tables_from_arrays, tables_to_arrays

FORMAT_VERSION = 3
READS = (1, 2, 3)
MAX_FIELD_BYTES = 16 << 20
N_WEIGHTS = {"linear": 1, "mlp": 3}


def save_scorer(scorer: Scorer, path, option: str = "--out") -> Path:
    tables = getattr(scorer, "tables", None)
    tables = tables.full if isinstance(tables, FoldedTables) else tables
    need = sorted(set(scorer.features) & set(TABLED))
    if tables is None and need:
        raise ConfigError(f"{option} {path}: the scorer's feature {need[0]!r} reads fitted tables, and it carries no tables")
    arrays = {
        "format_version": np.array(FORMAT_VERSION if tables is not None else 1, dtype=np.int64),
        "kind": np.array(scorer.kind),
        "features": np.array(list(scorer.features), dtype=str),
        "mean": np.asarray(scorer.mean, dtype=np.float64),
        "scale": np.asarray(scorer.scale, dtype=np.float64),
        "meta": np.array(json.dumps(scorer.meta, sort_keys=True)),
    }
    for i, w in enumerate(scorer.weights):
        arrays[f"w{i}"] = np.asarray(w, dtype=np.float64)
    if tables is not None:
        arrays.update(tables_to_arrays(tables))
    return write_npz(path, arrays, option=option)


def load_scorer(path) -> Scorer:
    """Read and validate a scorer file (ConfigError naming the file and field on any problem)."""
    p = Path(path)
    with open_npz(p, "scorer", "a scorer file") as npz:
        def field(name: str, **kw) -> np.ndarray:
            if name not in npz.files:
                raise ConfigError(f"scorer {p}: field {name!r} is missing")
            try:
                info = npz.zip.getinfo(f"{name}.npy")
                if info.file_size > MAX_FIELD_BYTES:
                    raise ConfigError(f"scorer {p}: field {name!r} is {info.file_size} bytes (a scorer is small)")
                return npz[name]
            except ConfigError:
                raise
            except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as err:
                raise ConfigError(f"scorer {p}: field {name!r} cannot be read ({numpy_reason(err)})") from None

        version = field("format_version")
        if version.shape != () or version.dtype.kind not in "iu":
            raise ConfigError(f"scorer {p}: field 'format_version' is not an integer")
        if int(version) not in READS:
            raise ConfigError(f"scorer {p}: field 'format_version' is {int(version)}; this expertcache reads "
                              f"versions {', '.join(map(str, READS))}")
        kind = str(_text(field("kind"), p, "kind"))
        if kind not in KINDS:
            raise ConfigError(f"scorer {p}: field 'kind' is {kind!r}, expected one of {', '.join(KINDS)}")
        feats = field("features")
        if feats.ndim != 1 or feats.dtype.kind != "U" or feats.size == 0:
            raise ConfigError(f"scorer {p}: field 'features' must be a non-empty list of names")
        for name in feats:
            if str(name) not in FEATURES:
                raise ConfigError(f"scorer {p}: field 'features' names unknown feature {str(name)[:40]!r}")
        F = feats.size
        mean, scale = _floats(field("mean"), p, "mean", (F,)), _floats(field("scale"), p, "scale", (F,))
        if np.any(scale <= 0):
            raise ConfigError(f"scorer {p}: field 'scale' must be positive")
        if kind == "linear":
            weights = [_floats(field("w0"), p, "w0", (F,))]
        else:
            W1 = _floats(field("w0"), p, "w0", None)
            if W1.ndim != 2 or W1.shape[0] != F:
                raise ConfigError(f"scorer {p}: field 'w0' has shape {W1.shape}, expected ({F}, hidden)")
            H = W1.shape[1]
            weights = [W1, _floats(field("w1"), p, "w1", (H,)), _floats(field("w2"), p, "w2", (H,))]
        try:
            meta = json.loads(str(_text(field("meta"), p, "meta")))
        except (json.JSONDecodeError, RecursionError):
            raise ConfigError(f"scorer {p}: field 'meta' is not JSON (or nests deeper than a reader follows)") from None
        if not isinstance(meta, dict):
            raise ConfigError(f"scorer {p}: field 'meta' is not a JSON object")
        tables = None
        names = set(str(f) for f in feats)
        if names & set(TABLED):
            if int(version) < 2:
                raise ConfigError(f"scorer {p}: version 1 cannot hold the routing tables its features need")
            tables = tables_from_arrays(field, f"scorer {p}", npz.files)
            if names & set(PRIOR) and tables.trans is None:
                raise ConfigError(f"scorer {p}: field 'sig_trans' is missing (its prior features need the transitions)")
    sc = Scorer(kind=kind, features=tuple(str(f) for f in feats), mean=mean, scale=scale, weights=weights,
                meta=meta)
    sc.tables = tables
    return sc


def _text(a: np.ndarray, p: Path, name: str) -> str:
    if a.shape != () or a.dtype.kind != "U":
        raise ConfigError(f"scorer {p}: field {name!r} is not a string")
    return str(a)


def _floats(a: np.ndarray, p: Path, name: str, shape) -> np.ndarray:
    if a.dtype.kind not in "fiu":
        raise ConfigError(f"scorer {p}: field {name!r} is not numeric")
    if shape is not None and a.shape != shape:
        raise ConfigError(f"scorer {p}: field {name!r} has shape {a.shape}, expected {shape}")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ConfigError(f"scorer {p}: field {name!r} holds a non-finite value")
    return a
