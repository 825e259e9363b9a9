"""Capacity walls on this machine: a real cgroup wall around a page-cache reader, the balloon's
refusal arithmetic, and the proofs every run carries."""

from __future__ import annotations

import json
import os
import sys

import pytest

from expertcache.errors import ConfigError
from expertcache.wall.pagecache import evict_file_pages
from expertcache.wall import capacity as cap
from expertcache.wall import cgroupfs

MB = 10**6

READER = """
import sys
line = [l for l in open("/proc/self/cgroup").read().splitlines() if "memory" in l.split(":")[1] or l.startswith("0::")]
print(line[0].split(":", 2)[2])
n = 0
with open(sys.argv[1], "rb") as fh:
    while chunk := fh.read(1 << 20):
        n += len(chunk)
print(n)
"""


@pytest.fixture(scope="module")
def walls():
    return cap.detect_walls()


def _big_file(tmp_path, n_mb: int) -> str:
    path = tmp_path / "pool.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as fh:
        for _ in range(n_mb):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    evict_file_pages([str(path)])
    return str(path)


def test_cgroup_wall_holds_page_cache_under_the_limit(tmp_path, walls):
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    f = _big_file(tmp_path, 160)  # bigger than the 64 MB wall
    run = cap.run_walled([sys.executable, "-c", READER, f], capacity_bytes=56 * MB, headroom_bytes=8 * MB,
                         wall="cgroup", timeout=120)
    json.dumps(run.to_dict())
    assert run.returncode == 0, run.stderr
    where, nbytes = run.stdout.split()
    assert int(nbytes) == 160 << 20  # the child read every byte
    assert run.enforced_by.startswith("cgroup-") and run.enforced_by.endswith(where.rsplit("/", 1)[1])
    p = run.proof
    assert p["limit_bytes"] <= 64 * MB and p["requested_limit_bytes"] == 64 * MB
    assert 0 < p["peak_bytes"] <= p["limit_bytes"]  # 160 MB streamed through a 64 MB wall
    assert p["oom_kill"] in (0, None) and p["removed"] is True
    assert p["samples"] > 0 and p["file_peak_bytes"] <= p["tier_peak_bytes"] <= p["peak_bytes"]
    assert p["anon_peak_bytes"] < 8 * MB  # a bare interpreter fits the headroom
    assert run.proof_ok is True and run.note == ""
    assert not os.path.exists(p["path"])  # the cgroup is gone


def test_headroom_larger_than_the_worker_fails_the_proof(tmp_path, walls):
    """A 16 MB capacity with 48 MB of headroom lets the page cache grow far past 16 MB: the run must
    not be reported as a 16 MB cell."""
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    f = _big_file(tmp_path, 100)
    run = cap.run_walled([sys.executable, "-c", READER, f], capacity_bytes=16 * MB, headroom_bytes=48 * MB,
                         wall="cgroup", timeout=120)
    assert run.returncode == 0
    assert run.proof["tier_peak_bytes"] > 16 * MB * 1.02 + (4 << 20)
    assert run.proof_ok is False and "lower the headroom" in run.note


