"""Learned eviction: causal features, labels, training, the scorer file, learned:/router-logit policies."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_bad_fields

from expertcache import Trace
from expertcache.cache import ExpertCache
from expertcache.errors import ConfigError, PolicyError
from expertcache.learn.dataset import build_dataset, collect, load_events, save_events
from expertcache.scorer.features import FEATURES, REUSE, FeatureState, feature_group
from expertcache.scorer.signals import DEFAULT_OFF, fit_tables
from expertcache.scorer.models import Scorer, fit, listwise
from expertcache.scorer.file import load_scorer, save_scorer
from expertcache.policies import make_policy
from expertcache.policies.learned import Learned
from expertcache.policies.lru import LRU
from expertcache.sim import build_layout, replay_layout


def rich_trace(T=120, L=3, E=10, k=2, seqs=1, seed=0) -> Trace:
    """A random trace with gate weights and router softmax; bursty so evictions have structure."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(size=(T, L, E))
    logits = 1.2 * noise + 0.15 * noise.cumsum(axis=0)
    rp = np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)
    ex = np.argsort(-rp, axis=2)[:, :, :k]
    probs = np.take_along_axis(rp, ex, axis=2)
    seq = np.repeat(np.arange(seqs), T // seqs)
    return Trace.from_arrays(ex, num_experts=E, seq=seq, probs=probs.astype(np.float32),
                             router_probs=rp.astype(np.float32))


def perturbed(tr: Trace, t0: int, seed=1) -> Trace:
    """Every request (and gate weight, router row) after row ``t0`` replaced."""
    other = rich_trace(tr.num_tokens, tr.num_layers, tr.num_experts, tr.top_k, tr.num_sequences, seed=seed)
    ex, pr, rp = tr.experts.copy(), tr.probs.copy(), tr.router_probs.copy()
    ex[t0 + 1:], pr[t0 + 1:], rp[t0 + 1:] = other.experts[t0 + 1:], other.probs[t0 + 1:], other.router_probs[t0 + 1:]
    return Trace.from_arrays(ex, num_experts=tr.num_experts, seq=tr.seq, probs=pr, router_probs=rp)


def with_signals(tr: Trace, t0: int | None = None) -> Trace:
    """``tr`` with model-side signal extras (token ids after ``t0``, next-token and hidden rows from ``t0``
    on, drawn from another seed when ``t0`` is given: a causal feature reads neither)."""
    T, rng, alt = tr.num_tokens, np.random.default_rng(3), np.random.default_rng(4)
    ex = {"token_ids": rng.integers(0, 9, T), "next_top_ids": rng.integers(0, 9, (T, 3)),
          "next_top_probs": rng.random((T, 3)).astype(np.float32) / 3, "hidden_summary": rng.normal(size=(T, 4))}
    if t0 is not None:
        for k, v in ex.items():
            a = t0 + 1 if k == "token_ids" else t0
            v[a:] = (alt.integers(0, 9, v[a:].shape) if v.dtype.kind == "i" else alt.random(v[a:].shape) / 3)
    return Trace.from_arrays(tr.experts, num_experts=tr.num_experts, seq=tr.seq, probs=tr.probs,
                             router_probs=tr.router_probs, extras=ex)


# ------------------------------------------------------------------------------------ causality
@pytest.mark.parametrize("pool", ["layer", "global"])
def test_features_do_not_see_the_future(pool):
    tr = rich_trace()
    t0 = 70
    pert = with_signals(perturbed(tr, t0), t0)
    tr = with_signals(tr)
    tables = fit_tables(with_signals(rich_trace(seed=9)))  # model-side tables, fitted on another trace
    causal = tuple(f for f in FEATURES if feature_group(f) not in DEFAULT_OFF)  # 'ahead'/'late' read later rows
    L = tr.num_layers
    out = []
    for trace in (tr, pert):
        lay = build_layout(trace, pool=pool)
        C = 5 if pool == "layer" else 5 * L
        ev = collect(lay, C, make_policy("lru"), causal, tables=tables)
        token = ev.step if pool == "layer" else ev.step // L
        out.append(ev.select(token <= t0))
    a, b = out
    assert a.num_events > 50
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.item, b.item)
    assert np.array_equal(a.X, b.X)  # every causal feature: gate, router and model-side signals included
    assert not np.array_equal(a.victim, b.victim)  # the labels do read the future: the test has teeth


