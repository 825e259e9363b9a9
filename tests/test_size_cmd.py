"""``expertcache size`` (docs/sizing.md): does every expert fit, and if not, the capacity per layer
that meets a target; the model read from a config, a checkpoint's safetensors headers or a GGUF."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache.cli.main import main
from expertcache.costmodel.model import estimate_other_params, read_model
from expertcache.costmodel.plan import KEYS, copies_for_rate, synthetic_trace
from expertcache.errors import ConfigError
from expertcache.sim import replay
from expertcache.sim.curves import curve_target, sweep

ROOT = Path(__file__).resolve().parents[1]
OLMOE = ROOT / "docs" / "examples" / "olmoe-1b-7b-config.json"
S = 3 * 2048 * 1024 * 2  # OLMoE's bf16 expert: 12,582,912 bytes


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


# ------------------------------------------------------------------------------ fits entirely
def test_olmoe_on_24gb_fits_entirely(capsys):
    """The issue's question: 64 experts x 16 layers x 12.6 MB = 12.9 GB on a 24 GB GPU."""
    rc, out, _ = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "24GB")
    assert rc == 0 and out.count("\n") == 1
    assert out.startswith("fits entirely: 64 experts x 16 layers") and "12.9 GB" in out and "zero copies" in out
    rc, out, _ = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "24GB", "--json")
    (rec,) = records(out)
    assert list(rec) == list(KEYS)
    assert rec["fits_entirely"] is True and rec["all_experts_bytes"] == 64 * 16 * S == 12_884_901_888
    assert rec["expert_bytes"] == S and rec["capacity_per_layer"] == 64 and rec["copies_per_token"] == 0


def test_expert_mb_and_dimensions_without_a_config(capsys):
    rc, out, _ = run(capsys, "size", "--expert-mb", "12.6", "--experts", "64", "--top-k", "8", "--moe-layers", "16",
                     "--device-memory", "24GB", "--json")
    (rec,) = records(out)
    assert rec["fits_entirely"] and rec["all_experts_bytes"] == 64 * 16 * 12_600_000


def test_non_expert_weights_are_taken_off_the_device(capsys):
    """12.88 GB of experts + 0.953 GB of other weights: 13.5 GB does not hold both, 13.9 GB does."""
    spec = read_model(OLMOE)
    assert 12.88e9 + spec.other_bytes > 13.5e9
    assert records(run(capsys, "size", "--model-config", OLMOE, "--device-memory", "13.9GB", "--json")[1])[0][
        "fits_entirely"]
    recs = records(run(capsys, "size", "--model-config", OLMOE, "--device-memory", "13.5GB", "--json", "-p", "lru")[1])
    assert recs[0]["fits_entirely"] is False
    assert recs[0]["capacity_per_layer"] == (13_500_000_000 - spec.other_bytes) // (16 * S)


