"""The tiering paper's trace side (issue 11): byte budgets, static pin sets with bypass, admission,
engine-iteration units, batch unions. Hand-computed cases and cross-checks against naive
implementations written from DESIGN section 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expertcache as ec
from expertcache._units import parse_byte_range, parse_bytes
from expertcache.cli.main import main
from expertcache.errors import ConfigError
from expertcache.sim import build_layout, replay_layout
from expertcache.sim.budget import Budget
from expertcache.sim.curves import sweep_layout
from expertcache.trace.batch import batch_union

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def one_layer(ids, E, seq=None, **extras):
    ex = np.asarray(ids)[:, None] if np.asarray(ids).ndim == 1 else np.asarray(ids)
    return ec.Trace.from_arrays(ex, seq, num_experts=E, extras=extras or None)


# ------------------------------------------------------------------------------- sizes
def test_parse_bytes_units():
    assert parse_bytes("12GB", "x") == 12 * 10**9
    assert parse_bytes("17.5MB", "x") == 17_500_000
    assert parse_bytes("1GiB", "x") == 2**30
    assert parse_bytes("4096", "x") == 4096
    assert parse_bytes(" 0.5 gb ", "x") == 500_000_000
    for bad in ("", "GB", "12XB", "-1GB", "0", "nan", "1e30GB"):
        with pytest.raises(ConfigError, match="^x: "):
            parse_bytes(bad, "x")
    with pytest.raises(ConfigError, match="no unit and is not a whole number of bytes"):  # 1.5 meant 1.5GB
        parse_bytes("1.5", "x")


def test_parse_byte_ranges():
    assert parse_byte_range("0.5GB:4GB:x2", "r") == [5 * 10**8, 10**9, 2 * 10**9, 4 * 10**9]
    assert parse_byte_range("1GB:3GB:+1GB", "r") == [10**9, 2 * 10**9, 3 * 10**9]
    assert parse_byte_range("2GB,1GB,2GB", "r") == [10**9, 2 * 10**9]
    assert parse_byte_range("1GB:5GB", "r") == [10**9, 2 * 10**9, 4 * 10**9]
    for bad in ("4GB:1GB", "1GB:2GB:x1", "1GB:2GB:7", "1GB:2GB:3:4", "1B:1TB:+1B"):
        with pytest.raises(ConfigError):
            parse_byte_range(bad, "r")


# ------------------------------------------------------------------------------- budgets
def test_budget_arithmetic():
    b = Budget(12 * 10**9, 17_500_000)
    assert b.experts == 685  # floor(12e9 / 17.5e6)
    assert b.capacity("global", 92) == 685
    assert b.capacity("layer", 92) == 7  # floor(685 / 92)
    assert b.record("layer", 92) == {"budget_bytes": 12 * 10**9, "expert_bytes": 17_500_000,
                                     "budget_experts": 685, "budget_unused_experts": 685 - 7 * 92}
    with pytest.raises(ConfigError, match="0 per layer"):
        Budget(10**9, 17_500_000).capacity("layer", 92)


@pytest.mark.parametrize("pool", ["layer", "global"])
def test_budget_gives_the_counts_of_the_equivalent_capacity(tmp_path, capsys, pool):
    rng = np.random.default_rng(1)
    ex = np.stack([[rng.choice(12, 2, replace=False) for _ in range(3)] for _ in range(80)])
    path = ec.Trace.from_arrays(ex, num_experts=12).save(tmp_path / "t.npz")
    cap = 5 if pool == "layer" else 15
    budget = cap * 3 * 1000 if pool == "layer" else cap * 1000  # experts of 1000 bytes
    assert main(["replay", str(path), "--budget", str(budget + 999), "--expert-mb", "0.001", "--pool", pool,
                 "-p", "lru", "-p", "belady", "--json"]) == 0
    by_budget = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert main(["replay", str(path), "-c", str(cap), "--pool", pool, "-p", "lru", "-p", "belady", "--json"]) == 0
    by_cap = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    for a, b in zip(by_budget, by_cap):
        assert a["capacity"] == cap and a["budget_bytes"] == budget + 999 and a["budget_experts"] == budget // 1000
        assert (a["copies_total"], a["copies_steady"], a["hit_rate"]) == (b["copies_total"], b["copies_steady"], b["hit_rate"])


def test_budget_needs_an_expert_size(tmp_path, capsys):
    path = one_layer([0, 1, 2], 4).save(tmp_path / "t.npz")
    assert main(["replay", str(path), "--budget", "1GB"]) == 2
    assert "--budget needs the size of one expert" in capsys.readouterr().err
    for args in (["--budget", "1GB", "-c", "3"], ["--budget", "12XB", "--expert-mb", "1"]):
        with pytest.raises(SystemExit) as exit_:
            main(["replay", str(path), *args])
        assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1


# ------------------------------------------------------------------------------- static with bypass
def test_static_bypass_hand_computed():
    # one layer, E=4, k=1; warm 0.5 of 8 tokens: profile = 0,0,1,2 -> pin (C=2) {0, 1} (tie 1 vs 2: smaller id)
    t = one_layer([0, 0, 1, 2, 2, 3, 0, 1], 4)
    r = ec.replay(t, 2, "static", warm=0.5)
    # scored 2,3,0,1: hits 0 and 1 -> 2 of 4; streamed 2 and 3
    assert (r.requests, r.copies_total, r.copies_steady) == (4, 2, 2)
    assert r.hit_rate == 0.5 and r.copies_per_token == 0.5
    # C=1: pin {0}; scored hits: 0 only
    assert ec.replay(t, 1, "static", warm=0.5).copies_total == 3


def test_static_global_pool_and_profile_trace():
    # two layers, E=3: warm half tokens 0..1
    ex = np.array([[[0], [2]], [[0], [1]], [[1], [2]], [[0], [2]]])
    t = ec.Trace.from_arrays(ex, num_experts=3)
    # profile counts: (l0,e0)=2, (l1,e2)=1, (l1,e1)=1 -> global C=2: (l0,e0) then (l1,e1) (tie: smaller layer, id)
    r = ec.replay(t, 2, "static", warm=0.5, pool="global")
    # scored: (l0,1) miss, (l1,2) miss, (l0,0) hit, (l1,2) miss
    assert (r.requests, r.copies_total) == (4, 3)
    # per-layer C=1: layer0 pins 0, layer1 pins 1 (tie 1 vs 2 at count 1: smaller id)
    assert ec.replay(t, 1, "static", warm=0.5).copies_total == 3
    # off-domain profile: a trace whose layer 1 favours expert 2
    prof = ec.Trace.from_arrays(np.array([[[1], [2]]] * 3), num_experts=3)
    p = ec.policies.make_policy("static").use_profile(prof)
    layout = build_layout(t, warm=0.5)
    r = replay_layout(layout, 1, p)  # pins layer0 {1}, layer1 {2}: scored (1,2) hit hit, (0,2) miss hit
    assert (r.requests, r.copies_total) == (4, 1)


def test_static_refuses_what_it_cannot_do(tmp_path, capsys):
    t = one_layer([0, 1, 2, 3], 4)
    with pytest.raises(ConfigError, match="profile window"):
        ec.replay(t, 2, "static")
    with pytest.raises(ConfigError, match="own admission"):
        ec.replay(t, 2, "static", warm=0.5, admission="second")
    path = t.save(tmp_path / "t.npz")
    assert main(["replay", str(path), "-c", "2", "-p", "lru", "--profile", str(path)]) == 2
    assert "no static policy" in capsys.readouterr().err
    other = ec.Trace.from_arrays(np.array([[0], [1]]), num_experts=5).save(tmp_path / "o.npz")
    assert main(["replay", str(path), "-c", "2", "-p", "static", "--profile", str(other)]) == 2
    assert "5 experts per layer" in capsys.readouterr().err


def test_static_capacity_below_k_is_valid():
    t = ec.Trace.from_arrays(np.array([[0, 1], [0, 2], [0, 1], [0, 3]]), num_experts=4)
    r = ec.replay(t, 1, "static", warm=0.5)  # pins {0}: scored (0,1) (0,3): 2 hits of 4
    assert r.hit_rate == 0.5
    with pytest.raises(ConfigError, match="below"):
        ec.replay(t, 1, "lru")


# ------------------------------------------------------------------------------- admission
def naive_lru_second(stream, C):
    """LRU where an item's first request in the stream is streamed (a miss, never inserted)."""
    seen, pool, last = set(), set(), {}
    total = steady = 0
    for t, demand in enumerate(stream):
        admitted = set()
        for e in sorted(demand):
            if e not in seen:
                seen.add(e)
                total += 1
                steady += 1
            else:
                admitted.add(e)
        for e in sorted(admitted - pool):
            if len(pool) == C:
                victim = min(pool - admitted, key=lambda c: (last[c], c))
                pool.remove(victim)
                steady += 1
            pool.add(e)
            total += 1
        for e in admitted:
            last[e] = t
    return total, steady


