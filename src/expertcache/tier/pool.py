"""Expert pools on disk: the files a file-backed tier reads (docs/tier.md).

A pool is a folder holding ``manifest.json`` and the expert bytes, in one of two layouts:

* ``files``: one file per (layer, expert), ``L{layer:03d}/E{expert:05d}.bin``;
* ``packed``: one file ``experts.bin``; entry (l, e) starts at a multiple of 4096 (so O_DIRECT
  reads of an entry are aligned) and the index (offset, size) lives in the manifest.

Manifest (JSON): ``format`` ("expertcache-pool"), ``version`` 1, ``layout``, ``expert_bytes``
(the largest entry), ``dtype``, ``layers`` (model layer ids; column i of a trace reads layer
index i), ``num_experts``, ``source``, ``files`` ({relative path: size}) and ``entries``: one per
(layer index, expert) in layer-major order, ``[file, offset, size, blake2b-128 hex]``.

Invariants: entry bytes are deterministic (pseudo-random from (seed, layer, expert) for
``--from-trace``; the checkpoint's own tensor bytes for ``--from-safetensors``), so checksums mean
something; every file is written atomically and the manifest last, so a pool with a manifest is
complete. :func:`open_pool` always checks the manifest and every file's size; ``verify=True``
also hashes every entry. A missing, truncated or altered file is refused with one line naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .._io import atomic_open, read_json
from ..errors import ConfigError, is_int

FORMAT = "expertcache-pool"
VERSION = 1
LAYOUTS = ("files", "packed")
MANIFEST = "manifest.json"
PACKED = "experts.bin"
ALIGN = 4096
HEX32 = re.compile(r"[0-9a-f]{32}")
"""An entry's checksum: blake2b with a 16-byte digest, lower-case hex."""
MAX_MANIFEST_BYTES = 256 * 2**20
MAX_ENTRIES = 4_000_000
CHUNK = 8 * 2**20


def checksum(data) -> str:
    """blake2b with a 16-byte digest, hex: the pool's checksum of one entry's bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def synthetic_bytes(seed: int, layer: int, expert: int, size: int) -> bytes:
    """The deterministic pseudo-random bytes of entry (layer, expert) of a ``--from-trace`` pool."""
    rng = np.random.Generator(np.random.PCG64([seed, layer, expert]))
    return rng.bytes(size)


@dataclass(frozen=True)
class Entry:
    """Where one expert's bytes lie: ``path`` (absolute), ``offset``, ``size`` and checksum."""

    path: str
    offset: int
    size: int
    digest: str


@dataclass(frozen=True, eq=False)
class Pool:
    """An opened, checked pool. ``entries[l][e]`` is the :class:`Entry` of layer index l, expert e."""

    root: Path
    manifest: dict
    entries: list

    @property
    def layout(self) -> str:
        return self.manifest["layout"]

    @property
    def expert_bytes(self) -> int:
        return int(self.manifest["expert_bytes"])

    @property
    def num_layers(self) -> int:
        return len(self.entries)

    @property
    def num_experts(self) -> int:
        return int(self.manifest["num_experts"])

    @property
    def total_bytes(self) -> int:
        return sum(int(s) for s in self.manifest["files"].values())

    @property
    def paths(self) -> list[str]:
        """Absolute paths of the pool's data files (for accounting, fadvise, residency)."""
        return [str(self.root / name) for name in self.manifest["files"]]

    def entry(self, layer: int, expert: int) -> Entry:
        return self.entries[layer][expert]

    def verify(self) -> int:
        """Hash every entry; ConfigError naming the first file whose bytes differ. Returns entries checked."""
        n = 0
        for row in self.entries:
            for ent in row:
                with open(ent.path, "rb") as fh:
                    data = os.pread(fh.fileno(), ent.size, ent.offset)
                if len(data) != ent.size or checksum(data) != ent.digest:
                    raise ConfigError(f"pool {self.root}: {_rel(self.root, ent.path)}: altered (checksum of bytes "
                                      f"{ent.offset}..{ent.offset + ent.size} differs from the manifest)")
                n += 1
        return n


