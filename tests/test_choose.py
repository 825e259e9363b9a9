"""``expertcache choose`` (docs/choose.md): the fastest admissible policy under c + rho * tau, its
crossovers, replayed lossless rules, the check against slowed runs, errors and the plot.

Every expected number below is worked out by hand in the comment next to it."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

import expertcache as ec
from expertcache.cli.main import main
from expertcache.costmodel.choose import admissible, choose, crossovers, predict, validate, winner
from expertcache.costmodel.runs import Run, parse_runs
from expertcache.errors import ConfigError
from expertcache.trace.synth import synthesize_preset

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "runs.jsonl"

# Three lines, all admissible at 0.05: A = 20 + 10 tau, B = 22 + 5 tau, C = 30 + 1 tau, and D, the
# fastest at every tau (10 ms, no copies) but 0.5 nats worse.
# A = B at (22 - 20) / (10 - 5) = 0.4; B = C at (30 - 22) / (5 - 1) = 2.0; A = C at 10/9 = 1.11,
# where B (27.56) is below both (31.1): not on the envelope. So A on (0, 0.4), B on (0.4, 2), C above.
THREE = [
    {"policy": "A", "c_ms": 20, "rho": 10, "dnll": 0.0, "tau_ms": 0.5},
    {"policy": "B", "c_ms": 22, "rho": 5, "dnll": 0.01, "tau_ms": 0.4},
    {"policy": "C", "c_ms": 30, "rho": 1, "dnll": 0.02, "tau_ms": 0.6},
    {"policy": "D", "c_ms": 10, "rho": 0, "dnll": 0.5},
]


def runs_of(records) -> list[Run]:
    return parse_runs("\n".join(json.dumps(r) for r in records), "t.jsonl")


def write(tmp_path, records, name="runs.jsonl", *, as_list=False) -> str:
    path = tmp_path / name
    text = json.dumps(records) if as_list else "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text)
    return str(path)


def run_json(capsys, argv) -> dict:
    assert main(argv + ["--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("expertcache choose: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return err[0]


# ------------------------------------------------------------------------------ the model
def test_three_lines_lower_envelope_by_hand():
    runs = runs_of(THREE)
    ok = admissible(runs, 0.05)
    assert [r.policy for r in ok] == ["A", "B", "C"]
    assert [(c.a, c.b, c.tau_ms) for c in crossovers(ok)] == [("A", "B", 0.4), ("B", "C", 2.0)]
    for tau, name in ((0.1, "A"), (0.39, "A"), (0.41, "B"), (1.11, "B"), (1.99, "B"), (2.01, "C"), (100, "C")):
        assert winner(runs, tau, 0.05).policy == name, tau
    assert winner(runs, 0.1, 1.0).policy == "D"  # admissible once the tolerance allows 0.5 nats
    # at tau 0.5: A 20 + 5 = 25, B 22 + 2.5 = 24.5, C 30.5, D 10 (1000 / 24.5 = 40.816 tok/s)
    pred = {p.policy: p for p in predict(runs, 0.5)}
    assert [pred[n].ms_per_token for n in "ABCD"] == [25.0, 24.5, 30.5, 10.0]
    assert pred["B"].tokens_per_s == pytest.approx(1000 / 24.5)
    assert pred["A"].ms_per_token_overlapped is None


def test_overlapped_model_by_hand():
    """max(c, rho tau): A = max(20, 10 tau), B = max(22, 5 tau), C = max(30, tau). A stays at 20 until
    tau = 2 and reaches B's 22 at tau = 2.2; B stays at 22 until tau = 4.4 and reaches C's 30 at 6."""
    runs = runs_of(THREE)
    ok = admissible(runs, 0.05)
    assert [(c.a, c.b, pytest.approx(c.tau_ms)) for c in crossovers(ok, overlapped=True)] == \
        [("A", "B", 2.2), ("B", "C", 6.0)]
    assert winner(runs, 0.5, 0.05, overlapped=True).policy == "A"  # 20 < 22 < 30; blocking picks B (24.5)
    assert winner(runs, 0.5, 0.05).policy == "B"
    pred = {p.policy: p for p in predict(runs, 0.5, overlapped=True)}
    assert (pred["A"].ms_per_token_overlapped, pred["B"].ms_per_token_overlapped) == (20.0, 22.0)
    assert pred["A"].tokens_per_s_overlapped == 50.0


def test_ties_go_to_dnll_then_rho_then_name():
    # at tau 0.5: P = 20 + 4 x 0.5 = 22 and Q = 21 + 2 x 0.5 = 22 tie
    tie = [{"policy": "P", "c_ms": 20, "rho": 4, "dnll": 0.01}, {"policy": "Q", "c_ms": 21, "rho": 2, "dnll": 0.02}]
    assert winner(runs_of(tie), 0.5, 0.05).policy == "P"  # smaller dnll
    tie[0]["dnll"] = 0.02
    assert winner(runs_of(tie), 0.5, 0.05).policy == "Q"  # equal dnll: smaller rho
    assert winner(runs_of(tie), 0.49, 0.05).policy == "P"  # no tie below the crossover at 0.5
    same = [{"policy": "zeta", "c_ms": 20, "rho": 4, "dnll": 0.0}, {"policy": "alpha", "c_ms": 20, "rho": 4, "dnll": 0.0},
            {"policy": "slow", "c_ms": 30, "rho": 0, "dnll": 0.0}]
    runs = runs_of(same)
    assert winner(runs, 1.0, 0.05).policy == "alpha"  # identical lines: the name decides
    # identical lines are one line, named by the tie-break: alpha = slow at (30 - 20) / 4 = 2.5
    assert [(c.a, c.b, c.tau_ms) for c in crossovers(runs)] == [("alpha", "slow", 2.5)]


def test_lines_meeting_in_one_point_give_one_crossover():
    # E = 10 + 4 tau, F = 12 + 2 tau, G = 14 + 0 tau all meet at tau = 1 (14 ms): E hands over to G directly
    runs = runs_of([{"policy": n, "c_ms": c, "rho": r, "dnll": 0} for n, c, r in (("E", 10, 4), ("F", 12, 2), ("G", 14, 0))])
    assert [(c.a, c.b, c.tau_ms) for c in crossovers(runs)] == [("E", "G", 1.0)]
    assert winner(runs, 1.0, 0).policy == "G"  # the three tie at 14: equal dnll, smallest rho


def test_crossovers_match_a_dense_grid_on_random_tables():
    rng = random.Random(7)
    for _ in range(60):
        runs = runs_of([{"policy": f"p{i}", "c_ms": rng.choice([5, 10, 15, 20, 25]) + rng.random(),
                         "rho": rng.choice([0, 1, 2, 4, 8]) + rng.random(), "dnll": 0} for i in range(rng.randint(1, 7))])
        for overlapped in (False, True):
            cross = crossovers(runs, overlapped)
            assert all(x.tau_ms < y.tau_ms for x, y in zip(cross, cross[1:]))
            for c in cross:  # just below: a, just above: b
                assert winner(runs, c.tau_ms * (1 - 1e-6), 0, overlapped).policy == c.a
                assert winner(runs, c.tau_ms * (1 + 1e-6), 0, overlapped).policy == c.b
            grid = np.geomspace(1e-3, 1e3, 4001)
            names = [winner(runs, t, 0, overlapped).policy for t in grid]
            changes = sum(a != b for a, b in zip(names, names[1:]))
            assert changes == len([c for c in cross if 1e-3 < c.tau_ms < 1e3]), (runs, cross)


def test_choose_needs_an_admissible_run_and_a_tau():
    runs = runs_of(THREE)
    c = choose(runs, 0.05)  # tau: median of 0.5, 0.4, 0.6
    assert c.tau_ms == 0.5 and c.winner.policy == "B"
    assert {n: r.policy for n, r in c.winners_at.items()} == {1: "B", 10: "C", 50: "C"}
    with pytest.raises(ConfigError, match="no admissible policy.*smallest: A at 0"):
        choose(runs, -0.1)
    with pytest.raises(ConfigError, match="--tau"):
        choose(runs_of([{k: v for k, v in r.items() if k != "tau_ms"} for r in THREE]), 0.05)


def test_the_functions_check_what_a_python_caller_passes():
    """The command parses its options first; a Python caller's arguments went in unchecked: a
    negative tau predicted copies that save time, tolerance=True read as 1 nat, runs="x" ended as
    AttributeError and an infinite tolerance admitted every run."""
    from expertcache.costmodel.choose import frontier

    runs = runs_of(THREE)
    for tau in (-1, float("nan"), float("inf"), True, "0.5", 10**400):
        for call in (lambda: predict(runs, tau), lambda: winner(runs, tau, 0.05), lambda: choose(runs, 0.05, tau),
                     lambda: validate(runs, 0.05, tau)):
            with pytest.raises(ConfigError, match="tau_ms must be a finite number >= 0"):
                call()
    for tol in (float("nan"), float("inf"), True, None, "0.1"):
        for call in (lambda: admissible(runs, tol), lambda: winner(runs, 0.5, tol), lambda: choose(runs, tol)):
            with pytest.raises(ConfigError, match="tolerance must be a finite number"):
                call()
    for bad in ("x", b"x", 5, None, [1], {"policy": "A"}):
        for call in (lambda: crossovers(bad), lambda: predict(bad, 0.5), lambda: choose(bad, 0.05)):
            with pytest.raises(ConfigError, match="runs must be a sequence of Run"):
                call()
    for factors in ((), (0,), (2.5,), "10", (True,)):
        with pytest.raises(ConfigError, match="factors must be"):
            choose(runs, 0.05, factors=factors)
        with pytest.raises(ConfigError, match="factors must be"):
            frontier(choose(runs, 0.05), factors)
    assert choose(tuple(runs), np.float64(0.05), np.int64(1)).tau_ms == 1 and predict(runs, 0)[0].ms_per_token > 0


# ------------------------------------------------------------------------------ the command
def test_json_object_matches_the_contract(tmp_path, capsys):
    path = write(tmp_path, THREE)
    out = run_json(capsys, ["choose", path, "--tolerance", "0.05", "--tau", "0.51ms"])
    assert list(out) == ["tau_ms", "tolerance", "admissible", "winner", "predicted", "crossovers"]
    assert out["tau_ms"] == 0.51 and out["tolerance"] == 0.05
    assert out["admissible"] == ["A", "B", "C"] and out["winner"] == "B"  # A 25.1, B 24.55, C 30.51
    assert [sorted(p) for p in out["predicted"]] == [["ms_per_token", "policy", "tokens_per_s"]] * 4
    assert [p["policy"] for p in out["predicted"]] == ["A", "B", "C", "D"]
    assert [p["ms_per_token"] for p in out["predicted"]] == pytest.approx([25.1, 24.55, 30.51, 10.0])
    assert out["crossovers"] == [{"a": "A", "b": "B", "tau_ms": 0.4}, {"a": "B", "b": "C", "tau_ms": 2.0}]
    assert run_json(capsys, ["choose", path, "--tolerance", "0.05", "--tau", "510us"]) == out
    measured = run_json(capsys, ["choose", path, "--tolerance", "0.05"])
    assert measured["tau_ms"] == 0.5
    ovl = run_json(capsys, ["choose", path, "--tolerance", "0.05", "--tau", "0.5", "--overlap"])
    assert list(ovl) == list(out) + ["winner_blocking", "crossovers_blocking"]
    assert (ovl["winner"], ovl["winner_blocking"]) == ("A", "B")
    assert [c["tau_ms"] for c in ovl["crossovers"]] == pytest.approx([2.2, 6.0])
    assert ovl["crossovers_blocking"] == out["crossovers"]
    assert sorted(ovl["predicted"][0]) == ["ms_per_token", "ms_per_token_overlapped", "policy", "tokens_per_s",
                                           "tokens_per_s_overlapped"]


def test_json_lines_and_json_list_read_the_same(tmp_path, capsys):
    argv = ["--tolerance", "0.05"]
    lines = run_json(capsys, ["choose", write(tmp_path, THREE)] + argv)
    listed = run_json(capsys, ["choose", write(tmp_path, THREE, "runs.json", as_list=True)] + argv)
    assert lines == listed
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n" + "\n\n".join(json.dumps(r) for r in THREE) + "\n\n")
    assert run_json(capsys, ["choose", str(blank)] + argv) == lines
    extra = [r | {"model": "m", "per_layer": [{"layer": 0}], "tau_ms": r.get("tau_ms", float("nan"))} for r in THREE]
    nan_text = "\n".join(json.dumps(r) for r in extra)  # json writes NaN for the missing tau: unknown, not an error
    (tmp_path / "extra.jsonl").write_text(nan_text)
    assert run_json(capsys, ["choose", str(tmp_path / "extra.jsonl")] + argv) == lines


def test_table_output(tmp_path, capsys):
    assert main(["choose", write(tmp_path, THREE), "--tolerance", "0.05", "--tau", "0.5", "--overlap"]) == 0
    out = capsys.readouterr().out
    assert "tau 0.5 ms per copy (--tau)" in out
    assert re.search(r"^D\s.*\s0\.5000\s+no\s+10\.0000\s+100\.0000\s+10\.0000\s+100\.0000$", out, re.M), out
    assert "winner: A (20 ms/token, 50 tok/s predicted by max(c, rho x tau))" in out
    assert "with blocking copies (c + rho x tau) the winner would be B" in out
    assert re.search(r"^\s*2\.2000\s+A\s+B$", out, re.M) and re.search(r"^\s*6\.0000\s+B\s+C$", out, re.M)


def test_no_admissible_policy_is_one_line(tmp_path, capsys):
    worse = [r | {"dnll": r["dnll"] + 0.001} for r in THREE]
    err = one_line_error(capsys, ["choose", write(tmp_path, worse), "--tolerance", "0", "--tau", "1"])
    assert "no admissible policy: every run's dnll exceeds the tolerance 0 nats (smallest: A at 0.001)" in err
    err = one_line_error(capsys, ["choose", write(tmp_path, [{k: v for k, v in r.items() if k != "tau_ms"}
                                                             for r in THREE]), "--tolerance", "1"])
    assert "--tau" in err


@pytest.mark.parametrize("record, field", [
    ({"c_ms": 1, "rho": 1, "dnll": 0}, "'policy'"),
    ({"policy": "x", "rho": 1, "dnll": 0}, "'c_ms'"),
    ({"policy": "x", "c_ms": 1, "dnll": 0}, "'rho'"),
    ({"policy": "x", "c_ms": 1, "rho": 1}, "'dnll'"),
    ({"policy": "x", "c_ms": None, "rho": 1, "dnll": 0}, "'c_ms'"),
    ({"policy": "x", "c_ms": -1, "rho": 1, "dnll": 0}, "'c_ms' must be >= 0"),
    ({"policy": "x", "c_ms": 1, "rho": -0.5, "dnll": 0}, "'rho' must be >= 0"),
    ({"policy": "x", "c_ms": "20", "rho": 1, "dnll": 0}, "'c_ms' must be a number"),
    ({"policy": "x", "c_ms": True, "rho": 1, "dnll": 0}, "'c_ms' must be a number"),
    ({"policy": "x", "c_ms": 1, "rho": float("nan"), "dnll": 0}, "'rho' must be a finite"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": float("inf")}, "'dnll' must be a finite"),
    ({"policy": "x", "c_ms": 10 ** 400, "rho": 1, "dnll": 0}, "'c_ms' must be a finite"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "tau_ms": -0.5}, "'tau_ms' must be >= 0"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "tau_ms": float("inf")}, "'tau_ms' must be a finite"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "ms_per_token": "fast"}, "'ms_per_token' must be a number"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "slow_copies": 0}, "'slow_copies' must be an integer >= 1"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "slow_copies": 2.5}, "'slow_copies'"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "needs_future": "no"}, "'needs_future'"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "capacity": 0}, "'capacity'"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "lossless": 1}, "'lossless'"),
    ({"policy": "x", "c_ms": 1, "rho": 1, "dnll": 0, "layers": [-1]}, "'layers'"),
    ({"policy": "", "c_ms": 1, "rho": 1, "dnll": 0}, "'policy' must be a non-empty string"),
    ({"policy": 3, "c_ms": 1, "rho": 1, "dnll": 0}, "'policy' must be a non-empty string"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_records_are_one_line_naming_file_line_and_field(tmp_path, capsys, record, field):
    records = [THREE[0], record]
    err = one_line_error(capsys, ["choose", write(tmp_path, records), "--tolerance", "0.05"])
    assert "runs.jsonl line 2: " in err and field in err, err
    err = one_line_error(capsys, ["choose", write(tmp_path, records, "runs.json", as_list=True), "--tolerance", "0.05"])
    assert "runs.json record 2: " in err and field in err, err


@pytest.mark.parametrize("content, expect", [
    ('{"policy": "a", "c_ms": 1, "rho": 1, "dnll": 0}\n{"policy": "b", "c_ms": 1,\n', "line 2: not valid JSON"),
    ('[{"policy": "a", "c_ms": 1, "rho": 1, "dnll": 0},\n {"policy": "b"\n', "line 3: not valid JSON"),
    ("", "no runs"),
    ("\n  \n", "no runs"),
    ("[]", "no runs"),
    ('{"policy": "a", "c_ms": 1, "rho": 1, "dnll": 0}\n{"policy": "a", "c_ms": 2, "rho": 0, "dnll": 0}\n',
     "line 2: policy 'a' again (first in"),
    ("[" * 100_000 + "]" * 100_000, "cannot be read as JSON"),
    ('{"policy": "a", "c_ms": 1' + "0" * 5000 + ', "rho": 1, "dnll": 0}', "cannot be read as JSON"),
    ("17", "expected a JSON object"),
])
def test_bad_files_are_one_line(tmp_path, capsys, content, expect):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    err = one_line_error(capsys, ["choose", str(path), "--tolerance", "0.05"])
    assert str(path) in err and expect in err, err


def test_hostile_paths_and_options(tmp_path, capsys):
    path = write(tmp_path, THREE)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe{}")
    assert "not UTF-8" in one_line_error(capsys, ["choose", str(tmp_path / "bin.jsonl"), "--tolerance", "1"])
    assert "no such file" in one_line_error(capsys, ["choose", str(tmp_path / "missing.jsonl"), "--tolerance", "1"])
    assert "is a folder" in one_line_error(capsys, ["choose", str(tmp_path), "--tolerance", "1"])
    assert "--add-replay" in one_line_error(capsys, ["choose", path, "--tolerance", "1", "--layers", "0"])
    assert "--plot" in one_line_error(capsys, ["choose", path, "--tolerance", "1", "--plot", str(tmp_path / "f.jpg")])
    assert "does not exist" in one_line_error(capsys, ["choose", path, "--tolerance", "1",
                                                       "--plot", str(tmp_path / "no" / "f.png")])
    for argv in (["--tolerance", "nan"], ["--tolerance", "-1"], ["--tolerance", "1", "--tau", "0"],
                 ["--tolerance", "1", "--tau", "-1ms"], ["--tolerance", "1", "--tau", "fast"]):
        with pytest.raises(SystemExit) as info:
            main(["choose", path] + argv)
        assert info.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0] and "usage:" not in err[0], (argv, err)


def test_slowed_runs_may_carry_a_negative_c(tmp_path, capsys):
    records = THREE + [{"policy": "A", "c_ms": -3.0, "rho": 10, "dnll": 0, "slow_copies": 10, "ms_per_token": 70}]
    assert run_json(capsys, ["choose", write(tmp_path, records), "--tolerance", "0.05"])["winner"] == "B"


# ------------------------------------------------------------------------------ --validate
# Base tau 0.5 (median of A, B, C). At 10 x 0.5 = 5 ms: A 20 + 50 = 70, B 22 + 25 = 47, C 30 + 5 = 35:
# C predicted. At 50 x 0.5 = 25 ms: A 270, B 147, C 55: C predicted.
SLOWED = [
    {"policy": "A", "c_ms": 21, "rho": 10, "dnll": 0.0, "slow_copies": 10, "ms_per_token": 71, "tau_ms": 5.1},
    {"policy": "B", "c_ms": 20, "rho": 5, "dnll": 0.01, "slow_copies": 10, "ms_per_token": 45, "tau_ms": 4.9},
    {"policy": "C", "c_ms": 31, "rho": 1, "dnll": 0.02, "slow_copies": 10, "ms_per_token": 36},
    {"policy": "D", "c_ms": 10, "rho": 0, "dnll": 0.5, "slow_copies": 10, "ms_per_token": 10},  # inadmissible
    {"policy": "X", "c_ms": 10, "rho": 0, "dnll": 0.0, "slow_copies": 10, "ms_per_token": 1},  # no base run
    {"policy": "A", "c_ms": 20, "rho": 10, "dnll": 0.0, "slow_copies": 50, "ms_per_token": 260},
    {"policy": "B", "c_ms": 20, "rho": 5, "dnll": 0.01, "slow_copies": 50, "ms_per_token": 50},  # measured: B
    {"policy": "C", "c_ms": 20, "rho": 1, "dnll": 0.02, "slow_copies": 50, "ms_per_token": 56},
]


def test_validate_agreeing_and_disagreeing(tmp_path, capsys):
    checks = validate(runs_of(THREE + SLOWED), 0.05, 0.5)
    assert [(c.slow_copies, c.tau_ms, c.predicted, c.measured, c.agree) for c in checks] == \
        [(10, 5.0, "C", "C", True), (50, 25.0, "C", "B", False)]
    assert checks[0].tau_ms_measured == 5.0 and checks[1].tau_ms_measured is None  # median of 5.1, 4.9
    assert checks[0].unmatched == ["X"]
    assert [(r["policy"], r["admissible"], r["ms_predicted"], r["ms_measured"]) for r in checks[0].rows] == \
        [("A", True, 70.0, 71), ("B", True, 47.0, 45), ("C", True, 35.0, 36), ("D", False, 10.0, 10)]
    path = write(tmp_path, THREE + SLOWED)
    out = run_json(capsys, ["choose", path, "--tolerance", "0.05", "--validate"])
    assert [(v["slow_copies"], v["agree"]) for v in out["validate"]] == [(10, True), (50, False)]
    assert out["validate"][0]["margin_predicted"] == pytest.approx(12 / 35)
    assert out["validate"][0]["margin_measured"] == pytest.approx(9 / 36)
    assert main(["choose", path, "--tolerance", "0.05", "--validate"]) == 0
    text = capsys.readouterr().out
    assert ("validate slow_copies 10: predicted C, measured C: agree "
            "(lead over the runner-up: predicted 34.3%, measured 25.0%)\n") in text  # (47-35)/35, (45-36)/36
    assert "  predicted at tau = 10 x 0.5 = 5 ms; these runs measured 5 ms (10 x the base)\n" in text
    assert "  predicted at tau = 50 x 0.5 = 25 ms\n" in text
    assert "predicted C, measured B: DISAGREE" in text and "left out (no slow_copies 1 run to predict from): X" in text
    # --tau changes the choice, not the check: the base runs' measured tau (0.5) predicts the slowed runs
    given = run_json(capsys, ["choose", path, "--tolerance", "0.05", "--validate", "--tau", "3"])
    assert given["validate"] == out["validate"] and given["tau_ms"] == 3


def test_validate_without_the_predicted_winner_is_untested(tmp_path, capsys):
    # At x10 (tau 5 ms) the model predicts C fastest of all (35 ms; A 70, B 47). Run only A and B
    # there: B wins both the prediction among them and the measurement, but the prediction the
    # base runs make, C, was never tested, so the verdict is not "agree".
    slowed = [r for r in SLOWED[:2]]
    checks = validate(runs_of(THREE + slowed), 0.05, 0.5)
    assert [(c.predicted, c.measured, c.not_run, c.agree, c.verdict) for c in checks] == \
        [("B", "B", ["C"], False, "untested")]
    path = write(tmp_path, THREE + slowed)
    out = run_json(capsys, ["choose", path, "--tolerance", "0.05", "--validate"])
    assert [(v["verdict"], v["agree"], v["not_run"]) for v in out["validate"]] == [("untested", False, ["C"])]
    assert main(["choose", path, "--tolerance", "0.05", "--validate"]) == 0
    text = capsys.readouterr().out
    assert ("validate slow_copies 10: untested: the base runs predict C fastest here and it has no run at this "
            "condition (among the runs: predicted B, measured B)\n") in text
    # a policy predicted slower than the tested winner does not matter: with C run, A missing is fine
    checks = validate(runs_of(THREE + SLOWED[1:3]), 0.05, 0.5)
    assert [(c.predicted, c.measured, c.not_run, c.verdict) for c in checks] == [("C", "C", [], "agree")]


def test_validate_errors(tmp_path, capsys):
    err = one_line_error(capsys, ["choose", write(tmp_path, THREE), "--tolerance", "0.05", "--validate"])
    assert "no slowed runs" in err
    no_ms = [dict(SLOWED[0], ms_per_token=None)]
    err = one_line_error(capsys, ["choose", write(tmp_path, THREE + no_ms), "--tolerance", "0.05", "--validate"])
    assert "runs.jsonl line 5" in err and "'ms_per_token'" in err


# ------------------------------------------------------------------------------ --add-replay
@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    trace = synthesize_preset("olmoe", seed=1, tokens=96, sequences=2, num_layers=4)
    return trace, trace.save(tmp_path_factory.mktemp("choose") / "t.npz")


def test_add_replay_adds_lossless_rules_with_the_replayed_rho(tmp_path, capsys, synthetic):
    trace, path = synthetic
    # c for replayed rules: median c_ms of the lossless runs, |dnll| <= 5e-3: lru 20 and decayed 21 -> 20.5
    records = [{"policy": "lru", "c_ms": 20.0, "rho": 9.0, "dnll": 0.001, "tau_ms": 0.5, "capacity": 16, "layers": [1, 3]},
               {"policy": "decayed:0.95", "c_ms": 21.0, "rho": 8.0, "dnll": -0.002, "capacity": 16, "layers": [1, 3]},
               {"policy": "dwell:16:128", "c_ms": 22.0, "rho": 2.0, "dnll": 0.07, "capacity": 16, "layers": [1, 3]}]
    runs = write(tmp_path, records)
    out = run_json(capsys, ["choose", runs, "--tolerance", "0.01", "--add-replay", str(path)])
    rho = {p: ec.replay(trace, 16, p, layers=[1, 3]).copies_per_token for p in ("belady", "foresight:16")}
    assert 0 < rho["belady"] <= rho["foresight:16"]
    pred = {p["policy"]: p for p in out["predicted"]}
    assert list(pred) == ["lru", "decayed:0.95", "dwell:16:128", "belady", "foresight:16"]
    assert pred["belady"]["ms_per_token"] == pytest.approx(20.5 + rho["belady"] * 0.5)
    assert pred["foresight:16"]["ms_per_token"] == pytest.approx(20.5 + rho["foresight:16"] * 0.5)
    assert pred["belady"]["replayed"] is True and pred["belady"]["needs_future"] is True
    assert pred["lru"]["replayed"] is False and pred["lru"]["needs_future"] is False
    assert out["admissible"] == ["lru", "decayed:0.95", "belady", "foresight:16"]
    # --layers overrides the runs' layers; --replay-policy picks the rules; a measured run is not replayed
    out = run_json(capsys, ["choose", runs, "--tolerance", "0.01", "--add-replay", str(path), "--layers", "0-3",
                            "--replay-policy", "belady", "--replay-policy", "lru"])
    pred = {p["policy"]: p for p in out["predicted"]}
    assert list(pred) == ["lru", "decayed:0.95", "dwell:16:128", "belady"]
    assert pred["belady"]["ms_per_token"] == pytest.approx(20.5 + ec.replay(trace, 16, "belady").copies_per_token * 0.5)
    assert main(["choose", runs, "--tolerance", "0.01", "--add-replay", str(path)]) == 0
    text = capsys.readouterr().out
    assert "needs the future (clairvoyant, an offline reference): belady, foresight:16" in text
    assert "replayed: rho from" in text and "at capacity 16 (layer pool, layers 1,3), c = 20.5 ms" in text
    # eval's 'lossless' field, where present, decides instead of |dnll|: c = lru's 20 alone
    flagged = [records[0] | {"lossless": True}, records[1] | {"lossless": False}, records[2]]
    out = run_json(capsys, ["choose", write(tmp_path, flagged), "--tolerance", "0.01", "--add-replay", str(path)])
    assert out["predicted"][3]["ms_per_token"] == pytest.approx(20.0 + rho["belady"] * 0.5)


def test_add_replay_errors(tmp_path, capsys, synthetic):
    _, path = synthetic
    base = {"c_ms": 20.0, "rho": 9.0, "dnll": 0.0, "tau_ms": 0.5}
    cases = [
        ([base | {"policy": "lru", "capacity": 16}, base | {"policy": "lfu", "capacity": 8}], "capacities 8, 16"),
        ([base | {"policy": "lru"}], "has no 'capacity'"),
        ([base | {"policy": "lru", "capacity": 16, "dnll": 0.2}], "no lossless run"),
        ([base | {"policy": "lru", "capacity": 16, "layers": [7]}], "layer"),
        # a trace of another model: the synthetic olmoe trace has 64 experts per layer
        ([base | {"policy": "lru", "capacity": 16, "num_experts": 16}],
         "the trace has 64 experts per layer, where the runs' model has 16"),
        ([base | {"policy": "lru", "capacity": 65}], "capacity 65 is above the 64 experts per layer of the trace"),
        ([base | {"policy": "lru", "capacity": 16, "num_experts": 64},
          base | {"policy": "lfu", "capacity": 16, "num_experts": 16}], "the runs are of different models"),
        ([base | {"policy": "lru", "capacity": 16, "num_experts": 0}], "'num_experts' must be a positive integer"),
    ]
    for records, expect in cases:
        err = one_line_error(capsys, ["choose", write(tmp_path, records), "--tolerance", "1", "--add-replay", str(path)])
        assert expect in err, err
    # the same model's runs replay: num_experts 64 as the trace, and a global pool above one layer's 64
    assert main(["choose", write(tmp_path, [base | {"policy": "lru", "capacity": 16, "num_experts": 64}]),
                 "--tolerance", "1", "--add-replay", str(path)]) == 0
    assert main(["choose", write(tmp_path, [base | {"policy": "lru", "capacity": 100, "pool": "global"}]),
                 "--tolerance", "1", "--add-replay", str(path)]) == 0
    capsys.readouterr()
    ok = write(tmp_path, [base | {"policy": "lru", "capacity": 16}])
    err = one_line_error(capsys, ["choose", ok, "--tolerance", "1", "--add-replay", str(path), "--replay-policy", "nope"])
    assert "nope" in err
    assert "no-such" in one_line_error(capsys, ["choose", ok, "--tolerance", "1", "--add-replay", str(tmp_path / "no-such")])


# ------------------------------------------------------------------------------ plot, docs
def test_plot_writes_a_png(tmp_path, capsys, synthetic):
    pytest.importorskip("matplotlib")
    out = tmp_path / "frontier.png"
    assert main(["choose", str(EXAMPLE), "--tolerance", "0.1", "--plot", str(out), "--add-replay", str(synthetic[1]),
                 "--layers", "0-3"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().err


def test_docs_example_prints_what_the_docs_show(capsys, monkeypatch):
    """docs/choose.md shows the output of its example command on docs/examples/runs.jsonl."""
    doc = (REPO / "docs" / "choose.md").read_text()
    block = re.search(r"```console\n\$ (expertcache choose [^\n]+)\n(.*?)```", doc, re.S)
    command, shown = block.group(1), block.group(2)
    monkeypatch.chdir(REPO)
    assert main(command.split()[1:]) == 0
    assert capsys.readouterr().out == shown


def test_tolerance_defaults_to_five_hundredths(capsys):
    """The issue's `choose runs.jsonl --add-replay T.npz` runs as written: --tolerance defaults to 0.05."""
    out = run_json(capsys, ["choose", str(EXAMPLE)])
    assert out["tolerance"] == 0.05


