"""Bounded reads of /proc and /sys: each file is read up to :data:`READ_CAP` bytes, and a file that
cannot be read gives ``(None, reason)``, never an exception or an invented value."""

from __future__ import annotations

import os

READ_CAP = 1 << 20
"""Most bytes read from one /proc or /sys file."""
VMSTAT_PREFIXES = ("pgscan", "pgsteal", "workingset_", "pgpgin", "pgpgout", "pgmajfault", "pgfault",
                   "pswpin", "pswpout", "allocstall", "pgrefill", "pgactivate", "pgdeactivate",
                   "pgrotated", "drop_pagecache", "nr_file_pages", "nr_mlock", "nr_unevictable")
"""/proc/vmstat counters kept in a snapshot (reclaim scan/steal, refaults, paging, locked pages)."""
MEMINFO_KEYS = ("MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "Active(file)",
                "Inactive(file)", "Mlocked", "Unevictable", "Dirty", "Writeback", "AnonPages",
                "Shmem", "SwapTotal", "SwapFree")
"""/proc/meminfo fields kept in a snapshot, in bytes."""


def read_text(path: str) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, reason)``; at most :data:`READ_CAP` bytes."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(READ_CAP)
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    return data.decode("utf-8", "replace"), None


def _read_whole(fd: int, path: str, cap: int) -> tuple[str | None, str | None]:
    """The whole text of the open file ``fd`` from offset 0 (``pread``), or ``(None, reason)`` where
    it cannot be read or is longer than ``cap`` bytes (never a truncated text)."""
    chunks, size = [], 0
    try:
        while True:
            data = os.pread(fd, 1 << 16, size)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            if size > cap:
                return None, f"{path}: longer than {cap} bytes"
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    return b"".join(chunks).decode("utf-8", "replace"), None


def read_whole(path: str, cap: int) -> tuple[str | None, str | None]:
    """:func:`read_text` for a file that must be read whole: longer than ``cap`` bytes is a reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    try:
        return _read_whole(fd, path, cap)
    finally:
        os.close(fd)


class OpenProcFile:
    """One /proc file of this process, opened once and read again, whole, from the same open file.

    Inside a memory cgroup at its limit, opening a file can fail with ENOMEM: the kernel charges
    the open file and its seq_file buffer to the cgroup. A model served behind a tight wall failed
    so at start, opening /proc/self/maps once llama.cpp had filled the wall (1 run in 6 beside two
    CPU burners and a disk reader). Opened and read once while there is room, the file is read
    again with ``pread`` from offset 0, which has the kernel regenerate its text into the buffer
    the first read allocated (as ``top`` re-reads /proc/stat): no new allocation while each line
    fits that buffer. ``read`` gives ``(text, None)`` or ``(None, reason)``; a file longer than
    ``cap`` bytes is a reason, never a truncated text."""

    def __init__(self, path: str, cap: int = READ_CAP):
        self.path, self.cap = path, int(cap)
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.read()  # the kernel's buffer for this file is allocated now, while there is room

    def read(self) -> tuple[str | None, str | None]:
        return _read_whole(self.fd, self.path, self.cap)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


MAPS_CAP = 64 << 20
"""Most bytes of /proc/self/maps read (a process with torch and llama.cpp loaded maps ~200 KB)."""


def file_mappings(maps: str, path: str) -> list[tuple[int, int, int]]:
    """``(start, end, file offset)`` of each line of a /proc/<pid>/maps text that maps the file at
    ``path`` (matched by device and inode, so a renamed or deleted path still matches)."""
    st = os.stat(path)
    out = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[4].isdigit() or int(parts[4]) != st.st_ino:
            continue
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        if os.makedev(major, minor) != st.st_dev:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, int(parts[2], 16)))
    return out


def keyed_numbers(text: str) -> dict[str, int]:
    """``name value`` lines (vmstat, memory.events, oom_control) as a dict; other lines skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def read_vmstat() -> tuple[dict | None, str | None]:
    text, why = read_text("/proc/vmstat")
    if text is None:
        return None, why
    nums = keyed_numbers(text)
    return {k: v for k, v in nums.items() if k.startswith(VMSTAT_PREFIXES)}, None


def read_meminfo() -> tuple[dict | None, str | None]:
    """Selected /proc/meminfo fields in bytes (the file says kB = 1024 bytes)."""
    text, why = read_text("/proc/meminfo")
    if text is None:
        return None, why
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in MEMINFO_KEYS:
            parts = rest.split()
            try:
                out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
            except (ValueError, IndexError):
                continue
    return out, None


def read_pressure(resource: str) -> tuple[dict | None, str | None]:
    """``{"some": {"avg10", "avg60", "avg300", "total"}, "full": {...}}``; total in microseconds."""
    text, why = read_text(f"/proc/pressure/{resource}")
    if text is None:
        return None, why
    return parse_pressure(text), None


