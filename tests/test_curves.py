"""Miss-ratio curves, foresight curves, global-vs-split pools, their plots and commands.

The one-pass LRU curve must equal a replay at every capacity, count for count (docs/semantics.md),
on random traces (padding, sequences, warm windows, both pools, both resets) and on the real ones.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertcache import Trace, load_trace, replay
from expertcache.cli.curves_cmd import capacity_list
from expertcache.cli.main import main
from expertcache.errors import ConfigError
from expertcache.sim import build_layout, replay_layout
from expertcache.sim.curves import (
    capacity_bounds, compare_pools, foresight_curve, lru_curve, sweep, sweep_layout,
)
from expertcache.sim.curves.mrc import _histograms
from expertcache.sim.curves.stack import stack_histograms


# ---------------------------------------------------------------------------------- helpers
def random_trace(seed: int, T: int, L: int, k: int, E: int, n_seq: int, pad: float, hot: int) -> Trace:
    """Groups drawn from a small per-layer working set (so there are hits at every depth), with
    -1 pads at random slots and ``n_seq`` contiguous sequences."""
    rng = np.random.default_rng(seed)
    ex = np.full((T, L, k), -1, dtype=np.int32)
    hot = max(hot, k)
    for l in range(L):
        working = rng.choice(E, size=min(hot, E), replace=False)
        for t in range(T):
            if rng.random() < 0.2:  # drift: swap one expert of the working set
                working[rng.integers(working.size)] = rng.integers(E)
                working = np.unique(working)
                if working.size < k:
                    working = np.union1d(working, rng.choice(E, size=k, replace=False))
            ids = rng.choice(working, size=k, replace=False)
            ids[rng.random(k) < pad] = -1
            ex[t, l] = ids
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(n_seq - 1, T - 1), replace=False)) if T > 1 else []
    seq = np.zeros(T, dtype=np.int32)
    for c in cuts:
        seq[c:] += 1
    return Trace.from_arrays(ex, seq, num_experts=E)


def counts(r):
    return (r.capacity, r.requests, r.copies_total, r.copies_steady, r.tokens,
            [(c.layer, c.requests, c.copies_total, c.copies_steady) for c in r.per_layer])


def assert_curve_matches_replay(layout, capacities=None):
    curve = lru_curve(layout, capacities).results
    assert curve, "empty curve"
    for r in curve:
        assert counts(r) == counts(replay_layout(layout, r.capacity, "lru")), f"capacity {r.capacity}"
    return curve


traces = st.builds(
    random_trace,
    seed=st.integers(0, 2**31),
    T=st.integers(1, 70),
    L=st.integers(1, 3),
    k=st.integers(1, 4),
    E=st.integers(4, 12),
    n_seq=st.integers(1, 4),
    pad=st.sampled_from([0.0, 0.0, 0.25]),
    hot=st.integers(2, 12),
)


# ---------------------------------------------------------------------------------- one-pass LRU
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces, pool=st.sampled_from(["layer", "global"]), reset=st.sampled_from(["sequence", "none"]),
       warm=st.sampled_from([0.0, 0.3, 0.6]))
def test_lru_curve_equals_replay_at_every_capacity(trace, pool, reset, warm):
    layout = build_layout(trace, pool=pool, reset=reset, warm=warm)
    lo, hi = capacity_bounds(layout)
    curve = assert_curve_matches_replay(layout, range(lo, hi + 3))  # past n_items too
    assert [r.capacity for r in curve] == list(range(lo, hi + 3))


@settings(max_examples=60, deadline=None)
@given(trace=traces, pool=st.sampled_from(["layer", "global"]), warm=st.sampled_from([0.0, 0.6]))
def test_fenwick_path_equals_direct_path(trace, pool, warm):
    """The Fenwick tree over word counts (large pools) gives the same depths as direct popcounts."""
    layout = build_layout(trace, pool=pool, warm=warm)
    L, T = len(layout.layer_ids), layout.token_scored.size
    rows = np.arange(L)
    gl, gs = ((np.repeat(rows, T), np.tile(layout.token_scored, L)) if pool == "layer"
              else (np.tile(rows, T), np.repeat(layout.token_scored, L)))
    direct = stack_histograms(layout.groups, layout.starts, layout.n_items, gl, gs, L)
    tree = stack_histograms(layout.groups, layout.starts, layout.n_items, gl, gs, L, 0)
    np.testing.assert_array_equal(direct[0], tree[0])
    np.testing.assert_array_equal(direct[1], tree[1])
    np.testing.assert_array_equal(direct[0], _histograms(layout)[0])


@pytest.mark.parametrize("pool", ["layer", "global"])
@pytest.mark.parametrize("reset", ["sequence", "none"])
def test_long_streams_renumber_stamps(pool, reset):
    """Streams far longer than the stamp space (4 * n_items + 2k) force many renumberings."""
    trace = random_trace(7, T=1500, L=2, k=3, E=9, n_seq=3, pad=0.1, hot=6)
    assert_curve_matches_replay(build_layout(trace, pool=pool, reset=reset, warm=0.4))


def test_seed_case_counts(seed_case):
    """C=3, {a,b},{c,d},{a,b}: 5 copies in total, 2 of them once the pool is full."""
    (r,) = lru_curve(build_layout(seed_case), [3]).results
    assert (r.copies_total, r.copies_steady, r.requests) == (5, 2, 6)


def test_steady_counts_only_scored_insertions_that_evict():
    """One stream 0,1,2,0 (k=1) with the first half warm. At C=2 both scored requests miss and
    both evict (steady 2, not max(0, 2 - 2) = 0); at C=3 the pool is still filling at token 2
    (steady 0) and token 3 hits."""
    trace = Trace.from_arrays(np.array([[0], [1], [2], [0]]), num_experts=3)
    layout = build_layout(trace, warm=0.5)
    by_cap = {r.capacity: (r.copies_total, r.copies_steady, r.requests) for r in lru_curve(layout, [1, 2, 3, 4]).results}
    assert by_cap == {1: (2, 2, 2), 2: (2, 2, 2), 3: (1, 0, 2), 4: (1, 0, 2)}


def test_ties_within_a_group_go_to_the_smallest_id():
    """After {3, 1} both have the same last use; the smaller id (1) is less recent and goes first."""
    trace = Trace.from_arrays(np.array([[3, 1], [5, -1], [1, -1], [3, -1]]), num_experts=6)
    layout = build_layout(trace)
    (r,) = assert_curve_matches_replay(layout, [2])
    # C=2: {3,1} -> 5 evicts 1 -> 1 evicts 3 -> 3 evicts 5: every request misses
    assert (r.copies_total, r.copies_steady) == (5, 3)


def test_capacity_below_the_widest_group_is_refused(seed_case):
    with pytest.raises(ConfigError, match="below the 2 experts"):
        lru_curve(build_layout(seed_case), [1, 2])


def test_lru_misses_never_grow_with_capacity(shared_trace_path):
    """The inclusion property of a stack algorithm: a bigger pool holds what a smaller one holds."""
    totals = list(lru_curve(build_layout(load_trace(shared_trace_path), warm=0.6)).copies_total)
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]


@pytest.mark.parametrize("pool,warm", [("layer", 0.0), ("layer", 0.6), ("global", 0.0), ("global", 0.6)])
def test_lru_curve_equals_replay_on_shared_traces(shared_trace_path, pool, warm):
    layout = build_layout(load_trace(shared_trace_path), pool=pool, warm=warm)
    lo, hi = capacity_bounds(layout)
    caps = range(lo, hi + 1) if pool == "layer" else sorted({lo, hi, *range(lo, hi + 1, 13)})
    assert_curve_matches_replay(layout, caps)


# ---------------------------------------------------------------------------------- sweep
def test_sweep_replays_other_policies_and_fills_the_gap():
    trace = random_trace(3, T=120, L=2, k=2, E=8, n_seq=2, pad=0.0, hot=5)
    curves = sweep(trace, [2, 4, 6], ["lru", "decayed:0.9", "belady"], warm=0.3)
    assert [c.policy for c in curves] == ["lru", "decayed:0.9", "belady"]
    assert [c.method for c in curves] == ["stack", "replay", "replay"]
    layout = build_layout(trace, warm=0.3)
    for c in curves:
        assert list(c.capacities) == [2, 4, 6]
        for r in c.results:
            assert counts(r) == counts(replay_layout(layout, r.capacity, c.policy))
    for i in range(3):
        lru, dec, bel = (c.results[i] for c in curves)
        if lru.copies_steady != bel.copies_steady:
            assert lru.gap_recovered == 0.0 and bel.gap_recovered == 1.0
            assert dec.gap_recovered == pytest.approx(
                (lru.copies_steady - dec.copies_steady) / (lru.copies_steady - bel.copies_steady))


def test_sweep_default_capacities_and_replayed_lru_agree():
    trace = random_trace(5, T=60, L=2, k=3, E=7, n_seq=2, pad=0.2, hot=6)
    layout = build_layout(trace, pool="global")
    (one,) = sweep_layout(layout)
    (many,) = sweep_layout(layout, one_pass=False)
    assert list(one.capacities) == list(range(3, 15)) and one.method == "stack" and many.method == "replay"
    assert [counts(r) for r in one.results] == [counts(r) for r in many.results]
    np.testing.assert_allclose(one.hit_rate, many.hit_rate)
    assert one.at(5).capacity == 5
    with pytest.raises(ConfigError):
        one.at(99)


# ---------------------------------------------------------------------------------- foresight
def test_foresight_curve_runs_from_lru_to_belady():
    trace = random_trace(11, T=150, L=2, k=2, E=10, n_seq=2, pad=0.0, hot=7)
    curve = foresight_curve(trace, 4, horizons=[0, 1, 4, 1000])
    assert curve.horizons == [0, 1, 4, 1000]
    h0, h1000 = curve.foresight[0], curve.foresight[-1]
    assert h0.copies_steady == curve.lru.copies_steady  # seeing nothing is LRU
    assert h1000.copies_steady == curve.belady.copies_steady  # seeing everything is Belady
    assert curve.lru.copies_steady > curve.belady.copies_steady
    assert curve.gap[0] == 0.0 and curve.gap[-1] == 1.0
    refs = {r.policy: r for r in curve.references}
    assert set(refs) == {"lfu", "decayed:0.95", "mean-interval"}
    lfu = replay(trace, 4, "lfu")
    assert refs["lfu"].gap_recovered == pytest.approx(
        (curve.lru.copies_steady - lfu.copies_steady) / (curve.lru.copies_steady - curve.belady.copies_steady))
    recs = curve.records()
    assert [r["role"] for r in recs] == ["bound"] + ["foresight"] * 4 + ["bound"] + ["reference"] * 3
    assert [r["horizon"] for r in recs if r["role"] == "foresight"] == [0, 1, 4, 1000]


def test_foresight_horizons_scale_with_layers_in_a_global_pool(shared_trace_path):
    trace = load_trace(shared_trace_path)
    L, k = trace.num_layers, trace.top_k
    curve = foresight_curve(trace, L * max(k, trace.num_experts // 2), horizons=[2], references=[], pool="global")
    assert curve.foresight[0].copies_steady == replay(trace, curve.capacity, "foresight:2", pool="global").copies_steady


def test_foresight_rejects_negative_horizons():
    trace = random_trace(1, T=10, L=1, k=1, E=4, n_seq=1, pad=0.0, hot=3)
    with pytest.raises(ConfigError, match="horizons"):
        foresight_curve(trace, 2, horizons=[-1, 2])


# ---------------------------------------------------------------------------------- pools
def test_compare_pools_is_two_fair_replays_at_equal_budget():
    trace = random_trace(9, T=200, L=3, k=2, E=8, n_seq=2, pad=0.0, hot=6)
    comps = compare_pools(trace, [3, 5], ["lru", "belady"])
    assert [(c.capacity, c.policy) for c in comps] == [(3, "lru"), (3, "belady"), (5, "lru"), (5, "belady")]
    for c in comps:
        split = replay(trace, c.capacity, c.policy, pool="layer", warm=0.6)
        shared = replay(trace, 3 * c.capacity, c.policy, pool="global", warm=0.6)
        assert counts(c.split) == counts(split) and counts(c.shared) == counts(shared)
        assert c.split.tokens == c.shared.tokens and c.split.requests == c.shared.requests
        assert c.hit_rate_diff_pp == pytest.approx(100 * (shared.hit_rate - split.hit_rate))
        assert c.copies_per_token_diff == pytest.approx(shared.copies_per_token - split.copies_per_token)
        d = c.to_dict()
        assert (d["capacity"], d["capacity_global"], d["warm"]) == (c.capacity, 3 * c.capacity, 0.6)
        assert d["layers"] == [0, 1, 2] and d["needs_future"] == (c.policy == "belady")


def test_one_layer_global_pool_is_the_split():
    trace = random_trace(2, T=80, L=1, k=2, E=6, n_seq=1, pad=0.0, hot=5)
    for c in compare_pools(trace, 3, ["lru", "lfu", "belady"]):
        assert c.hit_rate_diff_pp == 0.0 and c.copies_per_token_diff == 0.0


# ---------------------------------------------------------------------------------- plots
PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_write_pngs_atomically(tmp_path):
    pytest.importorskip("matplotlib")
    from expertcache.report.plots import plot_foresight, plot_mrc, plot_pools

    trace = random_trace(4, T=150, L=2, k=2, E=10, n_seq=2, pad=0.0, hot=7)
    target = tmp_path / "mrc.png"
    target.write_bytes(b"old")
    plot_mrc(sweep(trace, None, ["lru", "belady"]), target, trace="t")
    plot_foresight(foresight_curve(trace, 4), tmp_path / "fs.png", trace="t")
    plot_pools(compare_pools(trace, 4), tmp_path / "pools1.png", trace="t")
    plot_pools(compare_pools(trace, [3, 5, 7]), tmp_path / "pools3.png", trace="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fs.png", "mrc.png", "pools1.png", "pools3.png"]
    for p in tmp_path.iterdir():
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000


def test_foresight_plot_needs_a_gap(tmp_path):
    pytest.importorskip("matplotlib")
    from expertcache.report.plots import plot_foresight

    trace = Trace.from_arrays(np.array([[0], [1], [0], [1]]), num_experts=2)
    with pytest.raises(ConfigError, match="tie"):
        plot_foresight(foresight_curve(trace, 2), tmp_path / "x.png", trace="t")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------- CLI
@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "t.npz"
    random_trace(6, T=120, L=2, k=2, E=8, n_seq=2, pad=0.0, hot=6).save(path)
    return path


def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_capacity_list_syntax():
    assert capacity_list("8:16:4") == [8, 12, 16]
    assert capacity_list("3:5") == [3, 4, 5]
    assert capacity_list("16,8,8") == [8, 16]
    for bad in ("8:4", "a:b", "1:2:0", "0,4", "1:2:3:4", ""):
        with pytest.raises(Exception):
            capacity_list(bad)


def test_sweep_command_json_matches_replay(trace_file, capsys):
    rc, out, _ = run_cli(capsys, "sweep", trace_file, "--capacities", "2:6:2", "-p", "lru", "-p", "belady", "--json")
    assert rc == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [(r["policy"], r["capacity"]) for r in recs] == [("lru", 2), ("lru", 4), ("lru", 6),
                                                            ("belady", 2), ("belady", 4), ("belady", 6)]
    trace = load_trace(trace_file)
    for r in recs:
        ref = replay(trace, r["capacity"], r["policy"])
        assert (r["copies_steady"], r["copies_total"], r["hit_rate"]) == (ref.copies_steady, ref.copies_total, ref.hit_rate)
        assert r["trace"] == trace.name and r["gap_recovered"] in (0.0, 1.0, None)


def test_sweep_command_table_and_plot(trace_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "out").mkdir()
    png = tmp_path / "out" / "mrc.png"
    rc, out, err = run_cli(capsys, "sweep", trace_file, "--capacities", "2,4", "--plot", png)
    assert rc == 0 and png.read_bytes()[:8] == PNG and f"wrote {png}" in err
    lines = out.splitlines()
    assert lines[2].split()[:3] == ["capacity", "lru", "copies/tok"]
    assert [ln.split()[0] for ln in lines[4:6]] == ["2", "4"]
    assert lines[6] == "needs the future (clairvoyant, an offline reference): belady"


def test_capacity_vocabulary(trace_file, capsys):
    """-c/--capacity is one value everywhere; lists and ranges are --capacities; no --reference."""
    for argv in (["sweep", trace_file, "-c", "2,4"], ["sweep", trace_file, "-c", "4"],
                 ["compare-pools", trace_file, "--capacity", "2,4"], ["compare-pools", trace_file],
                 ["compare-pools", trace_file, "-c", "3", "--capacities", "3,4"],
                 ["foresight", trace_file, "-c", "4", "--reference", "lfu"]):
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in argv])
        assert exc.value.code == 2
    capsys.readouterr()
    rc, out, _ = run_cli(capsys, "compare-pools", trace_file, "--capacities", "3:4", "-p", "lru", "--json")
    assert rc == 0 and [json.loads(x)["capacity"] for x in out.splitlines()] == [3, 4]


def test_foresight_command(trace_file, capsys):
    rc, out, _ = run_cli(capsys, "foresight", trace_file, "--capacity", "4", "--horizons", "1,2", "--json")
    assert rc == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["policy"] for r in recs] == ["lru", "foresight:1", "foresight:2", "belady", "lfu", "decayed:0.95",
                                           "mean-interval"]
    assert [r["needs_future"] for r in recs] == [False, True, True, True, False, False, False]
    assert all(r["capacity"] == 4 and r["layers"] == [0, 1] and r["trace"] for r in recs)
    rc, out, _ = run_cli(capsys, "foresight", trace_file, "-c", "4", "--horizons", "1,2", "--policy", "lfu",
                         "-p", "belady")
    assert rc == 0 and "gap recovered" in out and "lfu" in out and "mean-interval" not in out
    header, _, *rows = out.splitlines()[2:]
    assert header.split()[:3] == ["policy", "future", "role"]
    assert [r.split()[:2] for r in rows] == [["lru", "bound"], ["foresight:1", "yes"], ["foresight:2", "yes"],
                                             ["belady", "yes"], ["lfu", "reference"], ["belady", "yes"]]


def test_compare_pools_command(trace_file, capsys):
    rc, out, _ = run_cli(capsys, "compare-pools", trace_file, "--capacity", "3", "--json")
    assert rc == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["policy"] for r in recs] == ["lru", "lfu", "belady"]
    trace = load_trace(trace_file)
    lru = recs[0]
    assert lru["capacity"] == 3 and lru["capacity_global"] == 6 and lru["warm"] == 0.6
    assert lru["layers"] == [0, 1] and lru["trace"] == trace.name
    assert [r["needs_future"] for r in recs] == [False, False, True]
    assert lru["hit_rate_split"] == replay(trace, 3, "lru", warm=0.6).hit_rate
    assert lru["hit_rate_global"] == replay(trace, 6, "lru", pool="global", warm=0.6).hit_rate
    rc, out, _ = run_cli(capsys, "compare-pools", trace_file, "-c", "3", "-p", "lru", "-p", "belady", "--warm", "0")
    assert rc == 0 and "diff pp" in out and "warm fraction" not in out
    lines = out.splitlines()
    assert lines[2].split()[:4] == ["C/layer", "global", "policy", "future"]
    assert lines[4].split()[2:4] != ["lru", "yes"] and lines[5].split()[2:4] == ["belady", "yes"]


@pytest.mark.parametrize("argv", [
    ["sweep", "{t}", "--capacities", "1:4"],
    ["foresight", "{t}", "--capacity", "1"],
    ["compare-pools", "{t}", "--capacity", "1"],
    ["sweep", "{t}", "-p", "nope"],
])
def test_commands_report_user_errors_in_one_line(trace_file, capsys, argv):
    rc, out, err = run_cli(capsys, *[a.format(t=trace_file) for a in argv])
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1


def test_default_grid_and_stack_fallback_on_a_large_item_space(monkeypatch):
    """A global pool of a large model has millions of capacities: the default sweep thins them,
    and LRU falls back to replay (same counts) when the stack histograms would not fit."""
    from expertcache.sim import build_layout
    from expertcache.sim.curves import mrc

    rng = np.random.default_rng(3)
    ex = np.stack([[rng.choice(600, 2, replace=False) for _ in range(4)] for _ in range(30)])
    trace = Trace.from_arrays(ex, num_experts=600)
    layout = build_layout(trace, pool="global")
    caps = mrc._capacities(layout, None)
    assert len(caps) == mrc.DEFAULT_GRID and caps[0] == 2 and caps[-1] == 2400
    stack = mrc.sweep_layout(layout, caps[:5] + caps[-2:], ["lru"])[0]
    monkeypatch.setattr(mrc, "MAX_STACK_CELLS", 10)
    replayed = mrc.sweep_layout(layout, caps[:5] + caps[-2:], ["lru"])[0]
    assert stack.method == "stack" and replayed.method == "replay"
    assert np.array_equal(stack.copies_per_token, replayed.copies_per_token)
    assert np.array_equal(stack.hit_rate, replayed.hit_rate)
