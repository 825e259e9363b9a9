"""tier plan: breakeven reuse (hand-computed and the paper's 1.06), placement on a hand-made trace,
the capacity answer from a hand-made curve, and one-line errors."""

from __future__ import annotations

import argparse
import importlib.util
import json

import numpy as np
import pytest

from expertcache import Trace
from expertcache.cli import tier_plan
from expertcache.errors import ConfigError
from expertcache.tier import plan as P

PAPER = dict(hbm=2938.0, host=327.0, pcie=23.0, nvme=27.0, copy=346.0)  # section 8's measured constants


def test_breakeven_hand_computed():
    # copy 10, slow 5, fast 10: saves 1/5 - 1/10 = 0.1 per use, costs 0.1: k* = 1
    assert P.breakeven(10, 5, 10) == pytest.approx(1.0)
    # copy 2, slow 1, fast 4: cost 0.5, saving 0.75 per use: k* = 2/3
    assert P.breakeven(2, 1, 4) == pytest.approx(2 / 3)
    # storage pair: copy = slow = nvme: k* = fast / (fast - slow)
    assert P.breakeven(27, 27, 327) == pytest.approx(327 / 300)
    with pytest.raises(ConfigError, match="not faster"):
        P.breakeven(1, 5, 5)
    with pytest.raises(ConfigError, match="positive"):
        P.breakeven(-1, 1, 2)


def test_paper_reference_k_star_and_tie():
    """Section 8: 'the breakeven reuse count is (1/346) / (1/327 - 1/2938) = 1.06'; 'adopt and
    stream tie within 5.6%' (327 vs 346 GB/s, gap taken relative to the mean of the two)."""
    rates = P.Rates(**PAPER).check()
    pairs = P.tier_pairs(rates)
    assert round(pairs[0]["k_star"], 2) == 1.06
    assert pairs[0]["pair"] == "hbm<-host" and pairs[0]["link"] == "coherent"
    assert pairs[1]["k_star"] == pytest.approx(2938 / (2938 - 23))  # PCIe: own-or-restream
    assert pairs[2]["k_star_admission_on_miss"] == 0.0
    a = P.adopt_or_stream(327, 346)
    assert round(a["gap"] * 100, 1) == 5.6
    assert a["adopt_slower_by"] == pytest.approx(346 / 327 - 1)  # 5.8%
    assert a["stream_faster_by"] == pytest.approx(1 - 327 / 346)  # 5.5%
    assert a["choice"] == "adopt (tie)"
    assert P.adopt_or_stream(327, 346, tie_band=0.01)["choice"] == "stream"


def test_rates_are_checked():
    with pytest.raises(ConfigError, match="--hbm-gbps 300 is not faster than --host-gbps 327"):
        P.Rates(**dict(PAPER, hbm=300.0)).check()
    with pytest.raises(ConfigError, match="--nvme-gbps"):
        P.Rates(**dict(PAPER, nvme=-1.0)).check()
    with pytest.raises(ConfigError, match="--host-gbps 20 is not faster than --nvme-gbps 27"):
        P.Rates(**dict(PAPER, host=20.0)).check()


def _trace():
    # 2 layers, 4 experts, top-2, 4 tokens (one iteration each). Layer 0: expert 0 in every token
    # (4 requests), expert 1 twice, experts 2 and 3 once. Layer 1: expert 3 three times, 2 once, 1 once, 0 once.
    ex = np.array([
        [[0, 1], [3, 2]],
        [[0, 2], [3, 1]],
        [[0, 1], [3, 0]],
        [[0, 3], [-1, -1]],
    ])
    return Trace.from_arrays(ex, num_experts=4)


def test_request_counts_and_placement():
    counts, iters = P.request_counts(_trace())
    assert iters == 4
    assert counts.tolist() == [[4, 2, 1, 1], [1, 1, 1, 3]]
    # k* = 1.06: reuse = requests - 1 must exceed it -> requests >= 3: (0,0) with 4, (1,3) with 3
    pl = P.placement(counts, iters, 1.06, expert_bytes=100)
    assert pl["candidates_above_k_star"] == 2 and pl["pinned"] == 2 and pl["pinned_bytes"] == 200
    assert pl["requests"] == 14 and pl["pinned_request_share"] == pytest.approx(7 / 14)
    assert pl["experts_touched"] == 8 and pl["left_to_page_cache"] == 6
    assert [(t["layer_index"], t["expert"]) for t in pl["pinned_top"]] == [(0, 0), (1, 3)]
    assert pl["requests_per_iteration"] == pytest.approx(14 / 4)
    # an HBM budget of one expert keeps the most requested
    one = P.placement(counts, iters, 1.06, expert_bytes=100, hbm_bytes=150)
    assert one["hbm_slots"] == 1 and one["pinned"] == 1 and one["pinned_request_share"] == pytest.approx(4 / 14)
    # k* below 1 (reuse > 0.5): every expert requested twice or more
    assert P.placement(counts, iters, 0.5, expert_bytes=1)["candidates_above_k_star"] == 3