def test_features_hand_computed():
    # E=4, C=2, one expert per token: 0 1 0 2 1 -> eviction at t=3 among {0, 1}
    tr = Trace.from_arrays(np.array([[0], [1], [0], [2], [1]]), num_experts=4)
    ev = collect(build_layout(tr), 2, make_policy("lru"), REUSE)
    assert ev.step.tolist() == [3, 4]  # lru evicts 1 at t=3 and misses it at t=4
    ev = ev.select(ev.step == 3)
    assert ev.item.tolist() == [0, 1]
    f = dict(zip(REUSE, ev.X.T))
    assert f["age"].tolist() == [1, 2] and f["count"].tolist() == [2, 1]
    assert np.allclose(f["rate"], [2 / 4, 1 / 3])
    assert np.allclose(f["decay_0.5"], [(0.25 + 1) * 0.5, 0.25])
    assert f["last_gap"].tolist() == [2, 0] and f["mean_gap"].tolist() == [2, 0]
    assert f["single_use"].tolist() == [0, 1] and f["since_load"].tolist() == [3, 2]
    assert ev.victim.tolist() == [True, False]  # 0 never again, 1 at t=4


def test_labels_are_the_farthest_next_use_set():
    tr = rich_trace(T=80, L=2, E=8, k=2, seed=3)
    lay = build_layout(tr)
    T = tr.num_tokens
    # brute force over each stream
    for l in range(2):
        groups = lay.groups[l * T:(l + 1) * T]
        sub = collect(build_layout(tr.select_layers([tr.layer_ids[l]])), 4, make_policy("decayed"), REUSE)
        assert sub.num_events > 20
        for i in range(sub.num_events):
            a, b = sub.offsets[i], sub.offsets[i + 1]
            t = sub.step[i]
            nu = [next((u for u in range(t + 1, T) if c in groups[u]), T) for c in sub.item[a:b]]
            assert sub.victim[a:b].tolist() == [x == max(nu) for x in nu]


@pytest.mark.parametrize("pool", ["layer", "global"])
def test_compiled_events_are_the_reference_bits(pool, monkeypatch):
    # every feature the compiled state computes (reuse, gate, router, online, prior), in lru's,
    # decayed's and a learned scorer's caches: the same events, bit for bit, as FeatureState's
    import expertcache.learn.dataset as dataset
    from expertcache.scorer.features import GATE, ONLINE, PRIOR, ROUTER

    tr = rich_trace(T=160, seqs=2, seed=4)
    tables = fit_tables(rich_trace(T=160, seqs=2, seed=8))
    names = REUSE + GATE + ROUTER + ONLINE + PRIOR
    lay = build_layout(tr, pool=pool)
    C = 4 if pool == "layer" else 4 * tr.num_layers
    ev = build_dataset(tr, C, states=("lru",), features="reuse", pool=pool)
    learner = Learned(fit(ev.X, ev.victim, ev.offsets, ev.features, kind="mlp", seed=0), "<learner>")
    inner = [lambda: make_policy("lru"), lambda: make_policy("decayed:0.9"), lambda: learner]
    want = [collect(lay, C, make(), names, 0, tables, reference=True) for make in inner]

    class Absent(FeatureState):  # the compiled path must not fall back to the reference
        def features(self, *a, **k):
            raise AssertionError("FeatureState used")

    monkeypatch.setattr(dataset, "FeatureState", Absent)
    for make, w in zip(inner, want):
        got = collect(lay, C, make(), names, 0, tables)
        assert got.num_events > 100
        for f in ("X", "victim", "offsets", "item", "step", "seq"):
            assert np.array_equal(getattr(got, f), getattr(w, f)), f


def test_training_products_in_index_order():
    # the MLP step's compiled products against their numpy twins (one term added at a time, the
    # same order): the same bits, any shape; and the products they name
    from expertcache.scorer import kernels_train as kt

    rng = np.random.default_rng(0)
    for N, F, H, n in [(50, 7, 32, 30), (9, 1, 1, 9), (40, 20, 2, 0), (300, 41, 5, 299), (6, 3, 64, 6)]:
        Z = rng.normal(size=(N, F)) * 10.0 ** rng.integers(-3, 4, size=(N, F))  # mixed magnitudes: order shows
        rows = np.sort(rng.choice(N, size=n, replace=False)).astype(np.int64)
        W1, b1, w2, ds = rng.normal(size=(F, H)), rng.normal(size=H), rng.normal(size=H), rng.normal(size=n)
        h = kt.pre_activation(Z, rows, W1, b1)
        assert np.array_equal(h, kt.pre_activation_numpy(Z, rows, W1, b1)) and h.shape == (n, H)
        assert np.allclose(h, Z[rows] @ W1 + b1)
        a = np.maximum(h, 0.0)
        got, twin = kt.mlp_backward(Z, rows, h, a, ds, w2), kt.mlp_backward_numpy(Z, rows, h, a, ds, w2)
        assert all(np.array_equal(x, y) for x, y in zip(got, twin))
        dh = ds[:, None] * w2 * (h > 0)
        for x, want in zip(got, (Z[rows].T @ dh, dh.sum(axis=0), a.T @ ds)):
            assert x.shape == want.shape and np.allclose(x, want)


