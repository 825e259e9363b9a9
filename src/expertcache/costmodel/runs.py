"""Measured runs, as ``expertcache eval --json`` writes them, read and checked for ``choose``.

A file holds JSON lines (one object per line; blank lines are skipped) or one JSON list of
objects (a single object is one run). Every record needs:

* ``policy``: the policy's name (a non-empty string, e.g. ``"lru"``, ``"dwell:16:128"``);
* ``c_ms``: compute milliseconds per token of that run (measured ms/token minus its copy time per
  token), finite, ``>= 0`` (a slowed run may carry a negative one, see below);
* ``rho``: steady copies per token, summed over the offloaded layers, finite, ``>= 0``;
* ``dnll``: NLL minus the all-resident reference NLL, nats, finite (may be negative).

Optional: ``tau_ms`` (measured ms of one copy; ``null``/NaN = the run made no copy), ``ms_per_token``
(measured; ``null``/NaN = unknown), ``ms_per_token_spread`` (``eval --repeats``: (max - min) / median
of the rounds' ms/token), ``slow_copies`` (an integer ``N >= 1``: every copy was repeated
N times; default 1), ``needs_future`` (bool; default: the registered policy's flag, false for names
not registered here), ``lossless`` (bool: the policy never restricts routing; eval writes it),
``capacity`` (int ``>= 1``), ``pool`` (string), ``layers`` (list of ints), ``num_experts`` (int
``>= 1``: the model's experts per layer, as eval writes it; runs of one file must agree on it, and
``choose --add-replay`` refuses a trace with another), ``host`` (where the
offloaded experts were read from: ``memory``, ``mmap`` or ``direct``, as eval writes it; absent =
``memory``). Any other field is ignored. Where a number is given it must be finite and ``>= 0``;
the times (``c_ms``, ``tau_ms``, ``ms_per_token``) at most an hour (3.6e6 ms), ``rho`` at most 1e9.

Runs of one ``(host, slow_copies)`` condition name each policy once: two records of the same
policy and condition are an error (average repeated runs, or keep one, before choosing). A slowed run
(``slow_copies > 1``) only ranks policies by its measured ``ms_per_token`` (``--validate``); its
``c_ms`` is not used and may be negative (the copy and step timings of a slowed run cover different
warm-up periods, so their difference can be).

Mistakes are one-line :class:`~expertcache.errors.ConfigError` naming the file, the line (JSON
lines) or the record number (JSON list, 1-based) and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._text import short
from ..errors import ConfigError, PolicyError, is_int, is_real
from .sizing import MAX_DURATION_MS

MAX_RHO = 1e9
"""Largest ``rho`` accepted (copies per token): a model has far fewer experts than this."""

MAX_RUNS_BYTES = 1 << 26
"""A runs file larger than this (64 MiB) is refused: eval writes a few kB per run."""

REQUIRED = ("policy", "c_ms", "rho", "dnll")
HOSTS = ("memory", "mmap", "direct")
"""The host modes of the live harness (``eval --host``; :mod:`expertcache.hf.host`)."""


MAX_SAMPLES = 10_000
"""Most timed samples or rounds a measurement takes (``calibrate --repeats``, ``size --calibrate``,
``eval --repeats`` and ``evaluate(repeats=)``: 10^30 rounds had run for ever)."""
MAX_SLOW_COPIES = 1000
"""Most times a live run repeats each copy (``slow_copies``: a link that many times slower): the
commands' ``--slow-copies`` and the Python ``offload``/``evaluate``/``calibrate`` (2^62 ran for ever)."""


def check_slow_copies(value) -> int:
    """``slow_copies`` of a live run: an integer in ``[1, MAX_SLOW_COPIES]``, else one ConfigError line
    (a Python caller's 10**30 had run for ever, and ``calibrate`` truncated 2.5 to 2)."""
    if not is_int(value, 1, MAX_SLOW_COPIES):
        raise ConfigError(f"slow_copies must be an integer in [1, {MAX_SLOW_COPIES:,}], got {short(value, 40)}")
    return int(value)