# ------------------------------------------------------------------------------ trace-only choose
def test_replay_json_is_a_runs_file_with_tau_and_c(tmp_path, capsys, synthetic):
    """replay --json rows are lossless runs: rho = copies_per_token, c = --c, dnll 0."""
    trace, path = synthetic
    assert main(["replay", str(path), "-c", "32", "-p", "lru", "-p", "decayed", "-p", "belady", "--json"]) == 0
    replayed = tmp_path / "replay.jsonl"
    replayed.write_text(capsys.readouterr().out)
    ref = {p: ec.sim.replay(trace, 32, p).copies_per_token for p in ("lru", "decayed:0.95", "belady")}
    out = run_json(capsys, ["choose", str(replayed), "--tau", "0.51ms", "--c", "20ms"])
    pred = {p["policy"]: p["ms_per_token"] for p in out["predicted"]}
    assert pred == pytest.approx({p: 20 + rho * 0.51 for p, rho in ref.items()})
    assert out["admissible"] == ["lru", "decayed:0.95", "belady"]
    # the winner is the fastest causal-or-not admissible rule, as for eval rows; fewest copies wins here
    assert out["winner"] == min(ref, key=ref.get)
    err = one_line_error(capsys, ["choose", str(replayed), "--tau", "0.51ms"])
    assert "--c" in err and "replay" in err


