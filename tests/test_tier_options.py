"""tier options that conflict or mean nothing are refused in one line; tier write never destroys
an input or an existing pool without --force; --help states the real defaults; timeouts say so."""

from __future__ import annotations

import os

import numpy as np
import pytest

from expertcache import Trace
from test_tier_replay import cli, one_line_error
from expertcache.trace import load_trace
from expertcache.wall import capacity as cap
from expertcache.tier.pool import open_pool, pool_from_trace

MB = 10**6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("opts")
    tr = Trace.from_arrays(np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 3], [1, 2]]]), num_experts=4)
    tr.save(d / "t.npz")
    pool_from_trace(d / "pool", tr, expert_bytes=100_000)
    return d


@pytest.mark.parametrize("extra, words", [
    (["--delivery", "pread"], ["--delivery", "without --advice"]),
    (["--mode", "direct", "--mmap"], ["--mmap", "direct"]),
    (["--mode", "arena", "--profile", "PROFILE", "--profile-fraction", "0.5"], ["--profile-fraction", "--profile"]),
    (["--profile-fraction", "0.5"], ["--profile-fraction", "arena"]),
    (["--mode", "arena", "--arena-fraction", "0.5"], ["--arena-fraction", "hybrid"]),
    (["--mode", "nocache", "--mode", "nocache"], ["--mode nocache", "twice"]),
    (["--timeout", "0"], ["--timeout", "positive"]),
    (["--threads", "100000"], ["--threads", "1024"]),
    (["--headroom", "10MB", "--wall", "none"], ["--headroom", "--wall none"]),
])
def test_conflicting_or_idle_options_are_refused(setup, extra, words):
    d = setup
    extra = [str(d / "t.npz") if x == "PROFILE" else x for x in extra]
    r = cli("tier", "replay", d / "t.npz", "--pool", d / "pool", "--capacity", "1MB", *extra)
    one_line_error(r, *words)


def test_a_timeout_that_fires_says_timed_out(setup):
    d = setup
    r = cli("tier", "replay", d / "t.npz", "--pool", d / "pool", "--capacity", "1MB", "--wall", "none",
            "--timeout", "0.001")
    one_line_error(r, "timed out after 0.001 s")
    assert "signal 9" not in r.stderr


def test_plan_with_pickle_garbage_is_our_line(setup, tmp_path):
    d = setup
    (tmp_path / "garbage.npz").write_bytes(b"not an npz at all")
    r = cli("tier", "replay", d / "t.npz", "--pool", d / "pool", "--capacity", "1MB", "--wall", "none",
            "--advice", f"plan:{tmp_path / 'garbage.npz'}")
    one_line_error(r, "--advice plan:")
    assert "allow_pickle" not in r.stderr


def test_headroom_help_states_the_real_default():
    for sub in ("replay", "sweep"):
        text = " ".join(cli("tier", sub, "--help").stdout.split())
        assert "256MB" not in text
        assert "calibration run" in text and f"{cap.DEFAULT_HEADROOM // MB} MB without a cgroup" in text
        assert "--repeats N" in text


def test_write_refuses_an_existing_pool_without_force_and_never_an_input(setup, tmp_path):
    d = setup
    pool = tmp_path / "p"
    assert cli("tier", "write", "--pool", pool, "--from-trace", d / "t.npz", "--expert-mb", "0.1").returncode == 0
    before = (pool / "manifest.json").read_bytes()
    r = cli("tier", "write", "--pool", pool, "--from-trace", d / "t.npz", "--expert-mb", "0.2")
    one_line_error(r, "--pool", "already holds a pool", "--force")
    assert (pool / "manifest.json").read_bytes() == before
    r = cli("tier", "write", "--pool", pool, "--from-trace", d / "t.npz", "--expert-mb", "0.2", "--force")
    assert r.returncode == 0, r.stderr
    assert open_pool(pool).expert_bytes == 200_000
    # an input hard-linked where the pool writes: refused even with --force, the input intact
    link = tmp_path / "q"
    link.mkdir()
    os.link(d / "t.npz", link / "manifest.json")
    r = cli("tier", "write", "--pool", link, "--from-trace", link / "manifest.json", "--expert-mb", "0.1", "--force")
    one_line_error(r, "--pool", "input")
    assert load_trace(d / "t.npz").num_tokens == 3
    # the checkpoint folder itself as the pool
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 16)
    r = cli("tier", "write", "--pool", model, "--from-safetensors", model, "--force")
    one_line_error(r, "--pool", "input folder")


def test_repeats_interleave_and_comparisons_are_worded(setup):
    d = setup
    r = cli("tier", "replay", d / "t.npz", "--pool", d / "pool", "--capacity", "1MB", "--wall", "none",
            "--mode", "pagecache", "--mode", "nocache", "--repeats", 2)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("at C="))
    assert "nocache vs pagecache" in line and ("tie (within noise)" in line or "faster" in line)
    order = [x.split("] ")[1].split(" C=")[0] + x.split(" run ")[1][0] for x in r.stderr.splitlines() if x.startswith("[")]
    assert order == ["pagecache0", "nocache0", "pagecache1", "nocache1"]  # interleaved
