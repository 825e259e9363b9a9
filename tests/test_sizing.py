"""Sizing (docs/sizing.md): copies per token in MB/token, GB/s, ms/token, tokens/s and cache memory;
the smallest capacity meeting a target; the 'needs future' marks; plot formats."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from expertcache import Trace
from expertcache.cli.main import main
from expertcache.costmodel import Sizing, cache_bytes, expert_bytes_from_config, parse_duration_ms
from expertcache.errors import ConfigError
from expertcache.sim.curves import curve_target, smallest_capacity, sweep

PAPER_C = 1000 / 49.0  # the eviction paper, Table 1: 49.0 tok/s with every expert resident (L40S)
OLMOE_BYTES = 3 * 2048 * 1024 * 2  # gated experts, hidden 2048, intermediate 1024, bf16


# ------------------------------------------------------------------------------ the figures
def test_paper_lru_figures_by_hand():
    """rho 9.6 (LRU), tau 0.51 ms, c = 1000/49 = 20.408 ms, S = 12.6 MB:
    bytes/token 9.6 x 12.6 MB = 120.96 MB; ms/token 20.408 + 9.6 x 0.51 = 20.408 + 4.896 = 25.304;
    overlapped max(20.408, 4.896) = 20.408; 1000 / 25.304 = 39.52 tok/s (the paper measured 38.3);
    GB/s at 39.52 tok/s = 0.12096 GB x 39.52 = 4.780."""
    s = Sizing(expert_bytes=12.6e6, tau_ms=0.51, c_ms=PAPER_C)
    f = s.figures(9.6)
    assert f.bytes_per_token == pytest.approx(120.96e6)
    assert f.copy_ms_per_token == pytest.approx(4.896)
    assert f.ms_per_token == pytest.approx(25.304, abs=5e-4)
    assert f.ms_per_token_overlapped == pytest.approx(20.408, abs=5e-4)
    assert f.tokens_per_s_predicted == pytest.approx(39.52, abs=5e-3)
    assert f.gbps_needed == pytest.approx(4.780, abs=5e-4)
    assert f.cache_bytes is None  # no capacity given
    # at a given decode rate instead of the predicted one: 0.12096 GB x 40 = 4.8384 GB/s
    assert Sizing(expert_bytes=12.6e6, tau_ms=0.51, c_ms=PAPER_C, tokens_per_s=40).figures(9.6).gbps_needed == \
        pytest.approx(4.8384)
    # farthest-future eviction, rho 4.6: 20.408 + 2.346 = 22.754 ms, 43.95 tok/s
    assert s.figures(4.6).ms_per_token == pytest.approx(22.754, abs=5e-4)


def test_partial_inputs_leave_the_rest_null():
    only_tau = Sizing(tau_ms=0.51).figures(9.6)
    assert only_tau.copy_ms_per_token == pytest.approx(4.896)
    assert (only_tau.ms_per_token, only_tau.ms_per_token_overlapped, only_tau.tokens_per_s_predicted,
            only_tau.bytes_per_token, only_tau.gbps_needed) == (None, None, None, None, None)
    size_only = Sizing(expert_bytes=1e6).figures(2.0, capacity=4, num_layers=3)
    assert (size_only.bytes_per_token, size_only.gbps_needed, size_only.cache_bytes) == (2e6, None, 12e6)
    at_rate = Sizing(expert_bytes=1e6, tokens_per_s=50).figures(2.0)
    assert at_rate.gbps_needed == pytest.approx(0.1)  # 2 MB/token x 50 tok/s
    assert Sizing(c_ms=20).figures(3.0).to_dict() == dict.fromkeys(Sizing().figures(0).to_dict())
    nan = Sizing(expert_bytes=1e6, tau_ms=1, c_ms=1).figures(math.nan, capacity=2, num_layers=1)
    assert nan.ms_per_token is None and nan.bytes_per_token is None and nan.cache_bytes == 2e6
    rec = Sizing(tau_ms=0.5).record(2.0)
    assert list(rec) == ["expert_bytes", "tau_ms", "c_ms", "tokens_per_s", "bytes_per_token", "gbps_needed",
                         "copy_ms_per_token", "ms_per_token", "ms_per_token_overlapped", "tokens_per_s_predicted",
                         "cache_bytes"]


def test_cache_bytes_per_layer_and_global():
    # 32 experts per layer x 8 layers x 12,582,912 B = 3,221,225,472 B; one global pool of 256: the same
    assert cache_bytes(32, OLMOE_BYTES, pool="layer", num_layers=8) == 3_221_225_472
    assert cache_bytes(256, OLMOE_BYTES, pool="global") == 3_221_225_472
    with pytest.raises(ConfigError):
        cache_bytes(4, 1.0, pool="layer")


@pytest.mark.parametrize("kwargs, option", [
    ({"tau_ms": -1.0}, "--tau"), ({"c_ms": 0}, "--c"), ({"expert_bytes": math.nan}, "--expert-mb"),
    ({"tokens_per_s": math.inf}, "--tokens-per-s"), ({"tau_ms": True}, "--tau"), ({"c_ms": "20"}, "--c"),
])
def test_sizing_validates_once_with_the_option_name(kwargs, option):
    with pytest.raises(ConfigError, match=option) as exc:
        Sizing(**kwargs)
    assert "\n" not in str(exc.value)


def test_compute_time_as_a_rate(olmoe_file, capsys):
    rc, out, _ = run_cli(capsys, "replay", olmoe_file, "-c", "32", "-p", "lru", "--tau", "0.51ms", "--c", "49tok/s",
                         "--json")
    assert rc == 0 and json.loads(out)["c_ms"] == pytest.approx(PAPER_C)
    with pytest.raises(SystemExit):
        main(["replay", str(olmoe_file), "-c", "32", "--c", "0tok/s"])
    assert "--c" in capsys.readouterr().err


def test_durations():
    for text in ("0.51ms", "510us", "0.00051s", "0.51", " 0.51 ms", "510µs", "0.51MS"):
        assert parse_duration_ms(text) == pytest.approx(0.51), text
    for bad in ("", "x", "1h", "-1ms", "0", "nan", "inf", "1e999s", "0.5 m s"):
        with pytest.raises(ConfigError, match="--tau"):
            parse_duration_ms(bad, "--tau")


# ------------------------------------------------------------------------------ model configs
def write(path, config):
    path.write_text(json.dumps(config))
    return path


def test_expert_bytes_from_configs(tmp_path):
    olmoe = {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "torch_dtype": "bfloat16"}
    folder = tmp_path / "olmoe"
    folder.mkdir()
    write(folder / "config.json", olmoe)
    assert expert_bytes_from_config(folder) == OLMOE_BYTES == 12_582_912  # the paper's 12.6 MB
    assert expert_bytes_from_config(folder / "config.json") == OLMOE_BYTES
    qwen3 = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "dtype": "bfloat16"}
    assert expert_bytes_from_config(write(tmp_path / "q.json", qwen3)) == 3 * 2048 * 768 * 2
    mixtral = {"hidden_size": 4096, "intermediate_size": 14336, "torch_dtype": "float32"}
    assert expert_bytes_from_config(write(tmp_path / "m.json", mixtral)) == 3 * 4096 * 14336 * 4
    deepseek = {"hidden_size": 7168, "moe_intermediate_size": 2048, "torch_dtype": "bfloat16",
                "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert expert_bytes_from_config(write(tmp_path / "d.json", deepseek)) == 3 * 7168 * 2048
    nested = {"text_config": olmoe}
    assert expert_bytes_from_config(write(tmp_path / "n.json", nested)) == OLMOE_BYTES


@pytest.mark.parametrize("config, message", [
    ({"intermediate_size": 1024, "torch_dtype": "bfloat16"}, "'hidden_size'"),
    ({"hidden_size": 2048, "torch_dtype": "bfloat16"}, "'moe_intermediate_size' or 'intermediate_size'"),
    ({"hidden_size": 2048, "intermediate_size": 1024}, "'torch_dtype' or 'dtype'"),
    ({"hidden_size": 2048, "intermediate_size": 1024, "torch_dtype": "int4"}, "torch_dtype = 'int4'"),
    ({"hidden_size": -1, "intermediate_size": 1024, "torch_dtype": "bfloat16"}, "hidden_size = -1"),
    ({"hidden_size": 8, "intermediate_size": 8, "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "awq"}},
     "'awq' is not supported"),
    ([1, 2], "not a JSON object"),
])
def test_config_errors_name_the_key(tmp_path, config, message):
    with pytest.raises(ConfigError, match="--model-config") as exc:
        expert_bytes_from_config(write(tmp_path / "config.json", config))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_config_file_errors(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    for path, message in ((tmp_path / "bad.json", "not valid JSON"), (tmp_path / "none", "no such file"),
                          (tmp_path, "holds no config.json")):
        with pytest.raises(ConfigError, match=message):
            expert_bytes_from_config(path)


def test_olmoe_preset_records_its_expert_size():
    from expertcache.trace.synth import synthesize_preset

    assert synthesize_preset("olmoe", seed=0, tokens=4, sequences=1).meta["expert_bytes"] == 12_582_912


# ------------------------------------------------------------------------------ targets
def tiny_trace() -> Trace:
    """One layer, one sequence, k = 1, E = 3: experts 0 1 0 1 2 0 1 2 (8 tokens)."""
    return Trace.from_arrays(np.array([0, 1, 0, 1, 2, 0, 1, 2]).reshape(8, 1, 1), num_experts=3, meta={"name": "tiny"})


def test_target_on_a_hand_computed_lru_curve():
    """LRU on 0 1 0 1 2 0 1 2, by hand:
    C=1: every token differs from the one before: 8 misses, hit rate 0/8 = 0, steady 8-1 = 7 -> 0.875/token;
    C=2: 0 m [0], 1 m [0 1], 0 h, 1 h, 2 m (evicts 0) [1 2], 0 m (evicts 1) [2 0], 1 m (evicts 2) [0 1],
         2 m (evicts 0): 6 misses, hit rate 2/8 = 0.25, steady 6-2 = 4 -> 0.5/token;
    C=3: only the 3 first uses miss: hit rate 5/8 = 0.625, steady 0.
    """
    (curve,) = sweep(tiny_trace(), [1, 2, 3], ["lru"])
    assert curve.hit_rate.tolist() == [0.0, 0.25, 0.625]
    assert curve.copies_per_token.tolist() == [0.875, 0.5, 0.0]
    assert curve_target(curve, target_hit_rate=0.2).capacity == 2
    assert curve_target(curve, target_hit_rate=0.25).capacity == 2  # >= : met exactly
    assert curve_target(curve, target_hit_rate=0.5).capacity == 3
    t = curve_target(curve, target_hit_rate=0.7)
    assert (t.reached, t.capacity, t.max_capacity) == (False, None, 3)
    assert curve_target(curve, target_copies=0.5).capacity == 2  # <= : met exactly
    assert curve_target(curve, target_copies=1.0).capacity == 1
    assert curve_target(curve, target_hit_rate=0.2, target_copies=0.4).capacity == 3  # both must hold
    assert curve_target(curve, target_hit_rate=0.2).misses_again_at == ()


def test_target_reports_a_curve_that_misses_again():
    t = smallest_capacity([1, 2, 3, 4], [0.1, 0.6, 0.5, 0.7], [3.0, 1.0, 2.0, 0.5], target_hit_rate=0.55)
    assert (t.capacity, t.misses_again_at) == (2, (3,))
    t = smallest_capacity([1, 2, 3, 4], [0.1, 0.6, 0.5, 0.7], [3.0, 1.0, 2.0, 0.5], target_copies=1.5)
    assert (t.capacity, t.misses_again_at) == (2, (3,))
    assert smallest_capacity([4], [math.nan], [math.nan], target_hit_rate=0.1).reached is False
    for kwargs in ({}, {"target_hit_rate": 0.0}, {"target_hit_rate": 1.5}, {"target_copies": -1.0}):
        with pytest.raises(ConfigError):
            smallest_capacity([1], [0.5], [0.5], **kwargs)


# ------------------------------------------------------------------------------ commands
def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tiny_file(tmp_path):
    return tiny_trace().save(tmp_path / "tiny.npz")


@pytest.fixture
def olmoe_file(tmp_path):
    from expertcache.trace.synth import synthesize_preset

    return synthesize_preset("olmoe", seed=0, tokens=48, sequences=2).save(tmp_path / "olmoe.npz")


SIZING = ("expert_bytes", "tau_ms", "c_ms", "tokens_per_s", "bytes_per_token", "gbps_needed", "copy_ms_per_token",
          "ms_per_token", "ms_per_token_overlapped", "tokens_per_s_predicted", "cache_bytes")


def test_sweep_target_command(tiny_file, capsys):
    rc, out, _ = run_cli(capsys, "sweep", tiny_file, "--capacities", "1:3", "-p", "lru", "--target-hit-rate", "0.5",
                         "--expert-mb", "1", "--json")
    assert rc == 0
    recs = [json.loads(x) for x in out.splitlines()]
    points, targets = recs[:3], recs[3:]
    assert [r["capacity"] for r in points] == [1, 2, 3] and all("record" not in r for r in points)
    assert [r["bytes_per_token"] for r in points] == [0.875e6, 0.5e6, 0.0]
    assert targets == [{
        "record": "target", "policy": "lru", "needs_future": False, "target_hit_rate": 0.5, "target_copies": None,
        "capacity": 3, "reached": True, "cache_bytes": 3_000_000, "hit_rate": 0.625, "copies_per_token": 0.0,
        "max_capacity": 3, "misses_again_at": [], "pool": "layer", "layers": [0], "trace": "tiny",
        "expert_bytes": 1_000_000, "tau_ms": None, "c_ms": None, "tokens_per_s": None, "bytes_per_token": 0.0,
        "gbps_needed": None, "copy_ms_per_token": None, "ms_per_token": None, "ms_per_token_overlapped": None,
        "tokens_per_s_predicted": None,
    }]
    rc, out, _ = run_cli(capsys, "sweep", tiny_file, "--capacities", "1:3", "-p", "lru", "-p", "belady",
                         "--target-hit-rate", "0.7", "--target-copies", "1")
    assert rc == 0
    assert "smallest swept capacity with hit rate >= 0.7 and copies/token <= 1 (experts per layer):" in out
    assert "lru     not reached up to C=3" in out and "belady  not reached up to C=3 (needs future)" in out
    rc, out, _ = run_cli(capsys, "sweep", tiny_file, "--capacities", "1:3", "-p", "lru", "--target-copies", "0.5")
    assert "lru  C=2: hit rate 0.2500, 0.5000 copies/token" in out and "cache" not in out  # size unknown


def test_replay_sizing_columns_and_fields(olmoe_file, capsys):
    rc, out, _ = run_cli(capsys, "replay", olmoe_file, "-c", "32", "--layers", "0-1", "-p", "lru", "-p", "belady",
                         "--tau", "510us", "--c", f"{PAPER_C}ms", "--json")
    assert rc == 0
    lru, belady = (json.loads(x) for x in out.splitlines())
    assert (lru["needs_future"], belady["needs_future"]) == (False, True)
    assert all(k in lru for k in SIZING)
    rho = lru["copies_per_token"]
    assert lru["expert_bytes"] == 12_582_912  # from the trace meta
    assert lru["tau_ms"] == pytest.approx(0.51) and lru["c_ms"] == pytest.approx(PAPER_C)
    assert lru["ms_per_token"] == pytest.approx(PAPER_C + rho * 0.51)
    assert lru["ms_per_token_overlapped"] == pytest.approx(max(PAPER_C, rho * 0.51))
    assert lru["tokens_per_s_predicted"] == pytest.approx(1000 / lru["ms_per_token"])
    assert lru["gbps_needed"] == pytest.approx(rho * 12_582_912 * lru["tokens_per_s_predicted"] / 1e9)
    assert lru["cache_bytes"] == 32 * 12_582_912 * 2 and lru["tokens_per_s"] is None
    rc, out, _ = run_cli(capsys, "replay", olmoe_file, "-c", "32", "--layers", "0-1", "-p", "lru", "-p", "belady",
                         "--expert-mb", "12.6", "--tau", "0.51", "--c", "20.408", "--tokens-per-s", "40")
    lines = out.splitlines()
    assert lines[2].startswith("sizing: expert 12.6 MB (12,600,000 bytes, --expert-mb), tau 0.51 ms per copy")
    assert "GB/s needed at 40 tok/s" in lines[3]
    assert lines[4].split() == ["policy", "future", "copies/token", "steady", "total", "hit", "rate", "gap",
                                "recovered", "MB/tok", "GB/s", "ms/tok", "ms/tok", "ovl", "tok/s", "cache", "GB"]
    assert lines[6].split()[:2] != ["lru", "yes"] and lines[7].split()[:2] == ["belady", "yes"]
    rc, out, _ = run_cli(capsys, "replay", olmoe_file, "-c", "32", "-p", "lru", "--tau", "0.51ms")
    assert "copy ms/tok" in out and "tok/s" not in out.splitlines()[4] and "copy time only" in out


def test_no_sizing_option_no_sizing_output(olmoe_file, capsys):
    rc, out, _ = run_cli(capsys, "replay", olmoe_file, "-c", "32", "-p", "lru", "--json")
    rec = json.loads(out)
    assert rc == 0 and rec["needs_future"] is False and not set(SIZING) & set(rec)
    rc, out, _ = run_cli(capsys, "replay", olmoe_file, "-c", "32", "-p", "lru")
    assert "sizing" not in out and "MB/tok" not in out
    rc, out, _ = run_cli(capsys, "sweep", olmoe_file, "--capacities", "16,32", "-p", "lru", "--json")
    assert not any(set(SIZING) & set(json.loads(x)) for x in out.splitlines())


def test_sweep_and_pools_sizing(olmoe_file, capsys):
    rc, out, _ = run_cli(capsys, "sweep", olmoe_file, "--capacities", "16,32", "--layers", "0-1", "-p", "lru",
                         "--expert-mb", "10", "--tau", "1ms", "--c", "10ms")
    lines = out.splitlines()
    assert lines[2].split() == ["capacity", "lru", "copies/tok", "lru", "hit"]  # the curve table as without sizing
    assert lines[6] == "" and lines[7].startswith("sizing: expert 10 MB")
    header = [h.strip() for h in lines[9].split("  ") if h.strip()]
    assert header == ["capacity", "policy", "future", "MB/tok", "GB/s", "ms/tok", "ms/tok ovl", "tok/s", "cache GB"]
    assert [ln.split()[:2] for ln in lines[11:]] == [["16", "lru"], ["32", "lru"]]
    # capacity 16, 2 layers, 10 MB: 0.32 GB of cache; ms/tok = 10 + copies/token x 1
    cells = lines[11].split()
    assert float(cells[-1]) == pytest.approx(0.32) and float(cells[4]) == pytest.approx(10 + float(cells[2]) / 10,
                                                                                          abs=1e-3)
    rc, out, _ = run_cli(capsys, "compare-pools", olmoe_file, "-c", "16", "--layers", "0-1", "-p", "belady",
                         "--expert-mb", "10", "--tau", "1ms", "--c", "10ms", "--json")
    rec = json.loads(out)
    assert rec["needs_future"] is True and rec["capacity"] == 16 and rec["cache_bytes"] == 16 * 2 * 10e6
    assert rec["ms_per_token_split"] == pytest.approx(10 + rec["copies_per_token_split"])
    assert rec["ms_per_token_global"] == pytest.approx(10 + rec["copies_per_token_global"])
    assert rec["bytes_per_token_global"] == pytest.approx(rec["copies_per_token_global"] * 10e6)
    rc, out, _ = run_cli(capsys, "compare-pools", olmoe_file, "-c", "16", "--layers", "0-1", "-p", "lru",
                         "--expert-mb", "10")
    assert "C/layer  policy  future  pool" in out and "MB/tok" in out and "cache GB" in out


def test_demo_sizes_with_the_paper_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_SHARED_TRACES", str(tmp_path / "none"))
    rc, out, _ = run_cli(capsys, "demo", "--json")
    recs = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and [r["policy"] for r in recs][-2:] == ["foresight:16", "belady"]
    assert [r["needs_future"] for r in recs] == [False] * 5 + [True, True]
    for r in recs:
        assert (r["expert_bytes"], r["tau_ms"], r["c_ms"]) == (12_582_912, 0.51, PAPER_C)
        assert r["ms_per_token"] == pytest.approx(PAPER_C + 0.51 * r["copies_per_token"])
    rc, out, _ = run_cli(capsys, "demo", "--json", "--tau", "0.24ms")  # an option overrides one figure
    assert all(json.loads(x)["tau_ms"] == pytest.approx(0.24) for x in out.splitlines())


@pytest.mark.parametrize("ext", ["png", "PDF", "svg"])
def test_plot_format_follows_the_extension(tiny_file, tmp_path, capsys, ext):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"mrc.{ext}"
    rc, _, err = run_cli(capsys, "sweep", tiny_file, "--capacities", "1:3", "--plot", path)
    assert rc == 0 and f"wrote {path}" in err
    head = path.read_bytes()[:64]
    magic = {"png": b"\x89PNG", "pdf": b"%PDF", "svg": b"<?xml"}[ext.lower()]
    assert head.startswith(magic)


@pytest.mark.parametrize("command", [["sweep", "--capacities", "1:3"], ["foresight", "-c", "2"],
                                     ["compare-pools", "-c", "1"]])
def test_other_plot_extensions_are_refused_before_any_work(tiny_file, tmp_path, capsys, command):
    rc, out, err = run_cli(capsys, command[0], tiny_file, *command[1:], "--plot", tmp_path / "mrc.jpg")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--plot" in err and ".png, .pdf or .svg" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.npz"]


def test_plot_api_refuses_other_formats_and_labels_future(tmp_path):
    from expertcache.report.plots import plot_format, plot_mrc, policy_label

    assert [plot_format(f"x.{e}") for e in ("png", "PNG", "pdf", "Svg")] == ["png", "png", "pdf", "svg"]
    with pytest.raises(ConfigError, match="'.jpg'"):
        plot_mrc(sweep(tiny_trace(), [1, 2], ["lru"]), tmp_path / "x.jpg", trace="t")
    assert policy_label("belady", True) == "belady (needs future)" and policy_label("lru", False) == "lru"


# ------------------------------------------------------------------------------ plots (issue 24, item 9)
def test_mrc_title_names_the_layers_and_the_target_is_drawn():
    pytest.importorskip("matplotlib")
    from expertcache.report.plots import mrc_figure
    from expertcache.trace.synth import synthesize_preset

    trace = synthesize_preset("olmoe", 0, tokens=32, sequences=2)
    curves = sweep(trace, [8, 16, 32], ["lru"], layers=[0, 2, 4, 6, 8, 10, 12, 14])
    fig = mrc_figure(curves, trace="t", target_hit_rate=0.9, target_copies=2.0)
    assert "8 layers replayed: 0,2,4,6,8,10,12,14" in fig._suptitle.get_text()
    ax_c, ax_h = fig.axes
    assert any(line.get_label().startswith("target: hit rate >= 90%") and list(line.get_ydata()) == [90, 90]
               for line in ax_h.lines)
    assert any(line.get_label().startswith("target: copies/token <= 2") for line in ax_c.lines)
    whole = sweep(trace, [8, 16], ["lru"])
    assert "16 layers replayed: 0-15" in mrc_figure(whole, trace="t")._suptitle.get_text()


def test_budget_axis_reads_gigabytes():
    """Budgets 1, 2, 4, 8 GB: the ticks say 1, 2, 4, 8 (GB), not 2^0 .. 2^3."""
    pytest.importorskip("matplotlib")
    from expertcache.report.plots import mrc_figure
    from expertcache.trace.synth import synthesize_preset

    trace = synthesize_preset("olmoe", 0, tokens=32, sequences=1, num_layers=2)
    budgets = [(1e9, 8), (2e9, 16), (4e9, 32), (8e9, 64)]  # 62.5 MB experts over two layers, say
    curves = sweep(trace, [8, 16, 32, 64], ["lru"])
    fig = mrc_figure(curves, trace="t", budgets=budgets)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["1", "2", "4", "8"] and "GB" in fig.axes[0].get_xlabel()
    assert list(fig.axes[0].lines[0].get_xdata()) == [1, 2, 4, 8]


def test_frontier_dodges_policies_on_the_same_dnll():
    pytest.importorskip("matplotlib")
    from expertcache.report.plots import dodge_points, frontier_figure

    pts = [{"policy": p, "dnll": d, "needs_future": False, "replayed": False, "tokens_per_s": [40.0, 30.0]}
           for p, d in (("lru", 0.0), ("decayed", 0.0), ("dwell", 0.03), ("belady", 1e-9))]
    assert dodge_points(pts) == [-6.0, 0.0, 0.0, 6.0]  # in dNLL order: lru 0, decayed 0, belady 1e-9
    near = [dict(pts[0], dnll=0.001), dict(pts[1], dnll=0.002), dict(pts[2], dnll=0.11)]
    assert dodge_points(near) == [-3.0, 3.0, 0.0]  # 0.001 apart on a 0.11 range: drawn apart
    fig = frontier_figure(pts, factors=(1, 10), tau_ms=0.5, tolerance=0.05, winners=["lru", "dwell"], model="m", title="x")
    ax = fig.axes[0]
    # the three lossless rules' lines sit at distinct heights on screen, the true dNLL on the axis
    heights = {line.get_label(): line.get_transform().transform((40.0, 0.0))[1] for line in ax.lines
               if line.get_label() in ("lru", "decayed", "belady")}
    assert len(set(round(h, 3) for h in heights.values())) == 3
    assert "drawn a few points apart" in ax.get_title()
