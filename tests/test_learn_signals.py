"""Model-side signals: the capture records them, traces validate them, features use them causally,
scorer files carry their routing tables (issue 12, items 1 and 6)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, assert_bad_fields
from expertcache import Trace, load_trace
from expertcache.cli.main import main
from expertcache.errors import ConfigError, PolicyError, TraceError
from expertcache.learn.dataset import build_dataset, collect
from expertcache.scorer.features import GROUPS, FeatureState
from expertcache.scorer.models import fit
from expertcache.scorer.file import load_scorer, save_scorer
from expertcache.scorer.signals import ALPHA, FoldedTables, fit_folded, fit_tables
from expertcache.policies import make_policy
from expertcache.trace.context import stream_context
from expertcache.policies.learned import Learned
from expertcache.sim import build_layout, replay_layout

MODEL = REPO / "models" / "small-moe"
CAUSAL = GROUPS["token"] + GROUPS["next"] + GROUPS["hidden"]


def signal_trace(T=120, L=3, E=10, k=2, seqs=2, V=12, M=4, D=5, seed=0) -> Trace:
    """Routing that depends on the token id (so the tables mean something), with every signal extra."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, V, T)
    pref = np.random.default_rng(99).normal(size=(V, L, E)) * 2.0  # the same token -> routing map for every seed
    logits = pref[tok] + rng.normal(size=(T, L, E))
    rp = np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)
    ex = np.argsort(-rp, axis=2)[:, :, :k]
    p = rng.random((T, M)) + 0.05
    p = -np.sort(-p / p.sum(axis=1, keepdims=True) * 0.9, axis=1)
    extras = {"token_ids": tok, "next_top_ids": np.stack([rng.choice(V, M, replace=False) for _ in range(T)]),
              "next_top_probs": p.astype(np.float32), "hidden_summary": rng.normal(size=(T, D)).astype(np.float16)}
    return Trace.from_arrays(ex, num_experts=E, seq=np.repeat(np.arange(seqs), T // seqs),
                             probs=np.take_along_axis(rp, ex, axis=2).astype(np.float32),
                             router_probs=rp.astype(np.float32), extras=extras)


def perturb(tr: Trace, t0: int, ids_after: int | None = None, seed=7) -> Trace:
    """Requests and token ids after row ``t0`` (token ids after ``ids_after`` when given), and next-token
    and hidden rows from ``t0`` on (they exist only after row t0's last layer), replaced."""
    o = signal_trace(tr.num_tokens, tr.num_layers, tr.num_experts, tr.top_k, tr.num_sequences, seed=seed)
    ex, pr, rp = tr.experts.copy(), tr.probs.copy(), tr.router_probs.copy()
    ex[t0 + 1:], pr[t0 + 1:], rp[t0 + 1:] = o.experts[t0 + 1:], o.probs[t0 + 1:], o.router_probs[t0 + 1:]
    extras = {k: v.copy() for k, v in tr.extras.items()}
    a = t0 if ids_after is None else ids_after
    extras["token_ids"][a + 1:] = (o.extras["token_ids"][a + 1:] + 1) % 12
    for k in ("next_top_ids", "next_top_probs", "hidden_summary"):
        extras[k][t0:] = o.extras[k][t0:]
    return Trace.from_arrays(ex, num_experts=tr.num_experts, seq=tr.seq, probs=pr, router_probs=rp, extras=extras)


# ------------------------------------------------------------------------------------ causality
@pytest.mark.parametrize("pool", ["layer", "global"])
@pytest.mark.parametrize("groups,lookahead", [(CAUSAL, 0), (GROUPS["ahead"], 8)])
def test_model_features_do_not_see_the_future(pool, groups, lookahead):
    tables = fit_tables(signal_trace(seed=5))  # fitted elsewhere: the tables do not move with the perturbation
    tr = signal_trace(seqs=1)
    t0 = 70
    L = tr.num_layers
    out = []
    # 'ahead' reads the input ids of the next 8 rows: only ids beyond row t0 + 8 are perturbed for it
    for trace in (tr, perturb(tr, t0, ids_after=t0 + lookahead if lookahead else None)):
        lay = build_layout(trace, pool=pool)
        ev = collect(lay, 5 if pool == "layer" else 5 * L, make_policy("lru"), groups, tables=tables)
        token = ev.step if pool == "layer" else ev.step // L
        out.append(ev.select(token <= t0))
    a, b = out
    assert a.num_events > 30 and np.array_equal(a.item, b.item)
    assert np.array_equal(a.X, b.X)
    assert not np.array_equal(a.victim, b.victim)


def test_late_diagnostic_does_read_the_current_rows_forecast():
    tables = fit_tables(signal_trace(seed=5))
    tr = signal_trace(seqs=1)
    ev = [collect(build_layout(t), 5, make_policy("lru"), GROUPS["late"], tables=tables) for t in (tr, perturb(tr, 70))]
    a, b = (e.select(e.step == 70) for e in ev)
    assert a.num_events and not np.array_equal(a.X, b.X)  # that is why 'late' is not causal


# ------------------------------------------------------------------------------------ tables, features
def test_tables_and_features_hand_computed():
    # one layer, E=3, k=1; tokens 0 1 0 1 2 route to experts 0 1 0 2 1
    tr = Trace.from_arrays(np.array([[0], [1], [0], [2], [1]]), num_experts=3,
                           extras={"token_ids": np.array([0, 1, 0, 1, 2])})
    t = fit_tables(tr)
    prior = np.array([2, 2, 1]) / 5
    assert np.allclose(t.prior[0], prior) and t.vocab.tolist() == [0, 1, 2]
    assert np.allclose(t.tok[0, 0], (np.array([2, 0, 0]) + ALPHA * prior) / (2 + ALPHA))  # token 0: expert 0 twice
    assert np.allclose(t.tok[0, 1], (np.array([0, 1, 1]) + ALPHA * prior) / (2 + ALPHA))
    # h=1 successor: rows 0..3 have a next row; token 0 -> next experts {1}, {2}; token 1 -> {0}, {1}
    sp = np.array([1, 2, 1]) / 4
    assert np.allclose(t.succ_prior[0, 0], sp)
    assert np.allclose(t.succ[0, 0, 0], (np.array([0, 1, 1]) + ALPHA * sp) / (2 + ALPHA))
    assert np.all(t.succ_prior[2] == 0)  # h=16: no row of a 5-row sequence has a whole window
    # features at an eviction of row 3 (C=2: experts 0, 1 resident, 2 requested): tok_now of token 1
    ctx = stream_context(build_layout(tr), 0)
    st = FeatureState(3, ctx, 1, t)
    X = st.features(np.array([0, 1]), 3, ("tok_now", "tok_h1", "ahead_1", "ahead_2"))
    assert np.allclose(X[:, 0], t.tok[0, 1, [0, 1]]) and np.allclose(X[:, 1], t.succ[0, 0, 1, [0, 1]])
    assert np.allclose(X[:, 2], t.tok[0, 2, [0, 1]]) and np.allclose(X[:, 3], X[:, 2])  # row 5 is past the end
    # an unseen token id falls back to the layer's marginal
    assert t.vocab_index(np.array([7, 2])).tolist() == [-1, 2]


def test_folded_tables_leave_each_sequences_fold_out():
    tr = signal_trace(T=160, seqs=4)
    ft = fit_folded(tr)
    assert isinstance(ft, FoldedTables) and sorted(ft.by_seq) == [0, 1, 2, 3]
    own = fit_tables(tr.select_sequences([2, 3]))
    assert np.array_equal(ft.for_stream(0).tok, own.tok) and ft.for_stream(9) is ft.full


# ------------------------------------------------------------------------------------ scorer file, errors
def test_scorer_round_trip_with_tables_and_errors(tmp_path, capsys):
    tr = signal_trace(seed=3)
    ev = build_dataset(tr, 5, features="reuse,token,next,hidden")
    assert set(CAUSAL) <= set(ev.features) and ev.tables is not None
    sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="linear", seed=0)
    sc.tables = ev.tables
    path = save_scorer(sc, tmp_path / "s.npz")
    back = load_scorer(path)
    assert np.array_equal(back.tables.tok, ev.tables.full.tok) and np.allclose(back.tables.hid, ev.tables.full.hid)
    lay = build_layout(tr)
    assert replay_layout(lay, 5, f"learned:{path}").copies_steady == replay_layout(lay, 5, Learned(back, "x")).copies_steady
    assert_bad_fields(path, [("sig_tok", None, "'sig_tok' is missing"), ("format_version", np.array(1), "version 1"),
                             ("sig_succ", lambda a: a[:1], "'sig_succ' has shape")], load_scorer, tmp_path)
    # a trace without the signals: one line naming the missing extra, at the stream's start
    plain = Trace.from_arrays(tr.experts, num_experts=tr.num_experts, seq=tr.seq)
    with pytest.raises(PolicyError, match="token_ids"):
        replay_layout(build_layout(plain), 5, Learned(back, "x"))
    plain.save(tmp_path / "plain.npz")
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "plain.npz"), "-c", "5", "-p", f"learned:{path}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "token_ids" in err


