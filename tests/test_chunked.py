"""Chunked traces (trace/chunked.py, sim/chunked.py): replay, sweep, stats and grid of a trace read
chunk by chunk equal the same trace loaded whole, for every pool, reset, warm window, admission
and layer selection; the manifest and the chunks are checked; writing is atomic."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from expertcache.analysis import locality_report
from expertcache.cli.main import main
from expertcache.analysis.locality import locality_report_chunked
from expertcache.errors import ConfigError, TraceError
from expertcache.sim import StreamOptions, build_layout, fill_gap, replay_layout
from expertcache.sim import chunked as simc
from expertcache.sim.chunked import plan_units, replay_chunked, sweep_chunked
from expertcache.sim.curves.mrc import sweep_layout
from expertcache.trace import Trace
from expertcache.trace.chunked import MANIFEST, ChunkWriter, open_chunked
from expertcache.trace.synth import PRESETS, synthesize_chunks

POLICIES = ["lru", "belady", "s3fifo", "arc", "foresight:4", "lfu"]


def random_pieces(rng, E=24, L=4, k=3, sequences=7, pad=False):
    """Pieces of whole sequences (1-3 each) of a random trace with locality; sequence ids 0.."""
    pieces, s = [], 0
    while s < sequences:
        n = min(int(rng.integers(1, 4)), sequences - s)
        lengths = rng.integers(5, 60, size=n)
        rows = []
        for length in lengths:
            hot = [rng.choice(E, size=8, replace=False) for _ in range(L)]
            block = np.empty((length, L, k), dtype=np.int64)
            for t in range(length):
                for l in range(L):
                    block[t, l] = rng.choice(hot[l] if rng.random() < 0.8 else E, size=k, replace=False)
            if pad:
                block[rng.random((length, L)) < 0.2, -1] = -1
            rows.append(block)
        seq = np.concatenate([np.full(length, s + i) for i, length in enumerate(lengths)])
        pieces.append(Trace.from_arrays(np.concatenate(rows), seq, num_experts=E, meta={"name": "rand"}))
        s += n
    return pieces


def write(path, pieces):
    with ChunkWriter(path) as w:
        for p in pieces:
            w.add(p)
    return open_chunked(path)


def strip(record):
    return {k: v for k, v in record.items() if k != "seconds"}


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    rng = np.random.default_rng(5)
    out = []
    for i, pad in enumerate((False, True)):
        out.append(write(tmp_path_factory.mktemp("ck") / f"t{i}", random_pieces(rng, pad=pad)))
    return out


@pytest.mark.parametrize("pool", ["layer", "global"])
@pytest.mark.parametrize("reset", ["sequence", "none"])
@pytest.mark.parametrize("extra", [{}, {"warm": 0.3}, {"admission": "second"}, {"layers": (1, 3)}])
def test_replay_and_sweep_of_chunks_equal_the_whole_trace(chunked, monkeypatch, pool, reset, extra):
    monkeypatch.setattr(simc, "UNIT_BYTES", 1)  # per-layer pools without reset: one layer per unit
    for ct in chunked:
        whole = ct.load()
        options = StreamOptions.of(pool=pool, reset=reset, **extra)
        layout = build_layout(whole, options)
        C = 5 if pool == "layer" else 20
        expect = [replay_layout(layout, C, p) for p in POLICIES]
        fill_gap(expect)
        got = replay_chunked(ct, C, POLICIES, options)
        assert [strip(r.to_dict()) for r in got] == [strip(r.to_dict()) for r in expect]
        caps = [3, 4, 9, 24] if pool == "layer" else [3, 17, 40, 200]
        want = sweep_layout(layout, caps, ["lru", "belady", "arc"])
        have = sweep_chunked(ct, caps, ["lru", "belady", "arc"], options)
        for a, b in zip(have, want):
            assert [strip(r.to_dict()) for r in a.results] == [strip(r.to_dict()) for r in b.results]
        units = plan_units(ct, options)
        if reset == "sequence":
            assert len(units) == ct.num_chunks > 1
        elif pool == "layer":
            assert len(units) == len(extra.get("layers", range(ct.num_layers)))


def test_workers_give_the_serial_counts(chunked):
    ct = chunked[0]
    serial = replay_chunked(ct, 5, ["lru", "belady"])
    parallel = replay_chunked(ct, 5, ["lru", "belady"], jobs=2)
    assert [strip(r.to_dict()) for r in parallel] == [strip(r.to_dict()) for r in serial]
    serial = sweep_chunked(ct, [3, 6], ["sieve"])[0]  # serial first: workers then load its compiled loop
    curves = sweep_chunked(ct, [3, 6], ["lru", "sieve"], jobs=2)
    assert [int(x) for x in curves[1].copies_steady] == [int(x) for x in serial.copies_steady]


def rounded(record: dict) -> dict:
    """A stats record with its reuse means rounded (sums of chunks add in another order)."""
    out = {}
    for key, value in record.items():
        if key == "per_layer":
            value = [rounded(x) for x in value]
        elif key.startswith("reuse") and isinstance(value, float):
            value = round(value, 12)
        out[key] = value
    return out


def test_stats_of_chunks_equal_the_whole_trace(chunked):
    for ct in chunked:
        a, b = locality_report_chunked(ct), locality_report(ct.load())
        assert rounded(a.to_dict()) == rounded(b.to_dict())
        assert np.array_equal(a.hot, b.hot)


def test_synth_chunks_share_one_model_and_are_reproducible(tmp_path):
    params = PRESETS["olmoe"].params.with_overrides(tokens=50, sequences=5)
    a = list(synthesize_chunks(params, 3, chunk_sequences=2, preset="olmoe"))
    b = list(synthesize_chunks(params, 3, chunk_sequences=2, preset="olmoe"))
    assert [p.num_sequences for p in a] == [2, 2, 1]
    assert all(np.array_equal(x.experts, y.experts) for x, y in zip(a, b))
    assert [int(p.seq[0]) for p in a] == [0, 2, 4]
    assert not np.array_equal(a[0].experts[:50], a[1].experts[:50])  # each piece its own draws
    ct = write(tmp_path / "s", a)
    assert (ct.num_tokens, ct.num_sequences, ct.num_chunks) == (250, 5, 3)
    assert ct.meta["provenance"]["chunk_sequences"] == 2


def test_the_writer_is_atomic_and_keeps_other_folders(tmp_path):
    rng = np.random.default_rng(0)
    pieces = random_pieces(rng)
    with pytest.raises(RuntimeError):
        with ChunkWriter(tmp_path / "t") as w:
            w.add(pieces[0])
            raise RuntimeError("stop")
    assert not (tmp_path / "t").exists() and not list(tmp_path.iterdir())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a chunked trace"):
        ChunkWriter(tmp_path / "other")
    write(tmp_path / "t", pieces)
    write(tmp_path / "t", pieces[:1])  # a chunked trace is replaced whole
    assert open_chunked(tmp_path / "t").num_chunks == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "t"]
    with pytest.raises(ConfigError, match="not above"):
        with ChunkWriter(tmp_path / "u") as w:
            w.add(pieces[1])
            w.add(pieces[0])
    # a chunk that is not a trace had ended as AttributeError; seq_offset 2.5 wrote float sequence ids
    for chunk, offset, says in ((None, 0, "a chunk must be a Trace"), (pieces[0], 2.5, "seq_offset must be"),
                                (pieces[0], -1, "seq_offset must be"), (pieces[0], 10**5000, "seq_offset must be")):
        with pytest.raises(ConfigError, match=says):
            with ChunkWriter(tmp_path / "v") as w:
                w.add(chunk, seq_offset=offset)
        assert not (tmp_path / "v").exists()



def test_a_killed_writers_partial_folder_is_removed_by_the_next_writer(tmp_path):
    """A writer killed mid-trace (no ``finally``) leaves ``.t.<pid>.<hex>.partial`` holding every
    chunk it wrote; the next writer of the same trace removes it once that process is gone, and
    keeps a live writer's and another trace's."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".t.{dead.pid}.0123abcd.partial"
    (stale / "sub").mkdir(parents=True)
    (stale / "chunk-000000.npz").write_bytes(b"x" * 1000)
    aside = tmp_path / f".t.{dead.pid}.4567abcd.old"
    aside.mkdir()
    others = [tmp_path / f".u.{dead.pid}.89abcdef.partial", tmp_path / f".t.{os.getpid()}.89abcdef.partial"]
    for other in others:
        other.mkdir()
    write(tmp_path / "t", random_pieces(np.random.default_rng(0))[:1])
    assert not stale.exists() and not aside.exists() and all(o.exists() for o in others)
    assert open_chunked(tmp_path / "t").num_chunks == 1

