"""One vocabulary across commands, one-line argument errors, and help texts that cite only what
is in this repository."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import expertcache as ec
from expertcache.cli.main import build_parser, main

COMMANDS = ["replay", "bounds", "verify-greedy", "synth", "stats", "sweep", "foresight", "compare-pools", "eval",
            "demo", "import", "export libcachesim"]


def subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    out = dict(action.choices)
    export = next(a for a in out["export"]._actions if a.dest == "format")
    out["export libcachesim"] = export.choices["libcachesim"]
    return out


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    rng = np.random.default_rng(0)
    ex = np.stack([[rng.choice(8, 2, replace=False) for _ in range(3)] for _ in range(40)])
    return ec.Trace.from_arrays(ex, np.repeat([0, 1], 20), num_experts=8, meta={"layer_ids": [1, 4, 6]}).save(
        tmp_path_factory.mktemp("v") / "t.npz")


@pytest.mark.parametrize("argv", [
    ["replay"], ["replay", "x.npz"], ["replay", "x.npz", "-c", "zero"], ["replay", "x.npz", "-c", "4", "--pool", "x"],
    ["sweep", "x.npz", "-c", "4"], ["synth", "--layers", "3"], ["stats"], ["bounds", "x", "-c", "2", "--order", "up"],
    ["nope"], ["replay", "x.npz", "-c", "4", "--layers", "3-1"], ["foresight", "x.npz", "-c", "4", "--reference", "lru"],
    ["compare-pools", "x.npz"], ["import"], ["eval", "--model", "m"], ["replay", "x.npz", "-c", "4", "--tau", "fast"],
])
def test_argument_errors_are_one_line_without_usage(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": error: " in err[0] and "usage:" not in err[0], err


def test_help_shows_usage_and_cites_only_files_in_the_repository(capsys):
    for name, parser in subparsers().items():
        text = parser.format_help()
        assert text.startswith("usage:"), name
        for banned in ("DESIGN", "seed 0", "seeds 0", "shared/seeds"):
            assert banned not in text, f"{name} --help cites {banned!r}"
        for doc in re.findall(r"docs/[\w.-]+\.md", text):
            from conftest import REPO

            assert (REPO / doc).is_file(), f"{name} --help cites {doc}, which does not exist"


def test_one_option_vocabulary():
    parsers = subparsers()
    options = {name: {s for a in p._actions for s in a.option_strings} for name, p in parsers.items()}
    for name in ("replay", "bounds", "foresight", "eval", "demo"):
        assert {"-c", "--capacity"} <= options[name], name
    for name in ("sweep", "compare-pools"):
        assert "--capacities" in options[name], name
    assert "-c" not in options["sweep"]  # -c is always one capacity
    for name in ("replay", "bounds", "sweep", "foresight", "compare-pools", "eval", "export libcachesim"):
        assert "--layers" in options[name], name
    assert "--num-layers" in options["synth"] and "--layers" not in options["synth"]
    assert "--num-experts" in options["synth"] and "--num-experts" in options["import"]
    for name in ("replay", "sweep", "foresight", "compare-pools", "eval"):
        assert {"-p", "--policy"} <= options[name], name
    assert "--reference" not in options["foresight"]
    for name in ("synth", "import", "export libcachesim"):
        assert {"-o", "--out"} <= options[name], name


def test_json_fields_are_named_the_same_everywhere(tmp_path, capsys, trace_path):
    runs = {
        "replay": ["replay", str(trace_path), "-c", "3", "-p", "lru", "--json"],
        "sweep": ["sweep", str(trace_path), "--capacities", "2:4", "-p", "lru", "--json"],
        "foresight": ["foresight", str(trace_path), "-c", "3", "--json"],
        "compare-pools": ["compare-pools", str(trace_path), "-c", "3", "-p", "lru", "--json"],
        "bounds": ["bounds", str(trace_path), "-c", "3", "--json"],
        "stats": ["stats", str(trace_path), "--json"],
        "synth": ["synth", "--preset", "olmoe", "--tokens", "8", "--num-layers", "2", "--out", str(tmp_path / "s.npz"), "--json"],
        "export": ["export", "libcachesim", str(trace_path), "--out", str(tmp_path / "x.csv"), "--json"],
    }
    for name, argv in runs.items():
        assert main(argv) == 0, name
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        for rec in records:
            if "layers" in rec:
                assert isinstance(rec["layers"], list), (name, rec["layers"])
            if name in ("replay", "sweep", "foresight", "compare-pools") and rec.get("record") != "target":
                assert {"policy", "capacity", "needs_future", "trace"} <= rec.keys(), (name, sorted(rec))
        if name in ("synth", "export"):
            assert records[0]["out"].endswith((".npz", ".csv"))
    assert records and "path" not in records[0]
