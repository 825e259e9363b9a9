"""Replay semantics (DESIGN section 2): reference cases, cross-checks between three independent
implementations (compiled loops, the ExpertCache reference driving policy objects, a naive
oracle), and invariants over random traces."""

from __future__ import annotations

from dataclasses import astuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expertcache as ec
from expertcache.errors import ConfigError
from expertcache.sim import build_layout, replay_layout

from oracle import naive_replay

RULES = ["lru", "lfu", "decayed", "decayed:0.5", "belady", "foresight:0", "foresight:2", "mean-interval", "random:3"]
ORACLE_RULES = [r for r in RULES if not r.startswith("random")]
"""The rules of the invariants below. The seeds' three-token case (5 copies, 2 steady) on both engines is
tests/test_rule_conformance.py's, for every registered eviction rule."""


@st.composite
def traces(draw, max_tokens=24, max_layers=2):
    E = draw(st.integers(2, 8))
    k = draw(st.integers(1, min(E, 3)))
    L = draw(st.integers(1, max_layers))
    T = draw(st.integers(1, max_tokens))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    skew = draw(st.sampled_from([0.0, 1.0, 2.0]))
    p = np.arange(1, E + 1, dtype=float) ** -skew
    p /= p.sum()
    ex = np.stack([[rng.choice(E, k, replace=False, p=p) for _ in range(L)] for _ in range(T)])
    if draw(st.booleans()):
        ex[rng.random(ex.shape) < 0.2] = -1
    seq = np.sort(rng.integers(0, draw(st.integers(1, 3)), T))
    trace = ec.Trace.from_arrays(ex, seq, num_experts=E)
    C = draw(st.integers(k, E + 1))
    return trace, C


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(case=traces(), pool=st.sampled_from(["layer", "global"]))
def test_compiled_matches_reference_and_oracle(case, pool):
    trace, C = case
    for rule in RULES:
        a = ec.replay(trace, C, rule, pool=pool, engine="compiled")
        b = ec.replay(trace, C, rule, pool=pool, engine="python")
        assert (a.copies_total, a.copies_steady) == (b.copies_total, b.copies_steady), rule
        assert [astuple(c) for c in a.per_layer] == [astuple(c) for c in b.per_layer], rule
        if rule in ORACLE_RULES:
            assert (a.copies_total, a.copies_steady) == naive_replay(trace, C, rule, pool), rule


@SETTINGS
@given(case=traces(max_layers=1), data=st.data())
def test_every_schedule_is_lossless(case, data):
    """Drive ExpertCache step by step: requested experts resident, never more than C, no
    requested expert evicted, slots distinct, evictions only once the pool is full."""
    trace, C = case
    rule = data.draw(st.sampled_from(RULES))
    layout = build_layout(trace)
    for s in range(layout.num_streams):
        groups = layout.stream_groups(s)
        cache = ec.ExpertCache(C, rule, layout.n_items, future=ec.StreamFuture(groups))
        for g in groups:
            want = set(int(x) for x in g if x >= 0)
            before = set(cache.resident.tolist())
            step = cache.prepare(g)
            after = set(cache.resident.tolist())
            assert want <= after
            assert len(after) <= C
            assert not (set(step.evicted) & want)
            assert set(step.evicted) <= before
            assert after == (before - set(step.evicted)) | want
            assert step.misses == len(want - before)
            slots = [cache.slot_of(i) for i in after]
            assert len(set(slots)) == len(slots) and all(0 <= x < C for x in slots)
            if step.evicted:
                assert len(before) + step.misses - len(step.evicted) == C
        assert cache.evictions == max(0, cache.copies - C)


@SETTINGS
@given(case=traces(), data=st.data())
def test_counts_do_not_depend_on_id_order_within_a_token(case, data):
    trace, C = case
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shuffled = rng.permuted(trace.experts, axis=2)
    other = ec.Trace.from_arrays(shuffled, trace.seq, num_experts=trace.num_experts)
    pool = data.draw(st.sampled_from(["layer", "global"]))
    for rule in RULES:
        a, b = ec.replay(trace, C, rule, pool=pool), ec.replay(other, C, rule, pool=pool)
        assert (a.copies_total, a.copies_steady) == (b.copies_total, b.copies_steady), rule


