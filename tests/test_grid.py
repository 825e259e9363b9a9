"""``expertcache grid``: spec checks, rows equal to direct replays, stable keys, resume after a
SIGKILL, a deleted or torn part, --force, --jobs 1 == --jobs 2, budgets, report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import expertcache as ec
from expertcache.errors import ConfigError
from expertcache.grid import load_spec, parse_spec, plan_tasks

pa = pytest.importorskip("pyarrow")

from expertcache.grid.runner import KILL_AFTER_ENV, run_grid  # noqa: E402
from expertcache.grid.store import Store, schema  # noqa: E402
from expertcache.cli.main import main  # noqa: E402

from conftest import GRID_CELLS as N_CELLS, strip_seconds as strip  # noqa: E402


def full_rows(tmp_path, spec):
    run_grid(spec, tmp_path / "reference", jobs=1)
    return strip(Store(tmp_path / "reference").read_rows())


def test_rows_equal_direct_replays(grid):
    spec = load_spec(grid / "grid.toml")
    summary = run_grid(spec, grid / "res", jobs=1)
    assert summary == {"cells": N_CELLS, "skipped": 0, "computed": N_CELLS, "parts": 3 * 2 * 2 * 2,
                       "out": str(grid / "res")}
    rows = Store(grid / "res").read_rows()
    assert len(rows) == N_CELLS and len({r["key"] for r in rows}) == N_CELLS
    traces = {t.label: t.load() for t in spec.traces}
    for r in rows:
        direct = ec.replay_many(traces[r["trace"]], r["capacity"], ["lru", "belady", "decayed:0.9"],
                                pool=r["pool"], warm=r["warm"])
        d = next(x for x in direct if x.policy == r["policy"]).to_dict()
        for field in ("tokens", "requests", "copies_total", "copies_steady", "copies_fill", "copies_per_token",
                      "hit_rate", "gap_recovered", "needs_future", "layers", "iterations"):
            assert r[field] == d[field], field
        assert json.loads(r["per_layer"]) == d["per_layer"]
    assert {r["trace_name"] for r in rows} == {"ta", "tb", "synthetic-olmoe"}


def test_schema_holds_every_replay_field(grid):
    trace = ec.load_trace(grid / "ta.npz")
    budget = ec.replay(trace, 8, "lru")
    budget.budget = ec.sim.budget.Budget(10**9, 10**6).record("layer", 3)
    assert set(budget.to_dict()) <= set(schema().names)


def test_keys_are_stable_and_follow_the_trace_bytes(grid):
    keys = [c.key for t in plan_tasks(load_spec(grid / "grid.toml")) for c in t.cells]
    assert len(set(keys)) == N_CELLS
    assert keys == [c.key for t in plan_tasks(load_spec(grid / "grid.toml")) for c in t.cells]
    trace = ec.load_trace(grid / "ta.npz")
    ec.Trace.from_arrays(trace.experts[::-1].copy(), np.repeat([0, 1], 40), num_experts=16, meta={"name": "ta"}).save(grid / "ta.npz")
    changed = [c.key for t in plan_tasks(load_spec(grid / "grid.toml")) for c in t.cells]
    assert len(set(changed) - set(keys)) == N_CELLS // 3  # only ta's cells change


def test_sigkilled_run_resumes_with_nothing_lost_or_duplicated(grid):
    code = ("import sys; from expertcache.grid import load_spec; from expertcache.grid.runner import run_grid; "
            "run_grid(load_spec(sys.argv[1]), sys.argv[2], jobs=1)")
    argv = [sys.executable, "-c", code, str(grid / "grid.toml"), str(grid / "res")]
    proc = subprocess.run(argv, env=dict(os.environ, **{KILL_AFTER_ENV: "3"}), capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(Store(grid / "res").parts()) == 3
    spec = load_spec(grid / "grid.toml")
    summary = run_grid(spec, grid / "res", jobs=1)
    assert summary["skipped"] == 3 * 3 and summary["computed"] == N_CELLS - 9
    rows = strip(Store(grid / "res").read_rows())
    assert rows == full_rows(grid, spec)
    assert not [p for p in os.listdir(grid / "res") if p.endswith(".tmp")]


def test_deleted_and_torn_parts_are_recomputed(grid):
    spec = load_spec(grid / "grid.toml")
    run_grid(spec, grid / "res", jobs=1)
    parts = Store(grid / "res").parts()
    parts[0].unlink()
    data = parts[1].read_bytes()
    parts[1].write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="unreadable Parquet part"):
        summary = run_grid(spec, grid / "res", jobs=1)
    assert summary["computed"] == 6 and summary["parts"] == 2
    assert strip(Store(grid / "res").read_rows()) == full_rows(grid, spec)
    assert (grid / "res" / f"_{parts[1].name}.corrupt").exists()
    import pyarrow.parquet as pq

    assert pq.read_table(grid / "res").num_rows == N_CELLS  # the folder reads as one table


def test_force_recomputes_without_duplicates(grid):
    spec = load_spec(grid / "grid.toml")
    run_grid(spec, grid / "res", jobs=1)
    assert run_grid(spec, grid / "res", jobs=1)["computed"] == 0
    summary = run_grid(spec, grid / "res", jobs=1, force=True)
    assert summary["computed"] == N_CELLS and summary["skipped"] == 0
    rows = Store(grid / "res").read_rows()
    assert len(rows) == N_CELLS == len({r["key"] for r in rows})


def test_jobs_1_and_2_give_identical_rows(grid):
    spec = load_spec(grid / "grid.toml")
    run_grid(spec, grid / "one", jobs=1)
    run_grid(spec, grid / "two", jobs=2)
    assert strip(Store(grid / "one").read_rows()) == strip(Store(grid / "two").read_rows())


def test_budget_cells(tmp_path):
    spec = parse_spec({"synth": [{"preset": "olmoe", "tokens": 20, "num_layers": 4}], "policies": ["lru"],
                       "budgets": ["1GB", "2GB"], "pools": ["layer", "global"]}, "g.toml")
    run_grid(spec, tmp_path / "res", jobs=1)
    rows = Store(tmp_path / "res").read_rows()
    S = 3 * 2048 * 1024 * 2  # the olmoe preset's expert_bytes
    for r in rows:
        n = r["budget_bytes"] // S
        assert r["expert_bytes"] == S and r["budget_experts"] == n
        assert r["capacity"] == (n if r["pool"] == "global" else n // 4)
    assert sorted(r["budget"] for r in rows) == ["1GB", "1GB", "2GB", "2GB"]
    spec = parse_spec({"traces": [], "synth": [{"preset": "bench-k1", "tokens": 10}], "budgets": ["1GB"]}, "g.toml")
    with pytest.raises(ConfigError, match="no expert_bytes; set expert_mb"):
        run_grid(spec, tmp_path / "res2", jobs=1)


@pytest.mark.parametrize("doc, message", [
    ({"traces": ["t*.npz"], "capacities": [8], "colour": 1}, "g.toml: colour: unknown key"),
    ({"capacities": [8]}, "traces: no trace given"),
    ({"traces": ["nope*.npz"], "capacities": [8]}, "traces: 'nope*.npz' matches no file"),
    ({"traces": ["ta.npz"], "capacities": [8], "budgets": ["1GB"]}, "give exactly one of capacities"),
    ({"traces": ["ta.npz"], "capacities": [0]}, "capacities: expected an integer >= 1"),
    ({"traces": ["ta.npz"], "capacities": [8, 8]}, "capacities: 8 is listed twice"),
    ({"traces": ["ta.npz"], "budgets": ["1XB"]}, "budgets: cannot read '1XB'"),
    ({"traces": ["ta.npz"], "capacities": [8], "policies": ["fifo"]}, "policies: unknown policy 'fifo'"),
    ({"traces": ["ta.npz"], "capacities": [8], "pools": ["shared"]}, "pools: 'shared' is not one of"),
    ({"traces": ["ta.npz"], "capacities": [8], "warm": [1.0]}, "warm: expected a fraction in [0, 1)"),
    ({"traces": ["ta.npz"], "capacities": [8], "reset": ["never"]}, "reset: 'never' is not one of"),
    ({"traces": ["ta.npz"], "capacities": [8], "layers": "9-2"}, "layers: '9-2' runs backwards"),
    ({"traces": ["ta.npz"], "capacities": [8], "expert_mb": 12}, "expert_mb: only budgets read it"),
    # integers beyond any float were an OverflowError: `grid` ended in an internal error
    ({"traces": ["ta.npz"], "budgets": ["1GB"], "expert_mb": 10**400}, "expert_mb: expected a positive number of MB"),
    ({"synth": [{"preset": "olmoe", "drift_rate": 10**400}], "capacities": [8]},
     "synth[0]: synthetic trace: drift_rate must be a finite number >= 0"),
    ({"synth": [{"preset": "olmoe", "reuse_prob": "high"}], "capacities": [8]},
     "synth[0]: synthetic trace: reuse_prob must lie in [0, 1], got 'high'"),
    ({"synth": [{"preset": "gpt"}], "capacities": [8]}, "synth[0]: preset: 'gpt' is not one of"),
    ({"synth": [{"preset": ["olmoe"]}], "capacities": [8]}, "synth[0]: preset: ['olmoe'] is not one of"),
    ({"synth": [{"preset": "olmoe", "colour": 2}], "capacities": [8]}, "synth[0]: synthetic trace: unknown parameter"),
])
def test_spec_errors_name_the_key(grid, doc, message):
    with pytest.raises(ConfigError) as err:
        parse_spec(doc, "g.toml", base=grid)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_run_report_and_errors(grid, capsys):
    out = grid / "res"
    assert main(["grid", str(grid / "grid.toml"), "--out", str(out), "--jobs", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["computed"] == N_CELLS
    assert main(["grid", str(grid / "grid.toml"), "--out", str(out)]) == 0
    assert f"{N_CELLS} cells, {N_CELLS} already done, 0 computed" in capsys.readouterr().out
    assert main(["grid", "report", str(out), "--plot", str(grid / "plots")]) == 0
    text = capsys.readouterr().out
    assert "hit rate (rows: policy" in text and "copies/token (rows: policy" in text
    assert len(list((grid / "plots").glob("grid-*.png"))) == 3 * 2 * 2
    assert main(["grid", "report", str(out), "--json"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = {(r["trace"], r["pool"], r["warm"], r["policy"], str(r["capacity"])): r for r in Store(out).read_rows()}
    for rec in recs:
        for size, value in rec["by_size"].items():
            assert rows[rec["trace"], rec["pool"], rec["warm"], rec["policy"], size][rec["metric"]] == value
    assert main(["grid", "report"]) == 2
    assert main(["grid", str(grid / "grid.toml")]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    # a report only reads: an unreadable part is skipped, not renamed aside (grid SPEC --out does that)
    (out / "part-garbage.parquet").write_bytes(b"not parquet" * 10)
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(["grid", "report", str(out), "--json"]) == 0
    assert "part-garbage.parquet: unreadable Parquet part (ArrowInvalid), skipped" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


def test_without_pyarrow_the_error_says_how_to_install(grid, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert main(["grid", str(grid / "grid.toml"), "--out", str(grid / "res")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'expertcache[grid]'" in err


def test_a_spec_tomllib_cannot_hold_is_one_line(tmp_path):
    """tomllib raises RecursionError on arrays nested 100k deep and ValueError on an integer of 5,000
    digits (outside TOMLDecodeError): each is a one-line ConfigError, as a malformed spec is."""
    from expertcache.grid.spec import load_spec

    (tmp_path / "deep.toml").write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "big.toml").write_text('traces = ["T.npz"]\ncapacities = [' + "9" * 5000 + "]\n")
    for name, match in (("deep.toml", "nested too deeply"), ("big.toml", "not valid TOML here")):
        with pytest.raises(ConfigError, match=match) as err:
            load_spec(tmp_path / name)
        assert "\n" not in str(err.value)


def test_belady_added_later_fills_the_gap_of_cells_stored_before(grid):
    """A grid rerun with belady added had kept its lru and lfu rows without gap_recovered ("4 already
    done"), where a fresh run fills it: the task is replayed again and its rows replaced."""
    base = 'traces = ["ta.npz"]\ncapacities = [8]\npools = ["layer"]\n'
    (grid / "a.toml").write_text(base + 'policies = ["lru", "lfu"]\n')
    (grid / "b.toml").write_text(base + 'policies = ["lru", "lfu", "belady"]\n')
    run_grid(load_spec(grid / "a.toml"), grid / "resumed", jobs=1)
    summary = run_grid(load_spec(grid / "b.toml"), grid / "resumed", jobs=1)
    run_grid(load_spec(grid / "b.toml"), grid / "fresh", jobs=1)
    resumed, fresh = (strip(Store(grid / d).read_rows()) for d in ("resumed", "fresh"))
    assert resumed == fresh and len(resumed) == 3 and summary["computed"] == 3
    assert all(r["gap_recovered"] is not None for r in resumed if r["policy"] != "belady")


def test_the_report_keeps_two_versions_of_a_trace_apart(grid, capsys):
    """grid report grouped rows by the trace's path: a file edited between two runs into one folder
    gave one table whose belady came from the old file and lru from the new, with no warning."""
    (grid / "one.toml").write_text('traces = ["ta.npz"]\ncapacities = [8]\npools = ["layer"]\n'
                                   'policies = ["lru", "belady"]\n')
    run_grid(load_spec(grid / "one.toml"), grid / "out", jobs=1)
    (grid / "ta.npz").write_bytes((grid / "tb.npz").read_bytes())  # the same path, other contents
    run_grid(load_spec(grid / "one.toml"), grid / "out", jobs=1)
    assert main(["grid", "report", str(grid / "out"), "--json"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    idents = {r["trace_id"] for r in recs}
    assert len(idents) == 2  # two panels, one per content
    rows = Store(grid / "out").read_rows()
    for ident in idents:
        mine = {r["policy"]: r["hit_rate"] for r in rows if r["trace_id"] == ident}
        got = {r["policy"]: r["by_size"]["8"] for r in recs if r["trace_id"] == ident and r["metric"] == "hit_rate"}
        assert got == mine
