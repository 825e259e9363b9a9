"""The safetensors header: an 8-byte little-endian length n, n bytes of JSON (tensor name -> dtype,
shape, data_offsets relative to the data section), then the raw tensor bytes. Read here only (the
file tier's expert index, the cost model's byte counts, convert's bf16 widening): the length
bounded by :data:`MAX_HEADER` and by the file, the JSON an object, every tensor's data_offsets
inside the file; anything else is one ConfigError line naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..errors import ConfigError

__all__ = ["MAX_HEADER", "DTYPE_BYTES", "read_header"]

MAX_HEADER = 100 * 2**20
"""A header larger than this is refused (real ones are a few MB at most)."""
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
"""Bytes per element of each safetensors dtype."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, start of the data section) of one safetensors file; ConfigError naming it if malformed."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise ConfigError(f"{path}: safetensors header length {n} is out of bounds (file has {size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ConfigError(f"{path}: safetensors header is not JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = info["data_offsets"]
            ok = isinstance(a, int) and isinstance(b, int) and 0 <= a <= b and data_start + b <= size
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"{path}: tensor {name[:60]!r}: data_offsets missing or outside the file")
    return header, data_start