def test_sweep_json_needs_one_capacity(tmp_path, capsys, synthetic):
    trace, path = synthetic
    assert main(["sweep", str(path), "--capacities", "16,32", "-p", "lru", "--json"]) == 0
    swept = tmp_path / "sweep.jsonl"
    swept.write_text(capsys.readouterr().out)
    err = one_line_error(capsys, ["choose", str(swept), "--tau", "1", "--c", "10"])
    assert "capacities 16, 32" in err and "--capacity" in err
    out = run_json(capsys, ["choose", str(swept), "--tau", "1", "--c", "10", "--capacity", "16"])
    assert out["predicted"][0]["ms_per_token"] == pytest.approx(10 + ec.sim.replay(trace, 16, "lru").copies_per_token)


def test_replay_rows_mix_with_eval_rows(tmp_path, capsys, synthetic):
    trace, path = synthetic
    assert main(["replay", str(path), "-c", "8", "-p", "lru", "-p", "belady", "--json"]) == 0
    lines = capsys.readouterr().out
    evals = [{"policy": "lru", "c_ms": 20, "rho": 9.0, "dnll": 0.0, "tau_ms": 0.5, "capacity": 8, "lossless": True},
             {"policy": "dwell:4:32", "c_ms": 21, "rho": 2.0, "dnll": 0.03, "tau_ms": 0.5, "capacity": 8}]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in evals) + lines)
    out = run_json(capsys, ["choose", str(mixed)])
    # c of the replay rows: the median c_ms of the lossless eval runs (20); lru is measured, not replayed
    names = [p["policy"] for p in out["predicted"]]
    assert names == ["lru", "dwell:4:32", "belady"]
    belady = ec.sim.replay(trace, 8, "belady").copies_per_token
    assert out["predicted"][2]["ms_per_token"] == pytest.approx(20 + belady * 0.5)
    assert main(["choose", str(mixed)]) == 0
    text = capsys.readouterr().out
    assert "not replayed (the file measures them): lru" in text and "replayed" in text
    # with --c given, the replay rows take it (and the eval runs still decide which rows they measure)
    out = run_json(capsys, ["choose", str(mixed), "--c", "30ms"])
    assert out["predicted"][2]["ms_per_token"] == pytest.approx(30 + belady * 0.5)


