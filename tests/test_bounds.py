"""Bounds of lossless schedules: B_flat <= B* <= B_greedy (DESIGN section 2, bounds).

Every bound is checked against an independent, deliberately simple implementation here:
classical MIN on single requests, and a brute force over *all* lossless schedules (prefetching
and arbitrary evictions included) for the exact optimum.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import expertcache as ec
from expertcache.bounds import (
    MAX_ITEMS, ORDERS, InstanceTooLarge, compute_bounds, flat_min_totals, flatten, optimal_total,
)
from expertcache.bounds.streams import bare_layout, stream_totals
from expertcache.cli.main import main
from expertcache.sim import build_layout
from oracle import naive_stream

INF = float("inf")


# ------------------------------------------------------------------------------ oracles
def simple_min(requests: list[int], capacity: int) -> int:
    """Belady's MIN on single requests, from its textbook definition: misses from empty."""
    cache: set[int] = set()
    misses = 0
    for i, x in enumerate(requests):
        if x in cache:
            continue
        misses += 1
        if len(cache) == capacity:
            def next_request(y):
                return next((j for j in range(i + 1, len(requests)) if requests[j] == y), INF)
            cache.remove(max(cache, key=next_request))
        cache.add(x)
    return misses


def brute_force_optimum(stream: list[set[int]], capacity: int) -> int:
    """Fewest insertions over every schedule R_1..R_T with |R_t| <= C and S_t <= R_t, from empty.

    Any resident set may follow any other (prefetching, early or extra evictions allowed); the
    cost of a move is |R_t - R_{t-1}|. Items never requested are never worth holding, so sets
    range over the stream's items.
    """
    items = sorted(set().union(*stream)) if stream else []
    sets = [frozenset(c) for r in range(capacity + 1) for c in itertools.combinations(items, r)]
    best = {frozenset(): 0}
    for demand in stream:
        best = {
            r: min(cost + len(r - prev) for prev, cost in best.items())
            for r in sets if demand <= r
        }
    return min(best.values())


def as_groups(stream: list[set[int]]) -> np.ndarray:
    """``[T, k]`` ids with -1 pads (groups of different sizes)."""
    k = max((len(s) for s in stream), default=1) or 1
    out = np.full((len(stream), k), -1, dtype=np.int32)
    for t, s in enumerate(stream):
        out[t, : len(s)] = sorted(s)
    return out


def random_stream(rng, n, k, tokens, ragged=False):
    sizes = rng.integers(1, k + 1, tokens) if ragged else np.full(tokens, k)
    return [set(rng.choice(n, size, replace=False).tolist()) for size in sizes]


streams = st.integers(1, 3).flatmap(
    lambda k: st.tuples(
        st.just(k),
        st.lists(st.sets(st.integers(0, 5), min_size=1, max_size=k), min_size=1, max_size=7),
        st.integers(k, 5),
    )
)


# ------------------------------------------------------------------------------ the seeds' case
def test_seed_case_bounds(seed_case):
    """C=3, {a,b},{c,d},{a,b}: flattened MIN needs 4 (1 steady), the optimum and belady 5 (2)."""
    report = compute_bounds(seed_case, 3, exact=True)
    (s,) = report.streams
    assert (s.flat_total, s.b_flat) == (4, 1)
    assert (s.star_total, s.b_star) == (5, 2)
    assert (s.greedy_total, s.b_greedy) == (5, 2)
    assert (report.b_flat, report.b_star, report.b_greedy) == (1, 2, 2)
    assert report.streams_tight == 0 and report.gap == 1.0 and report.exact_gap == 0.0


def test_seed_case_every_schedule_needs_five():
    """Literal enumeration of every sequence of resident sets (15 ** 3 schedules)."""
    stream = [{0, 1}, {2, 3}, {0, 1}]
    sets = [frozenset(c) for r in range(4) for c in itertools.combinations(range(4), r)]
    costs = [
        sum(len(r - p) for p, r in zip((frozenset(),) + sched, sched))
        for sched in itertools.product(sets, repeat=3)
        if all(d <= r for d, r in zip(stream, sched))
    ]
    assert min(costs) == 5 == brute_force_optimum(stream, 3) == optimal_total(as_groups(stream), 3).total
    assert simple_min([0, 1, 2, 3, 0, 1], 3) == 4


# ------------------------------------------------------------------------------ B_flat
def test_flatten_lists_each_groups_ids_in_order():
    layout = bare_layout(np.array([[3, 1], [2, -1], [0, 4]]), np.array([0, 2, 3]), 5)
    got = {o: flatten(layout, o) for o in ORDERS}
    assert got["router"].groups[:, 0].tolist() == [3, 1, 2, 0, 4]
    assert got["ascending"].groups[:, 0].tolist() == [1, 3, 2, 0, 4]
    assert got["descending"].groups[:, 0].tolist() == [3, 1, 2, 4, 0]
    assert all(f.starts.tolist() == [0, 3, 5] for f in got.values())
    with pytest.raises(ValueError):
        flatten(layout, "sideways")


