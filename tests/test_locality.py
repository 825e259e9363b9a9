"""Locality statistics (docs/locality.md): definitions against brute force, the shared traces'
published reuse numbers, hot-set overlap, and the ``expertcache stats`` command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache import ConfigError, Trace, TraceError, load_trace
from expertcache.analysis import (
    coverage_curve,
    expert_counts,
    hot_set_overlap,
    hot_sets,
    locality_report,
    reuse_within,
    scored_tokens,
    top_share,
    zipf_alpha,
)
from expertcache.cli.main import main


# ---------------------------------------------------------------------------- helpers
def random_trace(seed: int, T: int, L: int, k: int, E: int, *, pad: float = 0.2, gaps: bool = True) -> Trace:
    """A small trace with random ids, some padding, several sequences and (optionally) step gaps."""
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(L)]) for _ in range(T)])
    experts[rng.random(experts.shape) < pad] = -1
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(T - 1, rng.integers(0, 4)), replace=False)) if T > 1 else []
    seq = np.zeros(T, dtype=np.int32)
    for c in cuts:
        seq[c:] += 1
    extras = {}
    if gaps:
        inc = rng.choice([1, 1, 1, 2, 3], size=T)
        step = np.zeros(T, dtype=np.int64)
        for t in range(1, T):
            step[t] = 0 if seq[t] != seq[t - 1] else step[t - 1] + inc[t]
        extras["step"] = step.astype(np.int32)
    return Trace.from_arrays(experts, seq, num_experts=E, extras=extras)


def brute_reuse(trace: Trace, W: int) -> list[float]:
    """docs/locality.md, reuse within W, written as directly as possible."""
    ex, seq = trace.experts, trace.seq
    step = trace.extras.get("step")
    if step is None:
        step = np.concatenate([np.arange(b - a) for a, b in zip(trace.seq_bounds[:-1], trace.seq_bounds[1:])])
    out = []
    for l in range(trace.num_layers):
        vals = []
        for t in range(1, trace.num_tokens):
            if seq[t] != seq[t - 1] or step[t] - step[t - 1] != 1:
                continue
            cur = {int(e) for e in ex[t, l] if e >= 0}
            if not cur:
                continue
            window: set[int] = set()
            u = t - 1
            while u >= 0 and seq[u] == seq[t] and step[u] >= step[t] - W:
                window |= {int(e) for e in ex[u, l] if e >= 0}
                u -= 1
            vals.append(len(cur & window) / len(cur))
        out.append(float(np.mean(vals)) if vals else math.nan)
    return out


def traces_params():
    return st.tuples(st.integers(0, 2**31), st.integers(1, 30), st.integers(1, 3), st.integers(1, 3), st.integers(0, 4))


# ---------------------------------------------------------------------------- reuse
@settings(max_examples=60, deadline=None)
@given(traces_params(), st.sampled_from([1, 2, 3, 8, 64]))
def test_reuse_matches_brute_force(p, W):
    seed, T, L, k, extra = p
    trace = random_trace(seed, T, L, k, k + extra)
    got = reuse_within(trace, [W])[0]
    np.testing.assert_allclose(got, brute_reuse(trace, W), equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(traces_params())
def test_reuse_is_a_fraction_and_grows_with_the_window(p):
    seed, T, L, k, extra = p
    r = reuse_within(random_trace(seed, T, L, k, k + extra), [1, 2, 8, 64, 10_000])
    ok = ~np.isnan(r)
    assert (r[ok] >= 0).all() and (r[ok] <= 1).all()
    assert (np.isnan(r) == np.isnan(r[:1])).all()  # the scored set does not depend on W
    assert (np.diff(np.where(ok, r, 0), axis=0) >= -1e-12).all()


def test_reuse_of_a_repeated_token_is_one_and_of_disjoint_tokens_zero():
    same = Trace.from_arrays(np.tile([[0, 1]], (5, 1)), num_experts=4)
    assert reuse_within(same, [1])[0, 0] == 1.0
    alternating = Trace.from_arrays(np.array([[0, 1], [2, 3]] * 3), num_experts=4)
    # W=2: tokens 2..5 repeat token t-2; token 1 has only token 0 behind it
    assert reuse_within(alternating, [1, 2]).tolist() == [[0.0], [pytest.approx(4 / 5)]]


def test_reuse_never_crosses_sequences_or_gaps():
    ex = np.array([[0], [0], [0], [0]])
    two_seqs = Trace.from_arrays(ex, np.array([0, 0, 1, 1]), num_experts=2)
    assert scored_tokens(two_seqs).tolist() == [False, True, False, True]
    gap = Trace.from_arrays(ex, num_experts=2, extras={"step": np.array([0, 1, 5, 6], dtype=np.int32)})
    assert scored_tokens(gap).tolist() == [False, True, False, True]
    # scored: token 1 (step 1, reuses nothing) and token 3 (step 6): for W=4 its window is steps
    # 2..5 and holds only the row at step 5 (expert 1); W=5 reaches step 1 (expert 0)
    ex2 = np.array([[1], [0], [1], [0]])
    gap2 = Trace.from_arrays(ex2, num_experts=2, extras={"step": np.array([0, 1, 5, 6], dtype=np.int32)})
    assert reuse_within(gap2, [4, 5])[:, 0].tolist() == [0.0, 0.5]


def test_step_that_does_not_rise_is_a_one_line_trace_error():
    # validated once, when the trace is built: no command ever sees such a trace
    with pytest.raises(TraceError, match=r"step: not increasing inside a sequence at token 2") as err:
        Trace.from_arrays(np.array([[0], [1], [0]]), num_experts=2, extras={"step": np.array([0, 2, 2], dtype=np.int32)})
    assert "\n" not in str(err.value)


def test_w1_reproduces_the_shared_traces_meta_stats(shared_trace_path):
    trace = load_trace(shared_trace_path)
    stats = trace.meta["stats"]
    w1 = reuse_within(trace, [1])[0]
    assert round(float(np.mean(w1)), 4) == stats["reuse_prev_token_mean"]
    assert round(float(w1.min()), 4) == stats["reuse_prev_token_min_layer"]
    assert round(float(w1.max()), 4) == stats["reuse_prev_token_max_layer"]
    assert int(scored_tokens(trace).sum()) == stats["adjacent_pairs"]
    distinct = np.count_nonzero(expert_counts(trace), axis=1)
    assert (distinct.min(), distinct.max()) == (stats["distinct_experts_per_layer_min"], stats["distinct_experts_per_layer_max"])
    assert locality_report(trace).reuse(1) == pytest.approx(stats["reuse_prev_token_mean"], abs=5e-5)


# ---------------------------------------------------------------------------- skew
@settings(max_examples=50, deadline=None)
@given(st.floats(0.0, 3.0), st.integers(2, 600))
def test_zipf_alpha_of_exact_zipf_counts_is_its_exponent(s, E):
    counts = np.arange(1, E + 1, dtype=np.float64) ** -s * 1e6
    rng = np.random.default_rng(E)
    assert zipf_alpha(rng.permutation(counts)) == pytest.approx(s, abs=1e-9)


def test_zipf_alpha_of_a_large_zipf_sample_is_near_its_exponent():
    rng = np.random.default_rng(0)
    for s in (0.8, 1.0, 1.3):
        p = np.arange(1, 65, dtype=np.float64) ** -s
        counts = np.bincount(rng.choice(64, size=1_000_000, p=p / p.sum()), minlength=64)
        assert zipf_alpha(counts) == pytest.approx(s, abs=0.02)


def test_zipf_alpha_ignores_zero_counts_and_needs_two_experts():
    assert zipf_alpha([0, 6, 0, 3, 0, 2]) == pytest.approx(1.0)  # 6, 3, 2 at ranks 1, 2, 3: exactly 6 / r
    assert math.isnan(zipf_alpha([0, 5, 0]))
    assert math.isnan(zipf_alpha([0, 0]))


def test_top_share_and_hot_sets():
    counts = np.array([[5, 1, 5, 0, 3], [0, 0, 0, 0, 0]])
    assert top_share(counts, 2).tolist()[0] == pytest.approx(10 / 14)
    assert math.isnan(top_share(counts, 2)[1])
    assert top_share(np.array([3, 3, 3, 3]), 2) == pytest.approx(0.5)
    assert top_share(np.array([3, 1]), 8) == 1.0
    hot = hot_sets(counts, 2)
    assert hot[0].tolist() == [True, False, True, False, False]  # tie 5 = 5 keeps both; 3 is third
    assert not hot[1].any()  # never-selected experts are never hot
    assert hot_sets(np.array([[2, 4, 2, 2]]), 2)[0].tolist() == [True, True, False, False]  # tie -> smaller id


# ---------------------------------------------------------------------------- coverage
@settings(max_examples=40, deadline=None)
@given(traces_params())
def test_coverage_curve_matches_brute_force(p):
    seed, T, L, k, extra = p
    trace = random_trace(seed, T, L, k, k + extra, gaps=False)
    E = trace.num_experts
    curve = coverage_curve(trace, checkpoints=range(1, T + 1))
    for n, c in curve:
        seen = {(l, int(e)) for t in range(n) for l in range(L) for e in trace.experts[t, l] if e >= 0}
        assert c == pytest.approx(len(seen) / (L * E))
    assert all(b[1] >= a[1] for a, b in zip(curve, curve[1:]))
    report = locality_report(trace)
    assert report.coverage_final == pytest.approx(np.mean([x.coverage for x in report.layers]))


@settings(max_examples=40, deadline=None)
@given(traces_params(), st.integers(1, 12))
def test_a_report_worked_through_runs_of_sequences_equals_the_whole(p, selections):
    """The report works through runs of whole sequences of BLOCK_SELECTIONS token-slots; with runs
    as small as one sequence it gives the one-run report: counts, coverage and scored tokens exactly,
    reuse up to float rounding. The runs are views partitioning the rows in order."""
    from expertcache.analysis import locality

    seed, T, L, k, extra = p
    trace = random_trace(seed, T, L, k, k + extra, gaps=bool(seed % 2))
    blocks = list(locality.sequence_blocks(trace, selections))
    assert np.array_equal(np.concatenate([b.experts for b in blocks]), trace.experts)
    assert all(np.shares_memory(b.experts, trace.experts) for b in blocks)
    per = max(1, selections // k)
    assert all(b.num_tokens <= per or b.num_sequences == 1 for b in blocks)
    assert sum(b.num_sequences for b in blocks) == trace.num_sequences
    every = range(1, T + 1)
    whole = locality.locality_report(trace, checkpoints=every).to_dict()
    old = locality.BLOCK_SELECTIONS
    try:
        locality.BLOCK_SELECTIONS = selections
        runs = locality.locality_report(trace, checkpoints=every).to_dict()
    finally:
        locality.BLOCK_SELECTIONS = old
    assert json.dumps(whole, sort_keys=True, default=str) == json.dumps(runs, sort_keys=True, default=str) or \
        _close(whole, runs)


def _close(a, b) -> bool:
    """Records equal but for float rounding (NaN equal to NaN)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[x], b[x]) for x in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12)
    return a == b