@SETTINGS
@given(seed=st.integers(0, 2**31), C=st.integers(2, 6))
def test_admission_second_matches_naive_lru(seed, C):
    rng = np.random.default_rng(seed)
    E, k, T = 8, 2, 40
    ex = np.stack([rng.choice(E, k, replace=False, p=np.arange(1, E + 1) ** -1.2 / (np.arange(1, E + 1) ** -1.2).sum())
                   for _ in range(T)])
    t = ec.Trace.from_arrays(ex, num_experts=E)
    r = ec.replay(t, C, "lru", admission="second")
    total, steady = naive_lru_second([set(row) for row in ex.tolist()], C)
    assert (r.copies_total, r.copies_steady, r.requests) == (total, steady, T * k)
    # the one-pass stack curve agrees with replay under this admission, count for count
    layout = build_layout(t, admission="second")
    stack = sweep_layout(layout, [C], ["lru"])[0].results[0]
    replayed = sweep_layout(layout, [C], ["lru"], one_pass=False)[0].results[0]
    assert (stack.copies_total, stack.copies_steady, stack.requests) == \
        (replayed.copies_total, replayed.copies_steady, replayed.requests) == (r.copies_total, r.copies_steady, r.requests)


def test_admission_second_hand_case():
    # stream a, b, a, c, a, b with C=1: firsts of a, b, c streamed; a admitted at step 2; b at step 5 evicts a
    t = one_layer([0, 1, 0, 2, 0, 1], 3)
    r = ec.replay(t, 1, "lru", admission="second")
    assert (r.requests, r.copies_total) == (6, 5)  # only the request of a at step 4 hits
    assert r.copies_steady == 3 + 1  # three streamed + one insertion that evicted (b evicts a)