# ------------------------------------------------------------------------------ the model
def _meta_model(config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    other = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return other, experts


@pytest.mark.parametrize("kind", ["olmoe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_other_params_match_transformers(kind):
    """The shape estimate against the parameter count of the real architecture (on the meta device)."""
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                  intermediate_size=96)
    extra = {"olmoe": dict(num_experts=8, num_experts_per_tok=2),
             "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, mlp_only_layers=[1]),
             "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
             "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                 first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)}[kind]
    try:
        config = transformers.AutoConfig.for_model(kind, **common, **extra)
    except (KeyError, ValueError):
        pytest.skip(f"transformers has no {kind}")
    other, experts = _meta_model(config)
    d = config.to_dict()
    from expertcache.costmodel.model import moe_layer_ids

    moe = len(moe_layer_ids(d))
    E = d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts")
    inter = d.get("moe_intermediate_size") or d["intermediate_size"]
    assert experts == E * moe * 3 * 64 * inter
    est = estimate_other_params(d, "config", moe)
    assert abs(est - other) <= 2 * 64 * 3 + 64, (est, other)  # allow per-layer norm vectors (q/k norms)


def _safetensors(path: Path, tensors: dict[str, int]) -> None:
    """A safetensors file whose header lists ``name: bytes`` (U8 tensors), with zero data."""
    header, offset = {}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def test_checkpoint_folder_reads_exact_bytes(tmp_path):
    config = json.loads(OLMOE.read_text()) | {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": 1000, "lm_head.weight": 1000}
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.q_proj.weight"] = 300
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = 40
        for e in range(4):
            for w in ("gate_proj", "up_proj", "down_proj"):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] = 50
    _safetensors(tmp_path / "model-00001-of-00001.safetensors", tensors)
    spec = read_model(tmp_path)
    assert (spec.num_experts, spec.top_k, spec.moe_layers) == (4, 2, 2)
    assert spec.expert_bytes == 150 and spec.other_bytes == 2000 + 2 * 340
    assert "exact" in spec.other_source
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match="bad.safetensors"):
        read_model(tmp_path)


def test_gguf_metadata(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_block_count(2)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    for b in range(2):
        w.add_tensor(f"blk.{b}.attn_q.weight", np.zeros((8, 8), dtype=np.float32))
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            w.add_tensor(f"blk.{b}.{name}.weight", np.zeros((4, 6, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    spec = read_model(path)
    assert (spec.num_experts, spec.top_k, spec.moe_layers) == (4, 2, 2)
    assert spec.expert_bytes == 3 * 6 * 8 * 2 and spec.other_bytes == 4 * (80 + 2 * 64)


def test_gguf_without_the_package_is_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setitem(sys.modules, "gguf", None)
    rc, _, err = run(capsys, "size", "--model-config", path, "--device-memory", "24GB")
    assert rc == 2 and err.count("\n") == 1 and "pip install 'expertcache[llama]'" in err


# ------------------------------------------------------------------------------ sizing a cache
def test_synthetic_trace_is_matched_and_labelled():
    spec = read_model(OLMOE)
    trace, label = synthetic_trace(spec)
    assert (trace.num_experts, trace.top_k, trace.num_layers) == (64, 8, 16)
    assert label.startswith("SYNTHETIC") and "olmoe" in label
    other = type(spec)(96, 6, 10, 1, None, "x")
    trace, label = synthetic_trace(other)
    assert (trace.num_experts, trace.top_k, trace.num_layers) == (96, 6, 10) and "no preset" in label


def test_no_target_uses_the_capacity_that_fits(capsys):
    rc, out, _ = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "8GB", "--tau", "0.51ms", "--c",
                     "49tok/s", "--json", "-p", "lru", "-p", "belady")
    recs = records(out)
    cap = (8_000_000_000 - read_model(OLMOE).other_bytes) // (16 * S)
    trace, _ = synthetic_trace(read_model(OLMOE))
    for rec in recs:
        assert list(rec) == list(KEYS) and rec["capacity_per_layer"] == cap
        ref = replay(trace, int(cap), rec["policy"])
        assert rec["copies_per_token"] == pytest.approx(ref.copies_per_token)
        assert rec["hit_rate"] == pytest.approx(ref.hit_rate)
        assert rec["ms_per_token"] == pytest.approx(1000 / 49 + ref.copies_per_token * 0.51)
        assert rec["cache_bytes"] == cap * 16 * S
    assert [r["recommended"] for r in recs] == [True, False]  # belady needs the future


def test_hit_rate_target_is_the_smallest_capacity(capsys):
    rc, out, _ = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "8GB", "--target-hit-rate", "0.9",
                     "--json", "-p", "lru", "-p", "decayed")
    recs = records(out)
    trace, _ = synthetic_trace(read_model(OLMOE))
    curves = sweep(trace, range(8, 65), ["lru", "decayed"])
    for rec, curve in zip(recs, curves):
        assert rec["capacity_per_layer"] == curve_target(curve, target_hit_rate=0.9).capacity
    assert recs[0]["recommended"] != recs[1]["recommended"]


def test_hit_rate_above_the_ceiling_names_it(capsys):
    rc, out, _ = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "8GB", "--target-hit-rate", "0.98",
                     "-p", "lru")
    assert rc == 0 and "above the ceiling 0.97" in out and "cold fills" in out and "--warm 0.6" in out
    rc, out, _ = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "8GB", "--target-hit-rate", "0.98",
                     "-p", "lru", "--warm", "0.6", "--json")
    assert records(out)[0]["capacity_per_layer"] is not None


def test_tokens_per_s_target(capsys):
    assert copies_for_rate(40, 0.51, 1000 / 49) == pytest.approx((25 - 1000 / 49) / 0.51)
    with pytest.raises(ConfigError, match="out of reach"):
        copies_for_rate(50, 0.51, 1000 / 49)
    rc, out, _ = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "8GB", "--target-tokens-per-s", "40",
                     "--tau", "0.51ms", "--c", "49tok/s", "--json", "-p", "lru")
    (rec,) = records(out)
    assert rec["tokens_per_s"] >= 40
    trace, _ = synthetic_trace(read_model(OLMOE))
    below = replay(trace, rec["capacity_per_layer"] - 1, "lru").copies_per_token
    assert 1000 / (1000 / 49 + 0.51 * below) < 40


def test_page_cache_tier_line(tmp_path, capsys):
    from expertcache.tier.pool import pool_from_trace
    from expertcache.trace.synth import synthesize_preset

    trace = synthesize_preset("olmoe", 0, tokens=16, sequences=1, num_layers=2)
    pool_from_trace(tmp_path / "pool", trace, expert_bytes=4096)
    argv = ["size", "--expert-mb", "0.004096", "--experts", "64", "--top-k", "8", "--moe-layers", "2",
            "--device-memory", "200kB", "-p", "lru", "--tier-pool", tmp_path / "pool"]
    rc, out, _ = run(capsys, *argv, "--host-memory", "1MB")
    assert rc == 0 and "page-cache tier: the" in out and "fit in 1 MB" in out
    rc, out, _ = run(capsys, *argv, "--host-memory", "200kB")
    assert rc == 0 and "page-cache tier: 200 kB holds 48 of the 128 experts" in out


@pytest.mark.parametrize("argv, message", [
    ([], "give the model"),
    (["--model-config", OLMOE, "--expert-mb", "1"], "give one"),
    (["--expert-mb", "12.6", "--experts", "64"], "--top-k, --moe-layers"),
    (["--model-config", OLMOE, "--host-memory", "8GB"], "--host-memory needs"),
    (["--model-config", OLMOE, "-p", "static"], "not a lossless rule"),
    (["--model-config", "/nonexistent/x"], "no such file or folder"),
    (["--model-config", OLMOE, "--target-tokens-per-s", "40"], "needs --tau and --c"),
])
def test_errors_are_one_line(capsys, argv, message):
    rc, out, err = run(capsys, "size", "--device-memory", "8GB", *argv)
    assert rc == 2 and err.count("\n") == 1 and message in err, err


def test_a_trace_with_fewer_layers_is_scaled_to_the_model(tmp_path, capsys):
    """A 4-layer trace of the 16-layer model: copies/token x 16/4, said in the report."""
    from expertcache.trace.synth import synthesize_preset

    trace = synthesize_preset("olmoe", 0, tokens=64, sequences=2, num_layers=4)
    path = trace.save(tmp_path / "t4.npz")
    argv = ["size", "--model-config", OLMOE, "--device-memory", "8GB", "--trace", path, "-p", "lru"]
    (rec,) = records(run(capsys, *argv, "--json")[1])
    assert rec["copies_per_token"] == pytest.approx(4 * replay(trace, rec["capacity_per_layer"], "lru").copies_per_token)
    rc, out, _ = run(capsys, *argv)
    assert "scaled by 16/4" in out and "SYNTHETIC" not in out
    other = synthesize_preset("olmoe", 0, tokens=8, sequences=1, num_layers=2, num_experts=32).save(tmp_path / "e32.npz")
    rc, _, err = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "8GB", "--trace", other)
    assert rc == 2 and "E=32, the model has E=64" in err
    rc, _, err = run(capsys, "size", "--model-config", OLMOE, "--device-memory", "8GB", "--host-memory", "1GB",
                     "--tier-pool", tmp_path / "nopool")
    assert rc == 2 and "--tier-pool" in err and "no such folder" in err


