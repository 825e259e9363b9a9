"""Capacities mean something (issue 24, item 3): at or above E per layer (or L x E in a global pool)
every expert fits; the commands say so in one line, clamp, and report zero steady copies; ranges
are clipped at E with a note; a hit-rate target above the cold-fill ceiling names the ceiling."""

from __future__ import annotations

import json

import pytest

from expertcache.cli.main import main
from expertcache.sim import replay
from expertcache.trace.synth import synthesize_preset

E, L = 64, 4


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    trace = synthesize_preset("olmoe", 0, tokens=64, sequences=3, num_layers=L)
    return trace.save(tmp_path_factory.mktemp("caps") / "t.npz")


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def records(out):
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_replay_capacity_above_e_clamps(trace_file, capsys):
    rc, out, _ = run(capsys, "replay", trace_file, "-c", "65", "-p", "lru")
    assert rc == 0
    notes = [line for line in out.splitlines() if "every expert fits" in line]
    assert len(notes) == 1 and "65" in notes[0] and "64" in notes[0]
    (rec,) = records(run(capsys, "replay", trace_file, "-c", "65", "-p", "lru", "--json")[1])
    assert rec["capacity"] == E and rec["copies_steady"] == 0 and rec["copies_per_token"] == 0
    # counts equal the replay at E exactly
    ref = replay(__import__("expertcache").load_trace(trace_file), E, "lru")
    assert rec["copies_total"] == ref.copies_total


def test_replay_global_pool_clamps_at_l_times_e(trace_file, capsys):
    (rec,) = records(run(capsys, "replay", trace_file, "-c", "1000", "-p", "lru", "--pool", "global", "--json")[1])
    assert rec["capacity"] == L * E and rec["copies_steady"] == 0
    (rec,) = records(run(capsys, "replay", trace_file, "-c", "255", "-p", "lru", "--pool", "global", "--json")[1])
    assert rec["capacity"] == 255  # below L x E: unchanged


def test_budget_above_the_whole_pool(trace_file, capsys):
    """24 GB over 4 layers of 12.6 MB experts would be 476 per layer; the pool has 64."""
    rc, out, _ = run(capsys, "replay", trace_file, "--budget", "24GB", "--expert-mb", "12.6", "-p", "lru")
    assert rc == 0 and "capacity 476" not in out
    assert sum("every expert fits" in line for line in out.splitlines()) == 1
    (rec,) = records(run(capsys, "replay", trace_file, "--budget", "24GB", "--expert-mb", "12.6", "-p", "lru",
                         "--json")[1])
    assert rec["capacity"] == E and rec["copies_steady"] == 0
    assert rec["cache_bytes"] == pytest.approx(E * L * 12.6e6)


def test_bounds_capacity_above_e(trace_file, capsys):
    rc, out, _ = run(capsys, "bounds", trace_file, "-c", "100")
    assert rc == 0 and sum("every expert fits" in line for line in out.splitlines()) == 1
    (rec,) = records(run(capsys, "bounds", trace_file, "-c", "100", "--json")[1])
    assert rec["capacity"] == E and rec["b_greedy"] == 0 and rec["b_flat"] == 0


def test_sweep_range_is_clipped_at_e(trace_file, capsys):
    rc, out, err = run(capsys, "sweep", trace_file, "--capacities", "8:1000000", "-p", "lru")
    assert rc == 0
    rows = [line for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == E - 8 + 1 and rows[-1].split()[0] == str(E)
    assert "clipped" in out + err
    recs = records(run(capsys, "sweep", trace_file, "--capacities", "8:1000000", "-p", "lru", "--json")[1])
    assert max(r["capacity"] for r in recs) == E and len(recs) == E - 8 + 1


def test_compare_pools_clipped_at_e(trace_file, capsys):
    rc, out, err = run(capsys, "compare-pools", trace_file, "--capacities", "60:70", "-p", "lru", "--json")
    recs = records(out)
    assert rc == 0 and sorted({r["capacity"] for r in recs}) == [60, 61, 62, 63, 64]
    rc, out, err = run(capsys, "compare-pools", trace_file, "-c", "100", "-p", "lru")
    assert rc == 0 and sum("every expert fits" in line for line in out.splitlines()) == 1


def test_demo_capacity_at_or_above_e_fails_before_its_report(trace_file, tmp_path, capsys):
    rc, out, err = run(capsys, "demo", "--trace", trace_file, "-c", "999", "--out", tmp_path / "d", "--no-live")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "999" in err


def test_sweep_target_above_the_ceiling_says_why(trace_file, capsys):
    rc, out, _ = run(capsys, "sweep", trace_file, "--capacities", "8:64", "-p", "lru", "--target-hit-rate", "0.999")
    assert rc == 0 and "not reached" in out and "ceiling" in out and "cold fills" in out and "--warm 0.6" in out
    recs = [r for r in records(run(capsys, "sweep", trace_file, "--capacities", "8:64", "-p", "lru",
                                   "--target-hit-rate", "0.999", "--json")[1]) if r.get("record") == "target"]
    (t,) = recs
    assert t["hit_rate_ceiling"] < 0.999 and t["hit_rate_ceiling_fair"] > t["hit_rate_ceiling"]
