"""Accounting on real files: mincore residency, fadvise eviction, block-device bytes, deltas."""

from __future__ import annotations

import json
import os

import pytest

from expertcache.wall import accounting as acc
from expertcache.wall.pagecache import evict_file_pages, residency
from expertcache.wall.procfs import vmlck_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")


def _write(path, n: int) -> str:
    with open(path, "wb") as fh:
        fh.write(os.urandom(n))
        fh.flush()
        os.fsync(fh.fileno())
    return str(path)


def _read_all(path: str) -> int:
    n = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            n += len(chunk)
    return n


def test_residency_read_then_evict(tmp_path):
    f = _write(tmp_path / "a.bin", 3 * (1 << 20) + 123)  # a partial last page
    empty = _write(tmp_path / "empty.bin", 0)
    _read_all(f)
    res, total = residency([f, empty])
    assert total == 3 * (1 << 20) + 123
    assert 0 < res <= total
    out = evict_file_pages([f, empty])
    assert out["total_bytes"] == total and out["errors"] == []
    assert out["resident_after_bytes"] == 0 and out["cold"] is True
    assert residency([f]) == (0, total)
    with open(f, "rb") as fh:  # touch exactly the first page: residency says one page
        fh.read(10)
    res, _ = residency([f])
    assert res >= PAGE and res % PAGE == 0 or res == total  # readahead may bring more, never a fraction
    assert residency([]) == (0, 0)


def test_residency_missing_file_is_oserror(tmp_path):
    with pytest.raises(OSError):
        residency([str(tmp_path / "nope")])
    snap = acc.snapshot([str(tmp_path / "nope")])
    assert snap["residency"] is None and "nope" in snap["residency_note"]
    assert snap["block_device"] is None and snap["block_device_note"]


def test_device_bytes_cover_a_cold_read(tmp_path):
    f = _write(tmp_path / "b.bin", 8 * (1 << 20))
    assert evict_file_pages([f])["cold"]
    pre = acc.snapshot([f])
    if pre["diskstats"] is None:
        pytest.skip(f"no diskstats for the temp folder: {pre['diskstats_note']}")
    assert _read_all(f) == 8 << 20
    post = acc.snapshot([f])
    d = acc.delta(pre, post)
    json.dumps(d)  # JSON-able
    assert d["device_read_note"] is None
    assert d["device_read_bytes"] >= 8 << 20  # every byte came from the device (plus others' reads)
    assert d["residency_before"]["resident_bytes"] == 0
    assert d["residency_after"]["resident_bytes"] > 0
    assert d["meminfo_at_entry"]["MemAvailable"] > 0
    # a warm second read costs the device (almost) nothing of this file
    pre2 = acc.snapshot([f])
    _read_all(f)
    d2 = acc.delta(pre2, acc.snapshot([f]))
    assert d2["device_read_bytes"] < d["device_read_bytes"]


