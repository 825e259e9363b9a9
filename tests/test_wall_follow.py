"""The following wall's limit, sample by sample, on a fake cgroup v1 directory (no kernel needed):
the room it leaves above the worker's usage (a floor for the worker's system calls, a bound for
the tier), the steps while the worker waits for memory, and the follow flag released only once a
following limit is written (wall/cgroupfs.py, ``Sampler``; docs/robustness.md, "Under load")."""

from __future__ import annotations

import os
import time

import pytest

from expertcache.wall import cgroupfs as cg
from expertcache.wall.pagecache import FileCache

MiB = 1 << 20
CAPACITY, MARGIN, CEILING = 8 * MiB, MiB // 2, 4096 * MiB


class FakeCgroup:
    """The files a v1 Sampler reads and writes, in a temporary folder."""

    def __init__(self, d):
        self.d = str(d)
        self.set(usage=0, file=0)

    def set(self, *, usage: int, file: int, anon: int | None = None, unevictable: int = 0,
            under_oom: bool = False, cache: int | None = None) -> None:
        anon = usage - file - unevictable if anon is None else anon
        stat = {"active_file": file, "inactive_file": 0, "active_anon": anon, "inactive_anon": 0,
                "unevictable": unevictable, **({} if cache is None else {"cache": cache})}
        with open(os.path.join(self.d, "memory.stat"), "w") as fh:
            fh.write("".join(f"{k} {v}\n" for k, v in stat.items()))
        with open(os.path.join(self.d, "memory.usage_in_bytes"), "w") as fh:
            fh.write(f"{usage}\n")
        with open(os.path.join(self.d, "memory.oom_control"), "w") as fh:
            fh.write(f"oom_kill_disable 1\nunder_oom {int(under_oom)}\n")

    @property
    def limit(self) -> int:
        with open(os.path.join(self.d, "memory.limit_in_bytes")) as fh:
            return int(fh.read())


@pytest.fixture
def cgroup(tmp_path):
    return FakeCgroup(tmp_path)


def sampler(cgroup, flag=None) -> cg.Sampler:
    s = cg.Sampler(cgroup.d, "v1", follow=(CAPACITY, CEILING, MARGIN), follow_flag=flag)
    s._following = True
    return s