def test_flat_min_is_classical_min():
    rng = np.random.default_rng(11)
    for _ in range(300):
        n, k = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        stream = random_stream(rng, n, min(k, n), int(rng.integers(1, 25)), ragged=True)
        cap = int(rng.integers(max(len(s) for s in stream), n + 1))
        groups = as_groups(stream)
        totals = flat_min_totals(bare_layout(groups, np.array([0, len(stream)]), n), cap)[:, 0]
        for order, total in zip(ORDERS, totals):
            key = {"router": None, "ascending": lambda x: x, "descending": lambda x: -x}[order]
            reqs = [e for row in groups for e in (row[row >= 0] if key is None else sorted(row[row >= 0], key=key))]
            assert total == simple_min([int(e) for e in reqs], cap), (order, stream, cap)


# ------------------------------------------------------------------------------ B*
@settings(max_examples=300, deadline=None)
@given(streams)
def test_exact_equals_brute_force_with_prefetching(case):
    k, stream, cap = case
    assert optimal_total(as_groups(stream), cap).total == brute_force_optimum(stream, cap)


def test_exact_equals_brute_force_seeded():
    rng = np.random.default_rng(5)
    for _ in range(200):
        n, k = int(rng.integers(3, 8)), int(rng.integers(1, 4))
        stream = random_stream(rng, n, k, int(rng.integers(1, 9)), ragged=bool(rng.integers(2)))
        cap = int(rng.integers(max(len(s) for s in stream), min(n, 5) + 1))
        assert optimal_total(as_groups(stream), cap).total == brute_force_optimum(stream, cap), (stream, cap)


def test_sandwich_on_random_streams():
    """B_flat <= B* <= B_greedy on thousands of streams; greedy from the naive oracle too."""
    rng = np.random.default_rng(2024)
    for i in range(3000):
        n = int(rng.integers(3, 14))
        k = int(rng.integers(1, min(4, n - 1) + 1))
        cap = int(rng.integers(k, n))
        stream = random_stream(rng, n, k, int(rng.integers(1, 30)), ragged=i % 4 == 0)
        groups = as_groups(stream)
        layout = bare_layout(groups, np.array([0, len(stream)]), n)
        flat = int(flat_min_totals(layout, cap).max())
        star = optimal_total(groups, cap).total
        greedy = int(stream_totals(layout, cap, "belady")[0])
        assert flat <= star <= greedy, (stream, cap)
        if i % 10 == 0:
            assert greedy == naive_stream(stream, cap, "belady")[0]
        if k == 1:
            assert flat == star == greedy


def test_exact_limits_are_named():
    rng = np.random.default_rng(0)
    wide = np.stack([rng.choice(40, 2, replace=False) for _ in range(60)])
    with pytest.raises(InstanceTooLarge, match=f"at most {MAX_ITEMS} distinct items"):
        optimal_total(wide, 4)
    assert optimal_total(wide, 40).total == np.unique(wide).size  # never fills: no program needed
    small = np.stack([rng.choice(10, 3, replace=False) for _ in range(30)])
    with pytest.raises(InstanceTooLarge, match="state limit 2"):
        optimal_total(small, 5, max_states=2)
    assert optimal_total(small, 5).peak_states > 2
    with pytest.raises(ec.ConfigError, match="below"):
        optimal_total(small, 2)


