"""The page cache and this process's I/O, as the host tier sees them.

* :func:`resident_bytes`: how much of a mapped range is in memory (``mincore``), so a copy out
  of the mapping can be counted as a page-cache hit or a device read;
* :func:`release_mappings` / :func:`drop_cached`: give tensors that point into a file mapping
  their own memory, then drop the files' clean cached pages (these files only): a cold host tier;
* :func:`read_bytes_self`: ``/proc/self/io`` ``read_bytes``, what this process made the block
  layer read (other tenants' reads are not in it).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import torch

from ..wall.procfs import MAPS_CAP, file_mappings, read_self_io, read_whole

PAGE = mmap.PAGESIZE

_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc.mincore


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under the mapped CPU tensor ``t`` that are in memory (``mincore``)."""
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    base = addr - addr % PAGE
    pages = -(-(addr + n - base) // PAGE)
    vec = np.zeros(pages, dtype=np.uint8)
    if _mincore()(base, pages * PAGE, vec.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return PAGE * int(np.count_nonzero(vec & 1))


def mapped_ranges(paths) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``paths`` (``/proc/self/maps``; none where it
    or a path cannot be read)."""
    text, _ = read_whole("/proc/self/maps", MAPS_CAP)
    out = []
    for p in paths if text is not None else ():
        try:
            out += [(lo, hi) for lo, hi, _ in file_mappings(text, p)]
        except OSError:
            continue
    return out


def release_mappings(model: torch.nn.Module, paths) -> None:
    """Give every parameter and buffer that still points into a mapping of ``paths`` (transformers
    may load weights zero-copy) its own memory, so the mapping goes and the files' pages can be
    dropped: the page cache then holds only what a miss reads."""
    import gc

    ranges = mapped_ranges(paths)
    if not ranges:
        return
    inside = lambda t: any(a <= t.untyped_storage().data_ptr() < b for a, b in ranges)
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and inside(param):
                param.data = param.data.clone()
        for name, buf in module._buffers.items():
            if buf is not None and inside(buf):
                module._buffers[name] = buf.clone()
    gc.collect()


def drop_cached(paths) -> None:
    """Ask the kernel to drop the clean cached pages of ``paths`` (these files only): a cold host tier."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes_self() -> int | None:
    """This process's ``read_bytes`` from ``/proc/self/io`` (bytes it caused to be fetched from
    storage, readahead included; other tenants' reads are not in it), or ``None`` when unreadable."""
    counters, _ = read_self_io()
    return counters["read_bytes"] if counters else None
