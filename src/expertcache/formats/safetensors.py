"""The safetensors header: an 8-byte little-endian length n, n bytes of JSON (tensor name -> dtype,
shape, data_offsets relative to the data section), then the raw tensor bytes. Read here only (the
file tier's expert index, the cost model's byte counts, convert's bf16 widening, the HF harness's
checks): the length bounded by :data:`MAX_HEADER` and by the file, the JSON an object, and every
tensor entry checked as the reference library checks it (a dtype it names, a shape of
non-negative integers, data_offsets spanning the shape's bytes, the tensors tiling the data section
without gaps or overlaps to the file's end, ``__metadata__`` a table of strings); anything else is
one ConfigError line naming the file."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from .._io import read_json, regular_size
from ..errors import ConfigError

__all__ = ["INDEX", "MAX_HEADER", "DTYPE_BITS", "DTYPE_BYTES", "checkpoint_files", "held_twice", "read_header",
           "read_headers"]

MAX_HEADER = 100 * 2**20
"""A header larger than this is refused (real ones are a few MB at most)."""
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
"""Bits per element of each dtype the safetensors format names (the reference library's list, 0.8)."""
DTYPE_BYTES = {k: v // 8 for k, v in DTYPE_BITS.items() if v % 8 == 0}
"""Bytes per element of each whole-byte dtype."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, start of the data section) of one safetensors file; ConfigError naming it if malformed."""
    path = Path(path)
    size = regular_size(path, str(path))
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or type(exc).__name__}") from None
    with fh:
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
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ConfigError(f"{path}: safetensors __metadata__ is not a table of strings")
    spans = sorted((_span(path, name, info, data_start, size), name) for name, info in header.items()
                   if name != "__metadata__")
    end = 0
    for (a, b), name in spans:
        if a != end:
            raise ConfigError(f"{path}: tensor {name[:60]!r}: data_offsets [{a}, {b}] "
                              + ("overlap the tensor before" if a < end else f"leave a gap after byte {end}"))
        end = b
    if data_start + end != size:
        raise ConfigError(f"{path}: the tensors end at byte {data_start + end:,} of a {size:,}-byte file "
                          "(truncated, or bytes no tensor holds)")
    return header, data_start


def _span(path: Path, name: str, info, data_start: int, size: int) -> tuple[int, int]:
    """A tensor entry's ``data_offsets``, checked as the reference library checks them: a known
    dtype, a shape of non-negative integers, offsets inside the file whose length is the shape's
    elements times the dtype's width. Any other entry had reached a reader (tier write's dtype set,
    size's byte counts) as a TypeError (exit 70) or was counted as it stood (exit 0)."""
    where = f"{path}: tensor {name[:60]!r}"
    if not isinstance(info, dict):
        raise ConfigError(f"{where}: its entry is not a table")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ConfigError(f"{where}: dtype {str(dtype)[:20]!r} is not a safetensors dtype")
    if type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):  # type(): not a bool
        raise ConfigError(f"{where}: shape {str(shape)[:40]} is not a list of non-negative integers")
    if type(offsets) is not list or len(offsets) != 2:
        raise ConfigError(f"{where}: data_offsets missing or outside the file")
    a, b = offsets
    if type(a) is not int or type(b) is not int or not 0 <= a <= b or data_start + b > size:
        raise ConfigError(f"{where}: data_offsets missing or outside the file")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * (b - a):
        raise ConfigError(f"{where}: shape {shape} of {dtype} is {bits / 8:g} bytes, but its data_offsets span {b - a}")
    return a, b


def read_headers(files) -> list[tuple[Path, dict, int]]:
    """``(path, header, data start)`` of each of a checkpoint's safetensors ``files`` (:func:`read_header`),
    refusing a tensor name that two files hold: a stale shard beside a re-saved checkpoint (a
    ``model.safetensors`` left beside ``model-0000N-of-...``) had been counted twice, so an expert's
    bytes were doubled (``size``) and its slices listed twice (``tier write``), exit 0."""
    out, seen = [], {}
    for path in files:
        header, start = read_header(path)
        for name in header:
            if name != "__metadata__" and seen.setdefault(name, path) != path:
                raise held_twice(name, path, seen[name])
        out.append((Path(path), header, start))
    return out


def held_twice(name: str, path, first) -> ConfigError:
    """The refusal of a tensor ``name`` that ``path`` holds after ``first`` did."""
    return ConfigError(f"{path}: tensor {name[:80]!r} is also in {Path(first).name}; a checkpoint holds each tensor "
                       f"once (a stale shard? remove it: with a {INDEX}, only the files it names are read)")


INDEX = "model.safetensors.index.json"
"""The shard index a sharded checkpoint carries (``weight_map``: tensor name -> file name)."""
MAX_INDEX = 64 * 2**20
"""A shard index larger than this is refused (DeepSeek-V3's 163 shards: about 9 MB)."""


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, as transformers loads them: the files its
    ``model.safetensors.index.json`` names (``weight_map``'s values, each a file of this folder), or,
    without an index, every ``*.safetensors`` in it; sorted, ``[]`` when there are none. Every reader
    of a checkpoint's weights takes its files from here (convert, ``size``, the file tier, the HF
    harness's checks and hosts): a shard of another download left beside the index had been read
    too, and refused as holding the same tensors twice, where transformers loads the model. An index
    that is not a table of names, or names a file that is missing, outside the folder or not a
    safetensors file, is one ConfigError line."""
    folder = Path(folder)
    index = folder / INDEX
    if not index.exists():
        files = sorted(folder.glob("*.safetensors"))
        for path in files:  # a FIFO among them had hung every reader (safetensors' own open included)
            regular_size(path, f"model {folder}: {path.name}")
        return files
    where = f"model {folder}"
    table = read_json(index, where, max_bytes=MAX_INDEX)
    names = table.get("weight_map") if isinstance(table, dict) else None
    if not isinstance(names, dict) or not names or not all(isinstance(k, str) and isinstance(v, str)
                                                            for k, v in names.items()):
        raise ConfigError(f"{where}: {INDEX}'s weight_map is not a table of tensor name -> file name")
    files = []
    for name in sorted(set(names.values())):
        path = folder / name
        if Path(name).name != name or name in (".", "..") or not name.endswith(".safetensors"):
            raise ConfigError(f"{where}: {INDEX} names {name[:80]!r}, not a .safetensors file of this folder")
        if not path.exists():
            raise ConfigError(f"{where}: {INDEX} names {name[:80]}, which is not in the folder")
        regular_size(path, f"{where}: {name[:80]}")
        files.append(path)
    return files


def check_checkpoint(path: "str | Path", what: str = "model") -> Path:
    """``path`` as a folder holding a ``config.json`` and, where it has one, a shard index that names
    files it holds (:func:`checkpoint_files`), or a one-line refusal naming it as ``what``. Needs
    neither torch nor transformers, so a command refuses a bad folder before it imports them."""
    folder = Path(path)
    if not folder.exists():
        raise ConfigError(f"{what} {path}: no such folder")
    if not folder.is_dir():
        raise ConfigError(f"{what} {path}: is a file, expected a checkpoint folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{what} {path}: not a checkpoint folder (no config.json)")
    checkpoint_files(folder)
    return folder
