"""The grid spec: a TOML file naming traces, policies, capacities or byte budgets, pools, warm
fractions, layers and resets (docs/grid.md).

Invariants: :func:`load_spec` either returns a fully checked :class:`GridSpec` or raises ONE
:class:`~expertcache.errors.ConfigError` line naming the file and the key; every list is
non-empty, free of duplicates and in the order written; trace paths are resolved against the
spec file's folder and globs are expanded (sorted), each to at least one file.
"""

from __future__ import annotations

import glob
import json
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._units import parse_bytes
from ..errors import ConfigError, ExpertcacheError, is_int, is_real
from ..policies import make_policy
from ..sim.options import POOLS, RESETS
from ..trace import parse_layers
from ..trace.chunked import MANIFEST, file_sha256, is_chunked, open_chunked
from ..trace.npz import resolve_trace_path
from ..trace.synth import PRESETS

KEYS = ("traces", "synth", "policies", "capacities", "budgets", "expert_mb", "pools", "warm", "layers", "reset")
SYNTH_KEYS = ("preset", "seed")
MAX_CELLS = 1_000_000
"""Most cells one spec may expand to."""


@dataclass(frozen=True)
class TraceSource:
    """One trace of the grid: a file (``path``, with the SHA-256 of its bytes) or a synthetic
    preset (``preset``, ``seed`` and parameter ``overrides``). ``ident`` is what cell keys hash."""

    label: str
    path: str | None = None
    checksum: str | None = None
    preset: str | None = None
    seed: int = 0
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def ident(self) -> str:
        if self.path is not None:
            return f"sha256:{self.checksum}"
        params = PRESETS[self.preset].params.with_overrides(**dict(self.overrides))
        return "synth:" + json.dumps({"preset": self.preset, "seed": self.seed, "params": asdict(params)},
                                     sort_keys=True)

    def load(self):
        """The trace (read from the file, or generated)."""
        if self.path is not None:
            from ..trace import load_trace

            return open_chunked(self.path) if is_chunked(self.path) else load_trace(self.path)
        from ..trace.synth import synthesize

        params = PRESETS[self.preset].params.with_overrides(**dict(self.overrides))
        return synthesize(params, self.seed, preset=self.preset)


@dataclass(frozen=True)
class GridSpec:
    """A checked grid. Exactly one of ``capacities`` and ``budgets`` (bytes) is non-empty."""

    path: str
    traces: tuple[TraceSource, ...]
    policies: tuple[str, ...]
    capacities: tuple[int, ...]
    budgets: tuple[tuple[str, int], ...]
    """(text as written, bytes)."""
    expert_mb: float | None
    pools: tuple[str, ...]
    warm: tuple[float, ...]
    layers: tuple[int, ...] | None
    resets: tuple[str, ...]