def test_default_coverage_checkpoints_are_powers_of_four_and_the_end():
    trace = random_trace(1, 300, 1, 2, 40, pad=0.0, gaps=False)
    assert [n for n, _ in coverage_curve(trace)] == [16, 64, 256, 300]


# ---------------------------------------------------------------------------- overlap
def _trace(ids, model="m", E=8, layer_ids=None):
    meta = {"model": model} | ({"layer_ids": layer_ids} if layer_ids else {})
    return Trace.from_arrays(np.asarray(ids), num_experts=E, meta=meta)


def test_hot_set_overlap_is_jaccard_per_shared_layer():
    a = locality_report(_trace([[0, 1], [0, 1], [2, 3]]), top=2)
    b = locality_report(_trace([[1, 5], [1, 5], [1, 6]]), top=2)
    pair = hot_set_overlap(a, b)
    assert pair.reason is None and pair.jaccard == {0: pytest.approx(1 / 3)}  # {0,1} vs {1,5}
    assert hot_set_overlap(a, a).mean == 1.0


def test_hot_set_overlap_refuses_incomparable_traces():
    a = locality_report(_trace([[0], [1]]))
    assert "different models" in hot_set_overlap(a, locality_report(_trace([[0], [1]], model="other"))).reason
    assert "different expert counts" in hot_set_overlap(a, locality_report(_trace([[0], [1]], E=16))).reason
    assert "no layer id" in hot_set_overlap(a, locality_report(_trace([[0], [1]], layer_ids=[7]))).reason
    assert math.isnan(hot_set_overlap(a, locality_report(_trace([[0], [1]], E=16))).mean)