@SETTINGS
@given(case=traces(), warm=st.sampled_from([0.0, 0.25, 0.6]))
def test_steady_is_total_minus_capacity_per_stream(case, warm):
    trace, C = case
    layout = build_layout(trace, warm=warm)
    r = replay_layout(layout, C, "lru")
    from expertcache.kernels import lru_loop

    misses, ev = lru_loop(layout.groups, layout.starts, layout.n_items, C)
    for s in range(layout.num_streams):
        a, b = layout.starts[s], layout.starts[s + 1]
        assert ev[a:b].sum() == max(0, misses[a:b].sum() - C)
    # the scored window counts only scored tokens
    L = trace.num_layers
    scored = np.tile(layout.token_scored, L)
    assert r.copies_total == misses[scored].sum() and r.copies_steady == ev[scored].sum()
    assert r.tokens == layout.token_scored.sum()


@pytest.mark.parametrize("warm, n, unscored", [(0.7, 90, 63), (0.57, 100, 57), (0.29, 100, 29), (0.7, 170, 119),
                                               (0.6, 5, 3), (0.999, 1000, 999), (1 / 3, 9, 2)])
def test_the_warm_window_is_floor_of_the_decimal_given(warm, n, unscored):
    """docs/semantics.md: the first floor(w x n) tokens warm. In binary 0.7 x 90 is 62.99999999999999:
    a float floor had warmed 62 tokens and scored 28 of 90, where the docs say 27 (1/3 as a float,
    0.3333333333333333, floors 9 of it to 2 either way)."""
    rng = np.random.default_rng(0)
    trace = ec.Trace.from_arrays(rng.integers(0, 4, (n, 1, 1)), num_experts=4)
    layout = build_layout(trace, warm=warm)
    assert int((~layout.token_scored).sum()) == unscored and layout.token_scored[unscored:].all()
    assert ec.replay(trace, 2, "lru", warm=warm).tokens == n - unscored


@pytest.mark.parametrize("pool", ["layer", "global"])
def test_an_engine_traces_warm_window_stays_out_when_its_scored_tokens_equal_its_rows(pool):
    """An engine trace's tokens count accepted tokens, not rows: here the scored half holds 4 tokens
    in 4 rows' worth, and per_layer took that for "everything is scored" and summed the warm rows in
    (requests 4, copies 4 / 3, against 2, 2, 2; the one-pass curve had it right)."""
    from expertcache.sim.curves import sweep

    ex = np.array([[[0]], [[1]], [[2]], [[0]]])
    tr = ec.Trace.from_arrays(ex, num_experts=3, extras={"iteration": np.arange(4), "accepted": np.array([0, 0, 2, 2])})
    r = ec.replay(tr, 1, "lru", warm=0.5, pool=pool)
    assert (r.requests, r.copies_total, r.copies_steady) == (2, 2, 2)
    curve = sweep(tr, [1], ["lru"], warm=0.5, pool=pool)[0]
    assert (int(curve.layer_copies_total.sum()), int(curve.layer_copies_steady.sum())) == (2, 2)


def test_global_pool_of_one_layer_is_the_layer_pool(seed_case):
    for rule in RULES:
        a, b = ec.replay(seed_case, 3, rule, pool="layer"), ec.replay(seed_case, 3, rule, pool="global")
        assert (a.copies_total, a.copies_steady) == (b.copies_total, b.copies_steady)


def test_capacity_at_least_all_experts_means_no_steady_copies(seed_case):
    r = ec.replay(seed_case, 4, "lru")
    assert r.copies_steady == 0 and r.copies_total == 4


def test_gap_recovered_is_zero_for_lru_and_one_for_belady():
    rng = np.random.default_rng(1)
    ex = np.stack([rng.choice(16, 4, replace=False) for _ in range(300)])
    trace = ec.Trace.from_arrays(ex, num_experts=16)
    res = {r.policy: r for r in ec.replay_many(trace, 8, ["lru", "decayed", "belady", "foresight:4"])}
    assert res["lru"].gap_recovered == 0.0 and res["belady"].gap_recovered == 1.0
    assert res["belady"].copies_steady < res["lru"].copies_steady
    g = res["foresight:4"].gap_recovered
    assert g == (res["lru"].copies_steady - res["foresight:4"].copies_steady) / (
        res["lru"].copies_steady - res["belady"].copies_steady
    )