# ------------------------------------------------------------------------------- engine units
def engine_trace():
    # one sequence, 4 iterations: normal, spec-accept (2 tokens), failed spec + fallback, normal
    ex = np.array([[[0, -1]], [[1, 2]], [[0, 3]], [[0, -1]], [[1, -1]]])
    return ec.Trace.from_arrays(ex, num_experts=4, extras={
        "iteration": np.array([0, 1, 2, 2, 3]), "accepted": np.array([1, 2, 0, 1, 1]),
        "pass_kind": np.array([0, 1, 2, 3, 0], dtype=np.int8)})


def test_engine_trace_units_and_fair_window():
    t = engine_trace()
    r = ec.replay(t, 2, "lru")
    assert (r.tokens, r.iterations) == (5, 4)
    assert r.copies_per_token == r.copies_steady / 5 and r.copies_per_iteration == r.copies_steady / 4
    # warm 0.5 of 4 iterations = the first 2 iterations (rows 0, 1); the failed spec and its fallback stay together
    layout = build_layout(t, warm=0.5)
    assert layout.token_scored.tolist() == [False, False, True, True, True]
    assert (layout.tokens, layout.iterations) == (2, 2)
    layout = build_layout(t, warm=0.6)  # floor(2.4) = 2 iterations
    assert layout.token_scored.tolist() == [False, False, True, True, True]
    layout = build_layout(t, warm=0.75)  # 3 iterations: rows 0..3
    assert layout.token_scored.tolist() == [False, False, False, False, True]


# ------------------------------------------------------------------------------- batch unions
def test_union_of_one_trace_is_itself():
    rng = np.random.default_rng(3)
    ex = np.stack([[rng.choice(10, 3, replace=False) for _ in range(2)] for _ in range(30)])
    t = ec.Trace.from_arrays(ex, np.repeat([0, 1], 15), num_experts=10)
    u = batch_union([t])
    assert np.array_equal(u.experts, np.sort(t.experts, axis=2)) and np.array_equal(u.seq, t.seq)
    assert u.extras["batch_rows"][:, 0].tolist() == list(range(30))
    for pool in ("layer", "global"):
        a, b = ec.replay(t, 4, "lru", pool=pool), ec.replay(u, 4, "lru", pool=pool)
        assert (a.copies_total, a.copies_steady, a.tokens) == (b.copies_total, b.copies_steady, b.tokens)