@dataclass(frozen=True)
class Run:
    """One measured (or replayed) run; see the module docstring for the fields."""

    policy: str
    c_ms: float
    rho: float
    dnll: float
    tau_ms: float | None = None
    ms_per_token: float | None = None
    slow_copies: int = 1
    needs_future: bool = False
    capacity: int | None = None
    pool: str | None = None
    layers: tuple[int, ...] | None = None
    lossless: bool | None = None
    replayed: bool = False
    where: str = ""
    ms_per_token_spread: float | None = None
    """``(max - min) / median`` of ``ms_per_token`` over the run's repeats (``eval --repeats``);
    ``None`` when it was timed once: its noise is then unknown."""
    host: str = "memory"
    """Where the offloaded experts were read from (``eval --host``): each host mode is its own
    condition, with its own measured copy time."""
    num_experts: int | None = None
    """The model's experts per layer (eval writes it); ``None`` when the record does not say."""


def read_runs(path: str | Path) -> list[Run]:
    """The runs in ``path`` (``"-"``: standard input); see the module docstring."""
    if str(path) == "-":
        import sys

        return parse_runs(sys.stdin.read(), "<stdin>")
    return parse_runs(_read_text(path), str(path))


def _read_text(path: str | Path) -> str:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: " + ("is a folder, expected a runs file" if file.is_dir() else "no such file"))
    if file.stat().st_size > MAX_RUNS_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_RUNS_BYTES:,} bytes; not a runs file")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def parse_runs(text: str, name: str = "<runs>") -> list[Run]:
    """Runs from the text of a runs file called ``name`` (used in messages)."""
    runs = [run_from_record(item, where) for item, where in parse_records(text, name)]
    check_unique(runs)
    return runs


def read_records(path: str | Path) -> list[tuple[Any, str]]:
    """The decoded records of a runs file (``"-"``: standard input), each with where it was."""
    if str(path) == "-":
        import sys

        return parse_records(sys.stdin.read(), "<stdin>")
    return parse_records(_read_text(path), str(path))


def parse_records(text: str, name: str = "<runs>") -> list[tuple[Any, str]]:
    """``[(record, where)]`` from the text of a runs file: JSON lines or one JSON list."""
    stripped = text.lstrip()
    if not stripped:
        raise ConfigError(f"{name}: no runs (expected JSON lines or a JSON list of objects)")
    if stripped[0] == "[":
        items = _loads(text, name)
        if not isinstance(items, list):  # pragma: no cover - a '[' starts a list or fails to parse
            raise ConfigError(f"{name}: expected a JSON list of objects")
        located = [(item, f"{name} record {i}") for i, item in enumerate(items, 1)]
    else:
        located = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                located.append((_loads(line, name, lineno), f"{name} line {lineno}"))
    if not located:
        raise ConfigError(f"{name}: no runs (the list is empty)")
    return located


