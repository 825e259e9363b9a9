"""Counts that size a run's memory or time have a ceiling, each refused in one line before any work
(docs/robustness.md, "Options"): from hostile-input sweeps that found `--threads 100000` exhausting
the machine's threads (SIGSEGV), `--slow-copies 2**62` and `--calibrate 10**11` running for ever,
`router-tune --temperature 1e-300` overflowing the softmax (exit 70), `size --expert-mb 1e308` an
OverflowError (exit 70) and a config of 10^9 layers taking 24 GB."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from expertcache.cli.common import max_threads
from expertcache.cli.main import main


def _one_line(capsys, argv) -> str:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own refusal: one line too
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, (argv, code, err)
    return err


@pytest.mark.parametrize("argv, message", [
    (["llama", "run", "m.gguf", "--threads", "100000"], f"at most {max_threads()} (4 per core here)"),
    (["llama", "generate", "m.gguf", "--prompt", "x", "--threads", "0"], "expected a positive integer"),
    (["controller", "train", "--model", "m", "--text", "t", "-c", "4", "--out", "h.pt", "--threads", "100000"],
     "argument --threads"),
    (["eval", "--model", "m", "--tokens", "t.npy", "-c", "4", "--slow-copies", "4611686018427387904"], "at most 1,000"),
    (["calibrate", "--model", "m", "--repeats", "20000"], "at most 10,000"),
    (["eval", "--model", "m", "--tokens", "t.npy", "-c", "4", "--repeats", "4611686018427387904"],
     "at most 10,000"),  # ran the reference and each policy that many times: for ever
    (["size", "--model-config", "c.json", "--device-memory", "1GB", "--calibrate", "99999999999"], "at most 10,000"),
    (["size", "--expert-mb", "1e308", "--experts", "64", "--top-k", "8", "--moe-layers", "16", "--device-memory",
      "24GB"], "--expert-mb 1e+308: above 1e+07 MB, not a plausible value"),
    (["router-tune", "--model", "m", "--text", "t", "--layer", "0", "--cache", "4", "--temperature", "1e-300",
      "--out", "o"], "--temperature must be at least 0.01"),
    (["router-tune", "--model", "m", "--text", "t", "--layer", "0", "--cache", "4", "--group", "100000", "--out", "o"],
     "at most 256 generations of 4,096 tokens per prompt"),
    (["size", "--expert-mb", "12.6", "--experts", "64", "--top-k", "8", "--moe-layers", "16", "--device-memory", "8GB",
      "--c", "1e-300ms"], "'1e-300ms' is below 1 ns, not a plausible duration"),  # gave 8.7e301 tok/s
    (["size", "--expert-mb", "12.6", "--experts", "64", "--top-k", "8", "--moe-layers", "16", "--device-memory", "8GB",
      "--c", "1e308tok/s"], "above 1e9 tok/s"),
    (["size", "--expert-mb", "12.6", "--experts", "64", "--top-k", "8", "--moe-layers", "16", "--device-memory",
      "1e400B"], "'1e400B' is above 2**62 bytes"),  # said "below one byte"
    (["export", "libcachesim", "t.npz", "--layers", "", "--out", "e.csv"], "argument --layers: empty"),  # was all
    (["export", "libcachesim", "t.npz", "--out", "-"], "--out -: expected a file name (writing to stdout is not "
     "supported)"),  # wrote a file named '-'
    (["export", "libcachesim", "t.npz", "--out", "e.csv/"], "--out e.csv/: expected a file name, not a folder"),
    (["llama", "generate", "m.gguf", "--prompt", "x", "--seed", "4294967296"],  # aliased seed 0 in llama.cpp
     "expected a sampling seed in 0..2147483647"),
    (["llama", "generate", "m.gguf", "--prompt", "x", "--seed", "4294967295"], "sampling seed"),  # its "random"
    (["llama", "run", "m.gguf", "--prompt", "x", "--mode", "advise", "--readers", "8"],
     "--mode advise has no expert readers"),
    (["llama", "run", "m.gguf", "--prompt", "x", "--mode", "pin", "--policy", "lfu"],
     "leaves residency to the kernel"),  # both had been ignored without a word
    (["llama", "sweep", "m.gguf", "--prompt", "x", "--walls", "50%", "--mode", "mmap", "--mode", "advise", "--policy",
      "lfu"], "--mode mmap, advise"),
    (["llama", "generate", "m.gguf", "--prompt", "x", "--readers", "2"], "--mode mmap has no expert readers"),
    (["serve", "m.gguf", "--mode", "mmap", "--policy", "lfu"], "leaves residency to the kernel"),
    (["llama", "sweep", "m.gguf", "--target-tokens-per-s", "nan"], "expected a positive finite number"),  # was exit 0
    (["llama", "sweep", "m.gguf", "--target-tokens-per-s", "-1"], "expected a positive finite number"),
])
def test_counts_have_a_ceiling(capsys, argv, message):
    err = _one_line(capsys, argv)
    assert message in err, err


def test_local_worker_processes_have_a_ceiling(capsys, tmp_path):
    """``--jobs N`` without ``--ray`` starts up to N processes of about 130 MB here: ``replay --jobs 1000``
    on a 16-sequence trace had started 256 and stalled the machine. Above 4 per core it is one line,
    before any worker starts; with ``--ray`` it counts a cluster's tasks and the bound does not apply."""
    from expertcache.cli.common import check_local_jobs
    from expertcache.trace.synth import synthesize_preset

    trace = synthesize_preset("olmoe", seed=0, tokens=8, sequences=2, num_layers=2).save(tmp_path / "t.npz")
    (tmp_path / "g.toml").write_text(f'traces = ["{trace}"]\ncapacities = [8]\n')
    too_many = max_threads() + 1
    for argv in (["replay", trace, "-c", "8", "--jobs", too_many], ["sweep", trace, "--jobs", too_many],
                 ["verify-greedy", "-n", "10", "--jobs", too_many],
                 ["grid", tmp_path / "g.toml", "--out", tmp_path / "res", "--jobs", too_many]):
        err = _one_line(capsys, argv)
        assert f"--jobs {too_many}: at most {max_threads()} local worker processes" in err, (argv, err)
    assert not (tmp_path / "res").exists()
    check_local_jobs(max_threads())  # the bound itself is allowed
    check_local_jobs(10 * max_threads(), ray="auto")  # a cluster's tasks: not bounded here