def _edit(path, fn):
    doc = json.loads((path / MANIFEST).read_text())
    fn(doc)
    (path / MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format="x"), "not a chunked trace manifest"),
    (lambda d: d.update(version=9), "version 9"),
    (lambda d: d["chunks"][0].update(file="../x.npz"), "expected a name like"),
    (lambda d: d["chunks"][1].update(first_seq=0), "overlap the previous chunk"),
    (lambda d: d.update(tokens=1), "the chunks hold"),
    (lambda d: d["chunks"][0].update(tokens="many"), "expected an integer"),
    (lambda d: d.update(layer_ids=[0, 0, 1, 2]), "distinct layer ids"),
    (lambda d: d.update(chunks=[]), "non-empty list"),
])
def test_a_bad_manifest_is_one_line(tmp_path, edit, message):
    rng = np.random.default_rng(1)
    write(tmp_path / "t", random_pieces(rng))
    _edit(tmp_path / "t", edit)
    with pytest.raises(TraceError, match=message):
        open_chunked(tmp_path / "t")


def test_a_chunk_unlike_its_manifest_is_one_line(tmp_path):
    rng = np.random.default_rng(2)
    ct = write(tmp_path / "t", random_pieces(rng))

    def lie(d):
        d["chunks"][0]["tokens"] += 1
        d["tokens"] += 1
    _edit(tmp_path / "t", lie)
    with pytest.raises(TraceError, match="holds .* tokens .* says"):
        replay_chunked(open_chunked(tmp_path / "t"), 5, ["lru"])
    (ct.root / ct.chunks[1].file).unlink()
    _edit(tmp_path / "t", lambda d: d["chunks"][0].update(tokens=d["chunks"][0]["tokens"] - 1) or
          d.update(tokens=d["tokens"] - 1))
    with pytest.raises(TraceError, match="no such file"):
        replay_chunked(open_chunked(tmp_path / "t"), 5, ["lru"])


