"""The ``prefetch`` mode's readers (:class:`expertcache.llama.advice.Readers`), as ik_llama.cpp's pool
reads: pieces of 2 MiB read through the page cache, resident pieces skipped, the routed experts'
pieces ahead of a prefill's lookahead, and only what a lookahead read handed back to be marked cold.
On a real file and its page cache (no llama.cpp needed)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from expertcache.llama.advice import PREFETCH_CHUNK, Readers, resident
from expertcache.wall.pagecache import evict_file_pages

MB = 1 << 20
SIZE = 5 * MB


@pytest.fixture
def mapped(tmp_path):
    """A 5 MiB file, written, synced and evicted; yields its path and its mapping's address (a
    private mapping, only read: its pages are the file's page cache)."""
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(SIZE))
    assert evict_file_pages([str(path)])["cold"]
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    anchor = ctypes.c_ubyte.from_buffer(m)
    yield str(path), ctypes.addressof(anchor)
    del anchor
    m.close()


def test_a_lookahead_reads_its_pieces_and_hands_back_what_it_read(mapped):
    path, base = mapped
    assert PREFETCH_CHUNK == 2 * MB and not resident(base, SIZE)
    r = Readers(2, path)
    r.warm(base, [(0, SIZE)], urgent=False, track="layer 3")
    r.close()  # the readers finish what is queued, then stop
    assert resident(base, SIZE)
    assert sorted(r.take_read("layer 3")) == [(base, 2 * MB), (base + 2 * MB, 2 * MB), (base + 4 * MB, MB)]
    assert r.take_read("layer 3") == [] and (r.populated, r.skipped, r.errors) == (SIZE, 0, 0)


def test_resident_pieces_are_skipped_and_not_handed_back(mapped):
    path, base = mapped
    with open(path, "rb") as fh:  # the whole file read, then its last MiB evicted
        fh.read()
        os.posix_fadvise(fh.fileno(), 4 * MB, MB, os.POSIX_FADV_DONTNEED)
    assert resident(base, 4 * MB) and not resident(base + 4 * MB, MB)
    r = Readers(1, path)
    r.warm(base, [(0, SIZE)], urgent=False, track=7)
    r.close()
    assert r.skipped == 2 and r.populated == SIZE - 4 * MB  # [0, 4) MiB resident: only [4, 5) read
    assert r.take_read(7) == [(base + 4 * MB, MB)]


def test_routed_pieces_go_ahead_of_the_lookahead_in_their_own_order(mapped):
    path, base = mapped
    r = Readers(0, path)  # no thread: the queue stays as it was built
    r.warm(base, [(0, 4 * MB)], urgent=False, track=1)
    r.warm(base, [(4 * MB, MB), (MB, MB)], urgent=True)
    assert [(off, n, track) for _, _, n, off, track in r.jobs] == [
        (4 * MB, MB, None), (MB, MB, None), (0, 2 * MB, 1), (2 * MB, 2 * MB, 1)]
    assert [addr - off for _, addr, _, off, _ in r.jobs] == [base] * 4
    r.close()


def test_pieces_of_a_mapping_already_gone_are_errors_not_tracebacks(mapped, capfd):
    """An engine closed before its advisor leaves queued pieces over an unmapped range: ``mincore``
    fails there; the reader counts an error and goes on (no traceback on stderr). The range: the
    address space's first pages after page 0, where nothing is mapped (the interpreter, its
    libraries, heap and mappings lie far above; only a ``MAP_FIXED`` request would put one there)."""
    path, _ = mapped
    r = Readers(1, path)
    r.warm(4096, [(0, 32 << 10), (32 << 10, 16 << 10)], urgent=True, track="x")
    r.close()
    assert (r.errors, r.skipped, r.take_read("x")) == (2, 0, []) and capfd.readouterr().err == ""