def load_spec(path: str | Path) -> GridSpec:
    """Read and check a grid spec (see the module docstring)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, expected a grid spec (.toml)") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses per nested array or table
        raise ConfigError(f"{path}: not valid TOML here: nested too deeply") from None
    except ValueError as exc:  # an integer beyond Python's 4,300-digit conversion limit
        raise ConfigError(f"{path}: not valid TOML here: {str(exc)[:120]}") from None
    return parse_spec(doc, str(path), base=path.parent)


def parse_spec(doc: dict, where: str, base: Path = Path(".")) -> GridSpec:
    """Check a parsed TOML document; ``where`` names the file in errors, ``base`` resolves paths."""
    unknown = [k for k in doc if k not in KEYS]
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]}: unknown key (known: {', '.join(KEYS)})")
    traces = [*_file_traces(doc.get("traces"), where, base), *_synth_traces(doc.get("synth"), where)]
    if not traces:
        raise ConfigError(f"{where}: traces: no trace given (set traces = [paths or globs] or synth = [...])")
    traces = list({t.ident: t for t in traces}.values())
    policies = _strings(doc, "policies", where, ["lru", "belady"])
    try:
        policies = [make_policy(p).spec for p in policies]
    except ExpertcacheError as err:
        raise ConfigError(f"{where}: policies: {err}") from None
    _distinct(policies, "policies", where)
    has_c, has_b = "capacities" in doc, "budgets" in doc
    if has_c == has_b:
        raise ConfigError(f"{where}: capacities: give exactly one of capacities (experts) and budgets (bytes)")
    capacities, budgets = (), ()
    if has_c:
        capacities = tuple(_list(doc, "capacities", where, lambda v: _int(v, "capacities", where, lo=1)))
    else:
        budgets = tuple((str(v), parse_bytes(v, f"{where}: budgets")) if isinstance(v, (str, int)) and
                        not isinstance(v, bool) else _bad(where, "budgets", v, "a size such as '1GB'")
                        for v in _raw_list(doc, "budgets", where))
        _distinct([b for _, b in budgets], "budgets", where)
    expert_mb = doc.get("expert_mb")
    if expert_mb is not None:
        if not is_real(expert_mb) or expert_mb <= 0:
            raise ConfigError(f"{where}: expert_mb: expected a positive number of MB, got {expert_mb!r}")
        if not budgets:
            raise ConfigError(f"{where}: expert_mb: only budgets read it; capacities are in experts")
        expert_mb = float(expert_mb)
    pools = _strings(doc, "pools", where, ["layer"], choices=POOLS)
    resets = _strings(doc, "reset", where, ["sequence"], choices=RESETS)
    warm = _list(doc, "warm", where, lambda v: _fraction(v, where), default=[0.0])
    layers = doc.get("layers")
    if layers is not None:
        try:
            if isinstance(layers, str):
                layers = parse_layers(layers)
            elif isinstance(layers, list) and all(is_int(x, 0) for x in layers) and layers:
                layers = list(layers)
            else:
                raise ConfigError(f"expected '4-8', '0,2,4' or a list of layer ids, got {layers!r}")
        except ConfigError as err:
            raise ConfigError(f"{where}: layers: {str(err).removeprefix('--layers: ')}") from None
        layers = tuple(layers) if layers is not None else None
    n = len(traces) * len(policies) * max(len(capacities), len(budgets)) * len(pools) * len(warm) * len(resets)
    if n > MAX_CELLS:
        raise ConfigError(f"{where}: the grid has {n:,} cells, more than {MAX_CELLS:,}")
    return GridSpec(where, tuple(traces), tuple(policies), capacities, budgets, expert_mb, tuple(pools),
                    tuple(warm), layers, tuple(resets))


# ------------------------------------------------------------------------------------ traces
def _file_traces(value, where: str, base: Path) -> list[TraceSource]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: traces: expected a list of paths or globs, got {value!r:.80}")
    out = []
    for pattern in value:
        full = pattern if Path(pattern).is_absolute() else str(base / pattern)
        matches = sorted(glob.glob(full)) if glob.has_magic(pattern) else [full]
        if not matches:
            raise ConfigError(f"{where}: traces: {pattern!r} matches no file")
        for m in matches:
            if is_chunked(m):  # a chunked trace: identified by its manifest (names, sizes, sequence ranges)
                out.append(TraceSource(label=m, path=m, checksum=file_sha256(Path(m) / MANIFEST)))
                continue
            try:
                file = resolve_trace_path(m)
            except ExpertcacheError as err:
                raise ConfigError(f"{where}: traces: {err}") from None
            if not Path(file).is_file():
                raise ConfigError(f"{where}: traces: {m}: no such file")
            out.append(TraceSource(label=m, path=m, checksum=file_sha256(file)))
    return out


def _synth_traces(value, where: str) -> list[TraceSource]:
    if value is None:
        return []
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where}: synth: expected a list of tables such as {{preset = \"olmoe\", seed = 0}}")
    out = []
    for i, entry in enumerate(value):
        at = f"{where}: synth[{i}]"
        preset = entry.get("preset")
        if not isinstance(preset, str) or preset not in PRESETS:  # a list or table: unhashable, had been exit 70
            raise ConfigError(f"{at}: preset: {preset!r} is not one of {', '.join(PRESETS)}")
        seed = _int(entry.get("seed", 0), "seed", at, lo=0)
        overrides = {k: v for k, v in entry.items() if k not in SYNTH_KEYS}
        try:
            PRESETS[preset].params.with_overrides(**overrides)
        except (ConfigError, TypeError) as err:
            raise ConfigError(f"{at}: {err}") from None
        label = ":".join([f"synth:{preset}", f"seed={seed}", *(f"{k}={v}" for k, v in sorted(overrides.items()))])
        out.append(TraceSource(label=label, preset=preset, seed=seed, overrides=tuple(sorted(overrides.items()))))
    return out


# ------------------------------------------------------------------------------------ values
def _raw_list(doc, key, where):
    value = doc[key]
    value = value if isinstance(value, list) else [value]
    if not value:
        raise ConfigError(f"{where}: {key}: empty list")
    return value


def _list(doc, key, where, convert, default=None):
    if key not in doc:
        return list(default)
    out = [convert(v) for v in _raw_list(doc, key, where)]
    _distinct(out, key, where)
    return out


def _strings(doc, key, where, default, choices=None):
    def check(v):
        if not isinstance(v, str) or not v.strip():
            _bad(where, key, v, "a string")
        if choices is not None and v not in choices:
            raise ConfigError(f"{where}: {key}: {v!r} is not one of {', '.join(choices)}")
        return v.strip()

    return _list(doc, key, where, check, default)


def _distinct(values, key, where):
    seen = set()
    for v in values:
        if v in seen:
            raise ConfigError(f"{where}: {key}: {v!r} is listed twice")
        seen.add(v)


def _int(v, key, where, lo=0):
    if not is_int(v, lo, 2**62):
        _bad(where, key, v, f"an integer >= {lo}")
    return v


def _fraction(v, where):
    if not is_real(v) or not 0.0 <= v < 1.0:
        _bad(where, "warm", v, "a fraction in [0, 1)")
    return float(v)


def _bad(where, key, v, what):
    raise ConfigError(f"{where}: {key}: expected {what}, got {v!r:.60}")