def test_union_of_two_hand_made():
    a = one_layer(np.array([[0, 1], [2, 3], [0, 1]]), 6)
    b = one_layer(np.array([[1, 4], [3, 5]]), 6)
    u = batch_union([a, b])
    assert u.experts[:, 0].tolist() == [[0, 1, 4, -1], [2, 3, 5, -1], [0, 1, -1, -1]]
    assert u.extras["batch_rows"].tolist() == [[0, 0], [1, 1], [2, -1]]
    assert u.extras["accepted"].tolist() == [2, 2, 1] and u.meta["accepted_tokens"] == 5
    assert ec.replay(u, 3, "lru").tokens == 5


def test_union_of_engine_traces_keeps_every_pass():
    e = engine_trace()
    plain = one_layer(np.array([[3, -1], [2, -1], [1, -1]]), 4)
    u = batch_union([e, plain])
    # iteration 2 has two passes in e: the plain trace's row 2 joins the first pass only
    assert u.extras["iteration"].tolist() == [0, 1, 2, 2, 3]
    assert u.extras["batch_rows"].tolist() == [[0, 0], [1, 1], [2, 2], [3, -1], [4, -1]]
    assert u.experts[:, 0].tolist() == [[0, 3, -1, -1], [1, 2, -1, -1], [0, 1, 3, -1], [0, -1, -1, -1],
                                        [1, -1, -1, -1]]
    assert u.meta["accepted_tokens"] == 5 + 3
    with pytest.raises(ConfigError, match="experts per layer"):
        batch_union([e, one_layer([0, 1], 7)])


def test_batch_cli(tmp_path, capsys):
    a = one_layer(np.array([[0, 1], [2, 3], [0, 1]]), 6).save(tmp_path / "a.npz")
    b = one_layer(np.array([[1, 4], [3, 5]]), 6).save(tmp_path / "b.npz")
    out = tmp_path / "u.npz"
    assert main(["batch", str(a), str(b), "--out", str(out), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["batch"] == 2 and rec["rows"] == 3 and rec["accepted_tokens"] == 5
    assert rec["requests_in"] == 10 and rec["requests_union"] == 8
    assert ec.load_trace(out).experts.shape == (3, 1, 4)
    assert main(["batch", str(a), str(tmp_path / "missing.npz"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# ------------------------------------------------------------------------------- sweep --budgets
def test_sweep_budgets(tmp_path, capsys):
    rng = np.random.default_rng(2)
    ex = np.stack([[rng.choice(16, 2, replace=False) for _ in range(4)] for _ in range(100)])
    path = ec.Trace.from_arrays(ex, num_experts=16, meta={"expert_bytes": 10**6}).save(tmp_path / "t.npz")
    assert main(["sweep", str(path), "--budgets", "8MB:64MB:x2", "--warm", "0.6", "-p", "lru", "-p", "static",
                 "-p", "belady", "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["budget_bytes"] for r in recs[::3]] == [8 * 10**6, 16 * 10**6, 32 * 10**6, 64 * 10**6]
    assert [r["capacity"] for r in recs[::3]] == [2, 4, 8, 16]
    for r in recs:
        direct = ec.replay(ec.load_trace(path), r["capacity"], r["policy"], warm=0.6)
        assert (r["copies_total"], r["copies_steady"]) == (direct.copies_total, direct.copies_steady)
    assert main(["sweep", str(path), "--budgets", "4MB:64MB", "-p", "lru"]) == 2
    assert "fewer than the 2" in capsys.readouterr().err
    assert main(["sweep", str(path), "--budgets", "8MB:64MB", "--warm", "0.6", "-p", "lru", "-p", "static"]) == 0
    out = capsys.readouterr().out
    assert "budget GB" in out and "static hit" in out


def test_static_profiles_each_sequence_on_its_own_warm_window():
    # two sequences (domains): the first favours expert 0, the second expert 1; C=1, warm 0.5
    t = one_layer([0, 0, 0, 1, 1, 1, 1, 0], 3, seq=[0, 0, 0, 0, 1, 1, 1, 1])
    r = ec.replay(t, 1, "static", warm=0.5)
    # seq 0 pins {0}: scored 0 (hit), 1 (miss); seq 1 pins {1}: scored 1 (hit), 0 (miss)
    assert (r.requests, r.copies_total) == (4, 2)
    # one pooled off-domain table (counts 0: 4, 1: 4 -> tie -> expert 0) for both sequences
    p = ec.policies.make_policy("static").use_profile(t)
    assert replay_layout(build_layout(t, warm=0.5), 1, p).copies_total == 2  # seq 0: miss on 1; seq 1: miss on 1
