"""Tier accounting that cannot lie (issue 22, part 1): reclaim counters from the right places, the
process's own read bytes, proofs that hold for arena cells, refusals of nonsense, sweeps that keep
their finished cells, a zero-copy mmap reader."""

from __future__ import annotations

import json
import os
import sys
import tracemalloc

import numpy as np
import pytest

from expertcache import Trace
from test_tier_replay import cli, one_line_error
from expertcache.errors import ConfigError
from expertcache.wall import accounting as acc
from expertcache.wall.pagecache import evict_file_pages, residency
from expertcache.wall import capacity as cap
from expertcache.tier.pool import open_pool, pool_from_trace
from expertcache.tier.readers import FileReader, aligned_buffer
from expertcache.tier.sweep import compare

MB = 10**6


@pytest.fixture(scope="module")
def walls():
    return cap.detect_walls()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 4-layer, 16-expert trace of 24 rows (k=2) touching every expert, and 64 MB pools of 1 MB
    entries in both layouts."""
    d = tmp_path_factory.mktemp("proofs")
    rng = np.random.default_rng(5)
    rows = [[rng.choice(16, 2, replace=False) for _ in range(4)] for _ in range(24)]
    rows[:8] = [[[2 * t % 16, (2 * t + 1) % 16] for _ in range(4)] for t in range(8)]  # every expert once
    tr = Trace.from_arrays(np.array(rows), num_experts=16)
    tr.save(d / "t.npz")
    pool_from_trace(d / "pool", tr, expert_bytes=MB, layout="files")
    pool_from_trace(d / "packed", tr, expert_bytes=MB, layout="packed")
    return d, tr


def _walled_replay(setup, walls, capacity: str, *modes: str) -> list[dict]:
    """The --json records of a replay behind the default (cgroup) wall; skipped without one."""
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    d, _ = setup
    r = cli("tier", "replay", d / "t.npz", "--pool", d / "pool", "--capacity", capacity,
            *[x for m in modes for x in ("--mode", m)], "--threads", 2, "--json")
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines()]


# ------------------------------------------------------------------ 1. reclaim counters
def test_reclaim_totals_count_cgroup_reclaim():
    """On 6.x kernels reclaim forced by a cgroup limit appears in pgscan_file/pgsteal_file only."""
    vm = {"pgscan_kswapd": 0, "pgscan_direct": 0, "pgscan_file": 100, "pgscan_anon": 5,
          "pgsteal_kswapd": 0, "pgsteal_direct": 0, "pgsteal_file": 40, "pgsteal_anon": 0}
    assert acc.reclaim_totals(vm) == (105, 40)
    assert acc.reclaim_totals({"pgscan_kswapd": 3, "pgscan_direct": 4, "pgsteal_kswapd": 2}) == (7, 2)


def _snap(stat, pressure=None, version="v2", read_bytes=0):
    return {"self_io": {"read_bytes": read_bytes}, "memcg": {"path": "/cg/wall", "version": version, "stat": stat,
            "pressure": pressure, "io_read_bytes": None, "io_read_note": "x", "pressure_note": None}}


def test_memcg_reclaim_and_pressure_deltas_v2_and_v1():
    pre = _snap({"pgscan": 10, "pgsteal": 5, "pgmajfault": 1}, {"some": {"total": 100}, "full": {"total": 40}})
    post = _snap({"pgscan": 70, "pgsteal": 25, "pgmajfault": 3}, {"some": {"total": 350}, "full": {"total": 90}},
                 read_bytes=10 * MB)
    m = acc._self_and_memcg(pre, post, device_bytes=10 * MB)["memcg"]
    assert (m["pgscan"], m["pgsteal"], m["reclaim_scan_per_steal"]) == (60, 20, 3.0)
    assert m["pressure"] == {"some_us": 250, "full_us": 50} and m["stat"]["pgmajfault"] == 2
    m1 = acc._self_and_memcg(_snap({"pgpgin": 1}, version="v1"), _snap({"pgpgin": 9}, version="v1"), None)["memcg"]
    assert m1["reclaim_scan_per_steal"] is None and "v1" in m1["reclaim_note"] and m1["stat"]["pgpgin"] == 8


# ------------------------------------------------------------------ 2. per-process device bytes
def test_other_readers_on_the_device_are_flagged():
    pre, post = _snap({}), _snap({}, read_bytes=100 * MB)
    assert acc._self_and_memcg(pre, post, 101 * MB)["device_other_readers"] is False
    out = acc._self_and_memcg(pre, post, 140 * MB)
    assert out["device_other_readers"] is True and out["device_other_bytes"] == 40 * MB
    assert out["read_bytes_self"] == 100 * MB


def test_walled_cells_report_own_bytes_reclaim_and_amplification(setup, walls):
    """nocache reads every access itself (read_bytes_self ~ bytes_from_files) and amplification is
    computed from its own bytes; a page-cache cell below the working set behind a cgroup wall shows
    reclaim in the global pgscan_file/pgsteal_file (not in pgscan_kswapd/direct) and the wall's memcg."""
    recs = {x["mode"]: x for x in _walled_replay(setup, walls, "24MB", "nocache", "pagecache")}
    nc, pc = recs["nocache"], recs["pagecache"]
    if nc["read_bytes_self"] is None:
        pytest.skip(f"no task I/O accounting here: {nc['read_bytes_self_note']}")
    assert nc["read_bytes_self"] >= 0.95 * nc["bytes_from_files"]
    assert nc["amplification"] == pytest.approx(nc["read_bytes_self"] / nc["demand_miss_bytes"])
    assert pc["proof_ok"], pc["wall_note"]
    assert pc["pgscan_total"] > 0 and pc["reclaim_scan_per_steal"] is not None
    memcg = pc["accounting"]["memcg"]
    assert "expertcache-" in memcg["path"] and memcg["stat"]["pgpgin"] > 0