def test_iterations_follow_the_iteration_extra():
    ex = np.array([[[0]], [[1]], [[0]], [[2]]])
    t = Trace.from_arrays(ex, num_experts=3, extras={"iteration": np.array([0, 0, 1, 1])})
    counts, iters = P.request_counts(t)
    assert iters == 2 and counts.tolist() == [[2, 1, 1]]


def _curve(tmp_path, lines):
    path = tmp_path / "sweep.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_capacity_from_a_hand_made_curve(tmp_path):
    recs = [
        {"mode": "pagecache", "capacity_bytes": 1_000, "seconds_per_iteration_median": 1.0},   # 1 it/s
        {"mode": "pagecache", "capacity_bytes": 2_000, "seconds_per_iteration_median": 0.5},   # 2 it/s
        {"mode": "pagecache", "capacity_bytes": 4_000, "seconds_per_iteration_median": 0.25},  # 4 it/s
        {"mode": "arena", "capacity_bytes": 1_000, "seconds_per_iteration_median": 0.4, "proof_ok": False},
        {"mode": "arena", "capacity_bytes": 2_000, "seconds_per_iteration_median": 0.3},
        {"summary": True},
    ]
    points, skipped = P.read_curve(_curve(tmp_path, [json.dumps(r) for r in recs]))
    assert len(points) == 5 and skipped["without_fields"] == 1
    rows = {r["mode"]: r for r in P.capacity_for_target(points, 3.0)}
    pc = rows["pagecache"]
    assert pc["measured_capacity_bytes"] == 4_000
    # between (2000, 2 it/s) and (4000, 4 it/s): 3 it/s at 3000 bytes
    assert pc["interpolated_capacity_bytes"] == 3_000 and "interpolated" in pc["note"]
    ar = rows["arena"]  # 2.5 it/s at the smallest capacity, 3.33 at 2000: bracket 1000..2000
    assert ar["measured_capacity_bytes"] == 2_000
    assert ar["interpolated_capacity_bytes"] == round(1000 + (3 - 2.5) * 1000 / (1 / 0.3 - 2.5))
    assert [c["proof_ok"] for c in ar["curve"]] == [False, True]
    low = {r["mode"]: r for r in P.capacity_for_target(points, 0.5)}["pagecache"]
    assert low["measured_capacity_bytes"] == 1_000 and low["interpolated_capacity_bytes"] is None
    high = {r["mode"]: r for r in P.capacity_for_target(points, 10)}["pagecache"]
    assert high["measured_capacity_bytes"] is None and "no measured capacity" in high["note"]


def test_summary_records_win_over_runs(tmp_path):
    runs = [{"mode": "m", "capacity_bytes": 10, "seconds_per_iteration_median": s} for s in (1.0, 0.9, 0.1)]
    summ = {"summary": True, "mode": "m", "capacity_bytes": 10, "seconds_per_iteration_median": 0.8}
    points, _ = P.read_curve(_curve(tmp_path, [json.dumps(r) for r in runs + [summ]]))
    row = P.capacity_for_target(points, 1.0)[0]
    assert row["curve"] == [{"capacity_bytes": 10, "iters_per_s": 1 / 0.8, "records": 1, "proof_ok": True}]


def test_repeated_capacity_uses_the_median(tmp_path):
    recs = [{"mode": "m", "capacity_bytes": 10, "seconds_per_iteration_median": s} for s in (1.0, 0.5, 0.25)]
    points, _ = P.read_curve(_curve(tmp_path, [json.dumps(r) for r in recs]))
    row = P.capacity_for_target(points, 2.0)[0]
    assert row["curve"][0]["iters_per_s"] == pytest.approx(2.0) and row["curve"][0]["records"] == 3


@pytest.mark.parametrize("line, match", [
    ("{not json", ":2: not JSON"),
    ("[1, 2]", ":2: expected a JSON object"),
    ('{"capacity_bytes": -5, "seconds_per_iteration_median": 1}', ":2: capacity_bytes -5"),
    ('{"capacity_bytes": 5, "seconds_per_iteration_median": "fast"}', ":2: seconds_per_iteration_median"),
])
def test_bad_curve_lines_name_the_line(tmp_path, line, match):
    good = json.dumps({"capacity_bytes": 1, "seconds_per_iteration_median": 1})
    with pytest.raises(ConfigError, match=match):
        P.read_curve(_curve(tmp_path, [good, line]))


