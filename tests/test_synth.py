"""Synthetic traces: validity, determinism, the locality mechanisms, the presets' calibration
contract (docs/locality.md) and the ``expertcache synth`` command."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache import ConfigError, Trace, load_trace
from expertcache.analysis import expert_counts, hot_sets, locality_report, reuse_within, top_share
from expertcache.analysis.calibration import check_targets
from expertcache.cli.main import main
from expertcache.trace.synth import GENERATOR, PRESETS, SynthParams, get_preset, synthesize, synthesize_preset

SMALL = SynthParams(num_experts=32, top_k=4, num_layers=3, tokens=200, sequences=2, zipf_first=0.5, zipf_last=1.2,
                    zipf_cutoff=0.5, reuse_prob=0.5, lag_exponent=1.2, max_lag=32, drift_rate=0.1, domain_shuffle=0.5)


# ---------------------------------------------------------------------------- validity, determinism
params_strategy = st.builds(
    SynthParams,
    num_experts=st.integers(1, 40),
    top_k=st.just(1),
    num_layers=st.integers(1, 3),
    tokens=st.integers(1, 60),
    sequences=st.integers(1, 3),
    zipf_first=st.floats(0, 2),
    zipf_last=st.floats(0, 2),
    zipf_cutoff=st.sampled_from([0.0, 0.1, 1.0]),
    cutoff_power=st.sampled_from([1.0, 4.0]),
    reuse_prob=st.floats(0, 1),
    lag_exponent=st.floats(0, 3),
    max_lag=st.integers(1, 80),
    drift_rate=st.sampled_from([0.0, 0.3, 2.5]),
    domain_shuffle=st.floats(0, 1),
)


@settings(max_examples=60, deadline=None)
@given(params_strategy, st.integers(1, 8), st.integers(0, 2**32))
def test_any_parameters_give_a_valid_deterministic_trace(params, k, seed):
    params = replace(params, top_k=min(k, params.num_experts))
    a = synthesize(params, seed)
    assert a.experts.shape == (params.tokens * params.sequences, params.num_layers, params.top_k)
    assert a.num_sequences == params.sequences and a.num_experts == params.num_experts
    assert (a.experts >= 0).all()  # no padding; range and duplicates are checked by from_arrays
    np.testing.assert_array_equal(a.experts, synthesize(params, seed).experts)


def test_different_seeds_differ_and_meta_records_provenance():
    a, b = synthesize(SMALL, 1), synthesize(SMALL, 2)
    assert not np.array_equal(a.experts, b.experts)
    assert a.meta["model"] == "synthetic:custom" and a.meta["phase"] == "decode"
    prov = a.meta["provenance"]
    assert prov["generator"] == GENERATOR and prov["seed"] == 1 and prov["params"]["reuse_prob"] == 0.5
    t = synthesize_preset("olmoe", seed=3, tokens=16)
    assert t.meta["model"] == "synthetic:olmoe" and t.meta["provenance"]["preset"] == "olmoe"


PINNED_DIGEST = "fd79cc6b358a9df5"
"""sha256 prefix of ``synthesize(SMALL, 7).experts`` as little-endian int32."""


def test_generator_output_is_pinned():
    """The ids a seed gives are part of the contract (bump GENERATOR when they must change)."""
    digest = hashlib.sha256(synthesize(SMALL, 7).experts.astype("<i4").tobytes()).hexdigest()[:16]
    assert digest == PINNED_DIGEST


def test_saved_trace_round_trips(tmp_path):
    trace = synthesize(SMALL, 0)
    loaded = load_trace(trace.save(tmp_path / "s.npz"))
    np.testing.assert_array_equal(loaded.experts, trace.experts)
    assert loaded.meta["provenance"] == trace.meta["provenance"]


@pytest.mark.parametrize("override, message", [
    ({"top_k": 40}, "top_k = 40 exceeds num_experts = 32"),
    ({"reuse_prob": 1.5}, "reuse_prob must lie in [0, 1]"),
    ({"tokens": 0}, "tokens must be a positive integer"),
    ({"zipf_first": float("nan")}, "zipf_first must be a finite number"),
])
def test_bad_parameters_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SMALL.with_overrides(**override)


def test_unknown_parameter_and_preset_are_config_errors():
    with pytest.raises(ConfigError, match="unknown parameter"):
        SMALL.with_overrides(zipf=1.0)
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        get_preset("nope")
    with pytest.raises(ConfigError, match="seed"):
        synthesize(SMALL, -1)


# ---------------------------------------------------------------------------- mechanisms
def test_copying_recent_choices_raises_short_range_reuse():
    lone = replace(SMALL, reuse_prob=0.0)
    bursty = replace(SMALL, reuse_prob=0.8, lag_exponent=2.0)
    assert reuse_within(synthesize(bursty, 0), [1]).mean() > reuse_within(synthesize(lone, 0), [1]).mean() + 0.2


def test_concentration_grows_with_depth():
    params = replace(SMALL, num_layers=6, tokens=2000, sequences=1, zipf_first=0.2, zipf_last=1.6, reuse_prob=0.2,
                     zipf_cutoff=0.0, drift_rate=0.0)
    shares = top_share(expert_counts(synthesize(params, 0)), 4)
    assert shares[-1] > shares[0] + 0.2
    assert np.corrcoef(np.arange(6), shares)[0, 1] > 0.9


def test_popularity_drifts_over_time():
    """With drift, the hot set of a long stream's first half overlaps its second half less."""
    def halves_overlap(drift_rate):
        trace = synthesize(replace(SMALL, num_layers=1, sequences=1, tokens=20_000, reuse_prob=0.3,
                                   zipf_cutoff=0.0, drift_rate=drift_rate), 0)
        half = trace.num_tokens // 2
        a, b = (hot_sets(expert_counts(Trace.from_arrays(part, num_experts=32)), 4)
                for part in (trace.experts[:half], trace.experts[half:]))
        return (a & b).sum() / (a | b).sum()

    assert halves_overlap(0.0) == 1.0
    assert halves_overlap(0.2) < 0.5