def test_no_gap_without_both_references(seed_case):
    assert all(r.gap_recovered is None for r in ec.replay_many(seed_case, 3, ["lru", "decayed"]))


def test_capacity_below_k_is_an_error(seed_case):
    with pytest.raises(ConfigError, match="capacity 1 is below the 2 experts"):
        ec.replay(seed_case, 1, "lru")


def test_bad_options_are_errors(seed_case):
    with pytest.raises(ConfigError, match="--pool"):
        ec.replay(seed_case, 3, pool="shared")
    with pytest.raises(ConfigError, match="--warm"):
        ec.replay(seed_case, 3, warm=1.0)
    with pytest.raises(ec.TraceError, match="layer 5 is not in this trace"):
        ec.replay(seed_case, 3, layers=[5])


def test_layers_subset_and_reset_none():
    rng = np.random.default_rng(2)
    ex = np.stack([[rng.choice(8, 2, replace=False) for _ in range(3)] for _ in range(40)])
    trace = ec.Trace.from_arrays(ex, np.repeat([0, 1], 20), num_experts=8, meta={"layer_ids": [4, 5, 6]})
    full = ec.replay(trace, 4, "lru")
    sub = ec.replay(trace, 4, "lru", layers=[6, 4])
    assert sub.layers == [4, 6]
    by_layer = {c.layer: c for c in full.per_layer}
    assert sub.copies_steady == by_layer[4].copies_steady + by_layer[6].copies_steady
    carried = ec.replay(trace, 4, "lru", reset="none")
    assert carried.copies_total <= full.copies_total  # the second sequence starts warm
    assert carried.copies_fill == 3 * 4  # one fill per layer


def test_shared_traces_replay(shared_trace_path):
    trace = ec.load_trace(shared_trace_path)
    for C in (trace.top_k, (trace.num_experts + trace.top_k) // 2):
        res = {r.policy: r for r in ec.replay_many(trace, C, RULES)}
        for r in res.values():
            assert 0 <= r.copies_steady <= r.copies_total <= r.requests
            assert r.tokens == trace.num_tokens
        # clairvoyance never loses to its own limited-foresight versions on real traces
        assert res["belady"].copies_steady <= res["lru"].copies_steady
        py = ec.replay(trace, C, "decayed", engine="python")
        assert (py.copies_total, py.copies_steady) == (res["decayed:0.95"].copies_total, res["decayed:0.95"].copies_steady)


def test_stream_options_checked_once_and_equal_to_keywords():
    import numpy as _np

    from expertcache.errors import ConfigError as _CE
    from expertcache.sim import StreamOptions, build_layout
    from expertcache.trace.synth import synthesize_preset

    trace = synthesize_preset("olmoe", 0, tokens=30, sequences=2, num_layers=4)
    opts = StreamOptions.of(pool="global", reset="none", layers=[1, 3], warm=0.5, admission="second")
    a = build_layout(trace, opts)
    b = build_layout(trace, pool="global", reset="none", layers=[1, 3], warm=0.5, admission="second")
    assert _np.array_equal(a.groups, b.groups) and _np.array_equal(a.streamed, b.streamed)
    assert (a.layer_ids, a.pool, a.reset, a.warm, a.admission) == ([1, 3], "global", "none", 0.5, "second")
    for bad, text in [({"pool": "x"}, "--pool"), ({"reset": "x"}, "--reset"), ({"warm": 1.0}, "--warm"),
                      ({"warm": float("nan")}, "--warm"), ({"warm": True}, "--warm"), ({"admission": "x"}, "--admission"),
                      ({"layers": ["a"]}, "--layers")]:
        with pytest.raises(_CE, match=text) as err:
            StreamOptions.of(**bad)
        assert "\n" not in str(err.value)
    with pytest.raises(TypeError):
        build_layout(trace, opts, pool="layer")