def test_unreadable_or_empty_curve(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        P.read_curve(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="no record"):
        P.read_curve(_curve(tmp_path, ['{"mode": "x"}']))


def _parser():
    parser = argparse.ArgumentParser(prog="expertcache")
    tier = parser.add_subparsers(dest="command").add_parser("tier")
    tier_plan.add_plan_parser(tier.add_subparsers(dest="tier_command"))
    return parser


def _argv(trace_path, *extra):
    """The paper's rates; an option in ``extra`` that is one of them replaces it (options are given once)."""
    base = {"--hbm-gbps": "2938", "--host-gbps": "327", "--pcie-gbps": "23", "--nvme-gbps": "27",
            "--expert-mb": "17.5", "--target-iters-per-s": "2"}
    rest, i = [], 0
    while i < len(extra):
        if extra[i] in base and i + 1 < len(extra):
            base[extra[i]] = extra[i + 1]
            i += 2
        else:
            rest.append(extra[i])
            i += 1
    return ["tier", "plan", "--trace", str(trace_path), *[x for kv in base.items() for x in kv], *rest]


def test_cli_text_and_json(tmp_path, capsys):
    tp = tmp_path / "t.npz"
    _trace().save(tp)
    curve = _curve(tmp_path, [json.dumps({"mode": "pagecache", "capacity_bytes": c, "seconds_per_iteration_median": s})
                              for c, s in ((10**9, 1.0), (2 * 10**9, 0.25))])
    args = _parser().parse_args(_argv(tp, "--copy-gbps", "346", "--curve", curve, "--json"))
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["tier_pairs"][0]["k_star"], 2) == 1.06
    assert out["placement"]["pinned"] == 2 and out["expert_bytes"] == 17_500_000
    assert out["demand_bytes_per_iteration"] == pytest.approx(3.5 * 17.5e6)
    assert out["iters_per_s_all_from_nvme"] == pytest.approx(27e9 / (3.5 * 17.5e6))
    cap = out["capacity"][0]
    assert cap["measured_capacity_bytes"] == 2 * 10**9
    assert cap["interpolated_capacity_bytes"] == round(10**9 + (2 - 1) * 10**9 / (4 - 1))
    args = _parser().parse_args(_argv(tp))
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "k*" in text and "give --curve" in text and "taken as --host-gbps" in text


def test_cli_bad_inputs(tmp_path):
    tp = tmp_path / "t.npz"
    _trace().save(tp)
    with pytest.raises(SystemExit):
        _parser().parse_args(_argv(tp, "--nvme-gbps", "-3"))
    args = _parser().parse_args(_argv(tp, "--hbm-gbps", "100"))
    with pytest.raises(ConfigError, match="--hbm-gbps 100 is not faster"):
        args.func(args)
    bad = _curve(tmp_path, ['{"capacity_bytes": 1, "seconds_per_iteration_median": 1}', "oops"])
    args = _parser().parse_args(_argv(tp, "--curve", bad))
    with pytest.raises(ConfigError, match=r"sweep.jsonl:2: not JSON"):
        args.func(args)


