"""The command line: tables, --json records, one-line errors with a non-zero exit, --help."""

from __future__ import annotations

import importlib.util

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import expertcache as ec
from conftest import REPO
from expertcache.cli.main import build_parser, main


def run(*argv):
    return subprocess.run([sys.executable, "-m", "expertcache.cli.main", *map(str, argv)], capture_output=True, text=True)


@pytest.fixture
def trace_file(tmp_path):
    rng = np.random.default_rng(0)
    ex = np.stack([[rng.choice(16, 4, replace=False) for _ in range(2)] for _ in range(120)])
    return ec.Trace.from_arrays(ex, np.repeat([0, 1], 60), num_experts=16, meta={"name": "toy"}).save(tmp_path / "t.npz")


def test_replay_json_has_the_contract_fields(trace_file, capsys):
    assert main(["replay", str(trace_file), "--capacity", "8", "-p", "lru", "-p", "decayed:0.9", "-p", "belady", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in records] == ["lru", "decayed:0.9", "belady"]
    for r in records:
        for key in ("policy", "capacity", "tokens", "requests", "copies_total", "copies_steady", "copies_per_token", "hit_rate"):
            assert key in r
        direct = ec.replay(ec.load_trace(trace_file), 8, r["policy"])
        assert (r["copies_total"], r["copies_steady"], r["tokens"]) == (direct.copies_total, direct.copies_steady, 120)
    assert records[0]["gap_recovered"] == 0.0 and records[2]["gap_recovered"] == 1.0
    assert [r["needs_future"] for r in records] == [False, False, True]


def test_replay_table(trace_file, capsys):
    assert main(["replay", str(trace_file), "-c", "8", "--pool", "global", "--warm", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "trace toy" in out and "copies/token" in out and "lru" in out and "belady" in out
    header, _, lru, belady = out.splitlines()[2:]
    assert header.split()[:2] == ["policy", "future"]
    assert lru.split()[1] != "yes" and belady.split()[1] == "yes"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["replay", "{t}", "-c", "2"], "capacity 2 is below the 4 experts"),
        (["replay", "{t}", "-c", "8", "-p", "fifo"], "unknown policy 'fifo'"),
        (["replay", "{t}", "-c", "8", "-p", "decayed:2"], "decayed:beta: 2 is outside (0.0, 1.0]"),
        (["replay", "{t}", "-c", "8", "-p", "foresight:x"], "foresight:h: expected an integer"),
        (["replay", "{t}", "-c", "8", "--layers", "9"], "layer 9 is not in this trace"),
        (["replay", "missing.npz", "-c", "8"], "missing.npz: no such file"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(trace_file, argv, message):
    proc = run(*[a.format(t=trace_file) for a in argv])
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_python_m_runs_the_command(trace_file):
    """``python -m expertcache`` is the ``expertcache`` command: its output, its one-line errors."""
    command = subprocess.run([sys.executable, "-m", "expertcache", "replay", trace_file, "-c", "8", "--json"],
                             capture_output=True, text=True)
    untimed = lambda out: [{k: v for k, v in json.loads(line).items() if k != "seconds"}  # noqa: E731
                           for line in out.splitlines()]
    assert command.returncode == 0
    assert untimed(command.stdout) == untimed(run("replay", trace_file, "-c", "8", "--json").stdout)
    wrong = subprocess.run([sys.executable, "-m", "expertcache", "replay", "missing.npz", "-c", "8"],
                           capture_output=True, text=True)
    assert wrong.returncode == 2 and wrong.stderr.startswith("expertcache replay: error: missing.npz: no such file")
    assert len(wrong.stderr.splitlines()) == 1


def test_argparse_errors_exit_2(trace_file):
    proc = run("replay", trace_file, "--capacity", "zero")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_every_command_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        text = p.format_help()
        assert "usage:" in text and len(text) > 100, name


def _helps(parser, path=()) -> dict:
    """The help text of every parser below ``parser``, by its path of command names."""
    out = {path: parser.format_help()}
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, p in action.choices.items():
                out.update(_helps(p, path + (name,)))
    return out


def test_one_commands_parser_is_the_whole_parsers_part(capsys):
    """``main`` builds only the parser of the command it runs: for every command, every parser below
    it (its subcommands too) has the help the whole parser gives it; a name no command has, or none,
    is refused by the whole parser (the choices listed)."""
    whole = _helps(build_parser())
    names = {path[0] for path in whole if path}
    assert len(names) > 20
    for name in names:
        own = {path: text for path, text in _helps(build_parser(name)).items() if path}
        assert own == {path: text for path, text in whole.items() if path and path[0] == name}, name
    for argv, said in ((["bogus"], "invalid choice: 'bogus' (choose from 'replay', "), ([], "required: COMMAND")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and said in err[0], err
        assert "'serve')" in err[0] or not argv, err  # every command listed


def test_import_export_round_trip(tmp_path, capsys):
    log = tmp_path / "routing.jsonl"
    recs = [{"problem_id": s, "layer": l, "token_idx": t, "experts": [(t + l + s) % 6, (t + l + s + 1) % 6], "gating_probs": [0.7, 0.3]}
            for s in (3, 1) for t in range(5) for l in (0, 2)]
    log.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    out = tmp_path / "t.npz"
    assert main(["import", "vllm-jsonl", str(log), "--out", str(out), "--num-experts", "6", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokens"] == 10 and info["sequences"] == 2 and info["layers"] == [0, 2] and info["num_layers"] == 2
    assert info["format"] == "vllm-jsonl" and info["out"] == str(out)
    t = ec.load_trace(out)
    assert t.layer_ids == [0, 2] and t.meta["sequence_ids"] == {"0": 3, "1": 1}
    assert t.experts[0, 1].tolist() == recs[1]["experts"]
    csv = tmp_path / "t.csv"
    assert main(["export", "libcachesim", str(out), "--out", str(csv), "--order", "ascending"]) == 0
    lines = csv.read_text().splitlines()
    assert lines[0] == "time,obj_id,obj_size" and len(lines) == 1 + 10 * 2 * 2


def test_import_errors(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}\n{"problem_id": 0, "layer": 0}\n')
    proc = run("import", "vllm-jsonl", log, "--out", tmp_path / "x.npz")
    assert proc.returncode == 2 and "bad.jsonl:2: missing field 'token_idx'" in proc.stderr
    log.write_text('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 1]}\n')
    proc = run("import", "vllm-jsonl", log, "--out", tmp_path / "x.npz")
    assert proc.returncode == 2 and "bad.jsonl:1: field 'experts': an id appears twice" in proc.stderr
    log.write_text('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}\nnot json\n')
    proc = run("import", "vllm-jsonl", log, "--out", tmp_path / "x.npz")
    assert proc.returncode == 2 and "bad.jsonl:2: not valid JSON" in proc.stderr
    assert not (tmp_path / "x.npz").exists()


def test_demo_prints_the_table_and_writes_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_SHARED_TRACES", str(tmp_path / "none"))
    assert main(["demo", "--out", str(tmp_path / "out"), "--repeats", "1"]) == 0  # one round: repeats are tested with eval
    out = capsys.readouterr().out
    for word in ("lru", "belady", "foresight:16", "B_flat", "h=16", "ms/tok", "GB/s", "tok/s", "future"):
        assert word in out
    assert "tau 0.51 ms per copy (the eviction paper's L40S)" in out
    assert "expert 12.58 MB (12,582,912 bytes, trace meta expert_bytes)" in out
    assert (tmp_path / "out" / "mrc.png").stat().st_size > 10_000
    assert (tmp_path / "out" / "foresight.png").stat().st_size > 10_000
    from expertcache.cli.demo_live import small_model

    live = importlib.util.find_spec("torch") is not None and small_model() is not None
    if live:  # set-holding against lossless rules on the small trained model, and the policy choice
        assert "live: small-moe" in out and "choose --tolerance 0.15" in out and "at x50: predicted" in out
        lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("lru ", "prefix:32 "))}
        assert float(lines["lru"][1]) == 0.0 and float(lines["prefix:32"][1]) > 0  # dnll: lossless 0, held set > 0
        assert float(lines["prefix:32"][3]) < float(lines["lru"][3])  # ... and fewer copies per token
    else:
        assert "live part skipped" in out
    assert main(["demo", "--out", str(tmp_path / "out"), "--no-live"]) == 0
    assert "live" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------ options (issue 24, item 7)
def _refusal(argv, capsys) -> str:
    """Run ``argv`` in this process; it must exit 2 with exactly one line on stderr, which is returned."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's error path
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["replay", "{t}", "-c", "8", "-c", "16"], "--capacity/-c given twice (-c 8 and -c 16): give it once"),
    (["replay", "{t}", "-c", "8", "--capacity", "8"], "given twice (-c 8 and --capacity 8)"),
    (["replay", "{t}", "-c", "8", "--warm", "0.1", "--warm", "0.2"], "--warm given twice"),
    (["sweep", "{t}", "--capacities", "4:8", "--capacities", "4:9"], "--capacities given twice"),
    (["learn", "dataset", "{t}", "-c", "8", "-c", "9", "--out", "x.npz"], "given twice (-c 8 and -c 9)"),
    (["replay", "{t}", "-c", "8", "-p", "lru", "-p", "lru"], "-p lru given twice: give each value once"),
    (["replay", "{t}", "-c", "8", "-p", "lru", "--policy", "lru"], "--policy lru given twice"),
    (["sweep", "{t}", "--capacities", "4:8", "-p", "belady", "-p", "belady"], "-p belady given twice"),
])
def test_a_repeated_option_or_a_duplicate_policy_is_refused(trace_file, capsys, argv, message):
    assert message in _refusal([a.format(t=trace_file) for a in argv], capsys)


@pytest.mark.parametrize("argv, message", [
    (["replay", "{t}", "--budget", "-4GB"], "argument --budget: cannot read '-4GB' as a size"),
    (["replay", "{t}", "-c", "8", "--c", "-1ms"], "argument --c: expected a positive duration, got '-1ms'"),
    (["replay", "{t}", "-c", "-3"], "expected a positive integer up to 2**62, got '-3'"),
    (["replay", "{t}", "-c", "8", "--warm", "-.5"], "-.5 is outside [0, 1)"),
    (["learn", "eval", "--traces", "{t}", "-c", "-4"], "argument --capacity/-c: expected a positive integer"),
])
def test_negative_values_say_what_is_wrong(trace_file, capsys, argv, message):
    err = _refusal([a.format(t=trace_file) for a in argv], capsys)
    assert message in err and "expected one argument" not in err


def test_numpy_pickle_advice_never_reaches_the_user(tmp_path, capsys, trace_file):
    import pickle

    from expertcache.tier.advice import load_plan

    np.savez(tmp_path / "obj.npz", X=np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "pick.npz").write_bytes(pickle.dumps({"a": 1}))
    np.savez(tmp_path / "plan.npz", experts=np.array([{"a": 1}], dtype=object), allow_pickle=True)
    errors = []
    for name in ("obj.npz", "obj.npy", "pick.npz"):
        f = str(tmp_path / name)
        errors.append(_refusal(["learn", "train", f, "--out", str(tmp_path / "s.npz")], capsys))
        errors.append(_refusal(["replay", str(trace_file), "-c", "8", "-p", f"learned:{f}"], capsys))
    with pytest.raises(ec.ConfigError) as info:
        load_plan(tmp_path / "plan.npz", (120, 2, 4), 16)
    errors.append(str(info.value))
    for err in errors:
        assert "allow_pickle" not in err and "unsafe" not in err and "pickle.load" not in err, err
    # the .npy is no archive at all, whatever it holds (numpy had returned it as one array: exit 70)
    assert ["a single .npy array, not an .npz archive" in e for e in errors] == [0, 0, 1, 1, 0, 0, 0]
    # the scorer file reads its version first and says it is missing; every other one names the pickle
    assert ["pickled (object) data, which expertcache never loads" in e for e in errors] == [1, 0, 0, 0, 1, 1, 1]


def test_foresight_0_is_lru_and_not_marked_as_needing_the_future(trace_file, capsys):
    assert main(["replay", str(trace_file), "-c", "8", "-p", "foresight:0", "-p", "lru", "-p", "foresight:1", "--json"]) == 0
    f0, lru, f1 = (json.loads(x) for x in capsys.readouterr().out.splitlines())
    assert f0["copies_total"] == lru["copies_total"] and not f0["needs_future"] and f1["needs_future"]
    cache = ec.ExpertCache(8, "foresight:0", 16)  # the step-by-step engine, and no future given
    ref = ec.ExpertCache(8, "lru", 16)
    trace = ec.load_trace(trace_file)
    for row in trace.experts[:60, 0]:
        assert cache.prepare(row).loads == ref.prepare(row).loads


def test_an_unknown_policy_lists_every_policy_string(capsys, trace_file):
    err = _refusal(["replay", str(trace_file), "-c", "8", "-p", "nosuch"], capsys)
    for word in ("lru", "belady", "foresight", "learned", "dwell:k[:w]", "prefix:P", "controller:HEADS.pt:THR[:W]"):
        assert word in err
    with pytest.raises(ec.PolicyError, match=r"dwell:k\[:w\], prefix:P, controller"):
        ec.make_policy("nosuch")


def test_load_trace_on_a_path_with_a_nul_byte_raises_the_projects_error(tmp_path, capsys):
    from expertcache.trace.npz import read_npy

    with pytest.raises(ec.TraceError, match="NUL byte"):
        ec.load_trace(str(tmp_path / "a\0b.npz"))
    with pytest.raises(ec.TraceError, match="NUL byte"):
        read_npy("x\0.npy", "--tokens")
    assert "NUL byte" in _refusal(["replay", "a\0b.npz", "-c", "8"], capsys)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="needs torch and transformers")
@pytest.mark.parametrize("argv", [
    ["capture", "--model", "{m}", "--tokens", "{t}", "--out", "x.npz"],
    ["eval", "--model", "{m}", "--tokens", "{t}", "-c", "4"],
])
def test_a_missing_model_folder_says_so(tmp_path, capsys, argv):
    m = tmp_path / "nonexist"
    np.save(tmp_path / "ids.npy", np.arange(10))
    err = _refusal([a.format(m=m, t=tmp_path / "ids.npy") for a in argv], capsys)
    assert f"--model {m}: no such folder" in err


def test_a_trace_without_meta_says_its_E_was_inferred(tmp_path, capsys):
    """A trace file without ``meta`` loads with E = its largest id + 1 (semantics.md); the commands
    say so on stderr, since figures per expert (coverage) divide by it."""
    path = tmp_path / "nometa.npz"
    np.savez(path, experts=np.array([[[0, 1]], [[2, 3]], [[1, 2]]], dtype=np.int16), seq=np.zeros(3, np.int32))
    assert main(["stats", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{path}: E = 4 was inferred from its largest expert id, the model's experts not being recorded" in err
    # an imported log that records no E: its meta says so, and the note does not claim there is no meta
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"problem_id": "a", "layer": 0, "token_idx": t, "experts": [t % 3, 5]}) + "\n"
                           for t in range(4)))
    assert main(["import", "vllm-jsonl", str(log), "--out", str(tmp_path / "imp.npz")]) == 0
    capsys.readouterr()
    assert main(["stats", str(tmp_path / "imp.npz")]) == 0
    err = capsys.readouterr().err
    assert "E = 6 was inferred" in err and "no meta" not in err


def _small_moe_with_a_stale_shard(tmp_path, command: str):
    """models/small-moe copied to ``tmp_path/m``, its one file copied again as a second shard (a
    shard of another download); skips where the checkout lacks the model or ``command`` its extra."""
    import shutil
    from pathlib import Path

    small = Path(__file__).resolve().parents[1] / "models" / "small-moe"
    if not (small / "model.safetensors").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    if command == "convert" and importlib.util.find_spec("gguf") is None:
        pytest.skip("convert needs the llama extra (gguf)")
    m = tmp_path / "m"
    shutil.copytree(small, m)
    shutil.copy(m / "model.safetensors", m / "model-00002-of-00002.safetensors")
    return small, m


@pytest.mark.parametrize("argv", [
    ["size", "--model-config", "{m}", "--device-memory", "1GB"],  # had doubled the expert bytes, exit 0
    ["tier", "write", "--pool", "{tmp}/pool", "--from-safetensors", "{m}"],  # had listed each slice twice
    ["convert", "{m}", "--out", "{tmp}/m.gguf"],  # had taken the later file's tensor
])
def test_a_tensor_two_shards_hold_is_refused(tmp_path, argv):
    """A stale shard beside a re-saved checkpoint (here small-moe's one file, copied as a second
    shard) and no shard index: every reader of the folder's safetensors headers refuses it in one line."""
    _, m = _small_moe_with_a_stale_shard(tmp_path, argv[0])
    proc = run(*(a.format(m=m, tmp=tmp_path) for a in argv))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "model.safetensors: tensor 'lm_head.weight' is also in model-00002-of-00002.safetensors" in proc.stderr


@pytest.mark.parametrize("argv", [
    ["size", "--model-config", "{m}", "--device-memory", "1GB"],
    ["tier", "write", "--pool", "{tmp}/pool", "--from-safetensors", "{m}"],
    ["convert", "{m}", "--out", "{tmp}/m.gguf"],
    ["capture", "--model", "{m}", "--tokens", "{ids}", "--out", "{tmp}/t.npz"],  # these two had been refused too
    ["eval", "--model", "{m}", "--tokens", "{ids}", "-c", "4", "--host", "mmap"],
])
def test_a_shard_index_names_the_files_read(tmp_path, argv):
    """A sharded checkpoint's model.safetensors.index.json names its files, and transformers loads
    those: a shard of another download left beside them had been read too (and refused as holding
    the same tensors twice). Every reader now takes the files the index names; an index that names
    a missing file, one outside the folder or not a table is one line."""
    from safetensors.numpy import load_file

    from expertcache.costmodel.model import read_model

    small, m = _small_moe_with_a_stale_shard(tmp_path, argv[0])
    if argv[0] in ("capture", "eval"):
        pytest.importorskip("transformers")
    np.save(tmp_path / "ids.npy", np.arange(2, 26, dtype=np.int64).reshape(2, 12))
    argv = [a.replace("{ids}", str(tmp_path / "ids.npy")) for a in argv]
    names = list(load_file(str(m / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in names}}
    (m / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run(*(a.format(m=m, tmp=tmp_path) for a in argv))
    assert proc.returncode == 0, proc.stderr
    if argv[0] == "size":
        clean, indexed = read_model(small), read_model(m)
        assert (clean.expert_bytes, clean.other_bytes) == (indexed.expert_bytes, indexed.other_bytes)
    (tmp_path / "again").mkdir()
    for weight_map, says in (({names[0]: "missing.safetensors"}, "names missing.safetensors, which is not in"),
                             ({names[0]: "../model.safetensors"}, "not a .safetensors file of this folder"),
                             ({names[0]: "config.json"}, "not a .safetensors file of this folder"),
                             ([["x", "model.safetensors"]], "weight_map is not a table")):
        (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        proc = run(*(a.format(m=m, tmp=tmp_path / "again") for a in argv))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [
    ["llama", "info", "{fifo}.gguf"],
    ["size", "--model-config", "{fifo}.gguf", "--device-memory", "1GB"],  # had said "the folder holds no config.json"
    ["size", "--model-config", "{m}", "--device-memory", "1GB"],
    ["tier", "write", "--pool", "{tmp}/pool", "--from-safetensors", "{m}"],
    ["convert", "{m}", "--out", "{tmp}/m.gguf"],
])
def test_a_fifo_for_a_model_file_is_refused_not_waited_on(tmp_path, argv):
    """A FIFO given as a GGUF, or as a checkpoint's shard, had been opened, and opening one waits for
    a writer: these commands hung for good (convert's safetensors open even past SIGTERM). Each
    readers' files are checked to be regular files first (``_io.regular_size``)."""
    import os
    import shutil
    from pathlib import Path

    small = Path(__file__).resolve().parents[1] / "models" / "small-moe"
    if not (small / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    m = tmp_path / "m"
    m.mkdir()
    shutil.copy(small / "config.json", m / "config.json")
    os.mkfifo(m / "model.safetensors")
    os.mkfifo(tmp_path / "fifo.gguf")
    argv = [a.format(m=m, tmp=tmp_path, fifo=tmp_path / "fifo") for a in argv]
    proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "not a regular file (a FIFO, a device or a folder)" in proc.stderr


def _first_expert(header):
    return next(k for k in header if "experts" in k)


@pytest.mark.parametrize("edit, message", [
    # each had been a TypeError in tier write (exit 70) and counted as it stood by size (exit 0)
    (lambda h: h[_first_expert(h)].update(dtype=2.5), "dtype '2.5' is not a safetensors dtype"),
    (lambda h: h[_first_expert(h)].update(dtype="x"), "dtype 'x' is not a safetensors dtype"),
    (lambda h: h[_first_expert(h)].update(shape=["a", 2]), "shape ['a', 2] is not a list of non-negative integers"),
    (lambda h: h[_first_expert(h)].update(shape=[1]), "shape [1] of F16 is 2 bytes, but its data_offsets span 32768"),
    (lambda h: h.update({"__metadata__": {"format": 5}}), "safetensors __metadata__ is not a table of strings"),
    (lambda h: h[_first_expert(h)].update(data_offsets=[0, h[_first_expert(h)]["data_offsets"][1]
                                                        - h[_first_expert(h)]["data_offsets"][0]]),
     "overlap the tensor before"),
])
def test_a_safetensors_entry_the_format_forbids_is_refused(tmp_path, edit, message):
    """The header checks of the safetensors library, made by the one reader of the format: every
    command that reads headers only (size, tier write) refuses what convert's safe_open would."""
    import shutil
    import struct
    from pathlib import Path

    small = Path(__file__).resolve().parents[1] / "models" / "small-moe"
    if not (small / "model.safetensors").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    raw = (small / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    m = tmp_path / "m"
    shutil.copytree(small, m, ignore=shutil.ignore_patterns("model.safetensors"))
    (m / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    for argv in (["size", "--model-config", m, "--device-memory", "1GB"],
                 ["tier", "write", "--pool", tmp_path / "pool", "--from-safetensors", m]):
        proc = run(*argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [
    ["capture", "--model", "{m}", "--tokens", "{ids}", "--out", "{tmp}/t.npz"],
    ["eval", "--model", "{m}", "--tokens", "{ids}", "-c", "4"],
    ["controller", "train", "--model", "{m}", "--tokens", "{ids}", "--layers", "0-3", "-c", "8", "--out", "{tmp}/h.pt"],
    ["router-tune", "--model", "{m}", "--tokens", "{ids}", "--layer", "2", "--cache", "4", "--out", "{tmp}/rt"],
])
def test_a_bad_checkpoint_folder_is_refused_before_torch_is_imported(tmp_path, argv):
    """The commands that load a checkpoint with transformers refuse a folder without config.json, or
    with a shard index naming a missing file, before they import torch (5 s of imports here): a
    ``torch`` that exits 97 on import stands first on the path, and the refusal is the folder's."""
    small = REPO / "models" / "small-moe"
    if not (small / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    poison = tmp_path / "poison"
    poison.mkdir()
    (poison / "torch.py").write_text("import sys\nsys.exit(97)\n")
    np.save(tmp_path / "ids.npy", np.arange(2, 26, dtype=np.int64).reshape(2, 12))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(poison), os.environ.get("PYTHONPATH", "")]))
    bare, indexed = tmp_path / "bare", tmp_path / "indexed"
    bare.mkdir()
    indexed.mkdir()
    (indexed / "config.json").write_text((small / "config.json").read_text())
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    for folder, says in ((bare, "not a checkpoint folder (no config.json)"),
                         (indexed, "names missing.safetensors, which is not in the folder")):
        args = [a.format(m=folder, tmp=tmp_path, ids=tmp_path / "ids.npy") for a in argv]
        proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *args], capture_output=True, text=True,
                              env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
