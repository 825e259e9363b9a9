"""The compiled plan of ``learned:`` scorers (kernels_learned) against the Python engine.

Three paths: the compiled loop (its own residents, the compiled feature state of
kernels_feature_state); the Python engine driving :class:`~expertcache.policies.learned.Learned`
through the reference cache (:class:`~expertcache.cache.ExpertCache`) with the same compiled
feature state (:class:`~expertcache.scorer.kernels_live.LiveFeatures`, the live harness's
path); and the Python engine with ``reference=True``, which follows the stream with
:class:`~expertcache.scorer.features.FeatureState`, the independent Python implementation. Counts
must be equal group for group (not approximately) for every scorer kind and feature set, in both
pools, with warm windows, both reset modes and second-request admission.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from expertcache import Trace
from expertcache.errors import PolicyError
from expertcache.learn.dataset import build_dataset
from expertcache.scorer.features import GATE, ONLINE, PRIOR, REUSE, ROUTER, FeatureState
from expertcache.scorer.signals import fit_folded, fit_tables
from expertcache.scorer.models import Scorer, fit
from expertcache.scorer.file import save_scorer
from expertcache.scorer.kernels_learned import decayed, log1p_each, score_rows
from expertcache.policies import make_policy
from expertcache.policies.learned import Learned
from expertcache.sim import build_layout, replay_layout
from expertcache.sim.parallel import is_stream_local, replay_streams_parallel
from expertcache.sim.replay import _python_loop
from expertcache.kernels import pool_slots


def routed_trace(T=150, L=3, E=12, k=2, seqs=3, seed=0) -> Trace:
    """Bursty random routing with gate weights and a router softmax (test_learn's generator)."""
    from test_learn import rich_trace

    return rich_trace(T=T, L=L, E=E, k=k, seqs=seqs, seed=seed)


def random_scorer(features, kind, rng, hidden=8) -> Scorer:
    F = len(features)
    mean, scale = rng.normal(size=F), rng.uniform(0.5, 3.0, F)
    if kind == "linear":
        weights = [rng.normal(size=F)]
    else:
        weights = [rng.normal(size=(F, hidden)), rng.normal(size=hidden), rng.normal(size=hidden)]
    return Scorer(kind=kind, features=tuple(features), mean=mean, scale=scale, weights=weights)


def reference(policy: Learned) -> Learned:
    """The same scorer following the stream with FeatureState (the independent Python implementation)."""
    return Learned(policy.scorer, policy.path, reference=True)


def python_paths(layout, capacity, policy):
    """Per-group (misses, evictions) of the Python engine with the live compiled state and with
    FeatureState; asserts they are equal and that each path really ran its state."""
    slots = pool_slots(layout, capacity)
    live = _python_loop(layout, slots, policy)
    assert policy._live
    ref_policy = reference(policy)
    ref = _python_loop(layout, slots, ref_policy)
    assert not ref_policy._live
    assert np.array_equal(live[0], ref[0]) and np.array_equal(live[1], ref[1])
    return live


def assert_same(layout, capacity, policy):
    """Per-group misses and evictions equal on the three paths; the compiled one really ran."""
    plan = policy.plan(layout)
    assert plan is not None
    got = plan.run(layout, capacity)
    want = python_paths(layout, capacity, policy)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    b = replay_layout(layout, capacity, policy)  # replay picks the plan (the tally is the engines' common code)
    assert b.engine == "compiled"
    return b


FEATURE_SETS = {
    "reuse": REUSE,
    "all": REUSE + GATE + ROUTER + ONLINE + PRIOR,
    "prior": ("age",) + PRIOR,  # transition rows averaged over each layer's latest group
    "online": ("age",) + ONLINE,  # the stream's own pair counts
    "gate": REUSE[:3] + GATE,
    "router": ("age",) + ROUTER,
    "since_load": ("since_load",),  # the counts then hang on the residency inference alone
    "decays": tuple(f for f in REUSE if f.startswith("decay")),
}


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("fset", sorted(FEATURE_SETS))
def test_compiled_equals_python_on_synth(kind, fset):
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{fset}".encode()))
    names = FEATURE_SETS[fset]
    for seed in range(2):
        tr = routed_trace(seed=seed)
        L = tr.num_layers
        scorer = random_scorer(names, kind, rng)
        scorer.tables = fit_tables(routed_trace(seed=seed + 5)) if seed == 0 else fit_folded(tr)
        pol = Learned(scorer, f"{kind}-{fset}-{seed}")
        for pool, reset, warm, adm in (("layer", "sequence", 0.0, "all"), ("global", "sequence", 0.3, "all"),
                                       ("layer", "none", 0.25, "all"), ("global", "none", 0.0, "second"),
                                       ("layer", "sequence", 0.0, "second")):
            layout = build_layout(tr, pool=pool, reset=reset, warm=warm, admission=adm)
            for C in ((2, 3, 5, 9) if pool == "layer" else (2 * L, 4 * L, 7 * L)):
                r = assert_same(layout, C, pol)
                assert r.copies_steady > 0 or C >= layout.n_items


def test_ties_and_trained_scorers():
    tr = routed_trace(T=240, seqs=4, seed=7)
    zero = Scorer("linear", REUSE, np.zeros(len(REUSE)), np.ones(len(REUSE)), [np.zeros(len(REUSE))])
    count_only = Scorer("linear", ("count", "single_use"), np.zeros(2), np.ones(2), [np.array([-1.0, 1.0])])
    layout = build_layout(tr)
    # all scores tie: least recently used, then smallest id, i.e. LRU's counts
    r = assert_same(layout, 4, Learned(zero, "zero"))
    assert r.copies_steady == replay_layout(layout, 4, "lru").copies_steady
    assert_same(layout, 4, Learned(count_only, "count"))  # integer scores: many exact ties
    mlp = Learned(random_scorer(REUSE, "mlp", np.random.default_rng(9)), "short tables")
    for pool, C in (("layer", 4), ("global", 9)):
        lay = build_layout(tr, pool=pool, reset="none")
        plan = mlp.plan(lay)
        plan.table_max = 3  # ages and counts beyond the tables: computed, the same bits
        want = python_paths(lay, C, mlp)
        got = plan.run(lay, C)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    for pool, C in (("layer", 5), ("global", 12)):
        ev = build_dataset(tr, C, states=("lru", "decayed"), rounds=1, pool=pool)
        assert set(PRIOR) <= set(ev.features)
        for kind in ("linear", "mlp"):
            sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind=kind, seed=1)
            sc.tables = ev.tables.full
            assert_same(build_layout(tr, pool=pool), C, Learned(sc, kind))