# ------------------------------------------------------------------------------ noise called noise
def test_validate_lead_inside_the_spread_is_a_tie(tmp_path, capsys):
    """At x10 C leads B by (45 - 36) / 36 = 25% measured; with a 30% spread that is a tie, with 10% not."""
    def with_spread(spread):
        return [dict(r, ms_per_token_spread=spread, repeats=3) if r.get("slow_copies") == 10 else r
                for r in THREE + SLOWED[:5]]
    checks = validate(runs_of(with_spread(0.30)), 0.05, 0.5)
    assert checks[0].verdict == "tie (within noise)" and checks[0].to_dict()["verdict"] == "tie (within noise)"
    assert validate(runs_of(with_spread(0.10)), 0.05, 0.5)[0].verdict == "agree"
    assert main(["choose", write(tmp_path, with_spread(0.30)), "--tolerance", "0.05", "--validate"]) == 0
    text = capsys.readouterr().out
    assert "predicted C, measured C: tie (within noise)" in text and "spread 30.0%" in text
    # a disagreement inside the spread is a tie too: at x50 B is measured 50, C 56 -> C is 12% slower
    slowed50 = [dict(r, ms_per_token_spread=0.2) for r in SLOWED[5:]]
    (c50,) = validate(runs_of(THREE + slowed50), 0.05, 0.5)
    assert (c50.predicted, c50.measured, c50.verdict) == ("C", "B", "tie (within noise)")


