"""Reading routing logs safely: regular files only, gzip and zstd found by their magic bytes,
streamed line by line under a length cap, JSON parsed without tracebacks.

Invariants:

* a path is opened without blocking and refused unless it is a regular file, so a directory or a
  FIFO given as the log is an error, never a hang;
* compressed input is decompressed as a stream: memory holds one line (at most
  :data:`MAX_LINE_BYTES`) plus the decompressors' bounded buffers, never the whole file;
* a truncated or corrupt gzip/zstd stream is a one-line :class:`TraceError` naming the file;
* every record problem is a one-line :class:`TraceError` starting with ``file:line``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

from ...errors import TraceError

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZIP_MAGIC = b"PK\x03\x04"
MAX_LINE_BYTES = 64 << 20
"""The longest record line read (64 MiB); a longer one is an error, so a file without newlines
cannot exhaust memory."""

MAX_BLANK_LINES = 1_000_000
"""More blank lines than this in a row end the read with an error: a routing log has records on its
lines, and a small compressed file of blank lines would otherwise keep the reader busy for minutes.
(Counted in a row, not in all: server-sent events put a blank line after every record.)"""

_ZSTD_FEED = 1024  # compressed bytes per decompressor call: zstd expands 1 KiB to at most ~44 MiB


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file (checked on the open descriptor)."""
    src = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise TraceError(f"{src}: no such file") from None
    except OSError as exc:
        raise TraceError(f"{src}: cannot open ({exc.strerror or type(exc).__name__})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise TraceError(f"{src}: is {kind}; expected a regular file")
    return os.fdopen(fd, "rb")


def sniff(path: str | os.PathLike) -> bytes:
    """The first four bytes of a regular file (fewer if it is shorter)."""
    with open_regular(path) as fh:
        return fh.read(4)


def compression_of(magic: bytes) -> str | None:
    """``'gzip'``, ``'zstd'`` or ``None`` from a file's first bytes (never from its name)."""
    if magic.startswith(GZIP_MAGIC):
        return "gzip"
    if magic.startswith(ZSTD_MAGIC):
        return "zstd"
    return None


@contextlib.contextmanager
def open_stream(path: str | os.PathLike) -> Iterator[tuple[BinaryIO, str | None]]:
    """Yield ``(binary stream of the decompressed content, compression)``."""
    src = str(path)
    raw = open_regular(path)
    try:
        kind = compression_of(raw.read(4))
        raw.seek(0)
        if kind == "gzip":
            import gzip

            stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb")
        elif kind == "zstd":
            stream = io.BufferedReader(_ZstdRaw(raw, _zstandard(src)), buffer_size=1 << 16)
        else:
            stream = raw
        yield stream, kind
    finally:
        raw.close()


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line number, line without its newline)`` for every line, blank ones included."""
    src = str(path)
    with open_stream(path) as (stream, kind):
        lineno = blanks = 0
        errors = _stream_errors()
        while True:
            try:
                line = stream.readline(MAX_LINE_BYTES + 1)
            except errors as exc:
                what = f"{kind} stream" if kind else "file"
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise TraceError(f"{src}: corrupt or truncated {what} after line {lineno} ({reason})") from None
            if not line:
                return
            lineno += 1
            body = line[:-1] if line.endswith(b"\n") else line
            if body.strip():
                blanks = 0
            else:
                blanks += 1
                if blanks > MAX_BLANK_LINES:
                    raise TraceError(f"{src}:{lineno}: more than {MAX_BLANK_LINES:,} blank lines in a row; not a routing log")
            if len(body) > MAX_LINE_BYTES:
                limit = f"{MAX_LINE_BYTES >> 20} MiB" if MAX_LINE_BYTES >= 1 << 20 else f"{MAX_LINE_BYTES} bytes"
                raise TraceError(f"{src}:{lineno}: line longer than {limit} (the limit for one record)")
            yield lineno, body


class HugeInt:
    """Stands for a JSON integer of more than 20 digits in a line that holds one past Python's
    int-digit limit (the line is read again with this in place of ``int``); field checks report
    it as out of range, naming the field."""

    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<integer of {self.digits} digits>"


def _parse_int(text: str):
    return int(text) if len(text) <= 20 else HugeInt(len(text))


class _Repeated(Exception):
    """A key named twice in one JSON object (not a ValueError: the digit-limit retry must not catch it)."""


def _unique(pairs: list) -> dict:
    """An object's pairs as a dict, refusing a key named twice: the decoder keeps the last value,
    and ``{"experts": [0, 1], "experts": [5, 6]}`` had imported as [5, 6] without a word (a
    repeated ``layer`` would move the record). About 13% more parsing time."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        raise _Repeated(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


