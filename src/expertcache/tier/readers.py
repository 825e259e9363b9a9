"""How one expert access is served in each replay mode (docs/tier.md, "Modes").

Every access is a real read of the entry's bytes into a destination buffer the harness reuses:

* ``pagecache``: ``os.preadv`` through the page cache (or, with ``mmap=True``, one copy from a
  memoryview of a shared read-only ``mmap`` of the file straight into the destination: no
  intermediate bytes object, so the mode measures the kernel's page faults, not Python);
* ``nocache``: the same pread, then ``posix_fadvise(DONTNEED)`` on what the read brought in: the
  entry's range and the readahead window after it (the device's ``read_ahead_kb``), and at the end
  of a pass every pool file (readahead still in flight at a drop is caught there): the incumbent
  F_NOCACHE behaviour, every pass pays the device and nothing stays resident;
* ``direct``: ``O_DIRECT`` reads of the 4096-aligned span into page-aligned (mmap-allocated)
  buffers; when the filesystem refuses O_DIRECT the reader says so (``fallback``) and serves as
  ``nocache``;
* ``arena`` / ``hybrid``: entries preloaded into a locked anonymous buffer are copied from it
  (:mod:`expertcache.tier.arena`); the rest are read as in ``pagecache``.

Invariant: ``read(entry, buf)`` leaves exactly the entry's bytes in ``buf[:entry.size]`` and
returns the bytes served (= entry.size).
"""

from __future__ import annotations

import errno
import mmap
import os

from ..wall.procfs import read_text

from .pool import ALIGN, Pool

MODES = ("pagecache", "nocache", "direct", "arena", "hybrid")
DEFAULT_READAHEAD = 8 << 20
"""Readahead window (bytes) assumed where the device's ``read_ahead_kb`` cannot be read."""


def queue_value(path: str, name: str) -> int | None:
    """The integer in ``queue/<name>`` of the block device holding ``path`` (the partition's disk
    for a partition), or None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for q in (os.path.join(base, "queue", name), os.path.join(base, "..", "queue", name)):
        text, _ = read_text(q)
        if text and text.strip().isdigit():
            return int(text.strip())
    return None


def readahead_bytes(path: str) -> int:
    """The readahead window of the block device holding ``path`` (``queue/read_ahead_kb``, the
    partition's disk for a partition), else :data:`DEFAULT_READAHEAD`."""
    kb = queue_value(path, "read_ahead_kb")
    return DEFAULT_READAHEAD if kb is None else kb * 1024


def drop_behind(fd: int, offset: int, size: int, window: int) -> None:
    """``posix_fadvise(DONTNEED)`` on ``[offset, offset + size + window)``: the entry and the readahead
    its read may have brought in after it."""
    os.posix_fadvise(fd, offset, size + window, os.POSIX_FADV_DONTNEED)


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of at least ``size`` bytes (rounded up to 4096)."""
    return mmap.mmap(-1, max(ALIGN, -(-size // ALIGN) * ALIGN))


class FileReader:
    """Reads entries of ``pool`` through the page cache, without it, or with O_DIRECT.

    ``kind``: ``"pagecache"``, ``"nocache"`` or ``"direct"``. After construction ``self.kind`` is
    what is actually used and ``self.fallback`` says why it differs (``None`` when it does not).
    """

    def __init__(self, pool: Pool, kind: str = "pagecache", *, use_mmap: bool = False):
        self.pool = pool
        self.kind = kind
        self.fallback: str | None = None
        self.use_mmap = use_mmap and kind == "pagecache"
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._dfds: dict[str, int] = {}
        self.readahead = readahead_bytes(pool.entries[0][0].path) if kind in ("nocache", "direct") else 0
        if kind == "direct":
            self.fallback = self._probe_direct()
            if self.fallback:
                self.kind = "nocache"

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _probe_direct(self) -> str | None:
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            return "O_DIRECT is not available on this platform; served as nocache"
        ent = self.pool.entries[0][0]
        buf = aligned_buffer(ALIGN)
        try:
            fd = os.open(ent.path, os.O_RDONLY | flag)
        except OSError as exc:
            return f"open(O_DIRECT) refused ({exc.strerror}); served as nocache"
        try:
            os.preadv(fd, [buf], ent.offset - ent.offset % ALIGN)
        except OSError as exc:
            os.close(fd)
            return f"O_DIRECT read refused by this filesystem ({errno.errorcode.get(exc.errno, exc.errno)}); served as nocache"
        finally:
            buf.close()
        self._dfds[ent.path] = fd
        return None

    def read(self, ent, buf) -> int:
        """Read ``ent`` into ``buf`` (a writable buffer of at least ``ent.size`` bytes, page-aligned
        and rounded up for direct); returns ``ent.size``."""
        if self.kind == "direct":
            return self._read_direct(ent, buf)
        if self.use_mmap:
            m = self._maps.get(ent.path)
            if m is None:
                m = self._maps[ent.path] = mmap.mmap(self.fd(ent.path), 0, prot=mmap.PROT_READ)
            with memoryview(m) as src, memoryview(buf) as dst:  # one copy: map -> destination
                dst[: ent.size] = src[ent.offset: ent.offset + ent.size]
            return ent.size
        fd = self.fd(ent.path)
        view = memoryview(buf)[: ent.size]
        got = os.preadv(fd, [view], ent.offset)
        while got < ent.size:  # short reads are legal; finish the entry
            n = os.preadv(fd, [view[got:]], ent.offset + got)
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of file at byte {ent.offset + got}", ent.path)
            got += n
        if self.kind == "nocache":
            drop_behind(fd, ent.offset, ent.size, self.readahead)
        return ent.size

    def end_pass(self) -> None:
        """nocache: drop every pool file's clean pages (readahead that was in flight at a per-read drop)."""
        if self.kind != "nocache":
            return
        for path in self.pool.paths:
            os.posix_fadvise(self.fd(path), 0, 0, os.POSIX_FADV_DONTNEED)

    def _read_direct(self, ent, buf) -> int:
        fd = self._dfds.get(ent.path)
        if fd is None:
            fd = self._dfds[ent.path] = os.open(ent.path, os.O_RDONLY | os.O_DIRECT)
        start = ent.offset - ent.offset % ALIGN
        head = ent.offset - start
        span = -(-(head + ent.size) // ALIGN) * ALIGN
        view = memoryview(buf)[:span]
        got = 0
        while got < head + ent.size:
            n = os.preadv(fd, [view[got:]], start + got)
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of file at byte {start + got}", ent.path)
            got += n
        if head:
            view[: ent.size] = view[head: head + ent.size]
        return ent.size

    def buffer_bytes(self) -> int:
        """Destination buffer size this reader needs (direct reads the aligned span)."""
        return self.pool.expert_bytes + (2 * ALIGN if self.kind == "direct" else 0)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        for fd in list(self._fds.values()) + list(self._dfds.values()):
            os.close(fd)
        self._fds.clear()
        self._dfds.clear()
        self._maps.clear()