def vmlck_bytes() -> int | None:
    """This process's locked memory (VmLck of /proc/self/status) in bytes; None if unreadable."""
    text, _ = read_text("/proc/self/status")
    for line in (text or "").splitlines():
        if line.startswith("VmLck:"):
            parts = line.split()
            try:
                return int(parts[1]) * 1024
            except (ValueError, IndexError):
                return None
    return None


def cgroup_version() -> tuple[str | None, str | None]:
    """``"v2"`` (memory controller on cgroup2), ``"v1"`` (on a v1 hierarchy), ``"hybrid"`` (v1 memory
    beside a cgroup2 mount without it), or ``(None, reason)``."""
    text, why = read_text("/proc/self/mounts")
    if text is None:
        return None, why
    v1_memory = v2_memory = v2 = False
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        if parts[2] == "cgroup" and "memory" in parts[3].split(","):
            v1_memory = True
        elif parts[2] == "cgroup2":
            v2 = True
            ctl, _ = read_text(os.path.join(parts[1], "cgroup.controllers"))
            v2_memory = v2_memory or "memory" in (ctl or "").split()
    if v2_memory:
        return "v2", None
    if v1_memory:
        return ("hybrid" if v2 else "v1"), None
    return None, "no cgroup memory controller is mounted"


SELF_IO = "/proc/self/io"


def read_self_io(source: OpenProcFile | None = None) -> tuple[dict | None, str | None]:
    """This process's own I/O counters (/proc/self/io: every thread of it): ``read_bytes`` (bytes it
    caused to be read from storage: its reads, their readahead, its O_DIRECT reads), ``rchar``
    (bytes returned by read calls, cache hits included), ``syscr``; ``(None, reason)`` if unreadable.
    ``source``: the file kept open (:class:`OpenProcFile`), for a process inside a tight wall."""
    text, why = source.read() if source is not None else read_text(SELF_IO)
    if text is None:
        return None, why
    nums = {k.rstrip(":"): v for k, v in keyed_numbers(text.replace(":", " ")).items()}
    if "read_bytes" not in nums:
        return None, f"{SELF_IO}: no read_bytes field (task I/O accounting is off in this kernel)"
    return {k: nums[k] for k in ("read_bytes", "rchar", "syscr", "write_bytes") if k in nums}, None


MEMCG_STAT_PREFIXES = ("pgscan", "pgsteal", "pgrefill", "pgpgin", "pgpgout", "pgmajfault", "workingset_",
                       "file", "anon", "unevictable", "cache", "rss")
"""memory.stat keys kept from the wall's memory cgroup (v2 has pgscan/pgsteal; v1 has no reclaim counters)."""


def parse_pressure(text: str) -> dict:
    """PSI text (``some avg10=.. total=..`` lines) as ``{"some": {...}, "full": {...}}``; total in us."""
    out: dict = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("some", "full"):
            continue
        row = {}
        for item in parts[1:]:
            k, _, v = item.partition("=")
            try:
                row[k] = int(v) if k == "total" else float(v)
            except ValueError:
                continue
        out[parts[0]] = row
    return out


def read_memcg(d: str, version: str, device: str | None = None) -> dict:
    """The counters of memory cgroup ``d`` at this instant: ``stat`` (selected memory.stat keys),
    ``pressure`` (v2 memory.pressure, else None), ``io_read_bytes`` (v2 io.stat ``rbytes`` of
    ``device`` "MAJ:MIN", else None); ``*_note`` says why a value is missing."""
    out: dict = {"path": d, "version": version}
    text, why = read_text(os.path.join(d, "memory.stat"))
    out["stat"] = None if text is None else {k: v for k, v in keyed_numbers(text).items() if k.startswith(MEMCG_STAT_PREFIXES)}
    out["stat_note"] = why
    if version == "v2":
        text, why = read_text(os.path.join(d, "memory.pressure"))
        out["pressure"], out["pressure_note"] = (None, why) if text is None else (parse_pressure(text), None)
        text, why = read_text(os.path.join(d, "io.stat"))
        row = next((ln.split()[1:] for ln in (text or "").splitlines() if device and ln.split()[:1] == [device]), None)
        rb = next((int(x[7:]) for x in (row or []) if x.startswith("rbytes=") and x[7:].isdigit()), None)
        out["io_read_bytes"], out["io_read_note"] = rb, None if rb is not None else (
            why or f"io.stat has no row for {device}")
    else:
        out["pressure"], out["pressure_note"] = None, "cgroup v1 has no per-cgroup memory.pressure"
        out["io_read_bytes"], out["io_read_note"] = None, "cgroup v1: no io.stat (the process's own read_bytes is used)"
    return out