def test_demo_live_says_what_this_cpu_can_and_cannot_show():
    """At x1 copies take 2 x 0.01 / 10 = 0.2% (lru) and 1 x 0.01 / 11 = 0.09% (dwell) of a step: median 0.15%."""
    from expertcache.cli.demo_live import cpu_note, verdict_line

    recs = [{"policy": "lru", "slow_copies": 1, "rho": 2.0, "tau_ms": 0.01, "ms_per_token": 10.0},
            {"policy": "dwell:1:1", "slow_copies": 1, "rho": 1.0, "tau_ms": 0.01, "ms_per_token": 11.0},
            {"policy": "lru", "slow_copies": 50, "rho": 2.0, "tau_ms": 0.5, "ms_per_token": 12.0}]
    note = cpu_note(recs)
    assert "0.15% at x1, 8.3% at x50 of a step" in note  # x50: (2 x 0.5) / 12
    assert "can show" in note and "cannot show" in note
    checks = validate(runs_of(THREE + [dict(r, ms_per_token_spread=0.3) for r in SLOWED[:5]]), 0.05, 0.5)
    line = verdict_line(checks[0])
    assert line.startswith("  at x10: predicted C, measured C: tie (within noise)") and "spread 30%" in line


# ------------------------------------------------------------------------------ host modes
HOSTED = [
    {"policy": "lru", "c_ms": 10.0, "rho": 2.0, "dnll": 0.0, "tau_ms": 0.5, "ms_per_token": 11.0},
    {"policy": "dwell:8", "c_ms": 11.0, "rho": 0.5, "dnll": 0.001, "tau_ms": 0.5, "ms_per_token": 11.25},
    {"policy": "lru", "c_ms": 10.0, "rho": 2.0, "dnll": 0.0, "tau_ms": 5.0, "ms_per_token": 20.5, "host": "direct",
     "ms_per_token_spread": 0.02},
    {"policy": "dwell:8", "c_ms": 11.0, "rho": 0.5, "dnll": 0.001, "tau_ms": 4.0, "ms_per_token": 13.4,
     "host": "direct", "ms_per_token_spread": 0.02},
    {"policy": "lru", "c_ms": 10.0, "rho": 2.0, "dnll": 0.0, "tau_ms": 0.6, "ms_per_token": 11.1, "host": "mmap"},
]