# ------------------------------------------------------------------------------ traces
def multi_trace(seed=0, T=40, L=3, k=2, E=7, S=3):
    rng = np.random.default_rng(seed)
    experts = np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)])
    seq = np.repeat(np.arange(S), -(-T // S))[:T]
    return ec.Trace.from_arrays(experts, seq, num_experts=E)


@pytest.mark.parametrize("pool,reset", [("layer", "sequence"), ("layer", "none"), ("global", "sequence")])
def test_report_matches_replay_and_per_stream_sandwich(pool, reset):
    trace = multi_trace()
    cap = 4 if pool == "layer" else 8
    try:
        report = compute_bounds(trace, cap, pool=pool, reset=reset, exact=True)
    except InstanceTooLarge:  # a global pool of 3 layers x 7 experts stays below the item limit
        pytest.fail("exact program should handle 21 items")
    replayed = ec.replay(trace, cap, "belady", pool=pool, reset=reset)
    assert report.b_greedy == replayed.copies_steady
    assert sum(s.greedy_total for s in report.streams) == replayed.copies_total
    layout = build_layout(trace, pool=pool, reset=reset)
    assert len(report.streams) == layout.num_streams
    for s in report.streams:
        assert s.b_flat <= s.b_star <= s.b_greedy
        assert s.flat_order in ORDERS
    labels = [(s.layer, s.sequence) for s in report.streams]
    assert len(set(labels)) == len(labels)
    if pool == "global":
        assert all(s.layer is None for s in report.streams)
    if reset == "none":
        assert all(s.sequence is None for s in report.streams)


def test_b_flat_takes_the_largest_order_per_stream():
    trace = multi_trace(seed=3, T=60, L=4, k=3, E=9, S=2)
    report = compute_bounds(trace, 5)
    totals = flat_min_totals(build_layout(trace), 5)
    steady = np.maximum(totals - 5, 0)
    assert [s.b_flat for s in report.streams] == steady.max(axis=0).tolist()
    assert [s.flat_order for s in report.streams] == [ORDERS[i] for i in steady.argmax(axis=0)]
    only_router = compute_bounds(trace, 5, orders=["router"])
    assert only_router.b_flat <= report.b_flat
    assert sum(report.orders_used().values()) == len(report.streams)


def test_capacity_below_group_width_is_an_error(seed_case):
    with pytest.raises(ec.ConfigError, match="below the 2 experts"):
        compute_bounds(seed_case, 1)


def test_bounds_on_shared_traces(shared_trace_path):
    trace = ec.load_trace(shared_trace_path)
    for cap in (2 * trace.top_k, max(trace.top_k, trace.num_experts // 2)):
        layout = build_layout(trace)
        distinct = [np.unique(g[g >= 0]).size for g in map(layout.stream_groups, range(layout.num_streams))]
        feasible = all(d <= cap or d <= MAX_ITEMS for d in distinct)
        if feasible:
            report = compute_bounds(trace, cap, exact=True)
            assert report.b_flat <= report.b_star <= report.b_greedy
            assert all(s.b_flat <= s.b_star <= s.b_greedy for s in report.streams)
        else:
            with pytest.raises(InstanceTooLarge, match=f"at most {MAX_ITEMS}"):
                compute_bounds(trace, cap, exact=True)
            report = compute_bounds(trace, cap)
        assert report.b_flat <= report.b_greedy == ec.replay(trace, cap, "belady").copies_steady
        assert 0 <= report.streams_tight <= len(report.streams) == layout.num_streams
        if trace.top_k == 1:
            assert report.b_flat == report.b_greedy


# ------------------------------------------------------------------------------ CLI
@pytest.fixture
def seed_file(tmp_path, seed_case):
    return str(seed_case.save(tmp_path / "seed.npz"))


def test_cli_bounds_json(seed_file, capsys):
    assert main(["bounds", seed_file, "--capacity", "3", "--json", "--exact"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert (rec["b_flat"], rec["b_greedy"], rec["b_star"]) == (1, 2, 2)
    assert (rec["streams"], rec["streams_tight"], rec["median_gap"]) == (1, 0, 1.0)
    assert rec["per_stream"][0]["flat_total"] == 4 and rec["per_stream"][0]["star_total"] == 5


def test_cli_bounds_table(seed_file, capsys):
    assert main(["bounds", seed_file, "-c", "3"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "B_flat" in line).split()
    assert header == ["layer", "streams", "tight", "B_flat", "B_greedy", "gap"]
    assert "belady is within 100.00% of the optimum" in out


def test_cli_exact_too_large_is_one_line_exit_2(tmp_path, capsys):
    rng = np.random.default_rng(1)
    wide = ec.Trace.from_arrays(np.stack([rng.choice(32, 2, replace=False) for _ in range(50)]), num_experts=32)
    path = str(wide.save(tmp_path / "wide.npz"))
    assert main(["bounds", path, "-c", "4", "--exact"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"at most {MAX_ITEMS}" in err and "layer 0, sequence 0" in err
    assert main(["bounds", path, "-c", "4"]) == 0


def test_the_exact_program_refuses_what_it_would_misread():
    """optimal_total had floored a capacity of 1.5, read float ids (NaN as padding), taken -5 as
    padding, and met 2**70 states with an OverflowError."""
    from expertcache.bounds.exact import optimal_total
    from expertcache.errors import ConfigError

    g = np.array([[0, 1], [1, 2], [3, 0], [2, 3]])
    assert optimal_total(g, 2).total == 6 == optimal_total(g.astype(np.int16), np.int64(2)).total
    for groups, capacity, kw, said in ((g, 1.5, {}, "capacity must be an integer"),
                                       (g.astype(float), 2, {}, "expected integer ids"),
                                       (np.array(3), 2, {}, "expected integer ids"),
                                       (np.array([[0, -5]]), 2, {}, "id -5 is below -1"),
                                       (g, 2, {"max_states": 2**70}, "max_states must be an integer")):
        with pytest.raises(ConfigError, match=said):
            optimal_total(groups, capacity, **kw)
