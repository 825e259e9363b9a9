"""The expert geometry of a GGUF MoE file, read from its header with bounded memory.

A GGUF file is a header (magic ``GGUF``, version, tensor and key counts, key/value metadata, tensor
infos) followed by aligned tensor data. :func:`read_geometry` parses the header itself (no
third-party reader: every count and length is checked against :data:`LIMITS` and the file size
before anything is allocated) and returns a :class:`Geometry`: the architecture, E, k, the MoE
layers and, per layer, the three expert tensors ``blk.N.ffn_{gate,up,down}_exps.weight``.

Invariant (checked here, relied on by the runner's advice): expert ``e`` of an expert tensor is the
contiguous byte range ``[offset + e * nbytes / E, offset + (e + 1) * nbytes / E)`` of the file,
because the expert index is the slowest ggml dimension (``ne[2] == E``) and ggml stores rows
contiguously. ``expert_bytes`` is the sum over the three tensors of one expert's slice.

Refusals, each a :class:`~expertcache.errors.ConfigError` of one line: not a GGUF file, an
unsupported GGUF version, a header or tensor data that runs past the end of the file (truncated),
a count or string beyond :data:`LIMITS`, an architecture outside :data:`ARCHITECTURES`, a file
without expert tensors (not an MoE), expert tensors whose shapes disagree with E.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from ..errors import ConfigError

ARCHITECTURES = ("olmoe", "qwen2moe", "qwen3moe", "llama")
"""GGUF ``general.architecture`` values this package runs (``llama`` covers Mixtral-class MoE)."""
LIMITS = {"tensors": 1 << 20, "keys": 1 << 16, "string": 1 << 20, "array": 1 << 24, "dims": 4}
"""Most tensors, metadata keys, bytes in one string, items in one array, dimensions per tensor."""
EXPERT_PARTS = ("gate", "up", "down")
# ggml type id -> (block size in elements, bytes per block); the types a converter here writes and
# the common quantizations (ggml.h; checked against gguf.GGML_QUANT_SIZES in the tests).
TYPE_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
              10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2)}
TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 10: "q2_k",
              11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k", 30: "bf16"}
# GGUF metadata value types: id -> struct format (None: string 8, array 9)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: name, ggml dims (``ne[0]`` fastest), ggml type, absolute byte offset, size."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, f"type{self.type_id}")


@dataclass
class Geometry:
    """What expertcache needs of a GGUF MoE: see the module docstring for the byte-range invariant."""

    path: str
    file_bytes: int
    architecture: str
    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: list[int]
    experts: dict[int, dict[str, TensorInfo]]
    tensors: dict[str, TensorInfo] = field(repr=False)
    metadata: dict = field(repr=False)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down slices) of the first MoE layer; all layers agree."""
        first = self.experts[self.moe_layers[0]]
        return sum(t.nbytes // self.num_experts for t in first.values())

    @property
    def expert_tensor_bytes(self) -> int:
        """Bytes of all expert tensors of all layers (L x E x expert_bytes)."""
        return sum(t.nbytes for parts in self.experts.values() for t in parts.values())

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[int, int]]:
        """File ``(offset, length)`` of expert ``expert`` of MoE layer ``layer``: gate, up, down."""
        out = []
        for part in EXPERT_PARTS:
            t = self.experts[layer][part]
            size = t.nbytes // self.num_experts
            out.append((t.offset + expert * size, size))
        return out

    def layer_span(self, layer: int) -> list[tuple[int, int]]:
        """File ``(offset, length)`` of the three whole expert tensors of ``layer``."""
        return [(t.offset, t.nbytes) for t in (self.experts[layer][p] for p in EXPERT_PARTS)]

    def summary(self) -> dict:
        types = sorted({t.type_name for parts in self.experts.values() for t in parts.values()})
        return {"gguf": self.path, "architecture": self.architecture, "file_bytes": self.file_bytes,
                "num_experts": self.num_experts, "top_k": self.top_k, "num_layers": self.num_layers,
                "moe_layers": len(self.moe_layers), "expert_bytes": self.expert_bytes,
                "expert_tensor_bytes": self.expert_tensor_bytes, "expert_types": types}


