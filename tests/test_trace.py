"""The canonical trace: loading the shared traces as they are, validation with one-line errors
naming file, field and index, atomic saving."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import expertcache as ec
from expertcache.errors import TraceError


def _write(path, **arrays):
    meta = arrays.pop("meta", None)
    if meta is not None:
        arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    return path


def _good(**over):
    arrays = {
        "experts": np.array([[[0, 1]], [[2, 3]], [[0, 1]]], dtype=np.int16),
        "seq": np.zeros(3, dtype=np.int32),
        "meta": {"num_experts": 4, "top_k": 2, "num_layers": 1, "layer_ids": [7], "phase": "decode"},
    }
    arrays.update(over)
    return arrays


def test_loads_every_shared_trace_as_is(shared_trace_path):
    t = ec.load_trace(shared_trace_path)
    raw = np.load(shared_trace_path)
    meta = json.loads(str(raw["meta"]))
    assert t.experts.shape == raw["experts"].shape
    assert t.num_experts == meta["num_experts"] and t.top_k == meta["top_k"]
    assert t.layer_ids == meta["layer_ids"] and t.num_sequences == meta["sequences"]
    assert "step" in t.extras  # extra arrays are kept, not errors
    if "aligned" in raw.files:
        assert t.extras["aligned"].shape == raw["aligned"].shape
    # loading the folder works too
    assert ec.load_trace(shared_trace_path.parent).num_tokens == t.num_tokens


def test_round_trip_keeps_arrays_meta_and_extras(tmp_path):
    rng = np.random.default_rng(0)
    ex = np.stack([[rng.choice(300, 3, replace=False) for _ in range(2)] for _ in range(10)])
    probs = rng.random(ex.shape).astype(np.float16)
    rp = rng.random((10, 2, 300)).astype(np.float32)
    t = ec.Trace.from_arrays(ex, np.repeat([5, 9], 5), num_experts=300, probs=probs, router_probs=rp,
                             meta={"model": "m", "phase": "decode"}, extras={"step": np.arange(10)})
    path = t.save(tmp_path / "t.npz")
    u = ec.load_trace(path)
    assert np.array_equal(u.experts, ex) and u.experts.dtype == np.int16
    assert np.array_equal(u.probs, probs) and np.array_equal(u.router_probs, rp)
    assert np.array_equal(u.extras["step"], np.arange(10))
    assert u.meta == t.meta and u.num_sequences == 2
    assert list(tmp_path.iterdir()) == [path]


def test_save_is_atomic(tmp_path, monkeypatch):
    path = ec.Trace.from_arrays(np.array([[1, 2]]), num_experts=4).save(tmp_path / "t.npz")
    before = path.read_bytes()

    def boom(fh, **arrays):
        fh.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", boom)
    with pytest.raises(KeyboardInterrupt):
        ec.Trace.from_arrays(np.array([[0, 3]]), num_experts=4).save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["t.npz"]


@pytest.mark.parametrize(
    "over, message",
    [
        ({"experts": np.array([[[0, 4]], [[2, 3]], [[0, 1]]])}, r"experts: id 4 at token 0, layer 0, slot 1 is outside \[0, 4\)"),
        ({"experts": np.array([[[0, 1]], [[2, -2]], [[0, 1]]])}, r"experts: id -2 at token 1, layer 0, slot 1"),
        ({"experts": np.array([[[0, 1]], [[3, 3]], [[0, 1]]])}, r"experts: id 3 appears twice at token 1, layer 0"),
        ({"experts": np.array([[0, 1], [2, 3], [0, 1]])}, r"experts: expected rank 3"),
        ({"experts": np.array([[[0.0, 1.0]], [[2, 3]], [[0, 1]]])}, r"experts: expected an integer dtype, got float64"),
        ({"seq": np.array([0, 1, 0])}, r"seq: sequence 0 resumes at token 2"),
        ({"seq": np.array([2**64 - 1, 1, 2**64 - 1], dtype=np.uint64)}, r"seq: sequence 18446744073709551615 resumes"),
        ({"seq": np.zeros(2, dtype=np.int32)}, r"seq: expected shape \(3,\)"),
        ({"probs": np.ones((3, 1, 3), dtype=np.float16)}, r"probs: expected shape \(3, 1, 2\)"),
        ({"probs": np.full((3, 1, 2), np.nan)}, r"probs: non-finite value nan at index \(0, 0, 0\)"),
        ({"router_probs": np.ones((3, 1, 5))}, r"router_probs: expected shape \(3, 1, 4\)"),
        ({"meta": {"num_experts": 4, "top_k": 3}}, r"meta: top_k = 3 contradicts the arrays \(k = 2\)"),
        ({"meta": {"num_experts": 4, "tokens": 4}}, r"meta: tokens = 4 contradicts the arrays"),
        ({"meta": {"num_experts": 4, "layer_ids": [1, 2]}}, r"meta: layer_ids must be 1 distinct integers"),
        ({"meta": {"num_experts": 4, "phase": "training"}}, r"meta: phase 'training' is not one of"),
        ({"meta": {"top_k": 2}}, r"meta: missing 'num_experts'"),
    ],
)
def test_validation_names_file_field_and_index(tmp_path, over, message):
    path = _write(tmp_path / "bad.npz", **_good(**over))
    with pytest.raises(TraceError, match=message) as info:
        ec.load_trace(path)
    text = str(info.value)
    assert text.startswith(str(path)) and "\n" not in text


def test_missing_arrays_and_bad_files(tmp_path):
    arrays = _good()
    del arrays["seq"]
    with pytest.raises(TraceError, match="seq: missing"):
        ec.load_trace(_write(tmp_path / "a.npz", **arrays))
    with pytest.raises(TraceError, match="experts: missing"):
        ec.load_trace(_write(tmp_path / "b.npz", seq=np.zeros(3)))
    (tmp_path / "c.npz").write_text("not a zip")
    with pytest.raises(TraceError, match="not a readable .npz trace"):
        ec.load_trace(tmp_path / "c.npz")
    good = _write(tmp_path / "d.npz", **_good())
    data = good.read_bytes()
    (tmp_path / "e.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="e.npz: not a readable .npz trace"):
        ec.load_trace(tmp_path / "e.npz")
    with pytest.raises(TraceError, match="no such file"):
        ec.load_trace(tmp_path / "missing.npz")
    np.savez(tmp_path / "f.npz", experts=np.array([[[0]]], dtype=object), seq=np.zeros(1))
    with pytest.raises(TraceError, match=r"f.npz: member 'experts.npy': object \(pickled\) arrays are not allowed"):
        ec.load_trace(tmp_path / "f.npz")
    np.savez(tmp_path / "g.npz", meta=np.array("{oops"), **{k: v for k, v in _good().items() if k != "meta"})
    with pytest.raises(TraceError, match="meta: not valid JSON"):
        ec.load_trace(tmp_path / "g.npz")


def test_from_arrays_fills_meta_and_accepts_one_layer():
    t = ec.Trace.from_arrays(np.array([[0, 1], [2, 5]]))
    assert t.experts.shape == (2, 1, 2)
    assert t.num_experts == 6 and t.meta["num_experts_inferred"] is True
    assert t.layer_ids == [0] and t.num_sequences == 1 and t.num_requests == 4


def test_select_layers_and_sequences(tmp_path):
    path = _write(tmp_path / "t.npz", **_good())
    t = ec.load_trace(path)
    assert t.select_layers([7]).layer_ids == [7]
    with pytest.raises(TraceError, match="layer 3 is not in this trace"):
        t.select_layers([3])
    rng = np.random.default_rng(0)
    u = ec.Trace.from_arrays(rng.integers(0, 5, (6, 1, 1)), [0, 0, 1, 1, 1, 2], num_experts=5,
                             extras={"step": np.arange(6)})
    v = u.select_sequences([2, 0])
    assert v.num_tokens == 3 and v.extras["step"].tolist() == [5, 0, 1]
    assert v.meta["sequences"] == 2


def test_parse_layers():
    from expertcache.trace import parse_layers

    assert parse_layers("4-8") == [4, 5, 6, 7, 8]
    assert parse_layers("2,4-5,11") == [2, 4, 5, 11]
    assert parse_layers(None) is None and parse_layers("all") is None
    with pytest.raises(ec.ConfigError, match="--layers"):
        parse_layers("4-x")


def test_a_trace_owns_its_checked_arrays():
    """The ids are checked once, and the compiled loops trust them: a caller's int16 array kept as
    the trace's own, then changed to an id >= num_experts, had made replay segfault. from_arrays
    copies what the caller still holds; every array of a trace is read-only; the caller's stay
    writeable."""
    import expertcache as ec

    ex = np.array([[[0, 1]], [[1, 2]], [[3, 0]]], dtype=np.int16)
    seq = np.zeros(3, dtype=np.int64)
    tr = ec.Trace.from_arrays(ex, seq, num_experts=4, extras={"iteration": np.arange(3, dtype=np.int64)})
    before = ec.replay(tr, 2, "lru").copies_total
    ex[1, 0, 0] = 4
    seq[:] = 7
    assert ex.flags.writeable and seq.flags.writeable
    assert tr.experts[1, 0, 0] == 1 and (tr.seq == 0).all() and ec.replay(tr, 2, "lru").copies_total == before
    for arr in (tr.experts, tr.seq, tr.extras["iteration"]):
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 0


def test_the_dataclass_constructor_checks_as_from_arrays_does():
    """``Trace(experts=..., seq=..., meta=...)`` had taken its fields unchecked: an id past
    num_experts reached the compiled replay loop and the process died (a segfault), and a meta of
    ``True`` was kept. It now checks, derives what the meta lacks, and owns its arrays."""
    ex = np.array([[[0, 1]], [[2, 3]]], dtype=np.int16)
    seq = np.zeros(2, dtype=np.int64)
    tr = ec.Trace(ex, seq, {"num_experts": 4})
    assert tr.meta["top_k"] == 2 and tr.meta["tokens"] == 2 and not tr.experts.flags.writeable
    ex[1, 0, 0] = 9
    assert tr.experts[1, 0, 0] == 2 and ec.replay(tr, 2, "lru").copies_total == 4
    for bad in (np.array([[[0, 1]], [[2, 3_000_000]]]), np.array([[[0, 1]], [[2, -7]]])):
        with pytest.raises(TraceError, match="is outside \\[0, 4\\)"):
            ec.Trace(bad, seq, {"num_experts": 4})
    for meta, says in ((True, "meta: expected a mapping"), ({"num_experts": 4, "tokens": 5}, "tokens")):
        with pytest.raises(TraceError, match=says):
            ec.Trace(tr.experts, seq, meta)
    with pytest.raises(TraceError, match="extras: expected a mapping"):
        ec.Trace(tr.experts, seq, {"num_experts": 4}, extras=[1])
    with pytest.raises(TraceError, match="seq: expected shape"):
        ec.Trace(tr.experts, np.zeros(3, dtype=np.int64), {"num_experts": 4})


def test_selecting_sequences_or_layers_that_are_not_there_is_refused():
    """select_sequences([1, 1]) had merged two copies into one sequence (replayed without a reset,
    its save() refused on load), [-1] had given an empty trace, [-2] the last one; an empty layer
    list had replayed to 0 copies."""
    import expertcache as ec

    tr = ec.Trace.from_arrays(np.arange(10).reshape(10, 1, 1) % 4, np.repeat([0, 1], 5), num_experts=4)
    assert tr.select_sequences([1, 0]).num_sequences == 2 and tr.select_sequences([1]).num_tokens == 5
    for index, said in (([1, 1], "a position is named twice"), ([-1], "position -1 is not in [0, 2)"),
                        ([2], "position 2"), ([], "no position"), ([0.5], "position 0.5")):
        with pytest.raises(ec.TraceError, match="select_sequences: " + said.replace("[", r"\[").replace(")", r"\)")):
            tr.select_sequences(index)
    with pytest.raises(ec.TraceError, match="layers: no layer named"):
        tr.select_layers([])
    with pytest.raises(ec.TraceError, match="layers: no layer named"):
        ec.replay(tr, 2, "lru", layers=[])


def test_experts_of_the_wrong_rank_are_named_not_seq():
    """A 0-d or string ``experts`` had been reported as "seq: object arrays are not allowed"."""
    import expertcache as ec

    for experts in (np.array(3), np.array("abc")):
        with pytest.raises(ec.TraceError, match=r"experts: expected rank 3"):
            ec.Trace.from_arrays(experts, num_experts=4)
