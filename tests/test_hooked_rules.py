"""Rules written once as engine hooks (every registered rule with ``hooked``: arc, s3fifo, sieve,
random): libCacheSim's S3-FIFO at small caches, random against an independent numpy simulation, the
two drivers (compiled engine, ExpertCache) on token-grouped traces and the engine's refusal of a rule
that proposes a protected victim. The per-rule checks (libCacheSim's counts on k = 1 traces, the
compiled engine against the Python driver on a k = 1 trace) are tests/test_rule_conformance.py's,
for every registered rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expertcache as ec
from expertcache.policies import driver
from expertcache._jit import njit
from expertcache.policies.hooked import HookedPolicy
from expertcache.trace.exporters import export_libcachesim
from test_rule_conformance import lcs_misses, plain_specs

HOOKED = plain_specs(hooked=True)
"""Every registered hooked rule (with its declared parameter examples: random and random:3)."""


def loop_trace(n_objects=4, repeats=500):
    return ec.Trace.from_arrays(np.tile(np.arange(n_objects), repeats)[:, None], num_experts=n_objects)


def test_hooked_rules_are_found():
    assert {"arc", "s3fifo", "sieve", "random:3"} <= set(HOOKED)


def test_libcachesim_s3fifo_misbehaves_at_small_caches_and_ours_does_not(tmp_path):
    """libCacheSim's S3-FIFO inserts nothing when its small queue is one object (C = 10-19): a
    4-object loop misses every request; ours, with s = max(1, 0.1 C), misses only the first 4."""
    lcs = pytest.importorskip("libcachesim")
    trace = loop_trace(4, 500)
    path = tmp_path / "loop.bin"
    n = export_libcachesim(trace, path, fmt="oracle")
    for C in (10, 16, 19):
        assert lcs_misses(lcs, path, n, "s3fifo", C) == n
        assert ec.replay(trace, C, "s3fifo", reset="none").copies_total == 4
    assert lcs_misses(lcs, path, n, "s3fifo", 20) == ec.replay(trace, 20, "s3fifo", reset="none").copies_total == 4


def reference_random(trace, C, seed):
    """random:seed by hand, one global pool and stream: one step per (token, layer), its items
    (layer * E + expert) ascending, each miss evicting the resident outside the step with the
    smallest hash_keys (numpy twin of mix64), then the older last request, then the smaller id."""
    from expertcache.policies.randomized import hash_keys

    resident, last, misses = set(), {}, 0
    T, L = trace.experts.shape[:2]
    E = trace.num_experts
    for t in range(T * L):
        row, l = trace.experts[t // L, t % L], t % L
        group = sorted({int(l * E + e) for e in row if e >= 0})
        for e in group:
            if e in resident:
                continue
            misses += 1
            if len(resident) == C:
                cand = np.array(sorted(resident - set(group)), dtype=np.int64)
                keys = hash_keys(seed, t, cand)
                order = np.lexsort((cand, np.array([last[c] for c in cand]), keys))
                resident.remove(int(cand[order[0]]))
            resident.add(e)
        for e in group:
            last[e] = t
    return misses


@pytest.mark.parametrize("C", [8, 9, 20, 47])
def test_random_equals_an_independent_simulation(C):
    rng = np.random.default_rng(C)
    ex = np.stack([np.stack([rng.choice(24, 4, replace=False) for _ in range(2)]) for _ in range(300)])
    trace = ec.Trace.from_arrays(ex, num_experts=24)
    for seed in (0, 3, 2**40):
        want = reference_random(trace, C, seed)
        for engine_name in ("compiled", "python"):
            got = ec.replay(trace, C, f"random:{seed}", pool="global", reset="none", engine=engine_name)
            assert got.copies_total == want, (C, seed, engine_name)


@st.composite
def grouped(draw):
    E = draw(st.integers(2, 12))
    k = draw(st.integers(1, min(E, 4)))
    L = draw(st.integers(1, 2))
    T = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ex = np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)])
    if draw(st.booleans()):
        ex[rng.random(ex.shape) < 0.2] = -1
    seq = np.sort(rng.integers(0, draw(st.integers(1, 3)), T))
    return ec.Trace.from_arrays(ex, seq, num_experts=E), draw(st.integers(k, E + 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=grouped(), pool=st.sampled_from(["layer", "global"]), rule=st.sampled_from(HOOKED))
def test_token_grouped_drivers_agree_and_never_evict_the_group(case, pool, rule):
    trace, C = case
    a = ec.replay(trace, C, rule, pool=pool, engine="compiled")
    b = ec.replay(trace, C, rule, pool=pool, engine="python")
    assert [(c.copies_total, c.copies_steady) for c in a.per_layer] == [(c.copies_total, c.copies_steady) for c in b.per_layer]
    from expertcache.sim import build_layout

    layout = build_layout(trace, pool=pool)
    for s in range(layout.num_streams):
        cache = ec.ExpertCache(C, rule, layout.n_items)
        for g in layout.stream_groups(s):
            want = {int(x) for x in g if x >= 0}
            before = set(cache.resident.tolist())
            step = cache.prepare(g)
            assert want <= set(cache.resident.tolist()) and not (set(step.evicted) & want)
            assert set(step.evicted) <= before and len(cache.resident) <= C


def test_counts_do_not_depend_on_id_order_within_a_token():
    rng = np.random.default_rng(5)
    ex = np.stack([[rng.choice(10, 3, replace=False) for _ in range(2)] for _ in range(200)])
    a = ec.Trace.from_arrays(ex, num_experts=10)
    b = ec.Trace.from_arrays(rng.permuted(ex, axis=2), num_experts=10)
    for rule in HOOKED:
        assert ec.replay(a, 5, rule).copies_total == ec.replay(b, 5, rule).copies_total


def test_prefetched_items_go_first_and_enter_the_rule_on_first_use():
    for rule in HOOKED:
        cache = ec.ExpertCache(3, rule, 8)
        cache.prepare([0, 1, 2])
        cache.prefetch([5])
        assert cache.prefetch_pending == 1 and len(cache.resident) == 3
        step = cache.prepare([6])  # the unused prefetched 5 goes first
        assert step.evicted == [5] and cache.prefetch_wasted == 1
        cache.prefetch([7])
        assert cache.prepare([7]).hits == 1 and cache.prefetch_hits == 1


# -- the engine refuses a rule that breaks the group's protection --------------------------------
@njit(cache=False)
def _init(st, sc, fs, n, c):
    driver.list_clear(sc, 0)


@njit(cache=False)
def _nop(st, sc, fs, e, t):
    pass


@njit(cache=False)
def _admit(st, sc, fs, e, t):
    driver.push_head(st, sc, 0, e)


@njit(cache=False)
def _evict(st, sc, fs, v, t):
    driver.unlink(st, sc, v)


@njit(cache=False)
def _bad_victim(st, sc, fs, e, t, stamp, g, res, size):
    return driver.head(sc, 0)  # the newest: may be the current group's


@njit(cache=False)
def _bad_loop(groups, starts, n_items, capacity, rows, sc0, fs0):
    return driver.run(groups, starts, n_items, capacity, rows, sc0, fs0, _init, _nop, _nop, _bad_victim, _evict, _admit)


class _Bad(HookedPolicy):
    name = "bad-test-rule"
    hooks = (_init, _nop, _nop, _bad_victim, _evict, _admit)
    loop = staticmethod(_bad_loop)


def test_a_protected_victim_is_refused_by_both_drivers():
    trace = ec.Trace.from_arrays(np.array([[[0, 1]], [[2, 3]]]), num_experts=4)
    with pytest.raises(Exception, match="not resident|requested by the current group"):
        ec.replay(trace, 3, _Bad(), engine="compiled")
    with pytest.raises(ec.ConfigError, match="requested by the current group"):
        ec.replay(trace, 3, _Bad(), engine="python")


def test_hooked_rule_without_capacity_is_one_line():
    p = ec.make_policy("sieve")
    with pytest.raises(ec.PolicyError, match="needs its capacity"):
        p.reset(4)


def test_compiled_loops_are_stamped_with_every_compiled_module():
    """A rule's cached loop inlines driver.run from another file: its cache stamp must cover that
    file too, or an edit of the engine would leave a stale compiled loop."""
    from expertcache import _jit
    from expertcache.policies import sieve

    if not _jit.AVAILABLE:
        pytest.skip("numba is off: nothing is cached")
    locator = sieve.loop._cache._impl.locator
    assert type(locator).__name__.startswith("Expertcache")
    assert locator.get_source_stamp()[1] == _jit.dependency_stamp()