# ---------------------------------------------------------------------------- report
def test_report_overall_values_are_layer_means():
    trace = random_trace(3, 200, 4, 3, 12, pad=0.0)
    r = locality_report(trace)
    assert r.zipf_alpha == pytest.approx(np.mean([x.zipf_alpha for x in r.layers]))
    assert r.reuse(8) == pytest.approx(np.mean([x.reuse[8] for x in r.layers]))
    assert r.top_share == pytest.approx(np.mean([x.top_share for x in r.layers]))
    d = r.to_dict()
    assert d["reuse_w64"] == r.reuse(64) and d["top8_share"] == r.top_share and len(d["per_layer"]) == 4


# ---------------------------------------------------------------------------- CLI
def test_stats_cli_json_and_overlap(tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    random_trace(1, 120, 2, 2, 10).save(a)
    random_trace(2, 80, 2, 2, 10).save(b)
    assert main(["stats", str(a), str(b), "--json", "--top", "3", "--windows", "1,4"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in records] == ["trace", "trace", "overlap"]
    assert {"reuse_w1", "reuse_w4", "top3_share", "zipf_alpha", "coverage_curve"} <= set(records[0])
    assert len(records[2]["layers"]) == 2 and 0 <= records[2]["jaccard_mean"] <= 1


def test_stats_cli_tables(tmp_path, capsys):
    a = tmp_path / "a.npz"
    random_trace(1, 120, 2, 2, 10).save(a)
    assert main(["stats", str(a)]) == 0
    out = capsys.readouterr().out
    assert "reuse W64" in out and "top8 share" in out and "coverage of the pool" in out
    assert main(["stats", str(a), str(a), "--summary"]) == 0
    assert "hot-set overlap" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["stats", "/nonexistent/t.npz"], "no such file"),
])
def test_stats_cli_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_stats_cli_rejects_bad_windows(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["stats", "x.npz", "--windows", "0,8"])
    assert exc.value.code == 2
    assert "expected positive integers" in capsys.readouterr().err


def test_reuse_windows_are_integer_step_counts_a_first_use_never_reaches():
    """A first use's gap is int64's largest: a window of 2**63 - 1 steps had counted it as a reuse
    (1.0 where half the experts are reused); 1.5 had been floored to 1."""
    from expertcache.analysis.locality import reuse_within

    t = Trace.from_arrays([[[0, 1]], [[1, 2]], [[3, 0]]], num_experts=4)
    assert reuse_within(t, [2**62]).tolist() == [[0.5]] == reuse_within(t, [2]).tolist()
    for bad in ([2**63 - 1], [1.5], [0], [], [True]):
        with pytest.raises(ConfigError, match="windows: expected step counts"):
            reuse_within(t, bad)
