"""Stream-parallel replay (``replay --jobs N``): the same counts as serial replay, field for field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from expertcache.sim import build_layout, replay_layout
from expertcache.errors import ConfigError
from expertcache.sim.parallel import StreamReplayer, replay_streams_parallel, split_streams
from expertcache.trace.synth import synthesize_preset

POLICIES = ["lru", "lfu", "belady", "decayed:0.9", "foresight:4", "mean-interval", "random:3", "static"]


def strip(d):
    return {k: v for k, v in d.items() if k != "seconds"}


@pytest.mark.parametrize("pool, reset, warm, admission", [
    ("layer", "sequence", 0.0, "all"), ("layer", "none", 0.5, "second"), ("global", "sequence", 0.3, "all")])
def test_parallel_equals_serial(pool, reset, warm, admission):
    trace = synthesize_preset("olmoe", 0, tokens=60, sequences=3, num_layers=4)
    layout = build_layout(trace, pool=pool, reset=reset, warm=warm, admission=admission)
    assert len(split_streams(layout, 3)) == 3
    policies = [p for p in POLICIES if p != "static" or (warm > 0 and admission == "all")]  # static: serial path
    parallel = replay_streams_parallel(layout, 16, policies, 3)
    serial = [replay_layout(layout, 16, p) for p in policies]
    assert [strip(r.to_dict()) for r in parallel] == [strip(r.to_dict()) for r in serial]


def test_split_streams_covers_every_stream_once():
    layout = build_layout(synthesize_preset("olmoe", 0, tokens=10, sequences=5, num_layers=3))
    for jobs in (1, 2, 4, 15, 40):
        chunks = split_streams(layout, jobs)
        assert chunks[0][0] == 0 and chunks[-1][1] == layout.num_streams == 15
        assert all(a < b for a, b in chunks) and all(chunks[i][1] == chunks[i + 1][0] for i in range(len(chunks) - 1))
        assert len(chunks) == min(jobs, 15)


def test_cli_jobs_matches_serial(tmp_path):
    path = synthesize_preset("olmoe", 1, tokens=40, sequences=2, num_layers=4).save(tmp_path / "t.npz")

    def records(*extra):
        proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "replay", str(path), "-c", "16",
                               "-p", "lru", "-p", "belady", "--json", *extra], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return [strip(json.loads(line)) for line in proc.stdout.splitlines()]

    assert records("--jobs", "2") == records()


def test_shared_memory_is_released_and_reused_across_replays():
    import os
    from pathlib import Path

    from expertcache.sim.parallel import StreamReplayer

    layout = build_layout(synthesize_preset("olmoe", 2, tokens=30, sequences=2, num_layers=3))
    mine = lambda: sorted(p.name for p in Path("/dev/shm").glob(f"ec_{os.getpid()}_*"))  # noqa: E731
    with StreamReplayer(layout, 2) as rp:
        for capacity in (8, 16):  # one pool of workers, the groups mapped once, two replays
            got = rp.replay(capacity, ["lru", "belady"])
            assert [strip(r.to_dict()) for r in got] == [strip(replay_layout(layout, capacity, p).to_dict())
                                                         for p in ("lru", "belady")]
        assert len(mine()) == 2  # groups and starts
    assert mine() == []


def test_ray_option_without_ray_is_one_line(tmp_path, monkeypatch, capsys):
    from expertcache.cli.main import main

    path = synthesize_preset("olmoe", 1, tokens=20, sequences=2, num_layers=2).save(tmp_path / "t.npz")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["replay", str(path), "-c", "16", "--ray", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'expertcache[ray]'" in err
    assert main(["replay", str(path), "-c", "16", "--ray", "nowhere"]) == 2
    assert "expected 'auto' or a cluster address" in capsys.readouterr().err


def test_sweep_jobs_matches_serial(tmp_path):
    path = synthesize_preset("olmoe", 3, tokens=40, sequences=2, num_layers=3).save(tmp_path / "t.npz")

    def records(*extra):
        proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "sweep", str(path), "--capacities", "8,12,20",
                               "-p", "lru", "-p", "belady", "-p", "decayed:0.9", "--replay-lru", "--json", *extra],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return [strip(json.loads(line)) for line in proc.stdout.splitlines()]

    serial = records()
    assert len(serial) >= 9 and records("--jobs", "2") == serial



def test_the_replayer_checks_its_layout_and_jobs():
    """jobs 0 and -1 had become 1, 2.5 became 2 and infinity an OverflowError; a trace in place of
    its layout ended as AttributeError."""
    trace = synthesize_preset("olmoe", seed=0).select_sequences([0]).select_layers([0, 1])
    layout = build_layout(trace)
    for jobs in (0, -1, 2.5, float("inf"), True, "2"):
        with pytest.raises(ConfigError, match="jobs must be an integer"):
            StreamReplayer(layout, jobs)
    with pytest.raises(ConfigError, match="layout must be a StreamLayout"):
        StreamReplayer(trace, 2)
