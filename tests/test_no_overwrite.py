"""No command destroys its input (issue 24, item 1): an output path that is an input (the same
path, a hard link, a symbolic link, or a trace folder's routing.npz / a checkpoint's config) is
refused in one line, exit 2, before any work, and the input is left byte for byte as it was."""

from __future__ import annotations

import json
import os
import stat

import pytest

import expertcache as ec
from expertcache._io import check_not_input, overwritten_input
from expertcache.cli.main import main
from expertcache.errors import ConfigError
from expertcache.trace.synth import synthesize_preset

LOG = [{"problem_id": "a", "layer": 0, "token_idx": t, "experts": [t % 4, (t + 1) % 4]} for t in range(6)]


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LOG))
    tr = synthesize_preset("olmoe", 0, tokens=40, sequences=2, num_layers=2)
    tr.save(tmp_path / "t.npz")
    tr.save(tmp_path / "u.npz")
    (tmp_path / "folder").mkdir()
    tr.save(tmp_path / "folder" / "routing.npz")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors.index.json"):
        (tmp_path / "model" / name).write_text("{}")
    os.link(tmp_path / "t.npz", tmp_path / "hard.npz")
    os.link(tmp_path / "t.npz", tmp_path / "hard.png")
    os.symlink(tmp_path / "t.npz", tmp_path / "soft.npz")
    (tmp_path / "plots").mkdir()  # demo writes mrc.png and foresight.png into --out
    (tmp_path / "plots" / "mrc.png").write_bytes((tmp_path / "u.npz").read_bytes())
    os.link(tmp_path / "t.npz", tmp_path / "plots" / "foresight.png")
    return tmp_path


# every command that writes a file, each with an output that is (a link of) one of its inputs
CASES = [
    ["import", "ok.jsonl", "--out", "ok.jsonl"],
    ["import", "vllm-jsonl", "ok.jsonl", "-o", "ok.jsonl"],
    ["learn", "dataset", "t.npz", "-c", "4", "--out", "t.npz"],
    ["learn", "dataset", "t.npz", "-c", "4", "--out", "hard.npz"],
    ["learn", "dataset", "t.npz", "-c", "4", "--out", "soft.npz"],
    ["learn", "dataset", "folder", "-c", "4", "--out", "folder/routing.npz"],
    ["learn", "train", "t.npz", "--out", "t.npz"],
    ["batch", "t.npz", "u.npz", "--out", "u.npz"],
    ["export", "libcachesim", "t.npz", "--out", "hard.npz"],
    ["sweep", "t.npz", "--capacities", "4:8", "--plot", "hard.png"],
    ["sweep", "u.npz", "--capacities", "4:8", "-p", "learned:t.npz", "--plot", "hard.png"],  # NAME:PATH
    ["capture", "--model", "model", "--tokens", "t.npz", "--out", "model/config.json"],
    ["capture", "--model", "model", "--tokens", "t.npz", "--out", "model/model.safetensors.index.json"],  # shards' map
    ["capture", "--model", "model", "--tokens", "t.npz", "--out", "model/tokenizer.json"],  # what --text reads
    ["eval", "--model", "model", "--tokens", "t.npz", "--capture", "model/generation_config.json", "-c", "4"],
    ["eval", "--model", "model", "--tokens", "t.npz", "--capture", "t.npz", "-c", "4"],
    ["controller", "train", "--model", "model", "--tokens", "t.npz", "-c", "4", "--out", "t.npz"],
    ["grid", "t.npz", "--out", "t.npz"],
    ["demo", "--trace", "plots/mrc.png", "--out", "plots", "--no-live"],  # a file the demo writes into --out
    ["demo", "--trace", "t.npz", "--out", "plots", "--no-live"],  # its foresight.png is a link of the trace
]


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a))
def test_an_output_that_is_an_input_is_refused_and_the_input_is_intact(files, capsys, argv):
    before = {p: p.read_bytes() for p in files.rglob("*") if p.is_file()}
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refusing to overwrite an input" in err, err
    assert {p: p.read_bytes() for p in files.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in files.iterdir() if p.name.startswith(".")) == []  # no temporaries


def test_a_new_output_or_an_unrelated_existing_one_is_still_written(files, capsys):
    assert main(["import", "ok.jsonl", "--out", "new.npz"]) == 0
    assert main(["import", "ok.jsonl", "--out", "new.npz"]) == 0  # rewriting an earlier output is fine
    assert ec.load_trace(files / "new.npz").num_tokens == 6
    assert main(["learn", "dataset", "folder", "-c", "16", "--out", "folder/events.npz", "--json"]) == 0
    capsys.readouterr()