def _rel(root: Path, path: str) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def open_pool(root: str | os.PathLike, *, verify: bool = False) -> Pool:
    """Open and check the pool at ``root``; see the module docstring for what is checked."""
    root = Path(root)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise ConfigError(f"--pool {root}: no such folder (write one with 'expertcache tier write')")
    if not mpath.is_file():
        raise ConfigError(f"--pool {root}: {MANIFEST} missing (not a pool, or its writing did not finish)")
    man = read_json(mpath, f"pool {root}", max_bytes=MAX_MANIFEST_BYTES)
    _check_manifest(root, man)
    for name, size in man["files"].items():
        path = root / name
        if not path.is_file():
            raise ConfigError(f"pool {root}: {name}: missing")
        actual = path.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than the manifest says"
            raise ConfigError(f"pool {root}: {name}: {what} ({actual} bytes, manifest says {size})")
    L, E = len(man["layers"]), int(man["num_experts"])
    flat = [Entry(str(root / f), int(o), int(s), str(d)) for f, o, s, d in man["entries"]]
    pool = Pool(root, man, [flat[i * E:(i + 1) * E] for i in range(L)])
    if verify:
        pool.verify()
    return pool


def _check_manifest(root: Path, man) -> None:
    def bad(what: str):
        raise ConfigError(f"pool {root}: {MANIFEST}: {what}")

    if not isinstance(man, dict) or man.get("format") != FORMAT:
        bad(f"'format' is not {FORMAT!r}")
    if not is_int(man.get("version")) or man.get("version") != VERSION:  # JSON true == 1 in Python
        bad(f"'version' {man.get('version')!r} is not {VERSION}")
    if man.get("checksum") != "blake2b-128":
        bad(f"'checksum' {str(man.get('checksum'))[:40]!r} is not 'blake2b-128' (the only one --verify computes)")
    if not isinstance(man.get("dtype"), str):
        bad("'dtype' must be a string")
    if man.get("layout") not in LAYOUTS:
        bad(f"'layout' {man.get('layout')!r} is not one of {', '.join(LAYOUTS)}")
    for key in ("expert_bytes", "num_experts"):
        if not is_int(man.get(key)) or man[key] <= 0:
            bad(f"'{key}' must be a positive integer")
    layers = man.get("layers")
    if not isinstance(layers, list) or not layers:
        bad("'layers' must be a non-empty list")
    if not all(is_int(v, 0) for v in layers) or len(set(layers)) != len(layers):
        bad("'layers' must be distinct non-negative layer ids")
    files = man.get("files")
    if not isinstance(files, dict) or not all(is_int(v, 0) for v in files.values()):
        bad("'files' must map file names to sizes")
    for name in files:
        if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts:
            bad(f"file name {name!r} leaves the pool folder")
    entries = man.get("entries")
    n = len(man["layers"]) * man["num_experts"]
    if not isinstance(entries, list) or len(entries) != n or n > MAX_ENTRIES:
        bad(f"'entries' must list {n} (layer, expert) entries")
    for i, ent in enumerate(entries):
        ok = (isinstance(ent, list) and len(ent) == 4 and isinstance(ent[0], str) and ent[0] in files
              and is_int(ent[1]) and is_int(ent[2]) and ent[1] >= 0 and 0 < ent[2] <= man["expert_bytes"]
              and isinstance(ent[3], str))
        if not ok or ent[1] + ent[2] > files[ent[0]]:
            bad(f"entries[{i}] is not [file, offset, size, checksum] inside its file")
        if not HEX32.fullmatch(ent[3]):
            bad(f"entries[{i}]: checksum {ent[3][:40]!r} is not 32 hex digits (blake2b-128)")
        if man["layout"] == "packed" and ent[1] % ALIGN:
            bad(f"entries[{i}]: offset {ent[1]} is not a multiple of {ALIGN} (O_DIRECT reads need it)")
    if (man["layout"] == "packed") != (set(files) == {PACKED}):
        bad(f"'layout' {man['layout']!r} does not match its files ({len(files)}: "
            f"{'one ' + PACKED if man['layout'] == 'packed' else 'one per expert'} expected)")
    largest = max(ent[2] for ent in entries)
    if largest != man["expert_bytes"]:
        bad(f"'expert_bytes' is {man['expert_bytes']}, but the largest entry holds {largest} bytes")
    _check_no_overlap(entries, bad)


def _check_no_overlap(entries: list, bad) -> None:
    """No two entries may share bytes of a file (an aliased entry would read another expert's bytes)."""
    order = sorted(range(len(entries)), key=lambda i: (entries[i][0], entries[i][1]))
    for a, b in zip(order, order[1:]):
        fa, oa, sa, _ = entries[a]
        fb, ob, _, _ = entries[b]
        if fa == fb and oa + sa > ob:
            bad(f"entries[{a}] and entries[{b}] overlap in {fa} (bytes {ob}..{oa + sa})")