def test_delta_arithmetic_and_nulls():
    row = dict.fromkeys(acc.DISKSTATS_FIELDS, 0)
    dev = {"device": "vdx", "major": 254, "minor": 0}
    pre = {"time_monotonic": 1.0, "block_device": dev, "diskstats": dict(row, sectors_read=100, reads=3),
           "vmstat": {"pgscan_kswapd": 10, "pgscan_direct": 5, "pgsteal_kswapd": 4, "pgsteal_direct": 1,
                      "workingset_refault_file": 7},
           "pressure": {"io": {"some": {"total": 100}, "full": {"total": 50}}, "memory": None},
           "pressure_note": {"memory": "/proc/pressure/memory: No such file"},
           "meminfo": {"MemAvailable": 5}, "vmlck_bytes": 0, "residency": {"resident_bytes": 0, "total_bytes": 9}}
    post = {"time_monotonic": 3.5, "block_device": dev, "diskstats": dict(row, sectors_read=300, reads=5),
            "vmstat": {"pgscan_kswapd": 40, "pgscan_direct": 5, "pgsteal_kswapd": 14, "pgsteal_direct": 6,
                       "workingset_refault_file": 9},
            "pressure": {"io": {"some": {"total": 160}, "full": {"total": 50}}, "memory": None},
            "meminfo": {"MemAvailable": 4}, "vmlck_bytes": 0, "residency": {"resident_bytes": 9, "total_bytes": 9}}
    d = acc.delta(pre, post)
    assert d["seconds"] == 2.5
    assert d["device_read_bytes"] == 200 * 512 and d["device_reads"] == 2
    assert d["pgscan_total"] == 30 and d["pgsteal_total"] == 15 and d["reclaim_scan_per_steal"] == 2.0
    assert d["vmstat"]["workingset_refault_file"] == 2
    assert d["pressure"]["io"] == {"some_us": 60, "full_us": 0}
    assert d["pressure"]["memory"] is None and "memory" in d["pressure_note"]
    assert d["meminfo_at_entry"] == {"MemAvailable": 5}
    backwards = acc.delta(post, pre)
    assert backwards["device_read_bytes"] is None and "backwards" in backwards["device_read_note"]
    nodev = acc.delta(dict(pre, block_device=None, diskstats=None, diskstats_note="overlay"),
                      dict(post, block_device=None, diskstats=None, diskstats_note="overlay"))
    assert nodev["device_read_bytes"] is None and nodev["device_read_note"] == "overlay"


def test_virtual_filesystem_has_no_device():
    dev, why = acc.block_device("/proc/self/status")
    assert dev is None and "no block device" in why


def test_reclaim_setup_reads_or_explains():
    setup = acc.reclaim_setup()
    json.dumps(setup)
    assert setup["kernel"] == os.uname().release
    for key in ("mglru", "swap", "thp", "cgroup"):
        assert setup[key] is not None or setup.get(f"{key}_note")
    assert vmlck_bytes() is None or vmlck_bytes() >= 0


def test_a_proc_file_kept_open_is_read_again_whole_and_current(tmp_path, monkeypatch):
    """OpenProcFile (what a walled process reads /proc through: opening a file inside a cgroup at its
    limit can fail with ENOMEM): once made, reading opens nothing; each read is the file's current
    text (a mapping made after the open is there, at its file offset); the io counters move with
    this process's reads; a text over the cap and a closed file are reasons, never a short text."""
    import builtins
    import mmap

    from expertcache.llama.advice import mapped_ranges, mapping_base
    from expertcache.wall.procfs import SELF_IO, OpenProcFile, file_mappings, read_self_io

    path = _write(tmp_path / "f.bin", 8 * PAGE)
    maps, io = OpenProcFile("/proc/self/maps"), OpenProcFile(SELF_IO)
    before, _ = read_self_io(io)

    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 4 * PAGE, prot=mmap.PROT_READ, offset=2 * PAGE)  # file pages 2..5
        with monkeypatch.context() as mp:  # from here no file may be opened
            mp.setattr(os, "open", refuse)
            mp.setattr(builtins, "open", refuse)
            os.pread(fd, 4 * PAGE, 0)
            text, why = maps.read()
            assert why is None
            (lo, hi, off), = file_mappings(text, path)
            assert (hi - lo, off) == (4 * PAGE, 2 * PAGE)
            assert mapping_base(path, maps) == lo - 2 * PAGE and mapped_ranges(path, maps) == [(2 * PAGE, 4 * PAGE)]
            after, _ = read_self_io(io)
        assert after["rchar"] >= before["rchar"] + 4 * PAGE and after["syscr"] > before["syscr"]
        m.close()
        text, _ = maps.read()
        assert file_mappings(text, path) == []  # the mapping went: the next read says so
    finally:
        os.close(fd)
    small = OpenProcFile("/proc/self/maps", cap=64)
    assert small.read() == (None, "/proc/self/maps: longer than 64 bytes")
    small.close()
    maps.close()
    io.close()
    text, why = maps.read()
    assert text is None and "/proc/self/maps" in why