SMALL_MOE = Path(__file__).resolve().parents[1] / "models" / "small-moe"


def test_calibrate_measures_tau_and_c_and_the_answer_uses_them(capsys):
    """``--calibrate N`` times tau and c on the checkpoint (as 'expertcache calibrate'), says so on
    stderr, and the answer's ms/token is c + copies/token x tau with exactly those values."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import re
    assert main(["size", "--model-config", str(SMALL_MOE), "--device-memory", "3MB", "--calibrate", "3",
                 "-p", "lru", "--target-copies", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    m = re.search(r"tau ([0-9.]+) ms .* c ([0-9.]+) ms", err)
    assert m, err
    [rec] = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert rec["fits_entirely"] is False
    tau, c = float(m.group(1)), float(m.group(2))
    assert rec["ms_per_token"] == pytest.approx(c + rec["copies_per_token"] * tau, rel=2e-3, abs=2e-3)


@pytest.mark.parametrize("extra, message", [
    (["--tau", "1ms"], "--calibrate measures --tau and --c"),
    ([], "--calibrate needs a checkpoint folder"),
])
def test_calibrate_refusals_are_one_line(capsys, extra, message):
    model = str(SMALL_MOE) if extra else str(SMALL_MOE / "config.json")
    assert main(["size", "--model-config", model, "--device-memory", "3MB", "--calibrate", "3", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