def test_residency_inference_matches_the_cache():
    class Tracked(LRU):
        def reset(self, n_items, future=None, steps_per_token=1):
            super().reset(n_items, future, steps_per_token)
            self.state = FeatureState(n_items)

        def keys(self, candidates, t):
            k = super().keys(candidates, t)
            self.state.note_keys(candidates, k, t)
            return k

        def on_access(self, items, t):
            super().on_access(items, t)
            self.state.on_access(items, t)

    rng = np.random.default_rng(5)
    pol = Tracked()
    cache = ExpertCache(4, pol, 12)
    for _ in range(300):  # one request per step: the first eviction has no free slot, so it is exact
        cache.prepare([int(rng.integers(12))])
        assert np.flatnonzero(pol.state.resident).tolist() == cache.resident.tolist()


# ------------------------------------------------------------------------------------ models
def test_listwise_gradient_and_determinism():
    rng = np.random.default_rng(0)
    s = rng.normal(size=9)
    y = np.array([1, 0, 0, 0, 1, 1, 0, 0, 1], dtype=float)
    off = np.array([0, 3, 6, 9])
    loss, g = listwise(s, y, off)
    num = np.array([(listwise(s + 1e-6 * np.eye(9)[i], y, off)[0] - listwise(s - 1e-6 * np.eye(9)[i], y, off)[0]) / 2e-6
                    for i in range(9)])
    assert np.allclose(g, num, atol=1e-6)
    ev = build_dataset(rich_trace(T=60, seed=2), 5, states=("lru",))
    w1 = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="mlp", seed=4).weights
    w2 = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="mlp", seed=4).weights
    w3 = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="mlp", seed=5).weights
    assert all(np.array_equal(a, b) for a, b in zip(w1, w2))
    assert not np.array_equal(w1[0], w3[0])


def test_dataset_states_rounds_and_file(tmp_path):
    tr = rich_trace(T=60, seed=2)
    ev = build_dataset(tr, 5, states=("lru", "decayed"), rounds=1)
    assert ev.meta["states"] == ["lru", "decayed:0.95", "self-round1:linear"]
    assert sum(ev.meta["events_per_state"]) == ev.num_events and all(n > 0 for n in ev.meta["events_per_state"])
    save_events(ev, tmp_path / "ev.npz")
    back = load_events(tmp_path / "ev.npz")
    assert np.array_equal(back.X, ev.X) and back.features == ev.features and back.meta == ev.meta
    with pytest.raises(ConfigError, match="reads the future"):
        build_dataset(tr, 5, states=("belady",))
    assert list(tmp_path.iterdir()) == [tmp_path / "ev.npz"]
    # a file whose fields have the wrong shape or type, or whose meta nests without end, is one
    # ConfigError naming the field (they were a TypeError, an IndexError, a RecursionError)
    with np.load(tmp_path / "ev.npz", allow_pickle=False) as npz:
        good = {k: npz[k] for k in npz.files}
    for change, match in [({"meta": np.array("[" * 100_000 + "]" * 100_000)}, "'meta' is not JSON"),
                          ({"features": np.array("age")}, "'features' must be a 1-d list"),
                          ({"offsets": np.array(3)}, "'offsets' must be a 1-d array of integers"),
                          ({"offsets": np.array(["garbage"])}, "'offsets' must be a 1-d array of integers"),
                          ({"state": -good["state"] - 1}, "'state' holds a negative value")]:
        np.savez(tmp_path / "bad.npz", **{**good, **change})
        with pytest.raises(ConfigError, match=match):
            load_events(tmp_path / "bad.npz")


# ------------------------------------------------------------------------------------ policies
def _one_feature(name: str, w: float) -> Scorer:
    return Scorer("linear", (name,), np.zeros(1), np.ones(1), [np.array([w])])