@pytest.mark.skipif(importlib.util.find_spec("expertcache.cli.tier_cmd") is None, reason="tier command not registered yet")
def test_through_main_one_line_errors(tmp_path, capsys):
    from expertcache.cli.main import main

    tp = tmp_path / "t.npz"
    _trace().save(tp)
    assert main(_argv(tp, "--host-gbps", "20")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host-gbps 20 is not faster than --nvme-gbps 27" in err[0]
    with pytest.raises(SystemExit) as exc:
        main(_argv(tp, "--hbm-gbps", "-1"))
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    for option in ("--expert-mb", "--target-iters-per-s"):  # had said "expected a positive bandwidth in GB/s"
        with pytest.raises(SystemExit):
            main(["tier", "plan", "--trace", str(tp), option, "nan"])
        assert f"argument {option}: expected a positive finite number, got 'nan'" in capsys.readouterr().err


# ------------------------------------------------------------------ issue 22, item 6: plan checks its inputs
def _sweep_line(cap, sec, **extra):
    return json.dumps({"summary": True, "mode": "pagecache", "capacity_bytes": cap, "seconds_per_iteration_median": sec,
                       **extra})


def test_curve_from_another_pool_or_trace_is_refused(tmp_path):
    tp = tmp_path / "t.npz"
    _trace().save(tp)
    from expertcache.trace import load_trace
    name = load_trace(tp).name
    other_size = _curve(tmp_path, [_sweep_line(10**9, 1.0, expert_bytes=64_000, trace=name)])
    args = _parser().parse_args(_argv(tp, "--curve", other_size))
    with pytest.raises(ConfigError, match="experts of 64000 bytes, the plan's are 17500000"):
        args.func(args)
    other_trace = _curve(tmp_path, [_sweep_line(10**9, 1.0, expert_bytes=17_500_000, trace="elsewhere")])
    args = _parser().parse_args(_argv(tp, "--curve", other_trace))
    with pytest.raises(ConfigError, match="measured on trace elsewhere"):
        args.func(args)
    same = _curve(tmp_path, [_sweep_line(10**9, 1.0, expert_bytes=17_500_000, trace=name)])
    assert tier_plan.compute(_parser().parse_args(_argv(tp, "--curve", same)))["capacity_note"] is None
    bare = _curve(tmp_path, [_sweep_line(10**9, 1.0)])
    assert "not checked" in tier_plan.compute(_parser().parse_args(_argv(tp, "--curve", bare)))["capacity_note"]


def test_expert_size_from_the_pool(tmp_path):
    from expertcache.tier.pool import pool_from_trace
    tp = tmp_path / "t.npz"
    _trace().save(tp)
    pool_from_trace(tmp_path / "pool", _trace(), expert_bytes=12_345)
    argv = [x for x in _argv(tp) if x not in ("--expert-mb", "17.5")] + ["--pool", str(tmp_path / "pool")]
    assert tier_plan.compute(_parser().parse_args(argv))["expert_bytes"] == 12_345
    with pytest.raises(ConfigError, match="holds experts of 12345 bytes"):
        tier_plan.compute(_parser().parse_args(argv + ["--expert-mb", "1"]))


def test_only_the_rates_a_question_needs(tmp_path):
    tp = tmp_path / "t.npz"
    _trace().save(tp)
    argv = ["tier", "plan", "--trace", str(tp), "--hbm-gbps", "2938", "--host-gbps", "327", "--copy-gbps", "346",
            "--expert-mb", "1"]
    out = tier_plan.compute(_parser().parse_args(argv))
    assert [p["link"] for p in out["tier_pairs"]] == ["coherent"] and round(out["tier_pairs"][0]["k_star"], 2) == 1.06
    assert len(out["pairs_left_out"]) == 2 and out["iters_per_s_all_from_nvme"] is None and out["capacity"] is None
    curve = _curve(tmp_path, [_sweep_line(10**9, 1.0), _sweep_line(2 * 10**9, 0.5)])
    only_curve = ["tier", "plan", "--trace", str(tp), "--expert-mb", "1", "--curve", curve, "--target-iters-per-s", "1.5"]
    out = tier_plan.compute(_parser().parse_args(only_curve))
    assert out["tier_pairs"] == [] and out["capacity"][0]["measured_capacity_bytes"] == 2 * 10**9
    with pytest.raises(ConfigError, match="nothing to answer"):
        tier_plan.compute(_parser().parse_args(["tier", "plan", "--trace", str(tp), "--expert-mb", "1"]))
    with pytest.raises(ConfigError, match="--target-iters-per-s"):
        tier_plan.compute(_parser().parse_args(only_curve[:-2]))


def test_non_monotone_and_noisy_curves_are_flagged():
    pts = [{"mode": "pagecache", "capacity_bytes": c, "seconds_per_iteration_median": s, "proof_ok": True,
            "summary": True, "spread": sp} for c, s, sp in ((1000, 1.0, 0.05), (2000, 1.25, 0.5), (4000, 0.5, 0.01))]
    row = P.capacity_for_target(pts, 1.5)[0]
    assert any(f.startswith("non-monotone") for f in row["flags"]) and any(f.startswith("noisy") for f in row["flags"])
    assert "non-monotone" in row["note"]
    clean = [dict(p, spread=0.01) for p in pts if p["capacity_bytes"] != 2000]
    assert P.capacity_for_target(clean, 1.5)[0]["flags"] == []


def test_readme_plan_example_reproduces_the_papers_k_star():
    from conftest import REPO
    text = (REPO / "README.md").read_text()
    block = text[text.index("expertcache tier plan --trace tiny.npz"):]
    block = block[:block.index("```")]
    assert "--copy-gbps 346" in block and "--hbm-gbps 2938" in block and "--host-gbps 327" in block
