"""Reading ``.npz`` archives without trusting them: sizes checked before anything is allocated.

:func:`read_npz` is the only way a trace file's bytes become arrays. It never unpickles, never
follows a FIFO or device (only regular files are opened), and refuses, each with one line naming
the file and the member:

* a path that is not a regular file, or a folder without ``routing.npz``;
* a file that is not a zip archive (a ``.npy``, text, gzip, ...), or a corrupt one;
* members that are encrypted, use a compression other than stored/deflate/bzip2/lzma, are not
  ``.npy`` arrays, appear twice, or are more than :data:`MAX_MEMBERS`;
* an array header that is malformed, longer than numpy's 10,000-byte limit, holds an object
  (pickled) dtype, or claims a shape whose byte size disagrees with the member's size;
* archives whose arrays together claim more than :func:`max_bytes` bytes (8 GiB, or the memory
  available / :data:`WORK_FACTOR` where that is less; set ``EXPERTCACHE_MAX_TRACE_BYTES`` to change
  it), checked from the headers before any array is read;
* data that ends early or fails its CRC check.

Arrays come back in native byte order and C order, whatever the file held.
"""

from __future__ import annotations

import os
import stat
import tokenize
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .._text import first_line
from ..errors import TraceError
from ..wall.procfs import read_meminfo

MAX_MEMBERS = 256
"""Most members an archive may hold (a trace has a handful)."""

DEFAULT_MAX_BYTES = 8 << 30
_COMPRESSIONS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
_CHUNK = 1 << 22


WORK_FACTOR = 24
"""Peak memory of the commands that hold a whole trace, as a multiple of its arrays' bytes (the peak
RSS less a bare command's 108 MB), measured on two 2M-token traces of 72 MB arrays, 4 layers of k = 4
and 1 layer of k = 16 (docs/robustness.md, 2026-12-05): at most 20.6x (``bounds``), then ``replay``
of eight rules 19.5x, ``foresight`` 19.1x, ``export --format oracle`` 17.5x, ``batch`` 15.8x,
``compare-pools`` 15.9x, ``sweep`` 10.3x, ``stats`` 2.7x. Before the reports worked through runs of
whole sequences and the exports and unions through blocks, ``stats`` of the one-layer trace reached
36.8x and the oracle export 36.6x."""


def available_bytes() -> int | None:
    """``MemAvailable`` in bytes (:func:`~expertcache.wall.procfs.read_meminfo`), or None where
    there is none."""
    mem, _ = read_meminfo()
    return (mem or {}).get("MemAvailable")