@pytest.mark.parametrize("pool", ["layer", "global"])
def test_learned_reproduces_rules_in_both_pools(pool):
    tr = rich_trace(T=150, seed=4)
    lay = build_layout(tr, pool=pool)
    C = 5 if pool == "layer" else 14
    age = replay_layout(lay, C, Learned(_one_feature("age", 1.0), "age"))  # oldest goes first = lru
    assert age.engine == "compiled"  # kernels_learned; tests/test_learned_compiled.py checks it against python
    assert age.copies_steady == replay_layout(lay, C, "lru").copies_steady
    assert age.copies_total == replay_layout(lay, C, "lru", engine="python").copies_total
    dec = replay_layout(lay, C, Learned(_one_feature("decay_0.95", -1.0), "d"))  # lowest decayed count goes
    assert dec.copies_steady == replay_layout(lay, C, "decayed:0.95").copies_steady


def test_router_logit_evicts_lowest_current_probability():
    ex = np.array([[0], [1], [2]])
    for p0, p1, victim in ((0.1, 0.5, 0), (0.6, 0.2, 1)):
        rp = np.full((3, 1, 3), 0.3, dtype=np.float32)
        rp[2, 0, :2] = (p0, p1)
        tr = Trace.from_arrays(ex, num_experts=3, router_probs=rp)
        pol = make_policy("router-logit")
        from expertcache.trace.context import stream_context

        pol.set_context(stream_context(build_layout(tr), 0))
        cache = ExpertCache(2, pol, 3)
        steps = [cache.prepare(r) for r in ex]
        assert steps[2].evicted == [victim]
    with pytest.raises(PolicyError, match="router_probs"):
        replay_layout(build_layout(Trace.from_arrays(ex, num_experts=3)), 2, "router-logit")


def test_scorer_file_round_trip_and_errors(tmp_path):
    tr = rich_trace(T=60, seqs=2, seed=2)
    ev = build_dataset(tr, 5)
    sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="mlp", seed=0)
    assert "trans_h4" in sc.features  # the default features of two sequences include the routing priors
    with pytest.raises(ConfigError, match="carries no tables"):
        save_scorer(sc, tmp_path / "s.npz")
    assert not list(tmp_path.iterdir())
    sc.tables = ev.tables.full  # the tables of every training sequence (ev.tables: out of fold per sequence)
    path = save_scorer(sc, tmp_path / "s.npz")
    back = load_scorer(path)
    assert back.features == sc.features and all(np.array_equal(a, b) for a, b in zip(back.weights, sc.weights))
    lay = build_layout(tr)
    assert (replay_layout(lay, 5, f"learned:{path}").copies_steady == replay_layout(lay, 5, Learned(sc, "x")).copies_steady)
    with pytest.raises(ConfigError, match="no such file"):
        make_policy(f"learned:{tmp_path / 'missing.npz'}")
    (tmp_path / "t.npz").write_bytes(path.read_bytes()[:100])
    with pytest.raises(ConfigError, match="t.npz"):
        load_scorer(tmp_path / "t.npz")
    # files that are not archives: numpy calls a text file "pickled" and returns a .npy as one array
    (tmp_path / "notes.txt").write_text("hello\n")
    np.save(tmp_path / "one.npy", np.arange(4))
    for name, reason in (("notes.txt", r"not a numpy \.npz archive: it starts with b'hello"),
                         ("one.npy", r"a single \.npy array, not an \.npz archive")):
        with pytest.raises(ConfigError, match=f"not a scorer file \\({reason}"):
            load_scorer(tmp_path / name)
        with pytest.raises(ConfigError, match=f"not an events file \\({reason}"):
            load_events(tmp_path / name)
    assert_bad_fields(path, [("format_version", np.array(7), "format_version"), ("w1", None, "'w1' is missing"),
                             ("features", np.array(["age", "nope"] + list(sc.features[2:])), "unknown feature")],
                      load_scorer, tmp_path)
    # a scorer with gate features on a trace without probs: one PolicyError at the stream's start
    plain = Trace.from_arrays(tr.experts, num_experts=tr.num_experts, seq=tr.seq)
    with pytest.raises(PolicyError, match="probs"):
        replay_layout(build_layout(plain), 5, Learned(sc, "x"))