def test_each_host_is_a_condition_predicted_with_its_own_tau(tmp_path, capsys):
    """Runs at another host mode are checked like slowed runs, at the host's own measured tau
    (the median tau_ms of its slow_copies 1 runs), from the base host's c and rho."""
    runs = runs_of(HOSTED)
    c = choose(runs, 0.01)
    assert [r.policy for r in c.runs] == ["lru", "dwell:8"] and c.tau_ms == 0.5 and c.winner.policy == "lru"
    checks = validate(runs, 0.01, 0.5)
    assert [(k.host, k.slow_copies) for k in checks] == [("direct", 1), ("mmap", 1)]
    direct, mmap = checks
    assert direct.base_tau_ms == 4.5 and direct.tau_ms == 4.5  # median of 5.0 and 4.0
    assert {r["policy"]: r["ms_predicted"] for r in direct.rows} == {"lru": 10 + 2 * 4.5, "dwell:8": 11 + 0.5 * 4.5}
    assert direct.predicted == direct.measured == "dwell:8" and direct.verdict == "agree"
    assert mmap.rows == [{"policy": "lru", "admissible": True, "ms_predicted": 11.2, "ms_measured": 11.1}]
    out = run_json(capsys, ["choose", write(tmp_path, HOSTED), "--tolerance", "0.01", "--validate"])
    assert [(v["host"], v["slow_copies"], v["predicted"]) for v in out["validate"]] == [("direct", 1, "dwell:8"),
                                                                                          ("mmap", 1, "lru")]
    # choosing at another host: its own runs, its own tau; the memory runs become a condition
    out = run_json(capsys, ["choose", write(tmp_path, HOSTED), "--tolerance", "0.01", "--host", "direct", "--validate"])
    assert out["tau_ms"] == 4.5 and out["winner"] == "dwell:8"
    assert [(v["host"], v["predicted"], v["measured"]) for v in out["validate"]] == [("memory", "lru", "lru"),
                                                                                     ("mmap", "lru", "lru")]