# ---------------------------------------------------------------------------------------- writing
def check_pool_target(root: Path, force: bool, inputs=()) -> None:
    """Refuse to write a pool into ``root`` when it already holds one (or other files) unless
    ``force``, when it is one of ``inputs`` (a checkpoint folder), or when a file the pool would
    replace is one of ``inputs`` (equal, or a hard or symbolic link)."""
    from .._io import check_not_input
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--pool {root}: exists and is not a folder")
    for inp in inputs:
        with contextlib.suppress(OSError):
            if os.path.isdir(inp) and root.exists() and os.path.samefile(root, inp):
                raise ConfigError(f"--pool {root}: is the input folder {inp}; write the pool elsewhere")
    if not root.is_dir():
        return
    if not force and any(root.iterdir()):
        what = "a pool (manifest.json)" if (root / MANIFEST).exists() else "files"
        raise ConfigError(f"--pool {root}: already holds {what}; pass --force to rewrite it")
    for dirpath, _, names in os.walk(root):
        for name in names:
            check_not_input(os.path.join(dirpath, name), inputs, "--pool")


def write_pool(root: str | os.PathLike, *, layers: list[int], num_experts: int,
               source: Callable[[int, int], bytes], layout: str = "files", dtype: str = "uint8",
               description: str = "", progress: Callable[[int, int], None] | None = None,
               force: bool = True, inputs=()) -> Pool:
    """Write a pool whose entry (layer index l, expert e) holds ``source(l, e)``; returns it opened.

    Every data file is written atomically and the manifest last. A folder that already holds files
    is written only with ``force`` (then an existing manifest is replaced, and its data files
    overwritten, only after the new files are complete); no file that is one of ``inputs`` is ever
    replaced (:func:`check_pool_target`).
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"--layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    root = Path(root)
    check_pool_target(root, force, inputs)
    root.mkdir(parents=True, exist_ok=True)
    L, E = len(layers), int(num_experts)
    entries, files, largest, done = [], {}, 0, 0

    def items() -> Iterator[tuple[int, int, bytes]]:
        nonlocal done
        for li in range(L):
            for e in range(E):
                data = source(li, e)
                if not data:
                    raise ConfigError(f"expert (layer {layers[li]}, {e}) has no bytes")
                yield li, e, data
                done += 1
                if progress:
                    progress(done, L * E)

    if layout == "files":
        for li, e, data in items():
            name = f"L{li:03d}/E{e:05d}.bin"
            (root / name).parent.mkdir(exist_ok=True)
            with atomic_open(root / name, "wb", option="--pool") as fh:
                fh.write(data)
            files[name] = len(data)
            entries.append([name, 0, len(data), checksum(data)])
            largest = max(largest, len(data))
    else:
        pos = 0
        with atomic_open(root / PACKED, "wb", option="--pool") as fh:
            for li, e, data in items():
                pad = -pos % ALIGN
                fh.write(b"\0" * pad)
                pos += pad
                fh.write(data)
                entries.append([PACKED, pos, len(data), checksum(data)])
                pos += len(data)
                largest = max(largest, len(data))
            pad = -pos % ALIGN
            fh.write(b"\0" * pad)
            pos += pad
        files[PACKED] = pos
    man = {"format": FORMAT, "version": VERSION, "layout": layout, "expert_bytes": largest, "dtype": dtype,
           "layers": [int(x) for x in layers], "num_experts": E, "source": description,
           "checksum": "blake2b-128", "files": files, "entries": entries}
    with atomic_open(root / MANIFEST, "w", option="--pool", encoding="utf-8") as fh:
        json.dump(man, fh)
    return open_pool(root)


def pool_from_trace(root, trace, *, expert_bytes: int, layout: str = "files", seed: int = 0,
                    progress=None, force: bool = True, inputs=()) -> Pool:
    """A pool for ``trace``'s layers and experts with pseudo-random entries of ``expert_bytes``."""
    if expert_bytes <= 0:
        raise ConfigError("--expert-mb must be positive")
    return write_pool(root, layers=trace.layer_ids, num_experts=trace.num_experts,
                      source=lambda li, e: synthetic_bytes(seed, li, e, expert_bytes), layout=layout,
                      description=f"synthetic: seed {seed}, trace {trace.name}", progress=progress,
                      force=force, inputs=inputs)
