"""import --chunk-sequences for every format (trace/importers/table.py's two passes for the JSONL
logs, trace/chunked.write_trace_chunked for a trace read whole): the chunks hold the whole
import's sequences row for row, replays of them give the whole import's counts, memory holds only
the sequences open at once, and bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from expertcache.cli.main import main
from expertcache.errors import ConfigError, TraceError
from expertcache.trace import Trace
from expertcache.trace.chunked import write_trace_chunked
from expertcache.trace.importers import import_chunked, import_token_jsonl, import_vllm_jsonl
from expertcache.trace.importers.table import write_table_chunked

E, L, K = 12, 3, 2


def log_records(rng, sequences=7, interleave=True, gaps=True, probs=True, short_k=False):
    """Routing of ``sequences`` sequences (string and integer ids), as (seq, tok, layer, ids, probs)
    entries: tokens with gaps, sequences interleaved two at a time when ``interleave``; ``short_k``
    gives some lists k - 1 ids."""
    per_seq = []
    for s in range(sequences):
        name = f"req-{s}" if s % 2 else s
        toks = np.cumsum(rng.integers(1, 3 if gaps else 2, size=int(rng.integers(2, 9))))
        entries = []
        for t in toks:
            for layer in rng.permutation(L):
                n = K - 1 if short_k and rng.random() < 0.3 else K
                ids = [int(x) for x in rng.choice(E, size=n, replace=False)]
                pr = [round(float(x), 4) for x in rng.random(n)] if probs else None
                entries.append((name, int(t), int(layer), ids, pr))
        per_seq.append(entries)
    out = []
    if interleave:  # two sequences open at a time: their entries alternate
        for a in range(0, sequences, 2):
            pair = per_seq[a:a + 2]
            while any(pair):
                for entries in pair:
                    if entries:
                        out.append(entries.pop(0))
    else:
        out = [e for entries in per_seq for e in entries]
    return out


def write_vllm(path, entries):
    with open(path, "w") as fh:
        for s, t, layer, ids, pr in entries:
            rec = {"problem_id": s, "layer": layer, "token_idx": t, "experts": ids}
            if pr is not None:
                rec["gating_probs"] = pr
            fh.write(json.dumps(rec) + "\n")
    return path


def write_token(path, entries):
    """token-jsonl: one record per (sequence, token), its layers as an object of lists."""
    rows: dict = {}
    for s, t, layer, ids, pr in entries:
        rows.setdefault((s, t), []).append((layer, ids, pr))
    with open(path, "w") as fh:
        for (s, t), layers in rows.items():
            rec = {"problem_id": s, "token_idx": t, "experts": {str(l): ids for l, ids, _ in layers}}
            if layers[0][2] is not None:
                rec["gating_probs"] = {str(l): pr for l, _, pr in layers}
            fh.write(json.dumps(rec) + "\n")
    return path


def by_name(trace: Trace, names: dict) -> dict:
    """Sequence name -> (experts, probs, steps) of each sequence."""
    out = {}
    for j in range(trace.num_sequences):
        one = trace.select_sequences([j])
        probs = None if one.probs is None else np.nan_to_num(one.probs, nan=-9).tolist()
        out[str(names[str(j)])] = (one.experts.tolist(), probs, one.extras["step"].tolist())
    return out


def chunk_names(ct) -> dict:
    names = {}
    for chunk in ct.iter_chunks():
        names.update(chunk.meta["sequence_ids"])
    return names


@pytest.mark.parametrize("fmt", ["vllm-jsonl", "token-jsonl"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("case", ["interleaved", "serial-padded", "no-probs"])
def test_chunked_import_holds_the_whole_imports_sequences(tmp_path, fmt, chunk, case):
    rng = np.random.default_rng([chunk, len(case)])
    entries = log_records(rng, interleave=case == "interleaved", probs=case != "no-probs",
                          short_k=case == "serial-padded")
    writer, reader = (write_vllm, import_vllm_jsonl) if fmt == "vllm-jsonl" else (write_token, import_token_jsonl)
    log = writer(tmp_path / "log.jsonl", entries)
    pad = case == "serial-padded"
    whole = reader(log, num_experts=E, pad=pad)
    ct, read_as = import_chunked(log, tmp_path / "chunks", chunk_sequences=chunk, num_experts=E, pad=pad)
    assert read_as == fmt
    assert (ct.num_sequences, ct.num_tokens, ct.num_chunks) == (whole.num_sequences, whole.num_tokens, -(-7 // chunk))
    assert (ct.num_experts, ct.top_k, ct.layer_ids) == (whole.num_experts, whole.top_k, whole.layer_ids)
    assert by_name(ct.load(), chunk_names(ct)) == by_name(whole, whole.meta["sequence_ids"])
    assert ct.meta["validation"] == whole.meta["validation"]


def test_an_inferred_E_and_dropped_tokens_as_the_whole_import(tmp_path):
    entries = log_records(np.random.default_rng(3))
    s, t, layer, _, _ = entries[5]
    entries = [e for e in entries if (e[0], e[1], e[2]) != (s, t, layer)]  # one token lacks a layer
    log = write_vllm(tmp_path / "log.jsonl", entries)
    whole = import_vllm_jsonl(log, drop_incomplete=True)
    ct, _ = import_chunked(log, tmp_path / "c", chunk_sequences=3, drop_incomplete=True)
    assert ct.meta["validation"]["tokens_dropped"] == whole.meta["validation"]["tokens_dropped"] == 1
    assert ct.meta["validation"]["dropped_tokens"] == whole.meta["validation"]["dropped_tokens"]
    assert ct.num_experts == whole.num_experts and ct.meta["num_experts_inferred"]
    assert by_name(ct.load(), chunk_names(ct)) == by_name(whole, whole.meta["sequence_ids"])
    for read in (lambda: import_vllm_jsonl(log), lambda: import_chunked(log, tmp_path / "d", chunk_sequences=3)):
        with pytest.raises(TraceError, match=f"no entry for problem_id=.*token_idx={t}, layer {layer}"):
            read()
    assert not (tmp_path / "d").exists()


def test_replays_of_the_chunks_give_the_whole_imports_counts(tmp_path, capsys, monkeypatch):
    """Streams reset at each sequence, so the order in which sequences finished does not matter."""
    log = write_vllm(tmp_path / "log.jsonl", log_records(np.random.default_rng(5), sequences=9))
    monkeypatch.chdir(tmp_path)

    def cli(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out

    assert "wrote chunks/" in cli("import", log, "--num-experts", E, "--chunk-sequences", 4, "--out", "chunks")
    row = json.loads(cli("import", log, "--num-experts", E, "--chunk-sequences", 4, "--out", "chunks", "--json"))
    assert (row["chunks"], row["sequences"], row["format"]) == (3, 9, "vllm-jsonl")
    cli("import", log, "--num-experts", E, "--out", "whole.npz")
    # an --out folder that is, or holds, the input: the chunked writer would replace it (a folder of
    # SGLang dumps lost its .pt files this way)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "log.jsonl").write_bytes(Path(log).read_bytes())
    for out in ("logs", "."):
        capsys.readouterr()
        assert main(["import", "logs/log.jsonl" if out == "." else "logs", "--num-experts", str(E),
                     "--chunk-sequences", "4", "--out", out]) == 2
        assert "refusing to overwrite an input" in capsys.readouterr().err
    assert (tmp_path / "logs" / "log.jsonl").read_bytes() == Path(log).read_bytes()
    for pool in ("layer", "global"):
        runs = [[{k: v for k, v in json.loads(x).items() if k != "seconds"}
                 for x in cli("replay", src, "-c", 4, "-p", "lru", "-p", "belady", "--pool", pool, "--json").splitlines()]
                for src in ("chunks", "whole.npz")]
        assert runs[0] == runs[1]


def test_memory_holds_the_open_sequences_only(tmp_path):
    """Pass 2 keeps a sequence's entries only until its last one is read: a log written a sequence
    at a time has one open, an interleaved one two."""
    for interleave, most in ((False, 1), (True, 2)):
        entries = log_records(np.random.default_rng(7), sequences=8, interleave=interleave)
        seen = []

        def feed(table):
            for s, t, layer, ids, pr in entries:
                table.probs_present(True, "x")
                table.add(s, t, layer, ids, pr, f"entry {s}/{t}/{layer}")
                seen.append(len(getattr(table, "open", {})))
            return len(entries)

        names = {"seq": "seq", "token": "tok", "experts": "ids", "probs": "p"}
        ct = write_table_chunked(feed, tmp_path / f"c{interleave}", src="log", names=names, pad=False, chunk_sequences=3,
                                 num_experts=E, drop_incomplete=False, meta={"name": "log"})
        assert ct.num_sequences == 8 and max(seen) == most


def test_a_file_changed_between_the_passes_is_one_line(tmp_path):
    entries = log_records(np.random.default_rng(9), sequences=4)
    calls = []

    def feed(table):
        calls.append(1)
        for s, t, layer, ids, pr in entries[: None if len(calls) == 1 else -1]:
            table.probs_present(True, "x")
            table.add(s, t, layer, ids, pr, "x")
        return len(entries) - (len(calls) > 1)

    names = {"seq": "seq", "token": "tok", "experts": "ids", "probs": "p"}
    with pytest.raises(TraceError, match="changed between the two passes"):
        write_table_chunked(feed, tmp_path / "c", src="log", names=names, pad=False, chunk_sequences=2,
                            num_experts=E, drop_incomplete=False, meta={})
    assert not (tmp_path / "c").exists()


def test_a_trace_read_whole_is_written_in_trace_order(tmp_path):
    rng = np.random.default_rng(11)
    seq = np.repeat([4, 9, 2, 7, 5], [3, 1, 4, 2, 5])
    ex = np.array([[rng.choice(E, size=K, replace=False) for _ in range(L)] for _ in range(15)])
    tr = Trace.from_arrays(ex, seq, num_experts=E, meta={"name": "t"})
    ct = write_trace_chunked(tr, tmp_path / "c", chunk_sequences=2)
    assert [c.sequences for c in ct.chunks] == [2, 2, 1]
    back = ct.load()
    assert np.array_equal(back.experts, tr.experts) and back.num_sequences == 5
    assert np.array_equal(np.diff(back.seq_bounds), np.diff(tr.seq_bounds))
    with pytest.raises(ConfigError, match="--chunk-sequences"):
        write_trace_chunked(tr, tmp_path / "d", chunk_sequences=0)


def test_engine_logs_and_bad_options_are_one_line(tmp_path, capsys):
    engine = tmp_path / "engine.jsonl"
    engine.write_text("".join(json.dumps({"iteration": i, "layer": l, "experts": [1, 2]}) + "\n"
                              for i in range(3) for l in range(2)))
    log = write_vllm(tmp_path / "log.jsonl", log_records(np.random.default_rng(1), sequences=2))
    for args, message in ((["engine-jsonl", engine, "--top-k", "2"], "not written chunked"),
                          ([log, "--out", tmp_path / "x.npz"], "is a folder")):
        capsys.readouterr()
        argv = ["import", *map(str, args), "--chunk-sequences", "2"]
        if "--out" not in argv:
            argv += ["--out", str(tmp_path / "e")]
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "e").exists()
