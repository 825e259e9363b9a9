"""Byte sizes as users write them: ``12GB``, ``17.5MB``, ``1GiB``, ``4096`` (bytes).

Decimal units follow the cost model (:mod:`expertcache.costmodel.sizing`): 1 kB = 1e3, 1 MB = 1e6,
1 GB = 1e9, 1 TB = 1e12 bytes; binary units (KiB, MiB, GiB, TiB) are powers of 1024; a bare number
is bytes. Fractions round to the nearest byte. Ranges for sweeps: ``0.5GB:16GB:x2`` (geometric,
each step doubles, stop included when reached), ``1GB:4GB:+1GB`` (arithmetic) or ``0.5GB,1GB,2GB``.
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
MAX_BYTES = 2**62
"""Largest size accepted (4.6 EB): beyond it no count derived from it fits an index."""
MAX_STEPS = 10_000
"""Most values one range may expand to."""

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]{0,3})\s*")


def parse_bytes(text: str, what: str) -> int:
    """``text`` as a positive number of bytes, or a one-line ConfigError naming ``what`` (the option)."""
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS:
        raise ConfigError(f"{what}: cannot read {str(text)[:40]!r} as a size (e.g. 12GB, 17.5MB, 1GiB or bytes)")
    value = float(m.group(1)) * UNITS[unit]
    if not unit and math.isfinite(value) and not value.is_integer():
        raise ConfigError(f"{what}: {text!r} has no unit and is not a whole number of bytes (e.g. {text}GB)")
    if value < 1:  # the regex admits no sign and no NaN: what is not finite here is too large (1e400)
        raise ConfigError(f"{what}: {text!r} is below one byte")
    if not value <= MAX_BYTES:
        raise ConfigError(f"{what}: {text!r} is above 2**62 bytes")
    return int(round(value))


def parse_byte_range(text: str, what: str) -> list[int]:
    """Sizes for a sweep, ascending and distinct: ``LO:HI:xF`` (times F, F > 1), ``LO:HI:+STEP`` or a
    comma list. ``LO:HI`` alone means ``LO:HI:x2``."""
    text = str(text).strip()
    if ":" not in text:
        out = [parse_bytes(part, what) for part in text.split(",") if part.strip()]
        if not out:
            raise ConfigError(f"{what}: no size in {text!r}")
        return sorted(set(out))
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ConfigError(f"{what}: expected LO:HI, LO:HI:xFACTOR or LO:HI:+STEP, got {text[:60]!r}")
    lo, hi = parse_bytes(parts[0], what), parse_bytes(parts[1], what)
    step = parts[2].strip() if len(parts) == 3 else "x2"
    if hi < lo:
        raise ConfigError(f"{what}: {text!r} runs backwards")
    out: list[int] = []
    if step[:1] in ("x", "*"):
        try:
            factor = float(step[1:])
        except ValueError:
            raise ConfigError(f"{what}: cannot read the factor in {step!r} (e.g. x2)") from None
        if not math.isfinite(factor) or factor <= 1:
            raise ConfigError(f"{what}: the factor in {step!r} must be above 1")
        value = float(lo)
        while value <= hi * (1 + 1e-12) and len(out) <= MAX_STEPS:
            out.append(int(round(value)))
            value *= factor
    elif step[:1] == "+":
        inc = parse_bytes(step[1:], what)
        if (hi - lo) // inc > MAX_STEPS:
            raise ConfigError(f"{what}: {text!r} expands to more than {MAX_STEPS:,} sizes")
        out = list(range(lo, hi + 1, inc))
    else:
        raise ConfigError(f"{what}: the step {step!r} must be xFACTOR or +SIZE")
    if len(out) > MAX_STEPS:
        raise ConfigError(f"{what}: {text!r} expands to more than {MAX_STEPS:,} sizes")
    return sorted(set(out))


def format_bytes(n: float) -> str:
    """``12000000000`` -> ``'12 GB'`` (decimal units, 4 significant digits)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"
