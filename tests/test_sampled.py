"""Sampled curves (sim/sampled.py): at rate 1 they are the exact curves; the hash keeps the share
it should and keeps groups whole; on a large global pool the estimate is close and the error
measured against the exact curve; the rate chooser refuses samples too small to mean anything."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertcache.cli.main import main
from expertcache.sim import StreamOptions, build_layout
from expertcache.sim.curves.mrc import sweep_layout
from expertcache.sim.sampled import MIN_POOL_ITEMS, choose_rate, curve_error, sampled_curve
from expertcache.trace.chunked import write_trace_chunked
from expertcache.trace.sampling import item_mask, sample_trace
from expertcache.trace.synth import synthesize_preset


@pytest.fixture(scope="module")
def olmoe():
    return synthesize_preset("olmoe", 0, tokens=200, sequences=4)


@pytest.fixture(scope="module")
def kimi():
    return synthesize_preset("kimi-k3", 0, tokens=400, sequences=2)


@pytest.mark.parametrize("pool", ["layer", "global"])
@pytest.mark.parametrize("policy", ["lru", "belady", "arc", "foresight:4"])
def test_rate_one_is_the_exact_curve(olmoe, pool, policy):
    options = StreamOptions.of(pool=pool, warm=0.2)
    caps = [8, 12, 40] if pool == "layer" else [8, 100, 600]
    exact = sweep_layout(build_layout(olmoe, options), caps, [policy])[0]
    s = sampled_curve(olmoe, caps, policy, 1.0, options=options)
    assert s.kept == s.items == olmoe.num_layers * olmoe.num_experts
    assert np.array_equal(s.sampled_capacities, caps)
    assert np.array_equal(s.hit_rate, exact.hit_rate) and np.allclose(s.copies_per_token, exact.copies_per_token)
    assert curve_error(s, exact) == 0.0


def test_the_hash_keeps_its_share_and_groups_whole(kimi):
    a, b = item_mask(92, 896, 0.05, seed=3), item_mask(92, 896, 0.05, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, item_mask(92, 896, 0.05, seed=4))
    n = a.size
    assert abs(a.sum() - 0.05 * n) < 4 * np.sqrt(0.05 * 0.95 * n)
    sampled = sample_trace(kimi, a)
    assert np.array_equal(sampled.seq, kimi.seq) and sampled.experts.shape == kimi.experts.shape
    for t in (0, 17, 399):
        for col in (0, 45, 91):
            orig, got = list(kimi.experts[t, col]), list(sampled.experts[t, col])
            assert got == [e if a[col, e] else -1 for e in orig]  # kept ids where they were, the rest padding


def test_a_large_global_pool_is_estimated_closely(kimi):
    options = StreamOptions.of(pool="global")
    caps = [4000, 8000, 16000]
    for policy, rate, bound in (("lru", 0.25, 0.01), ("belady", 0.25, 0.01), ("lru", 0.05, 0.03)):
        exact = sweep_layout(build_layout(kimi, options), caps, [policy])[0]
        errors = [curve_error(sampled_curve(kimi, caps, policy, rate, seed=s, options=options), exact) for s in range(3)]
        assert np.mean(errors) < bound, (policy, rate, errors)


def test_the_rate_chooser_refuses_tiny_samples(olmoe, kimi):
    rate, spread = choose_rate(olmoe, [8, 16], "lru", 0.01)  # per-layer pools of 64 items: only exact is safe
    assert (rate, spread) == (1.0, 0.0)
    rate, spread = choose_rate(kimi, [4000, 16000], "lru", 0.01, options=StreamOptions.of(pool="global"))
    assert rate < 1.0 and spread <= 0.01 and rate * 92 * 896 >= MIN_POOL_ITEMS


def test_cli_sampled_sweep(tmp_path, capsys, monkeypatch, olmoe):
    monkeypatch.chdir(tmp_path)
    olmoe.save("t.npz")
    assert main(["sweep", "t.npz", "--capacities", "100,400", "--pool", "global", "--sample-rate", "0.5", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {r["policy"] for r in rows} == {"lru", "belady"} and all(r["method"] == "sampled" for r in rows)
    assert all(0 < r["kept_items"] < r["items"] == 1024 for r in rows)
    assert main(["sweep", "t.npz", "--capacities", "8", "--sample-rate", "0.1"]) == 0
    assert "too few for an estimate" in capsys.readouterr().out
    write_trace_chunked(olmoe, "ch", chunk_sequences=1)  # the same trace, chunked: the same estimates, on 2 workers
    assert main(["sweep", "ch", "--capacities", "100,400", "--pool", "global", "--sample-rate", "0.5", "--jobs", "2",
                 "--json"]) == 0
    strip = [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in capsys.readouterr().out.splitlines()]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} | {"trace": strip[0]["trace"]} for r in rows]
    for argv, message in ((["--sample-rate", "0.5"], "need --capacities"),
                          (["--capacities", "8", "--sample-rate", "0"], "outside (0, 1]"),
                          (["--capacities", "8", "--sample-rate", "0.5", "--target-error", "0.1"], "not allowed with"),
                          (["--capacities", "8", "--sample-rate", "0.5", "--plot", "x.png"], "does not combine")):
        try:
            rc = main(["sweep", "t.npz", *argv])
        except SystemExit as exit_:  # argparse's own errors
            rc = exit_.code
        assert rc == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("pool", ["layer", "global"])
@pytest.mark.parametrize("reset", ["sequence", "none"])
def test_a_chunked_trace_is_sampled_as_the_whole(tmp_path, pool, reset):
    """sweep --sample-rate on a chunked trace: every unit keeps the same items, and the estimates
    equal the whole trace's, for rules with and without foresight, with a layer selection too."""
    whole = synthesize_preset("olmoe", 1, tokens=60, sequences=5)
    ct = write_trace_chunked(whole, tmp_path / "c", chunk_sequences=2)
    for extra in ({}, {"layers": (1, 3, 4, 9)}):
        options = StreamOptions.of(pool=pool, reset=reset, **extra)
        caps = [8, 16, 40] if pool == "layer" else [16, 100, 300]
        for policy, rate in (("lru", 0.5), ("belady", 0.3), ("arc", 0.5)):
            a = sampled_curve(whole, caps, policy, rate, seed=2, options=options)
            b = sampled_curve(ct, caps, policy, rate, seed=2, options=options)
            assert (a.kept, a.items, a.requests) == (b.kept, b.items, b.requests)
            assert np.array_equal(a.sampled_capacities, b.sampled_capacities)
            assert np.array_equal(a.hit_rate, b.hit_rate) and np.array_equal(a.copies_per_token, b.copies_per_token)
    rates = [choose_rate(x, [16, 100], "lru", 0.2, options=StreamOptions.of(pool="global")) for x in (whole, ct)]
    assert rates[0] == rates[1]