@pytest.mark.parametrize("name,value,match", [
    ("token_ids", np.zeros(10, dtype=np.float32), "token_ids: expected integer shape"),
    ("token_ids", np.zeros(9, dtype=np.int64), r"token_ids: expected integer shape \(10,\)"),
    ("token_ids", np.r_[np.zeros(9), -3].astype(np.int64), "id -3 at row 9 is negative"),
    ("next_top_ids", np.zeros((10, 2), dtype=np.float32), "next_top_ids: expected an integer dtype"),
    ("next_top_probs", np.full((10, 2), 1.5, dtype=np.float32), "next_top_probs: value 1.5 at row 0"),
    ("next_top_probs", np.zeros((10, 3), dtype=np.float32), "differs from next_top_ids"),
    ("hidden_summary", np.full((10, 4), np.inf, dtype=np.float16), "hidden_summary: value inf at row 0, column 0 is not finite"),
    ("hidden_summary", np.zeros(10, dtype=np.float16), r"hidden_summary: expected shape \(10, m\)"),
])
def test_signal_extras_are_validated_at_load(tmp_path, name, value, match):
    good = {"token_ids": np.arange(10), "next_top_ids": np.zeros((10, 2), dtype=np.int64),
            "next_top_probs": np.full((10, 2), 0.5, dtype=np.float32), "hidden_summary": np.zeros((10, 4), np.float16)}
    tr = Trace.from_arrays(np.arange(10)[:, None] % 4, num_experts=4, extras=good)
    assert load_trace(tr.save(tmp_path / "ok.npz")).extras.keys() == good.keys()
    arrays = {"experts": tr.experts, "seq": tr.seq, "meta": np.array(json.dumps(tr.meta)), **good, name: value}
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(TraceError, match=match) as err:
        load_trace(tmp_path / "bad.npz")
    assert "\n" not in str(err.value)
    # a layer selection leaves [T, m] signals whole even when m equals the number of layers
    sq = Trace.from_arrays(np.zeros((10, 2, 1), dtype=int), num_experts=4, extras={"hidden_summary": np.zeros((10, 2))})
    assert sq.select_layers([1]).extras["hidden_summary"].shape == (10, 2)