def test_host_mistakes_are_one_line(tmp_path, capsys):
    bad = [{**HOSTED[0], "host": "disk"}]
    assert "field 'host' must be one of memory, mmap, direct" in one_line_error(capsys, ["choose", write(tmp_path, bad)])
    twice = HOSTED + [{**HOSTED[2]}]
    err = one_line_error(capsys, ["choose", write(tmp_path, twice, "twice.jsonl")])
    assert "policy 'lru' on host direct again" in err
    no_memory = [r for r in HOSTED if "host" in r]
    err = one_line_error(capsys, ["choose", write(tmp_path, no_memory, "nomem.jsonl")])
    assert "none is 'memory': give --host" in err
    err = one_line_error(capsys, ["choose", write(tmp_path, HOSTED[:2], "mem.jsonl"), "--host", "mmap"])
    assert "--host mmap: no slow_copies 1 runs there" in err
    untimed = HOSTED[:2] + [{**HOSTED[4], "tau_ms": None}]
    err = one_line_error(capsys, ["choose", write(tmp_path, untimed, "untimed.jsonl"), "--validate"])
    assert "on host mmap record no tau_ms" in err


def test_implausible_times_and_copies_are_refused(tmp_path, capsys):
    """Times above an hour and rho above 1e9 are not measurements: two runs at tau 1e308 had made a
    median of inf (the mean of two) and a winner at 0 tok/s with exit 0."""
    base = {"policy": "lru", "c_ms": 20, "rho": 9, "dnll": 0.0}
    for field, value in (("tau_ms", 1e308), ("c_ms", 3.7e6), ("ms_per_token", 1e10), ("rho", 2e9)):
        err = one_line_error(capsys, ["choose", write(tmp_path, [base | {field: value}])])
        assert f"field '{field}' is above" in err, err
    assert main(["choose", write(tmp_path, [base | {"tau_ms": 3.6e6}])]) == 0  # an hour is the most
    capsys.readouterr()
    for tau in ("1e300ms", "3601s"):
        with pytest.raises(SystemExit) as exc:  # an option argparse refuses
            main(["choose", write(tmp_path, [base]), "--tau", tau])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and "above an hour" in err[0], err