def tensor_nbytes(shape: tuple[int, ...], type_id: int, where: str) -> int:
    if type_id not in TYPE_SIZES:
        raise ConfigError(f"{where}: ggml type {type_id} is not supported here (known: "
                          f"{', '.join(TYPE_NAMES.values())})")
    block, size = TYPE_SIZES[type_id]
    if shape[0] % block:
        raise ConfigError(f"{where}: first dimension {shape[0]} is not a multiple of the type's block {block}")
    n = size * (shape[0] // block)
    for d in shape[1:]:
        n *= d
    return n


class _Reader:
    """Sequential little-endian reads that refuse to run past the file's end or the limits."""

    def __init__(self, fh, size: int, where: str):
        self.fh, self.size, self.where = fh, size, where

    def take(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise ConfigError(f"{self.where}: truncated GGUF header (ends at byte {self.fh.tell()} of {self.size})")
        return data

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        n = self.scalar("Q")
        if n > LIMITS[what]:
            raise ConfigError(f"{self.where}: GGUF header claims {n} {what}, more than the {LIMITS[what]} allowed")
        return n

    def string(self) -> str:
        n = self.count("string")
        if self.fh.tell() + n > self.size:
            raise ConfigError(f"{self.where}: truncated GGUF header (a string runs past the end of the file)")
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9:
            raise ConfigError(f"{self.where}: unknown GGUF metadata type {vtype}")
        itype, n = self.scalar("I"), self.count("array")
        if itype in _SCALARS and not keep:  # skip big arrays (token scores, types) without reading them
            skip = n * struct.calcsize(_SCALARS[itype])
            if self.fh.tell() + skip > self.size:
                raise ConfigError(f"{self.where}: truncated GGUF header (an array runs past the end of the file)")
            self.fh.seek(skip, os.SEEK_CUR)
            return n
        items = [self.value(itype, keep) for _ in range(n)]
        return items if keep else n


# arrays whose values are kept (small, per-layer settings); other arrays are kept as their length
_KEEP_ARRAYS = ("feed_forward_length", "head_count", "head_count_kv")


def read_header(path: str, where: str = "--model") -> tuple[dict, dict[str, TensorInfo], int]:
    """``(metadata, tensors, file size)`` of a GGUF file; refusals as in the module docstring."""
    where = f"{where} {path}"
    try:
        size = os.path.getsize(path)
        fh = open(path, "rb")
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    with fh:
        r = _Reader(fh, size, where)
        if size < 24 or fh.read(4) != b"GGUF":
            raise ConfigError(f"{where}: not a GGUF file (no GGUF magic)")
        version = r.scalar("I")
        if version not in (2, 3):
            raise ConfigError(f"{where}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_keys = r.count("tensors"), r.count("keys")
        meta: dict = {}
        for _ in range(n_keys):
            key = r.string()
            meta[key] = r.value(r.scalar("I"), keep=key.endswith(_KEEP_ARRAYS))
        infos = []
        for _ in range(n_tensors):
            name, nd = r.string(), r.scalar("I")
            if not 1 <= nd <= LIMITS["dims"]:
                raise ConfigError(f"{where}: tensor {name!r} has {nd} dimensions")
            shape = tuple(r.scalar("Q") for _ in range(nd))
            infos.append((name, shape, r.scalar("I"), r.scalar("Q")))
        align = int(meta.get("general.alignment", 32) or 32)
        if align <= 0 or align & (align - 1):
            raise ConfigError(f"{where}: general.alignment {align} is not a power of two")
        data_start = -(-fh.tell() // align) * align
    tensors = {}
    for name, shape, tid, off in infos:
        nbytes = tensor_nbytes(shape, tid, f"{where}: tensor {name!r}")
        t = TensorInfo(name, shape, tid, data_start + off, nbytes)
        if t.offset + nbytes > size:
            raise ConfigError(f"{where}: truncated file: tensor {name!r} ends at byte {t.offset + nbytes}, "
                              f"the file has {size}")
        tensors[name] = t
    return meta, tensors, size


def read_geometry(path: str, where: str = "--model") -> Geometry:
    """The :class:`Geometry` of the GGUF MoE at ``path`` (refusals in the module docstring)."""
    meta, tensors, size = read_header(path, where)
    label = f"{where} {path}"
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{label}: no general.architecture in the GGUF metadata")
    n_layers = meta.get(f"{arch}.block_count")
    E, k = meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count")
    experts: dict[int, dict[str, TensorInfo]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2].startswith("ffn_") and parts[2].endswith("_exps") \
                and parts[3] == "weight" and parts[1].isdigit():
            experts.setdefault(int(parts[1]), {})[parts[2][4:-5]] = t
    if not experts or not isinstance(E, int) or E < 2 or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{label}: not a mixture-of-experts GGUF (no expert tensors blk.N.ffn_*_exps or no "
                          f"{arch}.expert_count)")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{label}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if k > E:
        raise ConfigError(f"{label}: expert_used_count {k} exceeds expert_count {E}")
    for layer, parts in sorted(experts.items()):
        missing = [p for p in EXPERT_PARTS if p not in parts]
        if missing:
            raise ConfigError(f"{label}: layer {layer} has no ffn_{missing[0]}_exps tensor")
        for p, t in parts.items():
            if len(t.shape) != 3 or t.shape[2] != E:
                raise ConfigError(f"{label}: {t.name} has shape {list(t.shape)}, expected [*, *, {E}] experts")
    layers = sorted(experts)
    if not isinstance(n_layers, int) or layers[-1] >= n_layers:
        raise ConfigError(f"{label}: {arch}.block_count {n_layers!r} disagrees with expert tensors up to layer {layers[-1]}")
    sizes = {sum(t.nbytes for t in experts[lid].values()) for lid in layers}
    if len(sizes) != 1:
        raise ConfigError(f"{label}: MoE layers have expert tensors of different sizes (not supported)")
    return Geometry(os.fspath(path), size, arch, E, k, n_layers, layers, experts, tensors, meta)