def _loads(text: str, name: str, lineno: int | None = None) -> Any:
    at = f" line {lineno}" if lineno is not None else ""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        line = lineno if lineno is not None else exc.lineno
        raise ConfigError(f"{name} line {line}: not valid JSON ({exc.msg}, column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # giant integers, nesting deeper than Python parses
        raise ConfigError(f"{name}{at}: cannot be read as JSON ({type(exc).__name__})") from None


def run_from_record(rec: Any, where: str) -> Run:
    """A :class:`Run` from one decoded record, checked; ``where`` names it in messages."""
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [f for f in REQUIRED if f not in rec or rec[f] is None]
    if missing:
        raise ConfigError(f"{where}: missing field {missing[0]!r} (every run needs {', '.join(REQUIRED)})")
    policy = rec["policy"]
    if not isinstance(policy, str) or not policy.strip():
        raise ConfigError(f"{where}: field 'policy' must be a non-empty string, got {_short(policy)}")
    slow = rec.get("slow_copies", 1)
    if slow is None:
        slow = 1
    if not is_int(slow, 1):
        raise ConfigError(f"{where}: field 'slow_copies' must be an integer >= 1, got {_short(slow)}")
    c_ms = _number(rec, "c_ms", where, nonnegative=slow == 1, most=MAX_DURATION_MS)
    rho = _number(rec, "rho", where, most=MAX_RHO)
    dnll = _number(rec, "dnll", where, nonnegative=False)
    tau = _optional(rec, "tau_ms", where, most=MAX_DURATION_MS)
    ms = _optional(rec, "ms_per_token", where, most=MAX_DURATION_MS)
    future = rec.get("needs_future")
    if future is None:
        future = _registered_needs_future(policy.strip())
    elif not isinstance(future, bool):
        raise ConfigError(f"{where}: field 'needs_future' must be true or false, got {_short(future)}")
    lossless = rec.get("lossless")
    if lossless is not None and not isinstance(lossless, bool):
        raise ConfigError(f"{where}: field 'lossless' must be true or false, got {_short(lossless)}")
    capacity = rec.get("capacity")
    if capacity is not None and not is_int(capacity, 1):
        raise ConfigError(f"{where}: field 'capacity' must be a positive integer, got {_short(capacity)}")
    pool = rec.get("pool")
    if pool is not None and not isinstance(pool, str):
        raise ConfigError(f"{where}: field 'pool' must be a string, got {_short(pool)}")
    layers = rec.get("layers")
    if layers is not None:
        if not isinstance(layers, list) or not all(is_int(x, 0) for x in layers):
            raise ConfigError(f"{where}: field 'layers' must be a list of layer ids (integers >= 0)")
        layers = tuple(layers)
    experts = rec.get("num_experts")
    if experts is not None and not is_int(experts, 1):
        raise ConfigError(f"{where}: field 'num_experts' must be a positive integer, got {_short(experts)}")
    spread = _optional(rec, "ms_per_token_spread", where)
    host = rec.get("host")
    if host is None:
        host = "memory"
    if host not in HOSTS:
        raise ConfigError(f"{where}: field 'host' must be one of {', '.join(HOSTS)}, got {_short(host)}")
    return Run(policy.strip(), c_ms, rho, dnll, tau, ms, slow, future, capacity, pool, layers, lossless, where=where,
               ms_per_token_spread=spread, host=host, num_experts=experts)


def _number(rec: dict, field: str, where: str, *, nonnegative: bool = True, most: float | None = None) -> float:
    value = rec[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: field {field!r} must be a number, got {_short(value)}")
    if not is_real(value):  # NaN, an infinity, or an integer beyond any float
        raise ConfigError(f"{where}: field {field!r} must be a finite number, got {_short(value)}")
    x = float(value)
    if nonnegative and x < 0:
        raise ConfigError(f"{where}: field {field!r} must be >= 0, got {_short(value)}")
    if most is not None and abs(x) > most:
        what = "an hour in ms" if most == MAX_DURATION_MS else f"{most:g}"
        raise ConfigError(f"{where}: field {field!r} is above {what} ({_short(value)}), not a plausible measurement")
    return x


def _optional(rec: dict, field: str, where: str, *, most: float | None = None) -> float | None:
    """An optional measured number: ``None`` when absent, ``null`` or NaN; else finite and >= 0."""
    value = rec.get(field)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return _number(rec, field, where, most=most)


def _registered_needs_future(spec: str) -> bool:
    from ..policies import make_policy

    try:
        return bool(make_policy(spec).needs_future)
    except PolicyError:  # a rule of the live harness only (dwell, static, ...): causal
        return False


def check_unique(runs: list[Run]) -> None:
    """Each policy at most once per ``(host, slow_copies)`` condition, else a one-line error naming
    both runs; the runs that record ``num_experts`` record one (runs of one model)."""
    counted = [r for r in runs if r.num_experts is not None]
    other = next((r for r in counted if r.num_experts != counted[0].num_experts), None)
    if other is not None:
        raise ConfigError(f"{other.where}: num_experts {other.num_experts}, where {counted[0].where} has "
                          f"{counted[0].num_experts}: the runs are of different models; choose among one model's runs")
    seen: dict[tuple[str, int, str], Run] = {}
    for run in runs:
        key = (run.policy, run.slow_copies, run.host)
        if key in seen:
            factor = "" if run.slow_copies == 1 else f" at slow_copies {run.slow_copies}"
            host = "" if run.host == "memory" else f" on host {run.host}"
            raise ConfigError(f"{run.where}: policy {run.policy!r}{factor}{host} again (first in {seen[key].where}); "
                              "give one run per policy and condition (average repeated runs first)")
        seen[key] = run


def base_host(runs, host: str | None = None) -> str:
    """The host mode whose ``slow_copies == 1`` runs are chosen among: ``host`` when given (it must
    have such runs), else ``memory`` when any run is there, else the one host the runs use."""
    hosts = sorted({r.host for r in runs if r.slow_copies == 1})
    if host is not None:
        if host not in hosts:
            raise ConfigError(f"--host {host}: no slow_copies 1 runs there (the runs have: {', '.join(hosts) or 'none'})")
        return host
    if "memory" in hosts or not hosts:
        return "memory"
    if len(hosts) == 1:
        return hosts[0]
    raise ConfigError(f"the runs use host modes {', '.join(hosts)} and none is 'memory': give --host to choose at one")


def _short(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"a JSON {'list' if isinstance(value, list) else 'object'}"
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------- replay and sweep records
def is_replay_record(rec: Any) -> bool:
    """A ``replay`` / ``sweep`` JSON record (``copies_per_token``, no ``rho``): a lossless rule's
    counts, no timing or quality; a sweep's ``"record": "target"`` lines are not runs at all."""
    return isinstance(rec, dict) and "copies_per_token" in rec and "rho" not in rec and "dnll" not in rec


def replay_rows(records: list[tuple[dict, str]], *, c_ms: float, capacity: int | None, name: str) -> list[Run]:
    """Runs from replay/sweep records: ``rho = copies_per_token``, ``c = c_ms`` (every lossless rule
    computes what the all-resident model computes), ``dnll = 0``, ``lossless``; at ``capacity``
    (default: the one capacity the records hold; several need it named)."""
    rows = [(rec, where) for rec, where in records if rec.get("record") != "target"]
    caps = sorted({rec.get("capacity") for rec, _ in rows if isinstance(rec.get("capacity"), int)})
    if capacity is None:
        if len(caps) != 1:
            shown = ", ".join(map(str, caps[:6])) + (", ..." if len(caps) > 6 else "")
            raise ConfigError(f"{name}: the replay/sweep records hold capacities {shown}; choose at one with --capacity C")
        capacity = caps[0]
    elif capacity not in caps:
        raise ConfigError(f"{name}: no replay/sweep record at capacity {capacity} (they hold {', '.join(map(str, caps[:6]))})")
    out = []
    for rec, where in rows:
        if rec.get("capacity") != capacity:
            continue
        fields = {"policy": rec.get("policy"), "c_ms": c_ms, "rho": rec.get("copies_per_token"), "dnll": 0.0,
                  "needs_future": rec.get("needs_future"), "lossless": True, "capacity": capacity,
                  "pool": rec.get("pool"), "layers": rec.get("layers")}
        if fields["rho"] is None:
            raise ConfigError(f"{where}: copies_per_token is null (the replay scored no tokens)")
        run = run_from_record(fields, where)
        out.append(Run(**{**run.__dict__, "replayed": True}))
    check_unique(out)
    return out
