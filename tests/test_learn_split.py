"""learn eval --split / --bootstrap: the split, the sealed test part, bootstrap intervals, the CLI records."""

from __future__ import annotations

import json

import numpy as np
import pytest

import expertcache as ec
from expertcache import Trace
from expertcache.errors import ConfigError
from expertcache.learn import protocol
from expertcache.learn.bootstrap import gap_of, intervals
from expertcache.learn.split import SealedTest, assign, parse_split, part_sizes

LENGTHS = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]  # distinct: a trace's sequence lengths name its sequences


def bursty_trace(lengths=LENGTHS, L=2, E=10, k=2, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    noise = rng.normal(size=(T, L, E))
    logits = 1.2 * noise + 0.15 * noise.cumsum(axis=0)
    ex = np.argsort(-logits, axis=2)[:, :, :k]
    seq = np.repeat(np.arange(len(lengths)), lengths)
    return Trace.from_arrays(ex, num_experts=E, seq=seq)


def lengths_of(trace) -> frozenset[int]:
    return frozenset(int(x) for x in np.diff(trace.seq_bounds))


# ------------------------------------------------------------------------------------------ split
def test_split_sizes_reference_values():
    assert part_sizes(parse_split("0.6,0.2,0.2"), 10) == (6, 2, 2)
    assert part_sizes(parse_split("0.5,0.25,0.25"), 7) == (3, 2, 2)  # 3.5, 1.75, 1.75: remainders to parts 2, 3
    assert part_sizes(parse_split("0.5,0.3,0.2"), 3) == (1, 1, 1)
    assert part_sizes(parse_split("3,2,1"), 10) == (3, 2, 1)
    spec = parse_split("8, 4, 4")
    assert spec.counts and spec.values == (8, 4, 4)


@pytest.mark.parametrize("text, where", [("0.5,0.5", "three numbers"), ("0.5,0.6,0.2", "sum to"), ("a,b,c", "three"),
                                         ("0,1,1", "at least 1"), ("1.0,0,0", "(0, 1)"), ("nan,0.5,0.5", "(0, 1)"),
                                         ("", "three numbers")])
def test_split_spec_errors(text, where):
    with pytest.raises(ConfigError, match="--split") as err:
        parse_split(text)
    assert where in str(err.value)


def test_split_part_errors():
    with pytest.raises(ConfigError, match="6 sequences asked for, the trace has 5"):
        part_sizes(parse_split("3,2,1"), 5)
    with pytest.raises(ConfigError, match="empty"):
        part_sizes(parse_split("0.8,0.1,0.1"), 4)


def test_assign_is_a_deterministic_partition():
    spec = parse_split("0.5,0.25,0.25")
    a, b = assign(20, spec, seed=3), assign(20, spec, seed=3)
    assert a == b and assign(20, spec, seed=4) != a
    got = a["train"] + a["validation"] + a["test"]
    assert sorted(got) == list(range(20)) and len(set(got)) == 20 and a["unused"] == []
    assert [len(a[p]) for p in ("train", "validation", "test")] == [10, 5, 5]
    assert assign(6, parse_split("3,1,1"), seed=None) == {"train": [0, 1, 2], "validation": [3], "test": [4],
                                                          "unused": [5]}


def test_sealed_test_opens_once():
    tr = bursty_trace()
    sealed = SealedTest(tr, [7, 2])
    assert lengths_of(sealed.open()) == {32, 37}
    with pytest.raises(RuntimeError, match="read once"):
        sealed.open()


# -------------------------------------------------------------------------------------- bootstrap
def test_bootstrap_hand_checked_two_sequences():
    """Two sequences: a resample is {1,1}, {1,2} or {2,2}, each of the single-sequence cases a quarter of the
    resamples, so the 95% interval is exactly [min, max] of the per-sequence gaps; the difference to decayed is
    0.3 on every resample (3a+3b over 10(a+b))."""
    per = {"lru": np.array([10, 20]), "belady": np.array([0, 10]), "p": np.array([5, 12]),
           "decayed (tuned)": np.array([8, 15])}
    out = intervals(per, 2000, seed=0)
    assert out["gap"]["p"] == pytest.approx([0.5, 0.8])
    assert out["gap"]["decayed (tuned)"] == pytest.approx([0.2, 0.5])
    assert out["diff"]["p"] == pytest.approx([0.3, 0.3])
    assert out["gap"]["lru"] == [0.0, 0.0] and out["gap"]["belady"] == [1.0, 1.0]
    assert out["resamples_used"] == 2000
    assert float(gap_of(17, 30, 10)) == pytest.approx(0.65)  # the point estimate on the pooled sums


def test_bootstrap_is_deterministic_and_contains_the_point_estimate():
    rng = np.random.default_rng(1)
    for trial in range(5):
        n = 12
        lru = rng.integers(80, 120, n)
        bel = lru - rng.integers(30, 60, n)
        per = {"lru": lru, "belady": bel, "decayed (tuned)": lru - rng.integers(0, 20, n),
               "learned": lru - rng.integers(5, 30, n)}
        a, b = intervals(per, 500, seed=trial), intervals(per, 500, seed=trial)
        assert a == b
        assert a != intervals(per, 500, seed=trial + 100)
        for p in per:
            point = float(gap_of(per[p].sum(), lru.sum(), bel.sum()))
            lo, hi = a["gap"][p]
            assert lo <= point <= hi
            d = point - float(gap_of(per["decayed (tuned)"].sum(), lru.sum(), bel.sum()))
            assert a["diff"][p][0] <= d <= a["diff"][p][1]


def test_bootstrap_leaves_out_resamples_without_a_gap():
    per = {"lru": np.array([5, 9]), "belady": np.array([5, 4]), "decayed (tuned)": np.array([5, 6])}
    out = intervals(per, 400, seed=0)
    assert 0 < out["resamples_used"] < 400  # the {1,1} resamples have lru == belady
    assert out["gap"]["decayed (tuned)"] == pytest.approx([0.6, 0.6])


# --------------------------------------------------------------------------------------- protocol
def test_test_split_is_read_only_for_the_final_scoring(monkeypatch):
    """Every trace the protocol builds, every layout it replays and every fit, logged in order: nothing holding a
    test sequence is touched before the sealed part opens, it opens once, and nothing is fitted or tuned after."""
    log = []
    real_select, real_layout, real_open = Trace.select_sequences, protocol.build_layout, SealedTest.open
    real_fit, real_tune, real_learners = protocol.fit, protocol.tune_beta, protocol.fit_learners

    def select(self, index):
        out = real_select(self, index)
        log.append(("select", lengths_of(out)))
        return out

    def layout(trace, *a, **kw):
        log.append(("layout", lengths_of(trace)))
        return real_layout(trace, *a, **kw)

    def opened(self):
        log.append(("open", None))
        return real_open(self)

    def tagged(name, fn):
        def wrapper(*a, **kw):
            log.append((name, lengths_of(a[0]) if name != "fit" else None))
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(Trace, "select_sequences", select)
    monkeypatch.setattr(SealedTest, "open", opened)
    monkeypatch.setattr(protocol, "build_layout", layout)
    monkeypatch.setattr(protocol, "fit", tagged("fit", real_fit))
    monkeypatch.setattr(protocol, "tune_beta", tagged("tune", real_tune))
    monkeypatch.setattr(protocol, "fit_learners", tagged("learners", real_learners))
    tr = bursty_trace()
    res = protocol.evaluate_split(tr, 4, parse_split("0.6,0.2,0.2"), seeds=(0,), split_seed=1)
    test_lengths = {LENGTHS[i] for i in res["split"]["test"]}
    assert len(test_lengths) == 2
    opens = [i for i, (kind, _) in enumerate(log) if kind == "open"]
    assert len(opens) == 1
    before, after = log[: opens[0]], log[opens[0] + 1:]
    assert {kind for kind, _ in before} >= {"select", "layout", "fit", "tune", "learners"}
    assert all(not (lens & test_lengths) for kind, lens in before if lens is not None)
    assert not {kind for kind, _ in after} & {"fit", "tune", "learners"}
    assert any(lens == test_lengths for kind, lens in after if kind == "select")
    for kind, lens in log:  # validation and training sequences never mix into a tuning decision
        if kind == "tune":
            assert lens == {LENGTHS[i] for i in res["split"]["validation"]}
        if kind == "learners":
            assert lens == {LENGTHS[i] for i in res["split"]["train"]}


def test_split_protocol_counts_cross_checked():
    """Per-sequence sums equal a replay of the whole test part; beta and the chosen kind come from validation."""
    tr = bursty_trace()
    res = protocol.evaluate_split(tr, 4, parse_split("5,2,3"), seeds=(0, 1), split_seed=0, bootstrap=300)
    sp = res["split"]
    test, val = tr.select_sequences(sp["test"]), tr.select_sequences(sp["validation"])
    rows = {r["policy"]: r for r in res["rows"]}
    assert res["beta"] == protocol.tune_beta(val, 4)
    for name, spec in (("lru", "lru"), ("belady", "belady"), ("decayed (tuned)", f"decayed:{res['beta']:g}")):
        assert rows[name]["copies_steady"] == ec.replay(test, 4, spec).copies_steady
        assert rows[name]["validation_copies_steady"] == ec.replay(val, 4, spec).copies_steady
    assert res["tokens"] == test.num_tokens
    assert rows["lru"]["gap_recovered"] == 0 and rows["belady"]["gap_recovered"] == 1
    other = {"learned linear": "learned mlp", "learned mlp": "learned linear"}[res["chosen"]]
    assert rows[res["chosen"]]["validation_copies_steady"] <= rows[other]["validation_copies_steady"]
    assert rows["learned (chosen)"]["copies_steady"] == rows[res["chosen"]]["copies_steady"]
    for r in res["rows"]:
        lo, hi = r["gap_recovered_ci"]
        assert lo <= r["gap_recovered"] + 1e-12 and r["gap_recovered"] <= hi + 1e-12
        assert r["diff_vs_decayed"] == pytest.approx(r["gap_recovered"] - rows["decayed (tuned)"]["gap_recovered"])
    assert rows["decayed (tuned)"]["diff_vs_decayed_ci"] == [0.0, 0.0]


def test_cli_split_bootstrap_records_and_errors(tmp_path, capsys):
    from expertcache.cli.main import main

    path = str(bursty_trace().save(tmp_path / "t.npz"))
    argv = ["learn", "eval", "--traces", path, "-c", "4,12", "--split", "0.6,0.2,0.2", "--seeds", "0",
            "--bootstrap", "200", "--json"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # deterministic for the seeds
    recs = [json.loads(x) for x in first.splitlines()]
    rows = {r["policy"]: r for r in recs if "policy" in r}
    assert len(rows["learned (chosen)"]["gap_recovered_ci"]) == 2 and len(rows["lru"]["diff_vs_decayed_ci"]) == 2
    assert rows["lru"]["bootstrap"] == 200 and set(rows["lru"]["split"]) >= {"train", "validation", "test", "spec"}
    assert [r["capacity"] for r in recs if "skipped" in r] == [12]
    assert main(["learn", "eval", "--traces", path, "-c", "4", "--split", "6,2,2", "--seeds", "0"]) == 0
    text = capsys.readouterr().out
    assert "read once" in text and "no bootstrap" in text and "learned (chosen)" in text
    assert main(["learn", "eval", "--traces", path, "-c", "4", "--seeds", "0", "--split", "9,9,9"]) == 0
    assert "skipped" in capsys.readouterr().out  # a trace the split does not fit: a note, like a capacity
    for bad, message in ((["--bootstrap", "10"], "--bootstrap needs --split"), (["--split", "0.5,0.5"], "--split"),
                         (["--split", "6,2,2", "--bootstrap", "-1"], "--bootstrap")):
        try:
            code = main(["learn", "eval", "--traces", path, "-c", "4", "--seeds", "0", *bad])
        except SystemExit as exit_:  # argparse's own type errors
            code = exit_.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err