# ------------------------------------------------------------------ 3. proofs that hold
def test_arena_and_hybrid_below_the_working_set_prove_their_capacity(setup, walls):
    """An arena that fills its whole capacity (48 of 64 experts) and a hybrid, headroom calibrated per
    mode: neither is OOM-killed by its own wall (the preload is O_DIRECT, kernel memory is counted)
    and both proofs hold."""
    for rec in _walled_replay(setup, walls, "48MB", "arena", "hybrid"):
        assert not rec["failed"] and rec["proof_ok"], (rec["mode"], rec.get("wall_note"))
        assert rec["headroom_note"].startswith(f"headroom calibrated for {rec['mode']}")
        assert rec["arena"]["entries"] == (48 if rec["mode"] == "arena" else 24)
        assert rec["proof"]["tier_peak_bytes"] <= 48 * MB + cap.proof_slack(48 * MB)


# ------------------------------------------------------------------ 4. no silent nonsense
def test_slack_is_relative_and_a_tiny_capacity_fails_its_proof(tmp_path, walls):
    assert cap.proof_slack(1) < 1 and cap.proof_slack(10**9) == pytest.approx(0.02e9 + (4 << 20))
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8 * MB))
    evict_file_pages([str(path)])
    run = cap.run_walled([sys.executable, "-c", f"open({str(path)!r}, 'rb').read()"], capacity_bytes=1,
                         headroom_bytes=64 * MB)
    assert run.returncode == 0 and run.proof_ok is False and "above the capacity 1" in run.note


def test_a_following_wall_keeps_unused_headroom_out_of_the_page_cache(tmp_path, walls):
    """A generous fixed headroom lets page cache grow into what the worker leaves unused (the proof
    fails, honestly); with follow_margin the limit tracks the worker's own memory, so the same run
    keeps the page cache at the capacity and proves it, and the limit never exceeds the request."""
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(96 * MB))
    # read the file twice in 1 MB chunks (the worker's own memory moves by a chunk at most), slowly
    # enough for the sampler to follow (several samples per pass)
    child = [sys.executable, "-c", "import time\nfor _ in range(2):\n    with open(%r, 'rb') as f:\n"
             "        while f.read(1 << 20): time.sleep(0.004)" % str(path)]
    fixed, followed = [], []
    for follow, out in ((None, fixed), (1 << 20, followed)):
        evict_file_pages([str(path)])
        out.append(cap.run_walled(child, capacity_bytes=32 * MB, headroom_bytes=80 * MB, follow_margin=follow))
    (a,), (b,) = fixed, followed
    assert a.returncode == 0 and a.proof_ok is False and "exceeds what the worker needed" in a.note
    assert b.returncode == 0 and b.proof_ok, b.note
    p = b.proof
    assert p["limit_writes"] >= 1 and p["max_limit_bytes"] <= p["requested_limit_bytes"]
    assert p["tier_peak_bytes"] <= 32 * MB + cap.proof_slack(32 * MB)


