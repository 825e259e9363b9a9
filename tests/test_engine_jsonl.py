"""engine-jsonl: engine-iteration routing logs with speculative decoding, typed into passes.

The generator (``expertcache.trace.engine_gen``) builds its ground truth while it draws the log;
the importer reads only the lines. They must agree on every row, kind, iteration and accepted
token (several seeds, both record orders, batched sequences, gzip). The pure typing function is
checked on its own against hand-made iterations in random interleavings (hypothesis), and every
malformed or ambiguous record must be one line naming the file and line.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import expertcache as ec
from expertcache.cli.main import main
from expertcache.errors import ConfigError, TraceError
from expertcache.trace import accepted_tokens, iteration_ids, iterations
from expertcache.trace.engine_gen import generate_engine_jsonl
from expertcache.trace.importers import (
    EngineFields,
    EngineRecord,
    detect_format,
    import_engine_jsonl,
    import_trace,
    pass_arrays,
    type_passes,
)
from expertcache.trace.units import accepted_by_sequence, check_unit_extra

sys.path.insert(0, str(Path(__file__).parent))


def write(path: Path, recs, compression: str | None = None) -> Path:
    data = b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in recs)
    if compression == "zstd":
        data = pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    path.write_bytes(gzip.compress(data) if compression == "gzip" else data)
    return path


def cli(*argv, json_out: bool = True) -> tuple[int, object]:
    out = io.StringIO()
    old = sys.stdout
    sys.stdout = out
    try:
        rc = main([*map(str, argv), *(["--json"] if json_out else [])])
    finally:
        sys.stdout = old
    text = out.getvalue()
    return rc, (json.loads(text) if json_out and rc == 0 else text)


def rec(it, layer, ids, seq=None):
    r = {"iteration": it, "layer": layer, "experts": ids}
    if seq is not None:
        r["seq"] = seq
    return r


# ---------------------------------------------------------------------- hand-computed
# k = 2, two layers: a normal iteration, an accepted speculation (ids shared between its
# positions), a failed speculation of width 2k then its fallback, a failed one of width k.
HAND = [
    rec(0, 0, [1, 2]), rec(0, 1, [3, 4]),
    rec(1, 0, [1, 2, 2, 5]), rec(1, 1, [3, 4, 6, 7]),
    rec(2, 0, [1, 2, 3, 5]), rec(2, 1, [3, 4, 6, 7]), rec(2, 0, [0, 2]), rec(2, 1, [5, 4]),
    rec(3, 1, [1, 0]), rec(3, 0, [7, 6]), rec(3, 1, [1, 2]), rec(3, 0, [6, 5]),
]


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_hand_computed(tmp_path, compression):
    path = write(tmp_path / "run.jsonl", HAND, compression)
    tr = import_engine_jsonl(path, top_k=2, num_experts=8)
    assert tr.experts.tolist() == [
        [[1, 2, -1, -1], [3, 4, -1, -1]],
        [[1, 2, 5, -1], [3, 4, 6, 7]],   # union of the two positions, first-seen order
        [[1, 2, 3, 5], [3, 4, 6, 7]],
        [[0, 2, -1, -1], [5, 4, -1, -1]],
        [[7, 6, -1, -1], [1, 0, -1, -1]],
        [[6, 5, -1, -1], [1, 2, -1, -1]],
    ]
    assert tr.extras["iteration"].tolist() == [0, 1, 2, 2, 3, 3]
    assert tr.extras["accepted"].tolist() == [1, 2, 0, 1, 0, 1]
    assert tr.extras["pass_kind"].tolist() == [0, 1, 2, 3, 2, 3]
    assert tr.extras["accepted"].dtype == np.int8 and tr.extras["pass_kind"].dtype == np.int8
    assert tr.extras["iteration"].dtype == np.int64
    m = tr.meta
    assert (m["passes"], m["iterations"], m["accepted_tokens"], m["router_top_k"], m["row_unit"]) == (6, 4, 5, 2, "pass")
    assert m["pass_kinds"] == {"normal": 1, "spec-accept": 1, "spec-fail": 2, "fallback": 2}
    assert m["top_k"] == 4 and m["phase"] == "decode" and m["top_k_inferred"] is False
    assert m["source"]["format"] == "engine-jsonl" and m["source"]["fields"]["iteration"] == "iteration"
    assert (iterations(tr), accepted_tokens(tr), iteration_ids(tr).tolist()) == (4, 5, [0, 1, 2, 2, 3, 3])
    # the same log with k inferred (the smallest width is 2) and through the saved file
    again = ec.load_trace(import_engine_jsonl(path).save(tmp_path / "T.npz"))
    assert np.array_equal(again.experts, tr.experts) and again.meta["top_k_inferred"] is True
    for name in ("iteration", "accepted", "pass_kind"):
        assert np.array_equal(again.extras[name], tr.extras[name])


def test_width_k_only_keeps_k(tmp_path):
    log = generate_engine_jsonl(None, iterations=20, layers=2, num_experts=16, top_k=3, p_accept=0, p_fail=0, seed=1)
    path = write(tmp_path / "n.jsonl", [line.encode() for line in log.lines])
    tr = import_engine_jsonl(path)
    assert tr.top_k == 3 and tr.meta["pass_kinds"]["normal"] == 20 and accepted_tokens(tr) == 20
    assert np.array_equal(tr.experts, log.experts)


# ---------------------------------------------------------------------- generated logs
@pytest.mark.parametrize("seed, sequences, order, p_accept, p_fail, gz, give_k", [
    (0, 1, "pass", 0.6, 0.2, False, True), (1, 3, "pass", 0.3, 0.5, True, False), (2, 2, "layer", 0.0, 0.7, False, True),
    (3, 4, "layer", 0.9, 0.1, True, True), (4, 1, "pass", 0.0, 0.0, False, False), (5, 2, "pass", 1.0, 0.0, False, True),
])
def test_generated_logs_reconstruct_exactly(tmp_path, seed, sequences, order, p_accept, p_fail, gz, give_k):
    k, E, L = 4, 32, 3
    path = tmp_path / ("run.jsonl.gz" if gz else "run.jsonl")
    log = generate_engine_jsonl(path, iterations=60, layers=L, num_experts=E, top_k=k, p_accept=p_accept,
                                p_fail=p_fail, sequences=sequences, seed=seed, order=order)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == gz
    tr = import_engine_jsonl(path, top_k=k if give_k else None, num_experts=E)
    assert np.array_equal(tr.experts, log.experts)
    assert np.array_equal(tr.seq, log.seq) and np.array_equal(tr.extras["iteration"], log.iteration)
    assert np.array_equal(tr.extras["accepted"], log.accepted_per_row)
    assert np.array_equal(tr.extras["pass_kind"], log.pass_kind)
    assert tr.meta["pass_kinds"] == log.kinds and tr.meta["passes"] == tr.num_tokens == sum(log.kinds.values())
    assert tr.meta["iterations"] == iterations(tr) == log.iterations == 60 * sequences
    assert accepted_tokens(tr) == tr.meta["accepted_tokens"] == log.accepted_tokens
    assert accepted_by_sequence(tr).tolist() == [log.accepted[s] for s in range(sequences)]
    # accounting: every iteration credits 1 token, plus 1 per accepted speculation; fallbacks follow failures
    assert log.accepted_tokens == 60 * sequences + log.kinds["spec-accept"]
    assert log.kinds["spec-fail"] == log.kinds["fallback"]
    ids = iteration_ids(tr)
    assert ids[0] == 0 and np.all(np.diff(ids) >= 0) and ids[-1] + 1 == iterations(tr)
    if p_accept == 1.0 and not give_k:
        assert tr.meta["router_top_k"] == 2 * k  # every record two positions: k reads as 2k without --top-k


def test_both_orders_and_the_generator_are_deterministic(tmp_path):
    kw = dict(iterations=40, layers=3, num_experts=24, top_k=3, p_accept=0.4, p_fail=0.4, sequences=2, seed=7)
    a = generate_engine_jsonl(None, **kw)
    b = generate_engine_jsonl(None, **kw, order="layer")
    assert a.lines == generate_engine_jsonl(None, **kw).lines and sorted(a.lines) == sorted(b.lines) and a.lines != b.lines
    ta = import_engine_jsonl(write(tmp_path / "a.jsonl", [x.encode() for x in a.lines]), top_k=3)
    tb = import_engine_jsonl(write(tmp_path / "b.jsonl", [x.encode() for x in b.lines]), top_k=3)
    assert np.array_equal(ta.experts, tb.experts) and np.array_equal(ta.extras["pass_kind"], tb.extras["pass_kind"])


def test_renamed_fields(tmp_path):
    f = EngineFields(seq="request_id", iteration="step", layer="layer_idx", experts="topk_ids")
    log = generate_engine_jsonl(tmp_path / "r.jsonl", iterations=10, layers=2, num_experts=16, top_k=2,
                                p_accept=0.5, p_fail=0.3, sequences=2, seed=3, fields=f)
    assert set(json.loads(log.lines[0])) == {"request_id", "step", "layer_idx", "topk_ids"}
    tr = import_engine_jsonl(tmp_path / "r.jsonl", fields=f, top_k=2)
    assert np.array_equal(tr.experts, log.experts) and tr.meta["source"]["fields"]["experts"] == "topk_ids"
    rc, out = cli("import", "engine-jsonl", tmp_path / "r.jsonl", "--seq-field", "request_id", "--iteration-field", "step",
                  "--layer-field", "layer_idx", "--experts-field", "topk_ids", "--top-k", 2, "--out", tmp_path / "T.npz")
    assert rc == 0 and out["accepted_tokens"] == log.accepted_tokens


# ---------------------------------------------------------------------- the pure typing function
def _iteration_records(rng: random.Random, kind: str, L: int, k: int, E: int):
    """The routings of one iteration, as (pass index, layer, ids)."""
    def pos():
        return rng.sample(range(E), k)
    widths = {"normal": [1], "spec-accept": [2], "fail2": [2, 1], "fail1": [1, 1]}[kind]
    return [(p, layer, sum((pos() for _ in range(w)), [])) for p, w in enumerate(widths) for layer in range(L)]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.sampled_from(["normal", "spec-accept", "fail2", "fail1"]), min_size=1, max_size=12),
       st.integers(1, 3), st.integers(1, 3), st.booleans())
def test_type_passes_on_random_interleavings(seed, kinds, L, S, shuffle_layers):
    """Records of one iteration in any order that keeps each layer's first routing before its second;
    sequences interleaved arbitrarily: the typing depends on neither."""
    rng = random.Random(seed)
    k, E = 2, 12
    per_seq = {s: [(i, kind, _iteration_records(rng, kind, L, k, E)) for i, kind in enumerate(kinds)] for s in range(S)}
    streams = {}
    for s, its in per_seq.items():
        stream = []
        for i, _, routings in its:
            if shuffle_layers:  # a random order that keeps every layer's first routing before its second
                order = sorted(routings, key=lambda r: (r[0], rng.random()))
                firsts = [r for r in order if r[0] == 0]
                seconds = [r for r in order if r[0] == 1]
                merged = []
                while firsts or seconds:
                    ready = [r for r in seconds if all(f[1] != r[1] for f in firsts)]
                    if ready and (not firsts or rng.random() < 0.5):
                        seconds.remove(ready[0])
                        merged.append(ready[0])
                    else:
                        merged.append(firsts.pop(0))
                routings = merged
            stream += [(i, layer, ids) for _, layer, ids in routings]
        streams[s] = stream
    records, line = [], 0
    while any(streams.values()):
        s = rng.choice([s for s, v in streams.items() if v])
        i, layer, ids = streams[s].pop(0)
        line += 1
        records.append(EngineRecord(line, s, i, layer, ids))
    typed = type_passes(records, top_k=k)
    want = {"normal": [0], "spec-accept": [1], "fail2": [2, 3], "fail1": [2, 3]}
    first_seen = list(dict.fromkeys(r.seq for r in records))
    assert [p.kind for p in typed.passes] == [c for s in first_seen for kind in kinds for c in want[kind]]
    assert typed.accepted_by_sequence() == {s: sum(1 + (kind == "spec-accept") for kind in kinds) for s in range(S)}
    arrays = pass_arrays(typed)
    assert arrays["experts"].shape[2] == (4 if any(kd in ("spec-accept", "fail2") for kd in kinds) else 2)
    assert (arrays["experts"] >= 0).sum(axis=2).min() >= k


# ---------------------------------------------------------------------- malformed and ambiguous records
BAD = [
    ("width 3k", [rec(0, 0, [1, 2]), rec(0, 1, [3, 4, 5, 6, 7, 0])], ["--top-k", 2],
     ":2: iteration 0, layer 1: field 'experts' holds 6 ids; a record holds k = 2 ids (one position) or 2k = 4"),
    ("width 3 with k inferred", [rec(0, 0, [1, 2]), rec(0, 1, [3, 4, 5])], [],
     ":2: iteration 0, layer 1: field 'experts' holds 3 ids; a record holds k = 2 (inferred: the smallest width"),
    ("triple routing", [rec(0, 0, [1, 2]), rec(0, 0, [3, 4]), rec(0, 0, [5, 6])], ["--top-k", 2],
     ":3: iteration 0, layer 0: routed a third time (lines 1, 2)"),
    ("fallback of 2k", [rec(0, 0, [1, 2]), rec(0, 1, [3, 4]), rec(0, 0, [1, 2, 3, 4]), rec(0, 1, [3, 4, 5, 6])], ["--top-k", 2],
     ":3: iteration 0, layer 0: the second routing (a fallback pass) holds 4 ids; a fallback pass routes one position (k = 2)"),
    ("missing layer", [rec(0, 0, [1, 2]), rec(0, 1, [3, 4]), rec(1, 0, [1, 2]), rec(2, 0, [1, 2]), rec(2, 1, [1, 2])], [],
     ":3: iteration 1 (records from this line) has no record for layer 1; every iteration routes every layer (layers 0-1)"),
    ("one layer doubled, another not", [rec(0, 0, [1, 2]), rec(0, 1, [3, 4]), rec(0, 0, [5, 6])], [],
     ":3: iteration 0, layer 0: routed a second time, but layer 1 only once (line 2)"),
    ("widths of two types in one pass", [rec(0, 0, [1, 2]), rec(0, 1, [3, 4, 5, 6])], ["--top-k", 2],
     ":2: iteration 0, layer 1: 4 ids where layer 0 (line 1) holds 2 in the first routing of this iteration"),
    ("backwards iteration", [rec(5, 0, [1, 2], "a"), rec(2, 0, [1, 2], "b"), rec(4, 0, [1, 2], "a")], [],
     ":3: seq='a', iteration 4: comes after iteration 5 (line 1); a sequence's iterations never go back"),
    ("id outside [0, E)", [rec(0, 0, [1, 2]), rec(0, 1, [3, 8])], ["--num-experts", 8],
     ":2: field 'experts': expert id 8 is outside [0, 8) (--num-experts 8)"),
    ("id twice in one position", [rec(0, 0, [1, 2]), rec(0, 1, [3, 4, 5, 5])], ["--top-k", 2],
     ":2: iteration 0, layer 1: field 'experts': an id appears twice in position 2 of 2 in [3, 4, 5, 5]"),
    ("missing field", [rec(0, 0, [1, 2]), {"layer": 1, "experts": [3, 4]}], [],
     ":2: missing field 'iteration' (set the field names with the --*-field options)"),
    ("field named by an option and absent", [rec(0, 0, [1, 2])], ["--iteration-field", "step"], ":1: missing field 'step'"),
    ("sequence field in some records only", [rec(0, 0, [1, 2], 0), rec(1, 0, [1, 2])], [],
     ":2: field 'seq' is missing here but present at"),
    ("not an integer", [rec(0, 0, [1, 2]), rec("1", 0, [1, 2])], [], ":2: field 'iteration' must be an integer, got '1'"),
    ("expected tokens", [rec(0, 0, [1, 2], "a"), rec(0, 0, [1, 2, 3, 4], "b")], ["--top-k", 2, "--expect-tokens", 2],
     ": sequence seq='a' accounts for 1 accepted tokens, expected 2 (--expect-tokens)"),
]


@pytest.mark.parametrize("what, recs, args, message", BAD, ids=[b[0] for b in BAD])
def test_malformed_records_are_one_line(tmp_path, capsys, what, recs, args, message):
    path = write(tmp_path / "bad.jsonl", recs)
    out = tmp_path / "T.npz"
    rc = main(["import", "engine-jsonl", str(path), "--out", str(out), *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"expertcache import: error: {path}"), err[0]
    assert message in err[0], err[0]
    assert not out.exists()


def run_main(argv) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:  # argument errors
        return exc.code


def test_options_that_do_not_apply(tmp_path, capsys):
    path = write(tmp_path / "run.jsonl", HAND)
    for args, message in [(["--token-field", "t"], "--token-field does not apply to engine-jsonl"),
                          (["--probs-field", "p"], "--probs-field does not apply to engine-jsonl"),
                          (["--layers-field", "p"], "--layers-field does not apply to engine-jsonl"),
                          (["--pad"], "--pad does not apply to engine-jsonl"),
                          (["--drop-incomplete"], "--drop-incomplete does not apply to engine-jsonl"),
                          (["--top-k", "0"], "argument --top-k: expected a positive integer"),
                          (["--expect-tokens", "x"], "argument --expect-tokens: expected a positive integer")]:
        rc = run_main(["import", "engine-jsonl", path, "--out", tmp_path / "T.npz", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and message in err[0], (args, err)
    tok = write(tmp_path / "v.jsonl", [{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1]}])
    assert run_main(["import", tok, "--top-k", "1", "--out", tmp_path / "T.npz"]) == 2
    assert "--top-k does not apply to vllm-jsonl" in capsys.readouterr().err
    assert not (tmp_path / "T.npz").exists()
    with pytest.raises(ConfigError, match="--top-k"):
        import_engine_jsonl(path, top_k=0)


# ---------------------------------------------------------------------- CLI and --format auto
def test_cli_json_summary_and_expect_tokens(tmp_path):
    log = tmp_path / "run.jsonl"
    rc, out = cli("synth", "engine-jsonl", "--iterations", 50, "--num-layers", 3, "--num-experts", 32, "--top-k", 4,
                  "--p-accept", 0.5, "--p-fail", 0.3, "--sequences", 2, "--seed", 4, "--out", log)
    assert rc == 0 and out["records"] == len(log.read_text().splitlines()) and out["iterations"] == 100
    per = {r["sequence"]: r["accepted_tokens"] for r in out["accepted_per_sequence"]}
    rc, imp = cli("import", "engine-jsonl", log, "--top-k", 4, "--num-experts", 32, "--out", tmp_path / "T.npz")
    assert rc == 0 and imp["format"] == "engine-jsonl" and imp["router_top_k"] == 4 and imp["top_k"] == 8
    assert imp["pass_kinds"] == out["pass_kinds"] and imp["accepted_tokens"] == out["accepted_tokens"]
    assert imp["passes"] == imp["tokens"] == out["passes"] and imp["iterations"] == 100
    assert {r["sequence"]: r["accepted_tokens"] for r in imp["accepted_per_sequence"]} == per
    if len(set(per.values())) == 1:
        pytest.skip("both sequences accept the same number of tokens at this seed")
    rc, text = cli("import", "engine-jsonl", log, "--top-k", 4, "--expect-tokens", per[0], "--out", tmp_path / "T2.npz",
                   json_out=False)
    assert rc == 2 and not (tmp_path / "T2.npz").exists()
    one = tmp_path / "one.jsonl"
    generate_engine_jsonl(one, iterations=30, layers=2, num_experts=16, top_k=2, p_accept=0.5, p_fail=0.2, seed=1)
    n = accepted_tokens(import_engine_jsonl(one, top_k=2))
    rc, text = cli("import", "engine-jsonl", one, "--top-k", 2, "--expect-tokens", n, "--out", tmp_path / "T3.npz",
                   json_out=False)
    assert rc == 0 and f"every sequence accounts for {n} accepted tokens" in text


def test_cli_text_summary_and_help(tmp_path):
    log = tmp_path / "run.jsonl"
    rc, text = cli("synth", "engine-jsonl", "--out", log, json_out=False)
    assert rc == 0 and text.startswith(f"wrote {log}: ") and "accepted tokens" in text
    rc, text = cli("import", log, "--top-k", 8, "--out", tmp_path / "T.npz", json_out=False)
    assert rc == 0 and "(read as engine-jsonl)" in text and "engine iterations" in text
    assert "accepted tokens per sequence: 0: " in text
    for argv, words in [(["import", "--help"], ["engine-jsonl", "--iteration-field", "--top-k", "--expect-tokens", "2k"]),
                        (["synth", "engine-jsonl", "--help"], ["--p-accept", "--p-fail", "--iterations", "--json", "--order"]),
                        (["synth", "--help"], ["engine-jsonl"])]:
        proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *argv], capture_output=True, text=True)
        assert proc.returncode == 0 and all(w in proc.stdout for w in words), (argv, proc.stdout[-500:])


def test_synth_engine_option_errors(tmp_path, capsys):
    for argv, message in [(["--p-accept", "0.7", "--p-fail", "0.5"], "p_accept + p_fail = 1.2 is more than 1"),
                          (["--p-accept", "1.5"], "1.5 is outside [0, 1]"),
                          (["--top-k", "65", "--num-experts", "64"], "top_k: 65 is more than num_experts = 64")]:
        rc = run_main(["synth", "engine-jsonl", "--out", tmp_path / "r.jsonl", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r.jsonl").exists()


def test_auto_detects_engine_records(tmp_path):
    path = write(tmp_path / "run.jsonl", HAND, "gzip")
    assert detect_format(path) == "engine-jsonl"
    tr, fmt = import_trace(path, top_k=2)
    assert fmt == "engine-jsonl" and tr.meta["accepted_tokens"] == 5
    vllm = write(tmp_path / "v.jsonl", [{"problem_id": 0, "layer": 0, "token_idx": 0, "iteration": 3, "experts": [1]}])
    assert detect_format(vllm) == "vllm-jsonl"  # a token field makes it per-token, whatever else it has
    mixed = write(tmp_path / "m.jsonl", [HAND[0], {"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1]}])
    with pytest.raises(TraceError, match=r"m.jsonl:2: a vllm-jsonl record, but .*m.jsonl:1 is a engine-jsonl record"):
        detect_format(mixed)


# ---------------------------------------------------------------------- units of any trace
def test_units_fall_back_to_one_row_one_token():
    tr = ec.Trace.from_arrays(np.array([[0, 1], [2, 3], [0, 1]]), np.array([0, 0, 1]), num_experts=4)
    assert (iterations(tr), accepted_tokens(tr), iteration_ids(tr).tolist()) == (3, 3, [0, 1, 2])
    assert accepted_by_sequence(tr).tolist() == [2, 1]
    # two sequences whose engine iterations share indices still get distinct ids
    tr = ec.Trace.from_arrays(np.zeros((5, 1, 1), int), np.array([0, 0, 0, 1, 1]), num_experts=1,
                              extras={"iteration": np.array([0, 1, 1, 0, 1]), "accepted": np.array([1, 0, 1, 2, 1], np.int8)})
    assert (iterations(tr), accepted_tokens(tr), iteration_ids(tr).tolist()) == (4, 5, [0, 1, 1, 2, 3])


def test_malformed_unit_extras_are_one_line():
    bounds = np.array([0, 3])
    for name, arr, message in [("iteration", np.array([0, 2, 1]), "iteration: goes back inside a sequence at row 2"),
                               ("accepted", np.array([1, -1, 1]),
                                "accepted: value -1 at row 1 is not in [0, 1,048,576]"),
                               # three rows of 2**62 had summed past int64: a negative token count
                               ("accepted", np.array([2**62] * 3), "accepted: value 4611686018427387904 at row 0 is "
                                                                  "not in [0, 1,048,576]"),
                               ("pass_kind", np.array([0, 4, 1]), "pass_kind: value 4 at row 1 is not in [0, 3]"),
                               ("iteration", np.zeros(3, np.float32), "iteration: expected integer shape (3,)")]:
        with pytest.raises(TraceError) as info:
            check_unit_extra(name, arr, bounds, 3, "t.npz")
        assert str(info.value).startswith("t.npz: " + message), str(info.value)
    # every load validates them: a malformed extra never reaches the unit helpers
    with pytest.raises(TraceError, match="accepted: expected integer shape"):
        ec.Trace.from_arrays(np.zeros((2, 1, 1), int), num_experts=1, extras={"accepted": np.array([1.5, 2.0])})
    tr = ec.Trace.from_arrays(np.zeros((2, 1, 1), int), num_experts=1, extras={"accepted": np.array([1, 2])})
    assert accepted_tokens(tr) == 3


# ---------------------------------------------------------------------- fuzz (small)
def _engine_case(rng: random.Random):
    from fuzzing import Case

    k, L = rng.choice([2, 3]), rng.choice([2, 3])
    E = 4 * k + 1
    log = generate_engine_jsonl(None, iterations=rng.randint(2, 12), layers=L, num_experts=E, top_k=k,
                                p_accept=0.4, p_fail=0.3, sequences=rng.randint(1, 2), seed=rng.randrange(10**6),
                                order=rng.choice(["pass", "layer"]))
    lines = list(log.lines)
    i = rng.randrange(len(lines))
    r = json.loads(lines[i])
    args = ["--num-experts", str(E)] + (["--top-k", str(k)] if rng.random() < 0.5 else [])
    choice = rng.randrange(7)

    def oracle(path, out):
        tr = ec.load_trace(out)
        same = np.array_equal(tr.experts, log.experts) and np.array_equal(tr.extras["pass_kind"], log.pass_kind)
        return None if same else "imported trace differs from the generator's truth"

    def case(what, expect, data, check=None):
        return Case("log", what, expect, {"log.jsonl": data}, target="log.jsonl", log_format="engine-jsonl",
                    log_args=args, oracle=check)

    def body(ls):
        return "".join(x + "\n" for x in ls).encode()

    if choice == 0:
        return case("valid engine log", "valid", body(lines), oracle)
    if choice == 1:
        return case("valid engine log, gzip", "valid", gzip.compress(body(lines)), oracle)
    if choice == 2:
        return case("a record repeated", "invalid", body(lines[: i + 1] + [lines[i]] + lines[i + 1:]))
    if choice == 3:
        return case("a record removed", "invalid", body(lines[:i] + lines[i + 1:]))
    if choice == 4:
        r["experts"].append(next(e for e in range(E) if e not in r["experts"]))
        return case("a record one id wider", "invalid", body(lines[:i] + [json.dumps(r)] + lines[i + 1:]))
    if choice == 5:
        r["experts"][0] = E
        return case("an id equal to E", "invalid", body(lines[:i] + [json.dumps(r)] + lines[i + 1:]))
    data = bytearray(body(lines))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return case("random bytes", "any", bytes(data))


def test_fuzz_engine_logs(tmp_path, monkeypatch):
    from fuzzing import run_case

    monkeypatch.delenv("EXPERTCACHE_MAX_TRACE_BYTES", raising=False)  # run_case sets it; restored afterwards

    rng = random.Random("engine-0")
    failures, verdicts = [], []
    for n in range(30):
        got, ok = run_case(_engine_case(rng), tmp_path / f"c{n}")
        failures += got
        verdicts.append(ok)
    assert not failures, "\n".join(failures[:10])
    assert True in verdicts and False in verdicts