def max_bytes() -> int:
    """Largest total array size a trace archive may claim: ``EXPERTCACHE_MAX_TRACE_BYTES``, else the
    smaller of 8 GiB and the memory available now / :data:`WORK_FACTOR` (a 660 KB compressed file can
    claim 320 MB of arrays, which ``stats`` turned into a 7.6 GB peak)."""
    text = os.environ.get("EXPERTCACHE_MAX_TRACE_BYTES")
    if not text:
        avail = available_bytes()
        return DEFAULT_MAX_BYTES if avail is None else max(1, min(DEFAULT_MAX_BYTES, avail // WORK_FACTOR))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise TraceError(f"EXPERTCACHE_MAX_TRACE_BYTES: expected a positive integer (bytes), got {text!r}")
    return value


def array_bytes(trace) -> int:
    """Bytes of a loaded :class:`~expertcache.trace.Trace`'s arrays (ids, sequence ids, gate weights,
    router softmax, extras): what :func:`max_bytes` bounds, for commands that hold several traces."""
    arrays = [trace.experts, trace.seq, trace.probs, trace.router_probs, *trace.extras.values()]
    return sum(int(a.nbytes) for a in arrays if isinstance(a, np.ndarray))


def resolve_trace_path(path: str | os.PathLike) -> Path:
    """The regular file a trace argument names: the file itself, or ``routing.npz`` in a folder."""
    src = str(path)
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise TraceError(f"{src}: no such file or folder") from None
    except OSError as exc:
        raise TraceError(f"{src}: cannot read it ({exc.strerror or exc})") from None
    except ValueError:  # a NUL byte: no file can have this name
        raise TraceError(f"{src!r}: not a valid path (it holds a NUL byte)") from None
    if stat.S_ISDIR(st.st_mode):
        inner = p / "routing.npz"
        if not inner.exists():
            if (p / "chunks.json").is_file():
                raise TraceError(f"{src}: is a chunked trace (chunks.json); replay and sweep read it chunk by chunk, "
                                 "other commands need a whole trace (docs/scale.md)")
            raise TraceError(f"{src}: is a folder without routing.npz (name the trace file, or a folder holding routing.npz)")
        p = inner
        try:
            st = p.stat()
        except OSError as exc:
            raise TraceError(f"{inner}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        raise TraceError(f"{p}: is {kind}, not a trace file (.npz)")
    return p


def read_npz(path: Path, src: str | None = None) -> dict[str, np.ndarray]:
    """Every member of the archive at ``path`` as an array, keyed by name without ``.npy``."""
    src = src or str(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
            if head[:2] != b"PK":
                raise TraceError(f"{src}: not a readable .npz trace ({_sniff(head)})")
            fh.seek(0)
            size = os.fstat(fh.fileno()).st_size
            with zipfile.ZipFile(fh) as zf:
                return _read_members(zf, src, size)
    except TraceError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, NotImplementedError, ValueError,
            RuntimeError, OSError) as exc:
        raise TraceError(f"{src}: not a readable .npz trace ({first_line(exc, 200)})") from None


def read_npy(path: str | os.PathLike, what: str) -> np.ndarray:
    """One ``.npy`` file with the checks an archive member gets (``what`` names it in errors, e.g. '--tokens')."""
    where = f"{what} {path}"
    try:
        st = os.stat(path)
    except OSError:
        raise TraceError(f"{where}: no such file") from None
    except ValueError:  # a NUL byte
        raise TraceError(f"{what} {str(path)!r}: not a valid path (it holds a NUL byte)") from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(f"{where}: not a regular file")
    try:
        with open(path, "rb") as fh:
            hdr = _header(fh, st.st_size, where)
            if hdr[3] > max_bytes():
                raise TraceError(f"{where}: {hdr[3]:,} bytes of data, more than the limit of {max_bytes():,}")
            fh.seek(0)
            return _data(fh, hdr, where)
    except OSError as exc:
        raise TraceError(f"{where}: cannot read it ({exc.strerror or exc})") from None


def _read_members(zf: zipfile.ZipFile, src: str, size: int) -> dict[str, np.ndarray]:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise TraceError(f"{src}: {len(infos)} members in the archive (at most {MAX_MEMBERS})")
    headers = []
    seen: set[str] = set()
    for info in infos:
        name = info.filename
        if not name.endswith(".npy"):
            raise TraceError(f"{src}: member {name!r} is not a .npy array (a trace archive holds only arrays)")
        key = name[:-4]
        if key in seen:
            raise TraceError(f"{src}: member {name!r} appears twice in the archive")
        seen.add(key)
        if info.flag_bits & 0x1:
            raise TraceError(f"{src}: member {name!r} is encrypted")
        if info.compress_type not in _COMPRESSIONS:
            raise TraceError(f"{src}: member {name!r} uses unsupported compression method {info.compress_type}")
        if info.compress_size > size:
            raise TraceError(f"{src}: member {name!r} claims {info.compress_size:,} bytes, more than the whole file")
        with zf.open(info) as fh:
            headers.append((key, info, _header(fh, info.file_size, f"{src}: member {name!r}")))
    limit = max_bytes()
    total = sum(nbytes for _, _, (_, _, _, nbytes, _) in headers)
    if total > limit:
        why = ("" if os.environ.get("EXPERTCACHE_MAX_TRACE_BYTES") or limit == DEFAULT_MAX_BYTES else
               f" (a command holding it needs up to {WORK_FACTOR}x its arrays; the machine has "
               f"{available_bytes() or 0:,} bytes available: a chunked trace streams, docs/scale.md)")
        raise TraceError(
            f"{src}: its arrays claim {total:,} bytes, more than the limit of {limit:,}{why} "
            "(set EXPERTCACHE_MAX_TRACE_BYTES to allow more)"
        )
    out = {}
    for key, info, hdr in headers:
        with zf.open(info) as fh:
            out[key] = _data(fh, hdr, f"{src}: member {info.filename!r}")
    return out


def _header(fh, size: int, where: str):
    """(dtype, shape, fortran, nbytes, offset) of a ``.npy`` stream of ``size`` bytes, from its header alone."""
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unknown format version {version}")
    except (ValueError, SyntaxError, TypeError, EOFError, OverflowError, MemoryError, RecursionError,
            tokenize.TokenError) as exc:  # numpy tokenizes version 1.0 headers: unbalanced brackets
        raise TraceError(f"{where}: not a valid .npy header ({first_line(exc, 200)})") from None
    offset = fh.tell()
    if dtype.hasobject:
        raise TraceError(f"{where}: object (pickled) arrays are not allowed in a trace")
    if dtype.itemsize == 0:
        raise TraceError(f"{where}: dtype {dtype} has no size")
    if not all(isinstance(n, int) and n >= 0 for n in shape) or len(shape) > 32:
        raise TraceError(f"{where}: invalid shape {shape}")
    count = 1
    for n in shape:
        count *= n
    nbytes = count * dtype.itemsize
    if size - offset != nbytes:
        raise TraceError(
            f"{where}: header claims shape {shape} of {dtype} ({nbytes:,} bytes) but it holds "
            f"{max(0, size - offset):,} bytes of data"
        )
    return dtype, shape, fortran, nbytes, offset


def _data(fh, hdr, where: str) -> np.ndarray:
    """The array of a ``.npy`` stream positioned at its start, read in chunks into one buffer."""
    dtype, shape, fortran, nbytes, offset = hdr
    buf = bytearray(nbytes)
    view = memoryview(buf)
    fh.read(offset)
    got = 0
    while got < nbytes:
        n = fh.readinto(view[got: got + _CHUNK])
        if not n:
            raise TraceError(f"{where}: data ends after {got:,} of {nbytes:,} bytes")
        got += n
    if fh.read(1):
        raise TraceError(f"{where}: more data than its header claims")
    arr = np.frombuffer(buf, dtype=dtype)
    arr = arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)
    native = dtype.newbyteorder("=") if dtype.byteorder not in ("=", "|") else dtype
    if dtype.fields is None and native != dtype:
        arr = arr.astype(native)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _sniff(head: bytes) -> str:
    if head.startswith(b"\x93NUMPY"[:4]):
        return "it is a single .npy array; a trace is a .npz archive"
    if head.startswith(b"\x1f\x8b"):
        return "it is gzip-compressed"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "it is zstd-compressed"
    if not head:
        return "the file is empty"
    if all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return "it looks like text"
    return "unknown content"