_FAST = json.JSONDecoder(object_pairs_hook=_unique)
_SAFE = json.JSONDecoder(parse_int=_parse_int, object_pairs_hook=_unique)


def parse_record(body: bytes, where: str, *, arrays: bool = False) -> dict | list:
    """One JSON object (or, with ``arrays``, an array) from one line's bytes; every failure is a
    one-line TraceError at ``where``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{where}: invalid UTF-8 at byte {exc.start} of the line") from None
    text = text.lstrip("\ufeff")
    try:
        try:
            rec = _FAST.decode(text)
        except json.JSONDecodeError:
            raise
        except ValueError:  # an integer past Python's digit limit: read again, keeping it as HugeInt
            rec = _SAFE.decode(text)
    except (RecursionError, _Repeated) as exc:
        why = ("JSON nested too deeply" if isinstance(exc, RecursionError) else
               f"key {str(exc.args[0])[:40]!r} appears twice in one object")
        raise TraceError(f"{where}: {why}") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # any other number the decoder cannot represent
        raise TraceError(f"{where}: unreadable JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(rec, dict) and not (arrays and isinstance(rec, list)):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(rec), "a number")
        raise TraceError(f"{where}: expected a JSON object per line, got {kind}")
    return rec


def iter_records(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yield ``("file:line", record)`` for every non-blank line; an empty log is an error."""
    src = str(path)
    seen = False
    for lineno, body in iter_lines(path):
        if not body.strip():
            continue
        seen = True
        where = f"{src}:{lineno}"
        yield where, parse_record(body, where)
    if not seen:
        raise TraceError(f"{src}: empty file (no records)")


def display_name(path: str | os.PathLike) -> str:
    """The file name without compression and record-format suffixes (``a.jsonl.gz`` -> ``a``)."""
    name = Path(path).name
    for suffixes in ((".gz", ".zst", ".zstd"), (".jsonl", ".json", ".ndjson", ".pt", ".pth")):
        for s in suffixes:
            if name.endswith(s) and len(name) > len(s):
                name = name[: -len(s)]
                break
    return name


# ---------------------------------------------------------------------- zstd
def _zstandard(src: str):
    try:
        import zstandard
    except ImportError:
        raise TraceError(f"{src}: is zstd-compressed; reading it needs the zstandard package (pip install zstandard)") from None
    return zstandard


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


class _ZstdRaw(io.RawIOBase):
    """A raw stream over a zstd file of one or more frames that fails on a truncated frame.

    The decompressor is fed :data:`_ZSTD_FEED` bytes at a time, so one call yields a bounded
    amount of output (zstd's stream reader, by contrast, returns a clean EOF mid-frame).
    """

    def __init__(self, fh: BinaryIO, zstandard):
        self._fh = fh
        self._zstd = zstandard
        self._dobj = None
        self._out = memoryview(b"")
        self._error: BaseException | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            if self._error is not None:  # after the bytes decoded before it: the lines before it are read
                raise self._error
            chunk = self._fh.read(_ZSTD_FEED)
            if not chunk:
                if self._dobj is not None and not self._dobj.eof:
                    raise EOFError("the zstd stream ends in the middle of a frame")
                return 0
            self._out = memoryview(self._feed(chunk))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _feed(self, data: bytes) -> bytes:
        parts = []
        try:
            while data:
                if self._dobj is None or self._dobj.eof:
                    self._dobj = self._zstd.ZstdDecompressor().decompressobj()
                parts.append(self._dobj.decompress(data))
                data = self._dobj.unused_data if self._dobj.eof else b""
        except Exception as exc:  # bytes after the last frame that are no frame: said after the lines before
            if not parts:
                raise
            self._error = exc
        return b"".join(parts)