def test_domains_share_less_of_their_hot_sets_when_shuffled():
    def jaccard(shuffle):
        trace = synthesize(replace(SMALL, sequences=2, tokens=400, drift_rate=0.0, domain_shuffle=shuffle), 0)
        hot = [hot_sets(expert_counts(trace.select_sequences([i])), 4) for i in range(2)]
        return (hot[0] & hot[1]).sum() / (hot[0] | hot[1]).sum()

    assert jaccard(0.0) > jaccard(1.0) + 0.3


# ---------------------------------------------------------------------------- calibration contract
@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.targets])
def test_preset_meets_its_published_targets(name):
    """Each target lies in its published range widened by the stated tolerance (seed 0)."""
    checks = check_targets(PRESETS[name], synthesize_preset(name, seed=0))
    failed = [f"{c.name}: {[round(v, 4) for v in c.values]} not in {c.target} +- {c.target.tol}" for c in checks if not c.ok]
    assert not failed, "; ".join(failed)


def test_bench_k1_is_the_replay_benchmark_trace():
    p = get_preset("bench-k1").params
    assert (p.num_experts, p.top_k, p.num_layers, p.sequences, p.tokens) == (4096, 1, 1, 1, 2_000_000)
    small = synthesize_preset("bench-k1", tokens=50_000)
    r = locality_report(small)
    assert r.reuse(1) > 50 / 4096  # bursts: fifty times the uniform baseline k / E
    assert r.zipf_alpha > 0.5


# ---------------------------------------------------------------------------- CLI
def test_synth_cli_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "q.npz"
    argv = ["synth", "--preset", "qwen3-30b-a3b", "--tokens", "50", "--sequences", "2", "--num-layers", "3",
            "--seed", "5", "--out", str(out), "--json"]
    assert main(argv) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["out"] == str(out) and rec["tokens"] == 100 and rec["layers"] == [0, 1, 2] and rec["seed"] == 5
    trace = load_trace(out)
    assert trace.experts.shape == (100, 3, 8) and trace.meta["provenance"]["seed"] == 5
    np.testing.assert_array_equal(trace.experts, synthesize_preset("qwen3-30b-a3b", 5, tokens=50, sequences=2,
                                                                   num_layers=3).experts)


def test_synth_cli_parameter_overrides(tmp_path, capsys):
    out = tmp_path / "o.npz"
    assert main(["synth", "--preset", "olmoe", "--tokens", "20", "--reuse-prob", "0", "--num-experts", "16",
                 "--top-k", "2", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    trace = load_trace(out)
    assert trace.num_experts == 16 and trace.top_k == 2 and trace.meta["provenance"]["params"]["reuse_prob"] == 0.0


def test_synth_cli_list(capsys):
    assert main(["synth", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS) and "reuse_w64" in out
    assert main(["synth", "--list", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["preset"] for r in records] == list(PRESETS)
    assert records[0]["targets"]["zipf_alpha"] == {"lo": 1.10, "hi": 1.26, "tol": 0.02}


@pytest.mark.parametrize("argv, message", [
    (["synth", "--preset", "nope", "--out", "x.npz"], "unknown preset 'nope'"),
    (["synth", "--preset", "olmoe"], "--out is required"),
    (["synth", "--out", "x.npz"], "--preset is required"),
    (["synth", "--preset", "olmoe", "--out", "x.txt"], "expected a path ending in .npz"),
    (["synth", "--preset", "olmoe", "--out", "x.npz", "--top-k", "100"], "exceeds num_experts"),
    (["synth", "--preset", "olmoe", "--out", "x.npz", "--tokens", "100000000", "--sequences", "100"], "more than"),
])
def test_synth_cli_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_synth_cli_unwritable_out_is_one_line(tmp_path, capsys):
    (tmp_path / "taken.npz").mkdir()
    assert main(["synth", "--preset", "olmoe", "--tokens", "4", "--out", str(tmp_path / "taken.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {tmp_path / 'taken.npz'}: is a folder, expected a file name" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.npz"]  # no temporary file left behind
    assert main(["synth", "--preset", "olmoe", "--tokens", "4", "--out", str(tmp_path / "nope" / "t.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"folder {tmp_path / 'nope'} does not exist" in err and "\n" not in err
    assert not (tmp_path / "nope").exists()