def test_the_check_itself(files):
    assert overwritten_input("t.npz", ["t.npz"]) == "the input t.npz"
    assert overwritten_input("hard.npz", ["x", "t.npz"]) == "the input t.npz (the same file)"
    assert overwritten_input("missing.npz", ["t.npz"]) is None
    assert overwritten_input("u.npz", ["t.npz", "folder", "a\0b"]) is None  # a copy is another file
    assert overwritten_input("folder/routing.npz", ["folder"]) == "a file of the input folder folder"
    assert overwritten_input("model/config.json", ["./model"]) == "a file of the input folder ./model"
    assert overwritten_input("folder", ["folder"]) is None  # folders: their commands check them
    assert overwritten_input("model/tokenizer.json", ["model"]) == "a file of the input folder model"
    (files / "model" / "m.gguf").write_bytes(b"GGUF")  # convert's earlier output beside the checkpoint: rewritable
    assert overwritten_input("model/m.gguf", ["model"]) is None
    with pytest.raises(ConfigError, match="^--plot hard.png: is the input t.npz"):
        check_not_input("hard.png", ["t.npz"], "--plot")


def test_an_output_that_is_a_link_is_written_through_and_the_link_stays(files, capsys):
    """A symbolic link as ``--out`` (``/dev/stdout`` with stdout sent to a file is one) replaces the
    file it points to; renaming over the link had turned ``/dev/stdout`` into a regular file."""
    (files / "old.npz").write_bytes(b"old")
    os.symlink("old.npz", files / "out-link.npz")
    assert main(["synth", "--preset", "olmoe", "--tokens", "5", "--sequences", "2", "--out", "out-link.npz"]) == 0
    capsys.readouterr()
    assert os.path.islink(files / "out-link.npz") and os.readlink(files / "out-link.npz") == "old.npz"
    assert ec.load_trace(files / "old.npz").num_tokens == 10
    assert sorted(p.name for p in files.iterdir() if p.name.startswith(".")) == []


def test_a_grid_writes_into_an_unrelated_existing_folder_only_with_force(files, capsys):
    pytest.importorskip("pyarrow")
    (files / "g.toml").write_text('traces = ["t.npz"]\npolicies = ["lru"]\ncapacities = [8]\n')
    (files / "notes").mkdir()
    (files / "notes" / "a.txt").write_text("mine")
    assert main(["grid", "g.toml", "--out", "notes", "-j", "1"]) == 2
    err = capsys.readouterr().err
    assert "an existing folder holding no grid results (a.txt)" in err and "--force" in err
    assert sorted(p.name for p in (files / "notes").iterdir()) == ["a.txt"]
    assert main(["grid", "g.toml", "--out", "notes", "-j", "1", "--force", "--json"]) == 0
    assert main(["grid", "g.toml", "--out", "notes", "-j", "1", "--json"]) == 0  # now a results folder: resumes
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["skipped"] == 1
    assert main(["grid", "g.toml", "--out", "fresh", "-j", "1", "--json"]) == 0


@pytest.mark.parametrize("argv", [
    ["export", "libcachesim", "t.npz", "--out", "{fifo}"],
    ["synth", "--preset", "olmoe", "--out", "{fifo}"],
    ["export", "libcachesim", "t.npz", "--out", "{link}"],
    ["synth", "--preset", "olmoe", "--out", "/dev/null"],
])
def test_an_output_that_is_a_device_or_fifo_is_refused(files, capsys, argv):
    """An atomic write renames its temporary over the output: over a FIFO or a device (``/dev/null``,
    or a link to one) that would replace the special file with a regular one. Refused first, in
    one line; the special file stays."""
    os.mkfifo(files / "pipe")
    os.symlink("/dev/null", files / "null-link")
    argv = [a.format(fifo="pipe", link="null-link") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a regular file" in err[0], err
    assert stat.S_ISFIFO(os.stat(files / "pipe").st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert os.path.islink(files / "null-link")


def test_an_output_folder_that_cannot_be_written_is_said_before_any_work(files, capsys, monkeypatch):
    """A read-only mount refuses even root; ``os.access`` says so, and the option is named (a
    ``--plot`` path was reported as ``--out``, after the whole computation). Root passes permission
    bits, so the test stands in for the mount."""
    import expertcache._io as io

    real = io.os.access
    monkeypatch.setattr(io.os, "access", lambda p, mode: False if os.fspath(p) == "folder" else real(p, mode))
    assert main(["sweep", "t.npz", "--plot", "folder/x.png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["expertcache sweep: error: --plot folder/x.png: folder folder is not writable"], err