def test_a_config_of_a_billion_layers_is_refused_before_listing_them(capsys, tmp_path):
    cfg = {"model_type": "olmoe", "num_hidden_layers": 10**9, "num_experts": 64, "num_experts_per_tok": 8,
           "hidden_size": 2048, "intermediate_size": 1024, "vocab_size": 50304, "num_attention_heads": 16,
           "torch_dtype": "bfloat16"}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    err = _one_line(capsys, ["size", "--model-config", tmp_path / "c.json", "--device-memory", "24GB"])
    assert "num_hidden_layers 1000000000 is more than 4,096" in err, err


@pytest.mark.parametrize("value, lo, hi, expected", [
    (3, None, None, True), (np.int64(3), 1, 3, True), (np.uint64(2**64 - 1), 0, None, True), (2**80, 0, None, True),
    (0, 1, None, False), (4, None, 3, False), (True, None, None, False), (np.bool_(True), None, None, False),
    (2.0, None, None, False), (np.float64(2.0), None, None, False), ("3", None, None, False), (None, None, None, False),
])
def test_is_int_is_the_one_integer_test(value, lo, hi, expected):
    """``errors.is_int``, behind every integer parameter and file field: Python or numpy integers in
    ``[lo, hi]``; never a bool (JSON ``true`` reads as Python's ``True``, an int), a float or text."""
    from expertcache.errors import is_int

    assert is_int(value, lo, hi) is expected


@pytest.mark.parametrize("value, expected", [
    (3, True), (-2.5, True), (0.0, True), (np.float32(1.5), True), (np.int64(7), True), (2**80, True),
    (10**400, False), (float("nan"), False), (float("inf"), False), (-math.inf, False), (np.float64("nan"), False),
    (True, False), (np.bool_(False), False), ("1.5", False), (None, False), (1 + 0j, False),
])
def test_is_real_is_the_one_real_number_test(value, expected):
    """``errors.is_real``, behind every real-valued parameter and file field: a finite Python or
    numpy number; never a bool, NaN, an infinity, text, or an integer beyond any float (on one
    ``math.isfinite`` raises ``OverflowError``, which had reached users as an internal error)."""
    from expertcache.errors import is_real

    assert is_real(value) is expected
