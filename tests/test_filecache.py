"""A wall's reading of a file's page cache (``wall.pagecache.FileCache``): ``cachestat`` walks the
file's page-cache index without a lock, so a walk preempted while the pages churn counts pages added
ahead of it after others evicted behind it (readings 4-15 MiB above every page the cgroup had
charged, only from walks 20-100 times the usual). A slow walk is taken again and the quickest walk's
reading kept (docs/robustness.md, "Under load")."""

from __future__ import annotations

import os

import pytest

from expertcache.wall import pagecache as pc

MiB = 1 << 20


class Scripted:
    """Stands in for the ``cachestat`` system call and the clock: each walk takes the next
    (seconds, bytes) of the script."""

    def __init__(self, monkeypatch, script):
        self.script, self.now, self.walks = list(script), 0.0, 0
        monkeypatch.setattr(pc.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(pc.FileCache, "_cachestat", staticmethod(self.walk))

    def walk(self, fd) -> int:
        took, n = self.script.pop(0)
        self.now += took
        self.walks += 1
        return n


@pytest.fixture
def reader(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0" * 8192)
    fc = pc.FileCache([str(path)])
    if fc.method != "cachestat":
        fc.close()
        pytest.skip("this kernel has no cachestat (Linux 6.5+): the mincore reading has no walk to retry")
    yield fc
    fc.close()


def test_a_slow_walk_is_taken_again_and_the_quicker_reading_kept(reader, monkeypatch):
    true = 460 * MiB
    s = Scripted(monkeypatch, [(0.3e-3, true)] * 4 + [(20e-3, true + 15 * MiB), (0.4e-3, true + MiB // 4)])
    for _ in range(4):
        assert reader.bytes() == true
    assert reader.bytes() == true + MiB // 4  # the preempted walk's 15 MiB set aside
    assert s.walks == 6 and reader.slow_walks == 1


def test_at_most_the_tries_and_then_the_quickest_walk(reader, monkeypatch):
    true = 460 * MiB
    slow = [(30e-3, true + 12 * MiB), (9e-3, true + 3 * MiB), (15e-3, true + 8 * MiB), (0.3e-3, true)]
    s = Scripted(monkeypatch, [(0.3e-3, true)] * 2 + slow)
    reader.bytes(), reader.bytes()
    assert reader.bytes() == true + 3 * MiB  # three walks, all slow: the quickest one's
    assert s.walks == 2 + pc.WALK_TRIES and reader.slow_walks == pc.WALK_TRIES


def test_a_tier_grown_tenfold_is_measured_against_its_recent_walks(reader, monkeypatch):
    """The empty tier at the start walks in microseconds; once the model is loaded every walk takes
    milliseconds. Within a few readings a walk of the grown tier counts as quick again, so the
    reader does not walk three times a reading for the rest of the run."""
    s = Scripted(monkeypatch, [(0.01e-3, 0)] * 4 + [(5e-3, 4000 * MiB)] * 60)
    for _ in range(4):
        reader.bytes()
    counts = []
    for _ in range(12):
        before = s.walks
        assert reader.bytes() == 4000 * MiB
        counts.append(s.walks - before)
    assert counts[0] == pc.WALK_TRIES and counts[-4:] == [1] * 4


def test_the_reading_of_a_real_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * 1024))
    fc = pc.FileCache([str(path)])
    try:
        with open(path, "rb") as fh:
            fh.read()
        assert fc.bytes() == 64 * 1024  # written and read: every page cached
    finally:
        fc.close()