# ------------------------------------------------------------------------------------ capture
def test_capture_records_signals_equal_to_the_model(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import expertcache
    from expertcache.hf.signals import parse_record, projection

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    ids = np.load(MODEL / "heldout_ids.npy")[:2, :12]
    with torch.no_grad(), expertcache.capture(model, phase="all", record="token-ids,next-top:5,hidden:8:3") as cap:
        for row in ids:
            model(torch.as_tensor(row[None, :]))
    tr = cap.trace
    ex = tr.extras
    assert ex["token_ids"].tolist() == ids.reshape(-1).tolist()
    assert ex["next_top_ids"].shape == (24, 5) and ex["hidden_summary"].shape == (24, 8)
    assert ex["hidden_summary"].dtype == np.float16 and tr.meta["signals"]["hidden_summary"]["seed"] == 3
    with torch.no_grad():
        out = model(torch.as_tensor(ids[1][None, :]), output_hidden_states=True)
    probs = torch.softmax(out.logits[0].float(), dim=-1)
    top = torch.topk(probs, 5, dim=-1)
    assert np.array_equal(ex["next_top_ids"][12:], top.indices.numpy())
    assert np.allclose(ex["next_top_probs"][12:], top.values.numpy(), atol=1e-6)
    want = out.hidden_states[-1][0].numpy() @ projection(model.config.hidden_size, 8, 3)
    assert np.allclose(ex["hidden_summary"][12:].astype(np.float32), want, rtol=2e-3, atol=2e-3)
    with pytest.raises(ConfigError, match="batch-1"), torch.no_grad(), expertcache.capture(model, record="token-ids"):
        model(torch.as_tensor(ids))  # two rows at once
    for bad, match in (("next-top:0", "outside"), ("hidden:x", "integer"), ("tokens", "cannot read")):
        with pytest.raises(ConfigError, match=match):
            parse_record(bad)


def test_cli_capture_record_then_learn(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "t.npz"
    ids = np.load(MODEL / "heldout_ids.npy")[:4, :40]
    np.save(tmp_path / "ids.npy", ids)
    assert main(["capture", "--model", str(MODEL), "--tokens", str(tmp_path / "ids.npy"), "--out", str(out),
                 "--record", "token-ids,next-top:4,hidden:8", "--router-probs", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["layers"] == [0, 1, 2, 3] and rec["extras"] == ["hidden_summary", "next_top_ids", "next_top_probs", "token_ids"]
    tr = load_trace(out)
    assert tr.num_sequences == 4 and tr.extras["token_ids"].tolist() == ids.reshape(-1).tolist()
    assert main(["learn", "dataset", str(out), "-c", "4", "--features", "reuse,token,hidden", "--out",
                 str(tmp_path / "ev.npz")]) == 0
    assert main(["learn", "train", str(tmp_path / "ev.npz"), "--out", str(tmp_path / "s.npz")]) == 0
    sc = load_scorer(tmp_path / "s.npz")
    assert sc.tables is not None and sc.tables.hid.shape[2] == 9
    assert main(["replay", str(out), "-c", "4", "-p", f"learned:{tmp_path / 's.npz'}", "-p", "lru", "--json"]) == 0
    assert main(["capture", "--model", str(MODEL), "--tokens", str(tmp_path / "ids.npy"), "--out", str(out),
                 "--record", "next-top:999"]) == 2


def test_learn_eval_tables_from_another_capture(tmp_path, capsys):
    a, b = signal_trace(T=160, seqs=4, seed=1).save(tmp_path / "a.npz"), signal_trace(seed=2).save(tmp_path / "b.npz")
    argv = ["learn", "eval", "--traces", str(a), "-c", "5", "--seeds", "0", "--rounds", "0", "--features", "reuse,token",
            "--json"]
    assert main(argv + ["--tables-from", str(b)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {r["policy"] for r in rows} >= {"learned linear", "belady"} and "tok_h4" in rows[0]["folds"][0]["features"]
    plain = Trace.from_arrays(signal_trace().experts, num_experts=10).save(tmp_path / "plain.npz")
    assert main(argv + ["--tables-from", str(plain)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "token_ids" in err
    assert main(["learn", "dataset", str(plain), "-c", "5", "--features", "reuse,next", "--out", str(tmp_path / "e.npz")]) == 2
    assert "group 'next' needs the trace's token_ids" in capsys.readouterr().err