def test_capacity_above_what_the_machine_holds_is_refused(setup):
    most, what = cap.enforceable_bytes()
    assert most is not None and most > 0 and what
    with pytest.raises(ConfigError, match="more than this machine can give"):
        cap.run_walled(["true"], capacity_bytes=most + 10**9)
    assert cap.run_walled(["true"], capacity_bytes=most + 10**9, wall="none").enforced_by == "none"
    d, _ = setup
    r = cli("tier", "replay", d / "t.npz", "--pool", d / "pool", "--capacity", "100TB")
    one_line_error(r, "--capacity", "more than this machine can give")


def _edit_manifest(src, dst, edit):
    import shutil
    shutil.copytree(src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    edit(man)
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def test_manifest_lies_are_refused(setup, tmp_path):
    d, _ = setup
    cases = {
        "inflated": (lambda m: m.update(expert_bytes=10 * MB), "largest entry holds 1000000"),
        "bool": (lambda m: m.update(num_experts=True), "'num_experts' must be a positive integer"),
        "alias": (lambda m: m["entries"].__setitem__(1, [m["entries"][0][0], 4096, MB, m["entries"][1][3]]),
                  "overlap"),
    }
    for name, (edit, words) in cases.items():
        src = d / ("packed" if name == "alias" else "pool")
        with pytest.raises(ConfigError, match=words):
            open_pool(_edit_manifest(src, tmp_path / name, edit))


def test_read_mismatches_are_printed_and_fail_the_command(setup, tmp_path):
    import shutil
    d, _ = setup
    shutil.copytree(d / "pool", tmp_path / "pool")
    f = tmp_path / "pool" / "L001" / "E00003.bin"
    data = bytearray(f.read_bytes())
    data[10] ^= 0xFF
    f.write_bytes(bytes(data))  # same size: opening passes, the reads do not
    r = cli("tier", "replay", d / "t.npz", "--pool", tmp_path / "pool", "--capacity", "64MB", "--wall", "none",
            "--verify-reads")
    assert r.returncode == 1, r.stderr
    assert "verify mismatches" in r.stdout and "did not match the pool's manifest" in r.stderr


def test_profile_wider_than_the_pool_is_one_line(setup, tmp_path):
    d, tr = setup
    wide = Trace.from_arrays(np.tile([40, 41], (2, 4, 1)), num_experts=64)
    wide.save(tmp_path / "wide.npz")
    r = cli("tier", "replay", d / "t.npz", "--pool", d / "pool", "--capacity", "8MB", "--mode", "arena",
            "--profile", tmp_path / "wide.npz", "--wall", "none")
    one_line_error(r, "--profile", "expert id 41", "16 experts per layer")


def test_nocache_on_the_packed_layout_leaves_nothing_resident(setup):
    """Dropping only the entry's range left the neighbours' readahead resident (12-15 of 65 MB)."""
    d, tr = setup
    pool = open_pool(d / "packed")
    evict_file_pages(pool.paths)
    reader = FileReader(pool, "nocache")
    buf = aligned_buffer(reader.buffer_bytes())
    try:
        for row in tr.experts:
            for li, ids in enumerate(row):
                for e in ids:
                    reader.read(pool.entry(li, int(e)), buf)
        reader.end_pass()
    finally:
        reader.close()
        buf.close()
    resident, total = residency(pool.paths)
    assert total >= 64 * MB and resident <= 1 * MB, resident


# ------------------------------------------------------------------ 5. sweeps keep their results
def test_failed_cells_are_marked_and_finished_ones_kept(setup, tmp_path):
    d, _ = setup
    out = tmp_path / "cells.jsonl"
    env = dict(os.environ, EXPERTCACHE_TIER_FAIL_MLOCK="1")  # every arena run fails; pagecache runs do not
    r = cli("tier", "sweep", d / "t.npz", "--pool", d / "pool", "--capacities", "16MB,32MB", "--mode", "pagecache",
            "--mode", "arena", "--repeats", 1, "--wall", "none", "--out", out, "--json", env=env)
    assert r.returncode == 1 and "2 of 4 runs failed" in r.stderr, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    runs = [x for x in recs if not x.get("summary")]
    assert sorted((x["mode"], x["failed"]) for x in runs) == [("arena", True)] * 2 + [("pagecache", False)] * 2
    assert all("fail-stop" in x["error"] for x in runs if x["failed"])
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert len([x for x in kept if not x.get("summary")]) == 4
    assert {x["mode"]: x["runs_failed"] for x in kept if x.get("summary")} == {"arena": 1, "pagecache": 0}


def test_bad_plot_paths_fail_before_any_work(setup, tmp_path):
    d, _ = setup
    r = cli("tier", "sweep", d / "t.npz", "--pool", d / "pool", "--capacities", "8MB", "--plot", tmp_path / "x.txt")
    one_line_error(r, "--plot", ".txt")
    r = cli("tier", "sweep", d / "t.npz", "--pool", d / "pool", "--capacities", "8MB", "--plot",
            tmp_path / "nope" / "x.png")
    one_line_error(r, "--plot")
    assert "[1/" not in r.stderr  # refused before the first run


# ------------------------------------------------------------------ 7. zero-copy mmap reader
def test_mmap_reader_copies_once_into_the_destination(setup):
    """The mmap read goes from a memoryview of the map straight into the buffer: no bytes object of
    the entry's size is made (the old slice allocated 1 MB per read)."""
    d, _ = setup
    pool = open_pool(d / "pool")
    reader = FileReader(pool, "pagecache", use_mmap=True)
    buf = aligned_buffer(reader.buffer_bytes())
    ent = pool.entry(1, 5)
    try:
        reader.read(ent, buf)  # the first read maps the file
        tracemalloc.start()
        for _ in range(5):
            reader.read(ent, buf)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        with open(ent.path, "rb") as fh:
            assert bytes(buf[:MB]) == fh.read()
    finally:
        reader.close()
        buf.close()
    assert peak < 64 * 1024, peak


def test_compare_calls_a_lead_inside_the_spread_a_tie():
    a = {"mode": "arena", "capacity_bytes": 1, "runs": 3, "seconds_per_iteration_median": 1.0,
         "seconds_per_iteration_range": [0.9, 1.2]}
    b = {"mode": "pagecache", "capacity_bytes": 1, "runs": 3, "seconds_per_iteration_median": 1.1,
         "seconds_per_iteration_range": [1.05, 1.3]}
    c = compare(a, b)
    assert c["verdict"] == "tie (within noise)" and c["faster"] == "arena" and c["lead"] == pytest.approx(0.1)
    b["seconds_per_iteration_range"] = [1.25, 1.3]
    assert compare(a, b)["verdict"] == "arena faster"
    one = dict(a, runs=1, seconds_per_iteration_range=[1.0, 1.0])
    assert compare(one, dict(b, runs=1, seconds_per_iteration_range=[1.1, 1.1]))["verdict"].startswith("single run")


def test_proof_problems_of_limits_by_hand():
    """The limit checks of a cgroup wall's proof, one problem each: no limit (a named cgroup too,
    never a crash), a made wall read back wrong, a named wall above the request, and a following
    wall judged against its requested ceiling."""
    from expertcache.wall.cgroupwall import cgroup_problems

    base = {"peak_bytes": 10 * MB, "tier_peak_bytes": 5 * MB, "own_peak_bytes": 1 * MB, "removed": True}
    for made in (True, False):
        problems = cgroup_problems(dict(base, limit_bytes=None), 20 * MB, 8 * MB, made, None)
        assert problems == ["the cgroup has no memory limit"]
    assert cgroup_problems(dict(base, limit_bytes=19 * MB), 20 * MB, 8 * MB, True, None) == [
        f"limit read back as {19 * MB}, asked {20 * MB}"]
    assert cgroup_problems(dict(base, limit_bytes=21 * MB), 20 * MB, 8 * MB, False, None) == [
        f"the named cgroup's limit {21 * MB} is above capacity + headroom {20 * MB}"]
    followed = dict(base, limit_bytes=12 * MB, follow_margin_bytes=1 << 20)
    assert cgroup_problems(followed, 20 * MB, 8 * MB, True, None) == []
    assert cgroup_problems(dict(followed, limit_bytes=21 * MB), 20 * MB, 8 * MB, True, None) == [
        f"limit read back as {21 * MB}, above the requested {20 * MB}"]
