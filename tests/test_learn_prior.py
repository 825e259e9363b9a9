"""The ``prior`` feature group (routing popularity and transition tables fitted on training sequences)
and the ``online`` group (transitions counted on the stream's own past)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_bad_fields

from expertcache import Trace
from expertcache.cli.main import main
from expertcache.errors import ConfigError
from expertcache.learn.dataset import build_dataset, collect, load_events, resolve_features, save_events
from expertcache.scorer.features import FEATURES, ONLINE, PRIOR, feature_group
from expertcache.scorer.models import fit
from expertcache.scorer.signals import TRANS_MAX_BYTES, trans_bytes
from expertcache.scorer.file import load_scorer, save_scorer
from expertcache.scorer.signals import fit_folded, fit_tables, halved
from expertcache.policies import make_policy
from expertcache.policies.learned import Learned
from expertcache.sim import build_layout, replay_layout


def test_tables_and_features_hand_computed():
    # one layer, E=4, k=1: 0 1 0 1 2 0 in one sequence; C=2 under LRU evicts at t=4 and t=5
    tr = Trace.from_arrays(np.array([[0], [1], [0], [1], [2], [0]]), num_experts=4)
    t = fit_tables(tr)
    assert t.vocab.size == 0 and t.tok.shape == (1, 0, 4)  # no token ids: the priors only
    assert np.allclose(t.prior[0], [3 / 6, 2 / 6, 1 / 6, 0])
    h1 = 0  # HORIZONS[0] == 1: rows 0..4 have a next row; pairs 0>1, 1>0, 0>1, 1>2, 2>0
    assert np.allclose(t.succ_prior[h1, 0], [2 / 5, 2 / 5, 1 / 5, 0])
    sp = t.succ_prior[h1, 0]
    want = {(0, 1): (2 + sp[1]) / 3, (1, 0): (1 + sp[0]) / 3, (2, 0): (1 + sp[0]) / 2, (2, 1): sp[1] / 2,
            (3, 2): sp[2] / 1, (0, 2): sp[2] / 3}
    for (a, e), v in want.items():
        assert t.trans[h1, 0, a, e] == pytest.approx(v, rel=1e-6)
    ev = collect(build_layout(tr), 2, make_policy("lru"), PRIOR, tables=t)
    assert ev.step.tolist() == [4, 5]
    f = dict(zip(PRIOR, ev.X.T))
    # t=4: the group being served is [2]; candidates 0, 1.  t=5: group [0]; candidates 1, 2
    assert ev.item.tolist() == [0, 1, 1, 2]
    assert np.allclose(f["pop"], [3 / 6, 2 / 6, 2 / 6, 1 / 6])
    assert np.allclose(f["trans_h1"], [t.trans[h1, 0, 2, 0], t.trans[h1, 0, 2, 1], t.trans[h1, 0, 0, 1],
                                       t.trans[h1, 0, 0, 2]], rtol=1e-6)
    assert f["trans_h1"][0] == pytest.approx((1 + 2 / 5) / 2, rel=1e-6)


def test_global_pool_reads_each_layers_latest_group():
    # two layers, E=2, k=1; global pool of 2 slots, items l*2+e: 0 (l0e0), 3 (l1e1), then 1 (l0e1) misses
    ex = np.array([[[0], [1]], [[1], [0]], [[0], [0]], [[1], [1]]])
    tr = Trace.from_arrays(ex, num_experts=2)
    t = fit_tables(tr)
    ev = collect(build_layout(tr, pool="global"), 2, make_policy("lru"), PRIOR, tables=t)
    first = ev.select(ev.step == 2)
    assert first.item.tolist() == [0, 3]
    got = dict(zip(PRIOR, first.X.T))
    # item 0 (layer 0): the latest layer-0 group is the one being served, [e1]; item 3 (layer 1): row 0's [e1]
    assert np.allclose(got["trans_h1"], [t.trans[0, 0, 1, 0], t.trans[0, 1, 1, 1]], rtol=1e-6)
    assert np.allclose(got["pop"], [t.prior[0, 0], t.prior[1, 1]])


def test_online_transitions_hand_computed():
    # one layer, E=4, k=1: 0 1 0 1 2 0 in one sequence; LRU with C=2 evicts at t=4 (group [2]) and t=5 ([0])
    tr = Trace.from_arrays(np.array([[0], [1], [0], [1], [2], [0]]), num_experts=4)
    ev = collect(build_layout(tr), 2, make_policy("lru"), ONLINE)
    assert ev.step.tolist() == [4, 5] and ev.item.tolist() == [0, 1, 1, 2]
    # at t=4 (steps 0..4 counted): pairs 0>1, 1>0, 0>1, 1>2; N[2] = 0; q = use / 5 steps
    q4 = {0: 2 / 5, 1: 2 / 5}
    want4 = [(0 + q4[0]) / (0 + 1), (0 + q4[1]) / (0 + 1)]  # a = 2 has no successor yet
    # at t=5: pair 2>0 added; latest group [0]: M[0,1] = 2, N[0] = 2; M[0,2] = 0
    q5 = {1: 2 / 6, 2: 1 / 6}
    want5 = [(2 + q5[1]) / (2 + 1), (0 + q5[2]) / (2 + 1)]
    assert np.allclose(ev.X[:, 0], want4 + want5, rtol=1e-6)  # events store float32


def test_prior_and_online_are_causal_and_in_the_leakage_test():
    causal = [f for f in FEATURES if feature_group(f) not in ("ahead", "late")]
    assert set(PRIOR + ONLINE) <= set(causal)  # tests/test_learn.py::test_features_do_not_see_the_future covers them


def test_halved_gives_single_sequences_out_of_fold_tables():
    rng = np.random.default_rng(0)
    tr = Trace.from_arrays(rng.integers(0, 6, (40, 2, 1)), num_experts=6)
    h = halved(tr)
    assert h.num_sequences == 2 and h.seq_bounds.tolist() == [0, 20, 40]
    assert np.array_equal(h.experts, tr.experts) and halved(h) is h
    ft = fit_folded(h)
    a, b = ft.for_stream(int(h.seq[0])), ft.for_stream(int(h.seq[-1]))
    assert np.allclose(a.prior, fit_tables(h.select_sequences([1])).prior)  # first half's tables: the second half's rows
    assert np.allclose(b.prior, fit_tables(h.select_sequences([0])).prior)
    ev = build_dataset(tr, 3, states=("lru",), features="reuse,prior")
    assert set(ev.seq.tolist()) == {0, 1}  # events from both halves


def test_default_features_and_size_limit():
    small = Trace.from_arrays(np.zeros((4, 2, 1), dtype=np.int64), num_experts=8, seq=[0, 0, 1, 1])
    assert set(PRIOR + ONLINE) <= set(resolve_features(small))
    one = small.select_sequences([0])  # one sequence: no out-of-fold tables by default (halves transfer too well)
    assert set(ONLINE) <= set(resolve_features(one)) and not set(PRIOR) & set(resolve_features(one))
    assert set(PRIOR) <= set(resolve_features(one, "reuse,prior"))
    huge = Trace.from_arrays(np.zeros((2, 33, 1), dtype=np.int64), num_experts=512)  # 8 * 33 * 512^2 > 64 MB
    assert not set(ONLINE) & set(resolve_features(huge))
    with pytest.raises(ConfigError, match="group 'online' needs a table of at most 64 MB"):
        resolve_features(huge, "reuse,online")
    L = TRANS_MAX_BYTES // trans_bytes(1, 512) + 1
    big = Trace.from_arrays(np.zeros((2, L, 1), dtype=np.int64), num_experts=512, seq=[0, 1])
    assert not set(PRIOR) & set(resolve_features(big))  # the default leaves it out
    with pytest.raises(ConfigError, match="group .prior. needs a table of at most 16 MB"):
        resolve_features(big, "reuse,prior")
    assert fit_tables(big).trans is None


def test_scorer_and_events_files_carry_the_transitions(tmp_path):
    rng = np.random.default_rng(1)
    tr = Trace.from_arrays(np.argsort(rng.random((90, 2, 8)), axis=2)[:, :, :2], num_experts=8,
                           seq=np.repeat([0, 1, 2], 30))
    ev = build_dataset(tr, 4, states=("lru", "decayed"), features="reuse,prior")
    sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="linear", seed=0)
    sc.tables = ev.tables.full
    path = save_scorer(sc, tmp_path / "s.npz")
    back = load_scorer(path)
    assert np.array_equal(back.tables.trans, sc.tables.trans)
    lay = build_layout(tr)
    r = replay_layout(lay, 4, f"learned:{path}")
    assert r.engine == "compiled" and r.copies_steady == replay_layout(lay, 4, Learned(sc, "x")).copies_steady
    assert_bad_fields(path, [("sig_trans", None, "'sig_trans' is missing"),
                             ("sig_trans", lambda a: a[:, :1], "'sig_trans' has shape"),
                             ("sig_trans", lambda a: a + 1.5, "outside"),
                             ("format_version", np.array(1), "version 1")], load_scorer, tmp_path)
    save_events(ev, tmp_path / "ev.npz")
    assert load_events(tmp_path / "ev.npz").tables.trans is not None


def test_cli_learn_with_prior(tmp_path, capsys):
    rng = np.random.default_rng(2)
    tr = Trace.from_arrays(rng.integers(0, 8, (120, 2, 1)), num_experts=8, seq=np.repeat([0, 1, 2, 3], 30))
    t, ev, sc = (str(tmp_path / n) for n in ("t.npz", "ev.npz", "sc.npz"))
    tr.save(t)
    assert main(["learn", "dataset", t, "-c", "3", "--features", "reuse,prior", "--out", ev, "--json"]) == 0
    capsys.readouterr()
    assert main(["learn", "train", ev, "--out", sc, "--json"]) == 0
    capsys.readouterr()
    assert main(["replay", t, "-c", "3", "-p", f"learned:{sc}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == f"learned:{sc}"
    assert main(["learn", "eval", "--traces", t, "-c", "3", "--seeds", "0", "--rounds", "0", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert "trans_h4" in rows[0]["folds"][0]["features"]