def test_compiled_equals_python_on_a_shared_trace():
    from conftest import shared_trace_paths
    from expertcache.trace import load_trace

    paths = [p for p in shared_trace_paths() if p.parent.name.startswith(("switch", "mixtral-8x7b-inferred", "flame"))]
    if not paths:
        pytest.skip("../shared/traces is not beside this checkout")
    rng = np.random.default_rng(3)
    for path in paths:
        tr = load_trace(path)
        if tr.num_sequences > 2:
            tr = tr.select_sequences([0, 1])
        if tr.num_layers > 3:
            tr = tr.select_layers(list(tr.layer_ids[:3]))
        names = REUSE + (GATE if tr.probs is not None else ()) + ONLINE + PRIOR
        k, E, L = tr.top_k, tr.num_experts, tr.num_layers
        caps = [c for c in (k + 1, (k + E) // 2, E - 1) if k <= c < E]
        tables = fit_tables(tr)
        for seed in range(2):
            ev = build_dataset(tr, caps[0], states=("lru",), features="reuse,online,prior")
            trained = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="linear", seed=seed)
            for sc in (trained, random_scorer(names, "mlp", rng), random_scorer(names, "linear", rng)):
                sc.tables = tables
                pol = Learned(sc, "shared")
                for C in caps:
                    assert_same(build_layout(tr), C, pol)
                assert_same(build_layout(tr, pool="global", warm=0.2), caps[0] * L, pol)


def test_features_match_feature_state_bits():
    """FeatureState's numbers go through the same scalar helpers the loop uses."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 300, 50)
    d = rng.uniform(0, 5, (4, 50))
    lr = -np.log(np.array([0.5, 0.8, 0.95, 0.99]))
    assert log1p_each(x).tolist() == [math.log1p(v) for v in x]
    assert np.allclose(log1p_each(x), np.log1p(x), rtol=1e-15)
    assert np.allclose(decayed(d, lr, x), d * np.exp(-lr[:, None] * x[None, :]), rtol=1e-14, atol=0)
    st = FeatureState(6)
    for t, items in enumerate([[0, 1], [2], [0, 3], [4], [1, 0]]):
        st.on_access(np.array(items), t)
    X = st.features(np.array([0, 1, 2, 3, 4]), 5, REUSE)
    sc = random_scorer(REUSE, "mlp", rng)
    pol = Learned(sc, "x")
    want = np.einsum("nh,h->n", np.maximum(np.einsum("nf,fh->nh", (X - sc.mean) / sc.scale, sc.weights[0])
                                           + sc.weights[1], 0.0), sc.weights[2])
    assert np.allclose(score_rows(X, pol._mean, pol._scale, *pol._weights), want, rtol=1e-12)


def test_no_plan_falls_back_or_reports():
    tr = routed_trace()
    bare = Trace.from_arrays(tr.experts, num_experts=tr.num_experts, seq=tr.seq)
    gate = Learned(random_scorer(REUSE + GATE, "linear", np.random.default_rng(0)), "g")
    assert gate.plan(build_layout(tr)) is not None
    assert gate.plan(build_layout(bare)) is None  # the Python engine names the missing field
    with pytest.raises(PolicyError, match="probs"):
        replay_layout(build_layout(bare), 4, gate)
    odd = Scorer("linear", ("age", "not_compiled"), np.zeros(2), np.ones(2), [np.ones(2)])
    assert Learned(odd, "odd").plan(build_layout(tr)) is None


def test_reuse_scorer_file_replays_in_parallel(tmp_path):
    tr = routed_trace(T=200, seqs=4, seed=2)
    rng = np.random.default_rng(1)
    path = save_scorer(random_scorer(REUSE, "mlp", rng), tmp_path / "s.npz")
    pol = make_policy(f"learned:{path}")
    assert is_stream_local(pol) and not pol.wants_context
    gate = make_policy(f"learned:{save_scorer(random_scorer(REUSE + GATE + ROUTER, 'linear', rng), tmp_path / 'g.npz')}")
    assert not is_stream_local(gate) and gate.wants_context
    layout = build_layout(tr)
    par = replay_streams_parallel(layout, 4, [pol, gate, "lru"], jobs=2)
    ser = [replay_layout(layout, 4, p) for p in (pol, gate, "lru")]
    assert [(r.policy, r.copies_total, r.copies_steady) for r in par] == \
           [(r.policy, r.copies_total, r.copies_steady) for r in ser]