def test_headroom_smaller_than_the_worker_fails_the_proof(tmp_path, walls):
    """The worker holds 40 MB of its own memory with only 4 MB of headroom: the page cache is
    squeezed below the 48 MB capacity, so the run is not a 48 MB cell either. The worker keeps its
    ballast for a few of the wall's sample periods after reading: the whole run takes 70-110 ms,
    about two periods, and one run in ten had ended between samples that missed the ballast (its
    anon peak read 3-18 MB)."""
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    f = _big_file(tmp_path, 100)
    hog = ("import sys; ballast = bytearray(40 * 10**6); ballast[::4096] = b'x' * len(ballast[::4096])\n" + READER
           + f"import time; time.sleep({5 * cgroupfs.SAMPLE_S})\n")
    run = cap.run_walled([sys.executable, "-c", hog, f], capacity_bytes=48 * MB, headroom_bytes=4 * MB,
                         wall="cgroup", timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.proof["anon_peak_bytes"] >= 40 * MB
    assert run.proof_ok is False and "raise the headroom" in run.note


def test_cgroup_timeout_kills_and_cleans(walls):
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    run = cap.run_walled([sys.executable, "-c", "import time; time.sleep(60)"], capacity_bytes=64 * MB,
                         wall="cgroup", timeout=1.0)
    assert run.timed_out and run.proof_ok is False and "timed out" in run.note
    assert run.proof["removed"] is True and not os.path.exists(run.proof["path"])


def test_named_cgroup_is_used_as_is(tmp_path, walls):
    if not walls["cgroup"]["ok"]:
        pytest.skip(f"no cgroup wall here: {walls['cgroup']['reason']}")
    mine = os.path.join(walls["cgroup"]["parent"], f"expertcache-test-{os.getpid()}")
    os.mkdir(mine)
    try:
        limit_file = "memory.max" if walls["cgroup"]["version"] == "v2" else "memory.limit_in_bytes"
        with open(os.path.join(mine, limit_file), "w") as fh:
            fh.write(str(200 << 20))
        run = cap.run_walled([sys.executable, "-c", "print(1)"], capacity_bytes=64 * MB, headroom_bytes=0,
                             cgroup=mine)
        assert run.returncode == 0 and run.proof["created_here"] is False
        assert run.proof["limit_bytes"] == 200 << 20  # recorded, not changed
        assert run.proof_ok is False and "above capacity + headroom" in run.note  # 200 MiB > 64 MB
        run = cap.run_walled([sys.executable, "-c", "print(1)"], capacity_bytes=300 * MB, headroom_bytes=0,
                             cgroup=mine)
        assert run.proof_ok is True and run.enforced_by == f"cgroup-{walls['cgroup']['version']}:{mine}"
        assert os.path.isdir(mine)  # a named cgroup is never removed
    finally:
        cgroupfs.rmdir_retry(mine)


def test_balloon_refusal_arithmetic():
    GB = 10**9
    # 24 GB available, target 4 GB + 0.25 GB: lock the rest
    assert cap.balloon_plan(24 * GB, 4 * GB, GB // 4) == (24 * GB - 4 * GB - GB // 4, None)
    # the machine already has less than the target: nothing to lock
    assert cap.balloon_plan(3 * GB, 4 * GB, 0) == (0, None)
    # what would remain is under the 2 GB floor: refused, whatever is available
    size, why = cap.balloon_plan(24 * GB, GB, GB // 4)
    assert size == 0 and "under the 2 GB floor" in why
    assert cap.balloon_plan(24 * GB, 2 * GB - 1, 1) == (22 * GB, None)  # exactly 2 GB left is allowed
    assert cap.balloon_plan(24 * GB, 2 * GB - 2, 1)[1] is not None


def test_small_real_balloon_proves_its_lock(walls):
    if not walls["balloon"]["ok"]:
        pytest.skip(f"no balloon here: {walls['balloon']['reason']}")
    avail = walls["balloon"]["mem_available_bytes"]
    capacity = avail - cap.DEFAULT_HEADROOM - 48 * MB  # a balloon of about 48 MB
    if capacity + cap.DEFAULT_HEADROOM < cap.MIN_LEFT:
        pytest.skip("machine too small for a balloon test")
    with pytest.warns(UserWarning, match="deep-pressure"):
        try:
            run = cap._run_balloon([sys.executable, "-c", "print('ok')"], capacity, cap.DEFAULT_HEADROOM, 60,
                                   max_balloon_bytes=512 * MB)
        except cap.WallUnavailable as exc:
            pytest.skip(f"balloon not possible now: {exc}")
    assert run.returncode == 0 and run.stdout.strip() == "ok" and run.enforced_by == "balloon"
    p = run.proof
    assert p["balloon_vmlck_bytes"] >= p["balloon_requested_bytes"] and p["balloon_alive_at_end"]
    assert run.proof_ok is True


def test_no_wall_is_marked_unproven():
    run = cap.run_walled([sys.executable, "-c", "print(2)"], capacity_bytes=MB, wall="none")
    assert run.returncode == 0 and run.enforced_by == "none"
    assert run.proof_ok is False and "not enforced" in run.note


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="--wall"):
        cap.run_walled(["true"], capacity_bytes=MB, wall="magic")
    with pytest.raises(ConfigError, match="--capacity"):
        cap.run_walled(["true"], capacity_bytes=0)
    with pytest.raises(ConfigError, match="not a memory cgroup"):
        cap.run_walled(["true"], capacity_bytes=MB, cgroup=str(tmp_path))
    with pytest.raises(cap.WallUnavailable, match="balloon refused"):
        cap.run_walled(["true"], capacity_bytes=MB, wall="balloon")  # 1 MB + 256 MB < 2 GB


def _fake_proc(monkeypatch, files):
    monkeypatch.setattr(cgroupfs, "read_text", lambda p: (files[p], None) if p in files else (None, f"{p}: absent"))


def test_own_cgroup_discovery_v2_and_v1(monkeypatch):
    mounts = ("30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    _fake_proc(monkeypatch, {"/proc/self/cgroup": "0::/user.slice/app.scope\n", "/proc/self/mountinfo": mounts,
                             "/sys/fs/cgroup/user.slice/app.scope/cgroup.subtree_control": "cpu memory\n"})
    assert cgroupfs.own_memory_cgroup() == ({"version": "v2", "dir": "/sys/fs/cgroup/user.slice/app.scope"}, "")
    # memory not delegated to children: refused with the reason, never enabled by us
    _fake_proc(monkeypatch, {"/proc/self/cgroup": "0::/user.slice/app.scope\n", "/proc/self/mountinfo": mounts,
                             "/sys/fs/cgroup/user.slice/app.scope/cgroup.subtree_control": "cpu\n"})
    own, why = cgroupfs.own_memory_cgroup()
    assert own is None and "subtree_control" in why and "does not change it" in why
    # v1 memory controller, mounted with a non-root mount root (a container)
    v1 = "40 23 0:30 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    _fake_proc(monkeypatch, {"/proc/self/cgroup": "4:memory:/docker/abc/job\n0::/\n", "/proc/self/mountinfo": v1})
    assert cgroupfs.own_memory_cgroup() == ({"version": "v1", "dir": "/sys/fs/cgroup/memory/job"}, "")
    _fake_proc(monkeypatch, {"/proc/self/cgroup": "1:cpu:/\n", "/proc/self/mountinfo": ""})
    own, why = cgroupfs.own_memory_cgroup()
    assert own is None and why


def test_worker_main_prints_one_json_object_or_one_error_line(tmp_path, capsys, monkeypatch):
    """Both measured processes (llama/runner.py, tier/worker.py) answer through wall.cgroupwall.worker_main:
    the result as one JSON line, or one ``error:`` line and the status child_result reads."""
    from expertcache.errors import ExpertcacheError
    from expertcache.tier.arena import MlockError
    from expertcache.wall.cgroupwall import worker_main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"n": 3}))

    def run(s):
        if s["n"] == 1:
            raise ExpertcacheError("refused\n  on two lines")
        if s["n"] == 2:
            raise MlockError("mlock: no room")
        if s["n"] == 4:
            raise OSError(12, "Cannot allocate memory")  # a system call's error: says where
        if s["n"] == 5:
            raise RuntimeError("a bug")
        return {"twice": 2 * s["n"], "extra": {1, 2}}

    codes = ((MlockError, 3),)
    assert worker_main([str(spec)], run, "m.w", codes, default=sorted) == 0
    assert json.loads(capsys.readouterr().out) == {"twice": 6, "extra": [1, 2]}
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    cases = [(None, [], "usage: python -m m.w SPEC.json", 2),
             (None, [str(tmp_path / "absent.json")], f"error: {tmp_path / 'absent.json'}: No such file or directory", 2),
             (None, [str(bad)], "error: measured process: JSONDecodeError:", 2),
             (1, [str(spec)], "error: refused on two lines", 2),
             (2, [str(spec)], "error: mlock: no room", 3),
             ("x", [str(spec)], "error: measured process: KeyError:", 2),
             (4, [str(spec)], "error: Cannot allocate memory (in test_tier_capacity.py:", 2),
             (5, [str(spec)], "error: measured process: internal error (a bug): RuntimeError: a bug", 70)]
    monkeypatch.delenv("EXPERTCACHE_DEBUG", raising=False)
    for n, argv, line, rc in cases:
        spec.write_text(json.dumps({"n": n} if n != "x" else {}))
        assert worker_main(argv, run, "m.w", codes, default=sorted) == rc
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith(line), (argv, err)


def test_a_balloon_helper_that_cannot_map_says_so_in_one_line():
    """Under an address-space limit (``ulimit -v``; overcommit mode 2 likewise) the helper's mmap
    fails: one line and exit 3, as for a refused mlock (its Python traceback had reached the user)."""
    import resource
    import subprocess

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (400 * MB, 400 * MB))

    done = subprocess.run([sys.executable, "-c", cap._BALLOON, str(2000 * MB)], input="", capture_output=True,
                          text=True, preexec_fn=limited, timeout=60)
    assert done.returncode == 3 and done.stdout.startswith("mmap failed: "), (done.stdout, done.stderr)
    assert done.stderr == ""