# ------------------------------------------------------------------------------------ CLI
def test_cli_dataset_train_replay_eval(tmp_path, capsys):
    from expertcache.cli.main import main

    tr = rich_trace(T=160, L=2, E=12, k=2, seqs=4, seed=7)
    tr.save(tmp_path / "t.npz")
    t, ev, sc = (str(tmp_path / n) for n in ("t.npz", "ev.npz", "sc.npz"))
    assert main(["learn", "dataset", t, "-c", "5", "--states", "lru,self", "--rounds", "1", "--out", ev, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["states"] == ["lru", "self-round1:linear"]
    assert main(["learn", "train", ev, "--model", "linear", "--out", sc, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "linear"
    assert main(["replay", t, "-c", "5", "-p", f"learned:{sc}", "-p", "router-logit", "--pool", "layer", "--json"]) == 0
    assert [json.loads(x)["policy"] for x in capsys.readouterr().out.splitlines()] == [f"learned:{sc}", "router-logit"]
    assert main(["learn", "eval", "--traces", t, "-c", "5,1,12", "--folds", "2", "--seeds", "0", "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    rows = {r["policy"]: r for r in recs if "policy" in r}
    assert rows["belady"]["gap_recovered"] == 1.0 and rows["lru"]["gap_recovered"] == 0.0
    assert {"learned linear", "learned mlp", "shuffled control (mlp)", "decayed (tuned)", "foresight:4"} <= set(rows)
    assert len([r for r in recs if "skipped" in r]) == 2
    assert main(["replay", t, "-c", "5", "-p", f"learned:{tmp_path / 'none.npz'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "none.npz" in err


def test_protocol_on_a_shared_trace():
    from conftest import SHARED_TRACES
    from expertcache.learn.protocol import evaluate
    from expertcache.trace import load_trace

    path = SHARED_TRACES / "switch-base-8-encoder" / "routing.npz"
    if not path.is_file():
        pytest.skip("../shared/traces is not beside this checkout")
    res = evaluate(load_trace(path), 4, folds=2, seeds=(0,))
    rows = {r["policy"]: r for r in res["rows"]}
    assert sorted(sum((f["held_out"] for f in res["folds"]), [])) == list(range(10))  # each sequence once
    for f in res["folds"]:
        assert not set(f["held_out"]) & set(f["train"])
    assert rows["lru"]["gap_recovered"] == 0 and rows["belady"]["gap_recovered"] == 1
    fs = [rows[f"foresight:{h}"]["copies_steady"] for h in (1, 2, 4)]
    assert rows["lru"]["copies_steady"] >= fs[0] >= fs[1] >= fs[2] >= rows["belady"]["copies_steady"]


def test_replay_heldout_sequences_are_the_ones_the_scorer_never_saw(tmp_path, capsys):
    """learn dataset --sequences 0-1 -> learn train -> replay --sequences heldout replays sequences 2, 3."""
    import expertcache as ec
    from expertcache.cli.main import main

    rng = np.random.default_rng(5)
    ex = np.stack([[rng.choice(12, 2, replace=False) for _ in range(2)] for _ in range(80)])
    path = ec.Trace.from_arrays(ex, np.repeat([0, 1, 2, 3], 20), num_experts=12).save(tmp_path / "t.npz")
    ev, sc = tmp_path / "ev.npz", tmp_path / "sc.npz"
    assert main(["learn", "dataset", str(path), "-c", "4", "--sequences", "0-1", "--out", str(ev), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["sequences"] == [0, 1] and rec["trace_sequences"] == 4
    assert main(["learn", "train", str(ev), "--out", str(sc)]) == 0
    capsys.readouterr()
    assert main(["replay", str(path), "-c", "4", "-p", f"learned:{sc}", "-p", "lru", "--sequences", "heldout",
                 "--json"]) == 0
    got = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    held = ec.load_trace(path).select_sequences([2, 3])
    for r in got:
        direct = ec.replay(held, 4, make_policy(r["policy"]))
        assert (r["tokens"], r["copies_total"], r["copies_steady"]) == (40, direct.copies_total, direct.copies_steady)
    for argv, message in ((["-p", "lru", "--sequences", "heldout"], "no learned policy"),
                          (["-p", "lru", "--sequences", "7"], "beyond the 4 sequence"),
                          (["-p", f"learned:{sc}", "--sequences", "heldout", "--layers", "0"], None)):
        code = main(["replay", str(path), "-c", "4", *argv])
        err = capsys.readouterr().err
        if message is None:
            assert code == 0
        else:
            assert code == 2 and message in err and err.count("\n") == 1
    # a scorer trained on every sequence leaves nothing held out
    assert main(["learn", "dataset", str(path), "-c", "4", "--out", str(ev)]) == 0
    assert main(["learn", "train", str(ev), "--out", str(sc)]) == 0
    capsys.readouterr()
    assert main(["replay", str(path), "-c", "4", "-p", f"learned:{sc}", "--sequences", "heldout"]) == 2
    assert "trained on every sequence" in capsys.readouterr().err