def floor() -> int:
    return max(MARGIN, min(cg.FLOOR_BYTES, CAPACITY + MARGIN + MARGIN // 2))  # within the room of an empty tier


def test_the_limit_follows_own_memory_plus_the_capacity(cgroup):
    s = sampler(cgroup)
    cgroup.set(usage=100 * MiB, file=0)
    s.sample()
    assert cgroup.limit == 100 * MiB + CAPACITY + MARGIN


def test_a_worker_grown_up_to_its_limit_keeps_room_for_its_system_calls(cgroup):
    """Own memory grew past the window's least without waiting yet: the last limit would sit at the
    usage, where a system call's charge fails (ENOMEM) on v1; the floor leaves room above it."""
    s = sampler(cgroup)
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()
    cgroup.set(usage=90 * MiB + CAPACITY + MARGIN, file=0)  # grown up to the limit, nothing reclaimable
    s.sample()
    assert cgroup.limit - (90 * MiB + CAPACITY + MARGIN) >= floor() - 4096


def test_reclaimable_page_cache_counts_toward_the_floor(cgroup):
    """Where the cgroup holds page cache the kernel can reclaim for a system call, the floor adds
    nothing: the limit stays where the tier's bound puts it."""
    s = sampler(cgroup)
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()
    usage = 90 * MiB + CAPACITY + MARGIN
    cgroup.set(usage=usage, file=CAPACITY)  # the tier fills the capacity: reclaimable
    s.sample()
    assert cgroup.limit <= usage + MARGIN


def test_the_floor_never_gives_the_tier_more_than_its_bound(cgroup):
    """A tier of locked memory at the capacity, nothing reclaimable: the floor would leave 4 MiB
    above the usage, but the tier may take only one margin more, and that bound wins."""
    s = sampler(cgroup)
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()
    usage = 90 * MiB + CAPACITY + MARGIN
    cgroup.set(usage=usage, file=0, unevictable=CAPACITY + MARGIN)
    s.sample()
    assert cgroup.limit - usage <= MARGIN


def test_steps_while_the_worker_waits_stay_within_what_the_tier_may_take(cgroup):
    """A worker waiting for memory gets a step, but never more room above its usage than the tier
    may fill without leaving the proof's slack (capacity + 1.5 margins - tier)."""
    s = sampler(cgroup)
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()
    for tier in (0, CAPACITY // 2, CAPACITY, CAPACITY + MARGIN):
        usage = cgroup.limit
        cgroup.set(usage=usage, file=tier, under_oom=True)
        s.sample()
        room = cgroup.limit - usage
        assert room > 0, tier
        assert room <= max(MARGIN, CAPACITY + MARGIN + MARGIN // 2 - tier) + 4096, tier
    assert s.limits["oom_waits"] == 4


def test_the_flag_is_released_only_once_a_following_limit_is_written(cgroup, tmp_path):
    """v1 refuses a limit (EBUSY) below a usage that grew between the read and the write: the
    worker, waiting on its flag, must not go on to load its model under the start-up ceiling."""
    flag = str(tmp_path / "worker.follow")
    open(flag, "w").close()
    limit_file = os.path.join(cgroup.d, "memory.limit_in_bytes")
    os.mkdir(limit_file)  # writing it fails, as a refused limit does
    s = cg.Sampler(cgroup.d, "v1", follow=(CAPACITY, CEILING, MARGIN), follow_flag=flag)
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()
    assert os.path.exists(flag) and s.limits["limit_write_errors"] == 1
    os.rmdir(limit_file)
    s.sample()
    assert not os.path.exists(flag)
    assert cgroup.limit == 90 * MiB + CAPACITY + MARGIN


def test_a_model_load_gets_no_room_from_other_files_page_cache(cgroup, tmp_path):
    """While the worker loads its model (llama.cpp maps the GGUF with MAP_POPULATE, faster than a
    sample), the page cache of other files charged to the wall is room the kernel reclaims for the
    load: the wall counts it as room, so the tier cannot pass its bound; the worker's mark is removed
    once such a limit is written, and the phase ends when the worker says so."""
    from expertcache.wall.pagecache import evict_file_pages

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * (1 << 16))
    evict_file_pages([str(gguf)])
    flag = str(tmp_path / "worker.follow")
    s = cg.Sampler(cgroup.d, "v1", follow=(CAPACITY, CEILING, MARGIN), follow_flag=flag, tier_files=[str(gguf)],
                   tier_locked=False)
    open(flag, "w").close()
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()  # following from here (begin_following)
    assert not os.path.exists(flag)
    other = 24 * MiB  # the libraries' page cache, charged to the wall
    cgroup.set(usage=100 * MiB, file=other)
    open(flag + cg.LOAD_SUFFIX, "w").close()  # model_load: the worker waits for the mark to go
    s.sample()
    assert not os.path.exists(flag + cg.LOAD_SUFFIX)
    tier = s.files.bytes()
    assert cgroup.limit - (100 * MiB - other) <= CAPACITY + MARGIN - tier + 4096
    open(flag + cg.LOADED_SUFFIX, "w").close()  # the load is over
    s.sample()
    assert not os.path.exists(flag + cg.LOADED_SUFFIX)
    assert cgroup.limit >= 100 * MiB  # other files' pages are the worker's own memory again
    s.files.close()


def loading(cgroup, tmp_path, usage: int) -> tuple[cg.Sampler, str]:
    """A following sampler whose worker (``usage`` bytes) has begun its model load: ``(sampler, flag)``."""
    flag = str(tmp_path / "worker.follow")
    s = cg.Sampler(cgroup.d, "v1", follow=(CAPACITY, CEILING, MARGIN), follow_flag=flag)
    open(flag, "w").close()
    cgroup.set(usage=usage, file=0)
    s.sample()
    open(flag + cg.LOAD_SUFFIX, "w").close()
    s.sample()
    return s, flag


def test_the_load_ends_only_once_the_limit_after_it_is_written(cgroup, tmp_path):
    """The load fills the room it is given, so when it ends the cgroup sits at its limit, where a
    system call's charge fails (a server's next thread start did): the worker's end-of-load mark
    stays until the wall has written its limit after the load, with room above the usage."""
    s, flag = loading(cgroup, tmp_path, 90 * MiB)
    assert not os.path.exists(flag + cg.LOAD_SUFFIX)
    full = cgroup.limit
    cgroup.set(usage=full, file=MARGIN)  # at its limit, little of it reclaimable
    limit_file = os.path.join(cgroup.d, "memory.limit_in_bytes")
    os.rename(limit_file, limit_file + ".x")
    os.mkdir(limit_file)  # the write after the load is refused once
    open(flag + cg.LOADED_SUFFIX, "w").close()
    s.sample()
    assert os.path.exists(flag + cg.LOADED_SUFFIX)  # no limit after the load yet: the worker waits
    os.rmdir(limit_file)
    os.rename(limit_file + ".x", limit_file)
    s.sample()
    assert not os.path.exists(flag + cg.LOADED_SUFFIX)
    assert cgroup.limit - full >= cg.FLOOR_BYTES - MARGIN  # room and reclaimable cache: the floor


def test_the_load_end_mark_of_a_wall_that_follows_nothing_goes_at_once(tmp_path):
    """A wall that follows nothing (none, balloon) acknowledges every mark, the end of a load too."""
    import threading
    import time

    from expertcache.wall.capacity import _ack_flag, model_load

    flag = str(tmp_path / "worker.follow")
    done = threading.Event()
    _ack_flag(flag, done)
    t0 = time.monotonic()
    with model_load(flag):
        pass
    done.set()
    assert time.monotonic() - t0 < 2 and not os.path.exists(flag + cg.LOADED_SUFFIX)


def test_a_settled_worker_restarts_the_window(cgroup, tmp_path):
    """A worker that has warmed up (its first forward's buffers touched) says so with the settled
    mark: the window restarts from that sample, the limit counts its memory at once, and the mark
    goes once that limit is written (llama run's managed mode does this before its pool fills)."""
    s, flag = loading(cgroup, tmp_path, 50 * MiB)
    open(flag + cg.LOADED_SUFFIX, "w").close()
    s.sample()
    cgroup.set(usage=60 * MiB, file=0)  # the warm-up's buffers
    s.sample()
    assert min(s._recent_own) == 50 * MiB  # the window's least still the load's end
    open(flag + cg.SETTLED_SUFFIX, "w").close()
    s.sample()
    assert not os.path.exists(flag + cg.SETTLED_SUFFIX)
    assert list(s._recent_own) == [60 * MiB] and cgroup.limit == 60 * MiB + CAPACITY + MARGIN and s._bias == 0


def tier_sampler(cgroup, tmp_path):
    """A following sampler whose tier is a file's page cache, its flag and the file."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * (1 << 16))
    flag = str(tmp_path / "worker.follow")
    s = cg.Sampler(cgroup.d, "v1", follow=(CAPACITY, CEILING, MARGIN), follow_flag=flag, tier_files=[str(gguf)],
                   tier_locked=False)
    s._following = True
    return s, flag, gguf


def scripted_tier(s, gguf, values) -> None:
    """The sampler's tier readings replaced by ``values``, one a reading, in order."""
    reads = iter(values)

    class Scripted(FileCache):
        def bytes(self):
            return next(reads)

    s.files.close()
    s.files = Scripted([str(gguf)])


def settled_tier_sampler(cgroup, tmp_path, values):
    """:func:`tier_sampler` whose worker has settled at 90 MiB (its window restarted there), then
    whose tier readings are ``values``: ``(sampler, flag)``."""
    s, flag, gguf = tier_sampler(cgroup, tmp_path)
    open(flag + cg.SETTLED_SUFFIX, "w").close()
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()
    assert s._settled and not os.path.exists(flag + cg.SETTLED_SUFFIX)
    scripted_tier(s, gguf, values)
    return s, flag


def test_after_it_settled_a_sample_taken_while_the_tier_moves_stays_out(cgroup, tmp_path):
    """Once the worker has settled, the tier is read on both sides of the usage; a sample in which
    it moved by more than a quarter margin (a prefill reading 1 GB/s) and whose own memory would
    lower the window's least stays out (its dip held the limit low for a second); one that would
    not lower it is kept, so the window slides."""
    # the tier grew by a margin during each of the next two samples
    s, flag = settled_tier_sampler(cgroup, tmp_path, [0, MARGIN, 0, MARGIN])
    base = list(s._recent_own)
    cgroup.set(usage=80 * MiB, file=0)  # own read low: left out
    s.sample()
    assert list(s._recent_own) == base
    cgroup.set(usage=100 * MiB, file=0)  # own read high: kept
    s.sample()
    assert list(s._recent_own) == base + [100 * MiB - MARGIN]


def test_a_sample_whose_tier_fell_between_its_readings_lowers_no_limit(cgroup, tmp_path):
    """A managed pool drops its victims, then reads its loads: a usage read between them came out
    18 MB low against the tier read after, and the tier fell 52 MB between the sample's two
    readings. Such a sample is moving too (either way): it stays out of the window, it writes no
    lower limit (its room above that usage had come out 35 MB short, and the kernel took the pool's
    pages through the decode), and the next sample comes at once."""
    tier = CAPACITY - MARGIN
    # steady twice, then a fall within a sample
    s, flag = settled_tier_sampler(cgroup, tmp_path, [tier] * 4 + [tier + MARGIN, tier - MARGIN])
    cgroup.set(usage=90 * MiB + tier, file=tier)
    s.sample()
    s.sample()  # no growth since the last sample: the settled pace
    limit, base = cgroup.limit, list(s._recent_own)
    assert s.interval != cg.SAMPLE_FAST_S
    cgroup.set(usage=80 * MiB + tier, file=tier)  # the usage read low, between a drop and its loads
    s.sample()
    assert list(s._recent_own) == base  # left out of the window
    assert cgroup.limit == limit and s.interval == cg.SAMPLE_FAST_S  # no lower limit; look again at once


def test_a_mark_refused_for_memory_is_tried_again(tmp_path, monkeypatch):
    """On v1 a system call charged at the limit fails with ENOMEM instead of waiting; creating a
    handshake mark at the end of a model's load met it beside two burners. The worker tries again
    until the wall's next limit gives room (within the handshake's wait), then waits as before."""
    import builtins
    import errno
    import threading
    import time

    from expertcache.wall import capacity

    mark = str(tmp_path / "worker.follow.loaded")
    refusals = [2]

    def fake_open(path, *a, **k):
        if path == mark and refusals[0]:
            refusals[0] -= 1
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return builtins.open(path, *a, **k)

    def wall():  # removes the mark once it appears, as the sampler does
        while not os.path.exists(mark):
            time.sleep(0.001)
        os.unlink(mark)

    monkeypatch.setattr(capacity, "open", fake_open, raising=False)
    t = threading.Thread(target=wall, daemon=True)
    t.start()
    capacity._handshake(mark, "took no limit")
    t.join(timeout=5)
    assert refusals[0] == 0 and not os.path.exists(mark)
    refusals[0] = 10**9  # refused for good: the error, once the handshake's wait is over
    monkeypatch.setattr(capacity, "FOLLOW_WAIT_S", 0.05)
    with pytest.raises(OSError):
        capacity._handshake(mark, "took no limit")


@pytest.mark.parametrize("mark", [cg.SETTLED_SUFFIX, cg.STEADY_SUFFIX])
def test_once_steady_the_tier_readings_take_a_bounded_share_of_a_core(cgroup, tmp_path, monkeypatch, mark):
    """A tier reading walks the file's page cache (3.2 ms of CPU for a 1.2 GB GGUF), and a sampler at
    nice -10 takes that from the worker's compute threads. Before the worker settles the wall samples
    every SAMPLE_S (start-up and load need it); after, the next sample waits ``cost / TIER_CPU_SHARE``
    (within [SAMPLE_S, SETTLED_MAX_S]); a worker that grows still gets SAMPLE_FAST_S. The steady mark
    (llama run's worker after its prefill, any mode) does the same without the settled handshake."""
    s, flag, gguf = tier_sampler(cgroup, tmp_path)
    cost = 0.003  # CPU seconds per reading (two a sample once settled)

    class Costly(FileCache):
        def bytes(self):
            t = time.thread_time()
            while time.thread_time() - t < cost:
                pass
            return 0

    s.files.close()
    s.files = Costly([str(gguf)])
    cgroup.set(usage=90 * MiB, file=0)
    s.sample()
    assert s.interval == cg.SAMPLE_S  # not settled: every 50 ms however costly
    open(flag + mark, "w").close()
    s.sample()
    assert s._steady and cost / cg.TIER_CPU_SHARE <= s.interval <= cg.SETTLED_MAX_S
    if mark == cg.SETTLED_SUFFIX:
        s.sample()  # now read on both sides of the usage
        assert 2 * cost / cg.TIER_CPU_SHARE <= s.interval <= cg.SETTLED_MAX_S
    else:
        assert not s._settled and os.path.exists(flag + mark)  # no handshake: the mark stays
    monkeypatch.setattr(cg, "TIER_CPU_SHARE", 1e-6)
    s.sample()
    assert s.interval == cg.SETTLED_MAX_S
    cgroup.set(usage=90 * MiB + 2 * MARGIN, file=0)  # grew by a margin since the last sample
    s.sample()
    assert s.interval == cg.SAMPLE_FAST_S


def test_a_worker_waiting_for_memory_before_the_limit_follows_is_killed_after_the_patience(cgroup, monkeypatch):
    """Before it follows, the limit is the start-up ceiling; a worker whose own memory needs more
    (``--headroom 1MB``) had waited for memory for ever (a walled run hung until its timeout): after
    OOM_PATIENCE_S of waiting the OOM killer is turned back on, as at a following limit's ceiling."""
    s = cg.Sampler(cgroup.d, "v1", follow=(CAPACITY, CEILING, MARGIN), follow_flag=None)
    clock = [100.0]
    monkeypatch.setattr(cg.time, "monotonic", lambda: clock[0])
    oom = os.path.join(cgroup.d, "memory.oom_control")
    cgroup.set(usage=CAPACITY, file=0, under_oom=True)
    s.sample()
    assert not s._following and s.limits["oom_waits"] == 1 and "oom_kill_disable 1" in open(oom).read()
    clock[0] += cg.OOM_PATIENCE_S / 2
    s.sample()
    assert "oom_kill_disable 1" in open(oom).read()  # still within the patience
    clock[0] += cg.OOM_PATIENCE_S
    s.sample()
    assert open(oom).read() == "0"  # the killer is back on: the kernel ends the wait
    cgroup.set(usage=CAPACITY, file=0, under_oom=False)
    s.sample()
    assert s._oom_since is None


def test_a_following_wall_that_squeezes_the_tier_fails_its_proof(cgroup):
    """A following limit that holds the tier far below the capacity while the cgroup sits at it:
    the run measures a smaller cache than its wall (an 8 MB wall whose tier peaked at 4.4 MB read
    4-8 times the file a token), yet the proof had held (its "reached" compared the usage with the
    ceiling, capacity + 4 GiB). Counted only after the first forward (steady)."""
    from expertcache.wall.cgroupwall import cgroup_problems, proof_slack, squeezed

    s = sampler(cgroup)
    s._steady = True
    cgroup.set(usage=40 * MiB, file=0)
    s.sample()  # the first limit is written
    for _ in range(4):
        limit = cgroup.limit
        cgroup.set(usage=limit - 4096, file=CAPACITY // 2)  # at the limit, the tier at half the capacity
        s.sample()
    lim = s.limits
    assert lim["at_limit_samples"] >= 3 and lim["at_limit_tier_max_bytes"] == CAPACITY // 2
    floor = CAPACITY - proof_slack(CAPACITY)
    assert squeezed(lim, floor) and not squeezed({**lim, "at_limit_tier_max_bytes": int(floor) + 1}, floor)
    proof = {**lim, "limit_bytes": 50 * MiB, "follow_margin_bytes": MARGIN, "peak_bytes": 45 * MiB,
             "tier_peak_bytes": CAPACITY // 2, "own_peak_bytes": 40 * MiB, "removed": True}
    problems = cgroup_problems(proof, CEILING, CAPACITY, True, None)
    assert len(problems) == 1 and "held the tier below the capacity" in problems[0], problems
    assert cgroup_problems({**proof, "at_limit_tier_max_bytes": CAPACITY}, CEILING, CAPACITY, True, None) == []


def test_a_tier_squeezed_at_the_limit_raises_it(cgroup):
    """Own memory stepped up after the load (a first forward's buffers: 16 MB in a Qwen3 2-thread
    decode) while the window's least still holds the load's: a page-cache mode's tier sat 11 MB
    under its 393 MB capacity, 0.6 MB above the squeezed proof's floor, until the window slid a
    second later (after a 0.6 s decode had ended). Feedback on the tier gives the room back: each
    sample at the limit with the tier below the capacity less the margin raises the limit by half
    the shortfall, until the tier reaches it."""
    s = sampler(cgroup)
    s._steady = True
    cgroup.set(usage=40 * MiB, file=0)
    s.sample()  # the first limit is written: the window's least own memory is 40 MiB
    own = 40 * MiB + 4 * MiB  # the step: own memory 4 MiB above the window's least
    tiers = []
    for _ in range(8):
        limit = cgroup.limit
        tier = limit - own  # the kernel fills the page cache up to the limit
        cgroup.set(usage=limit, file=tier)
        s.sample()
        tiers.append(tier)
    assert tiers[0] == CAPACITY + MARGIN - 4 * MiB  # squeezed by the step less the margin
    assert all(b >= a for a, b in zip(tiers, tiers[1:])) and tiers[-1] >= CAPACITY - MARGIN - (1 << 16)
    assert cgroup.limit <= own + CAPACITY + MARGIN  # never above where the tier's bound puts it


def test_a_tier_over_its_capacity_is_reclaimed_at_once(cgroup):
    """In a page-cache thrash own memory reads high (pages on their way out are still charged), and
    the tier grew past the capacity while the limit sat at the usage: only the bias, half the excess
    a sample, brought it down, and 4 of 8 ``advise`` and ``prefetch`` runs at a 480 MB wall ended 1-8
    MB past the proof's slack. A sample that finds the tier over writes a limit below the usage by
    the excess, which the kernel reclaims at once; never more than the page cache less the floor."""
    s = sampler(cgroup)
    s._steady = True
    cgroup.set(usage=40 * MiB, file=0)
    s.sample()  # the first limit is written: the window's least own memory is 40 MiB
    usage = cgroup.limit
    over = 3 * MiB
    cgroup.set(usage=usage, file=CAPACITY + over, anon=usage - CAPACITY - over)  # at the limit, the tier over
    s.sample()
    assert cgroup.limit == usage - over
    # a tier over the capacity in locked pages, with less page cache than the floor: nothing to reclaim,
    # the limit is not lowered below the usage
    s2 = sampler(FakeCgroup(cgroup.d))
    s2._steady = True
    cgroup.set(usage=40 * MiB, file=0)
    s2.sample()
    usage = cgroup.limit
    cgroup.set(usage=usage, file=2 * MiB, unevictable=CAPACITY + MARGIN - 2 * MiB,
               anon=usage - CAPACITY - MARGIN)
    s2.sample()
    assert cgroup.limit >= usage


def test_a_load_over_the_capacity_leaves_no_bias_behind(cgroup, tmp_path):
    """During the model's load the tier sits up to a margin over the capacity by the load's own rule,
    and the limit there does not use the feedback: a bias summed over the load's samples was never
    applied, then squeezed the run after it (46 MB at the load's end, an ``advise`` tier held at
    380.7 MB under a 393.2 MB capacity, its proof false). The load's samples leave it at 0."""
    s, flag = loading(cgroup, tmp_path, 50 * MiB)
    assert s._loading
    for _ in range(20):
        cgroup.set(usage=50 * MiB + CAPACITY + MARGIN, file=CAPACITY + MARGIN)
        s.sample()
    assert s._bias == 0 and s.limits.get("max_bias_bytes", 0) == 0


def test_the_tier_peak_is_published_each_time_it_rises(cgroup, tmp_path):
    """A wall with a follow flag publishes its proof's tier peak at ``flag + PEAK_SUFFIX`` (what
    ``serve``'s ``/metrics`` shows live): the running maximum of the samples, the proof's number."""
    flag = str(tmp_path / "w.follow")
    s = sampler(cgroup, flag)
    peak = flag + cg.PEAK_SUFFIX
    assert cg.read_published_peak(peak) is None  # nothing sampled yet
    for file, want in ((3 * MiB, 3 * MiB), (5 * MiB, 5 * MiB), (2 * MiB, 5 * MiB), (6 * MiB, 6 * MiB)):
        cgroup.set(usage=100 * MiB, file=file)
        s.sample()
        assert cg.read_published_peak(peak) == want == s.peaks["tier_peak_bytes"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # replaced whole, nothing left


@pytest.mark.parametrize("text", [b"", b"12a", b"-5", b"1" * 40, b"\xff\xfe", b" 7"])
def test_a_published_peak_that_is_not_a_count_reads_as_none(tmp_path, text):
    path = tmp_path / "w.peak"
    path.write_bytes(text)
    assert cg.read_published_peak(str(path)) is None
    assert cg.read_published_peak(str(tmp_path / "absent")) is None


def test_one_sample_short_of_the_capacity_gives_nothing_back(cgroup):
    """A reading of the tier taken while its pages churn can be tens of MB low: a prefetch prefill's
    sample read 436 MB of a 480 MB wall's file while the cgroup's file pages were 470; the limit it
    gave back let the tier end 0.2 MB past the proof's slack. A shortfall is given back only once two
    samples in a row found it, and only the smaller of the two."""
    s = sampler(cgroup)
    s._steady = True
    cgroup.set(usage=40 * MiB, file=0)
    s.sample()  # the first limit is written: the window's least own memory is 40 MiB
    full = cgroup.limit
    cgroup.set(usage=full, file=CAPACITY - MARGIN // 2, anon=full - CAPACITY + MARGIN // 2)  # at the limit, full
    s.sample()
    bias, limit = s._bias, cgroup.limit
    low = CAPACITY - 3 * MiB
    cgroup.set(usage=limit, file=low, anon=limit - low)  # one reading 3 MiB short
    s.sample()
    assert s._bias == bias and cgroup.limit == limit
    lower = CAPACITY - 4 * MiB
    cgroup.set(usage=limit, file=lower, anon=limit - lower)  # short again: half the smaller shortfall
    s.sample()
    assert s._bias == bias - (CAPACITY - MARGIN - low) // 2


def test_a_settled_worker_squeezed_by_a_dip_gets_the_room_back_at_once(cgroup, tmp_path):
    """A settled managed run's window took one sample whose own memory read 20 MB low (its tier read
    while the pool churned in the prefill); the limit followed the dip, the kernel took the pool's
    pages at the limit, and the decode after it faulted them back (100-550 major faults a token in 2
    runs of 6 at OLMoE's 25% wall). A shortfall at the limit that the next sample confirms gives room
    back for a settled worker too, and that next sample comes at once, not at the settled pace."""
    s, flag = loading(cgroup, tmp_path, 40 * MiB)
    open(flag + cg.LOADED_SUFFIX, "w").close()
    s.sample()
    open(flag + cg.SETTLED_SUFFIX, "w").close()
    s.sample()
    assert s._settled and s._bias == 0
    dip = 40 * MiB - 2 * MiB  # one sample's own memory, 2 MiB low: the window's least from here
    cgroup.set(usage=dip + CAPACITY - MiB, file=CAPACITY - MiB, anon=dip)
    s.sample()
    assert cgroup.limit == dip + CAPACITY + MARGIN
    tiers, intervals = [], []
    for _ in range(6):  # own memory back at 40 MiB: the kernel keeps the tier at the limit less it
        limit = cgroup.limit
        tier = limit - 40 * MiB
        cgroup.set(usage=limit, file=tier, anon=40 * MiB)
        s.sample()
        tiers.append(tier)
        intervals.append(s.interval)
    assert tiers[0] < CAPACITY - MARGIN  # squeezed
    assert intervals[1] == cg.SAMPLE_FAST_S  # a shortfall with no growth: confirmed at once
    assert s._bias < 0 and tiers[-1] >= CAPACITY - MARGIN - (1 << 16)  # given back: the tier at its room
    assert cgroup.limit <= 40 * MiB + CAPACITY + MARGIN  # never above where the tier's bound puts it


def stepped_after_the_load(cgroup, tmp_path, step: int):
    """A following sampler whose worker's model load has ended at 40 MiB of own memory, then grew by
    ``step`` (its first forward's buffers), the kernel keeping the tier at the limit less that:
    ``(sampler, the step's own memory)``."""
    s, flag = loading(cgroup, tmp_path, 40 * MiB)
    open(flag + cg.LOADED_SUFFIX, "w").close()
    cgroup.set(usage=40 * MiB + CAPACITY, file=CAPACITY, anon=40 * MiB)
    s.sample()
    assert s._loaded and not s._steady and not s._loading
    return s, 40 * MiB + step


def test_own_memory_that_steps_up_after_the_load_is_given_back_in_the_prefill(cgroup, tmp_path):
    """A page-cache mode's prefill allocates its compute buffers (OLMoE, 1 thread: own memory 69 MB
    at the load's end, 95 MB a tenth of a second into the prefill) while the window's least keeps
    the load's for a second: the tier sat 25-31 MB under its 480 MB wall through the prefill and
    most of a 0.8 s decode, since room was given back only once the first forward had run, at the
    settled pace. From the load's end a shortfall at the limit, confirmed, is given back at the
    load's pace: the tier is back within the margin of the capacity within a few samples."""
    s, own = stepped_after_the_load(cgroup, tmp_path, 4 * MiB)
    tiers = []
    for _ in range(8):
        limit = cgroup.limit
        tier = limit - own  # the kernel fills the page cache up to the limit
        cgroup.set(usage=limit, file=tier, anon=own)
        s.sample()
        tiers.append(tier)
    assert tiers[0] < CAPACITY - MARGIN  # squeezed by the step
    assert not s._steady and s._bias < 0  # given back before the first forward ended
    assert tiers[-1] >= CAPACITY - MARGIN - (1 << 16)
    assert cgroup.limit <= own + CAPACITY + MARGIN  # never above where the tier's bound puts it


def test_the_window_catching_up_takes_back_the_room_it_stood_for(cgroup, tmp_path):
    """Room given back below a bias of 0 stands for own memory the window's least has not seen yet;
    when the window slides past the load's samples its least rises by the step, and the limit must
    not rise by it a second time (the tier would pass the capacity by the room given back: with a
    25 MB step, past the proof's slack within one sample). Through the catch-up the tier, filled to
    the limit by the kernel, stays within a margin of the capacity."""
    s, own = stepped_after_the_load(cgroup, tmp_path, 4 * MiB)
    tiers = []
    for _ in range(cg.FOLLOW_WINDOW + 10):
        limit = cgroup.limit
        tier = limit - own
        cgroup.set(usage=limit, file=tier, anon=own)
        s.sample()
        tiers.append(tier)
    assert min(s._recent_own) == own  # the window has caught up
    assert s._bias >= 0  # the room given back is taken back as the least rises (then the usual feedback)
    assert max(tiers) <= CAPACITY + MARGIN and tiers[-1] >= CAPACITY - MARGIN - (1 << 16)


def test_a_tier_reading_above_the_charged_page_cache_counts_what_was_charged(cgroup, tmp_path):
    """A ``cachestat`` walk that churning pages outran can read more than the file holds (a 512-token
    ``prefetch`` prefill: 15 MiB above the cgroup's whole charged page cache, though its walks were
    retried). The tier counted is never more than the page cache the cgroup had charged right after
    the walk (``cache`` on v1), plus the file's pages cached outside the cgroup when the wall began
    (the header the parent read). A reading under that bound is kept as it is."""
    s, flag, gguf = tier_sampler(cgroup, tmp_path)
    outside = s._outside
    assert outside == 1 << 16  # the file was written and is cached: outside the (fake) cgroup
    scripted_tier(s, gguf, [CAPACITY + 15 * MiB, CAPACITY - MiB])  # a walk over-counting, then one under the bound
    charged = CAPACITY - 2 * MiB
    cgroup.set(usage=40 * MiB + charged, file=charged, cache=charged)
    s.sample()
    assert s.peaks["tier_peak_bytes"] == charged + outside
    cgroup.set(usage=40 * MiB + charged, file=charged, cache=CAPACITY)
    s.sample()
    assert s.peaks["tier_peak_bytes"] == CAPACITY - MiB  # a reading under the bound: kept as it is


def test_room_given_back_never_stands_for_more_own_memory_than_there_is(cgroup, tmp_path):
    """Room given back below a bias of 0 stands for own memory above the window's least. When the
    worker frees it (a 512-token prefill's buffers, 100 MB) the window's least falls with it, and the
    room must go too: otherwise the limit leaves the tier the freed memory over its capacity."""
    s, own = stepped_after_the_load(cgroup, tmp_path, 4 * MiB)
    for _ in range(8):  # the step given back
        limit = cgroup.limit
        cgroup.set(usage=limit, file=limit - own, anon=own)
        s.sample()
    assert s._bias < -2 * MiB
    low = 40 * MiB - MiB  # the buffers freed: own memory below the window's least
    cgroup.set(usage=low + CAPACITY, file=CAPACITY, anon=low)
    s.sample()
    assert s._bias >= 0
    assert cgroup.limit - low <= CAPACITY + MARGIN + MARGIN // 2  # the tier's room: its bound, no more


def test_a_moving_sample_takes_no_room_back(cgroup, tmp_path):
    """A settled worker's sample whose tier moved between its two readings does not measure own
    memory (a managed pool drops its victims, then reads its loads: own read 18 MB low). Room given
    back stays through such a sample; a steady sample that finds own memory at the window's least
    takes it back."""
    tier = CAPACITY - MARGIN
    s, flag = settled_tier_sampler(cgroup, tmp_path, [tier, tier + MARGIN, tier, tier])  # moving, then steady
    s._bias = -2 * MiB  # room given back after a confirmed shortfall
    least = min(s._recent_own)
    cgroup.set(usage=least - 3 * MiB + tier + MARGIN, file=tier)  # own read 3 MiB below the least
    s.sample()
    assert s._bias == -2 * MiB
    cgroup.set(usage=least + tier, file=tier)  # steady, own at the window's least
    s.sample()
    assert s._bias >= 0


def test_the_catch_up_takes_the_room_back_when_own_memory_reads_high(cgroup, tmp_path):
    """The catch-up above, where the sample's own memory reads above its true level (a thrash's
    pages on their way out are still charged: 10-20 MB high): the bound on what own memory stands
    above the window's least is loose then, and the rise of the least itself takes the room back."""
    s, own = stepped_after_the_load(cgroup, tmp_path, 4 * MiB)
    old = 40 * MiB
    s._recent_own.clear()
    s._recent_own.extend([old] + [own] * (cg.FOLLOW_WINDOW - 1))  # the load's sample about to leave
    s._bias = -3 * MiB  # room given back for the step
    high = own + 5 * MiB
    cgroup.set(usage=cgroup.limit, file=cgroup.limit - high, anon=high)
    s.sample()
    assert min(s._recent_own) == own and s._bias == 0