def run_cli(capsys, monkeypatch, cwd, *args):
    """``expertcache ARGS`` in this process: (exit status, stdout, stderr)."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_synth_replay_sweep_stats_on_chunks(tmp_path, capsys, monkeypatch):
    def cli(*args):
        return run_cli(capsys, monkeypatch, tmp_path, *args)

    rc, out, err = cli("synth", "--preset", "olmoe", "--tokens", "40", "--sequences", "5", "--chunk-sequences", "2",
                       "--out", "ch", "--json")
    assert rc == 0, err
    assert json.loads(out)["chunks"] == 3
    open_chunked(tmp_path / "ch").load().save(tmp_path / "whole.npz")
    for cmd in (["replay", "-c", "12", "-p", "lru", "-p", "belady", "--reset", "none"],
                ["sweep", "--capacities", "8,16,40", "--pool", "global"],
                ["stats", "--windows", "1,8"]):
        a, b = cli(cmd[0], "ch", *cmd[1:], "--json"), cli(cmd[0], "whole.npz", *cmd[1:], "--json")
        assert a[0] == 0 and b[0] == 0, a[2] + b[2]
        ra = [strip(json.loads(x)) for x in a[1].splitlines()]
        rb = [strip(json.loads(x)) for x in b[1].splitlines()]
        if cmd[0] == "stats":
            ra, rb = ([rounded(x) | {"path": None} for x in r] for r in (ra, rb))
        assert ra == rb
    assert "3 chunk(s) on disk" in cli("replay", "ch", "-c", "12")[1]
    for cmd, message in ((["bounds", "ch", "--capacity", "8"], "is a chunked trace"),
                         (["replay", "ch", "-c", "12", "--sequences", "0-1"], "replayed whole"),
                         (["sweep", "ch", "--target-hit-rate", "0.5"], "need the whole trace"),
                         (["synth", "--preset", "olmoe", "--chunk-sequences", "2", "--out", "x.npz"], "is a folder")):
        rc, out, err = cli(*cmd)
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_grid_cells_of_a_chunked_trace_equal_the_whole_trace(tmp_path, chunked):
    pytest.importorskip("pyarrow")
    from expertcache.grid import load_spec
    from expertcache.grid.runner import run_grid
    from expertcache.grid.store import Store

    ct = chunked[1]
    ct.load().save(tmp_path / "whole.npz")
    (tmp_path / "grid.toml").write_text(f'traces = ["{ct.root}", "whole.npz"]\npolicies = ["lru", "belady", "arc"]\n'
                                        'capacities = [4, 7]\npools = ["layer", "global"]\nreset = ["sequence", "none"]\n')
    spec = load_spec(tmp_path / "grid.toml")
    assert spec.traces[0].ident.startswith("sha256:") and spec.traces[0].ident != spec.traces[1].ident
    run_grid(spec, tmp_path / "res", jobs=1)
    rows = Store(tmp_path / "res").read_rows()
    drop = ("key", "trace", "trace_id", "trace_name", "seconds")

    def cells(label):
        return sorted((json.dumps({k: v for k, v in r.items() if k not in drop}, sort_keys=True)
                       for r in rows if r["trace"] == label))
    assert len(cells(str(ct.root))) == 3 * 2 * 2 * 2
    assert cells(str(ct.root)) == cells(str(tmp_path / "whole.npz"))


def test_a_chunk_replaced_after_writing_is_refused_by_its_digest(tmp_path):
    """A chunk copied over from another trace of the same shape had been replayed as this trace's
    (and a grid kept its results under the same key): the manifest records each chunk's SHA-256."""
    import json as _json
    import shutil

    from expertcache.trace.chunked import open_chunked, write_trace_chunked
    from expertcache.trace.synth import synthesize_preset

    for seed, name in ((1, "a"), (2, "b")):
        write_trace_chunked(synthesize_preset("olmoe", seed=seed, tokens=20, sequences=4, num_layers=2),
                            tmp_path / name, chunk_sequences=2)
    doc = _json.loads((tmp_path / "a" / "chunks.json").read_text())
    assert all(len(c["sha256"]) == 64 for c in doc["chunks"])
    open_chunked(tmp_path / "a").load()  # intact: read
    shutil.copy(tmp_path / "b" / "chunk-000000.npz", tmp_path / "a" / "chunk-000000.npz")
    with pytest.raises(TraceError, match="its bytes are not the ones chunks.json records"):
        open_chunked(tmp_path / "a").chunk(0)
