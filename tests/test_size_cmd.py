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
from test_pagelists import two_lists_ref
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
    experts = 2 * 3 * 4 * 6 * 8 * 2
    assert spec.expert_bytes == 3 * 6 * 8 * 2 and spec.layer_expert_bytes == (3 * 6 * 8 * 2,) * 2
    # dense: every byte of the file that is not an expert tensor (the header and padding included)
    assert spec.other_bytes == path.stat().st_size - experts > 4 * (80 + 2 * 64)


@pytest.mark.parametrize("patch, message", [
    ({"num_key_value_heads": 0}, "num_key_value_heads = 0 is not a positive integer"),
    ({"num_experts": 10**31}, "experts a layer is more than 1,048,576"),
    ({"quantization_config": 5}, "quantization_config = 5 is not a table"),
    ({"text_config": 5}, "text_config = 5 is not a table"),
    ({"text_config": {"quantization_config": "fp8"}}, "quantization_config = 'fp8' is not a table"),
    ({"tie_word_embeddings": "x"}, "tie_word_embeddings = 'x' is not true or false"),
])
def test_config_values_the_estimate_cannot_use_are_one_line(tmp_path, capsys, patch, message):
    """Each had been sized with exit 0: 0 KV heads left the k and v projections out of the dense
    bytes, a quantization_config or text_config that is not a table and a tie_word_embeddings of text
    were passed over, and 10**31 experts were sized ("non-expert weights (6.554e+23 TB)")."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**json.loads(OLMOE.read_text()), **patch}))
    rc, _, err = run(capsys, "size", "--model-config", path, "--device-memory", "24GB")
    assert rc == 2 and err.count("\n") == 1 and message in err, err


def test_gguf_without_the_package_is_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setitem(sys.modules, "gguf", None)
    rc, _, err = run(capsys, "size", "--model-config", path, "--device-memory", "24GB")
    assert rc == 2 and err.count("\n") == 1 and "needs the gguf package" in err and "pip install 'expertcache[" in err


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
        # every miss, the cold fills of the pools emptied at each sequence included (finding (a))
        assert rec["misses_per_token"] == pytest.approx(ref.copies_total / ref.tokens)
        assert rec["misses_per_token"] > rec["copies_per_token"]
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
    # --json holds the line's figures, and the table's "fits" and GB/s (they were only in the text)
    rc, out, _ = run(capsys, *argv, "--host-memory", "200kB", "--tau", "1ms", "--c", "10ms", "--json")
    (rec,) = records(out)
    tier = rec["host_tier"]
    assert rc == 0 and list(rec) == list(KEYS) and tier["experts_held"] == 48 and tier["experts_total"] == 128
    text = run(capsys, *argv, "--host-memory", "200kB")[1]
    assert tier["fits"] is False and f"reads {tier['experts_per_token_from_disk']:.4g} experts/token" in text
    assert rec["fits"] is (rec["capacity_per_layer"] <= rec["memory_capacity_per_layer"])
    assert rec["copy_bytes_per_s"] == pytest.approx(rec["copies_per_token"] * 4096 * rec["tokens_per_s"])
    rc, out, _ = run(capsys, *argv, "--host-memory", "1MB", "--json")
    assert records(out)[0]["host_tier"]["fits"] is True


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


@pytest.mark.parametrize("name, memory", [("config.json", ["--device-memory", "8GB"]),
                                          ("model.gguf", ["--device-memory", "8GB"]), ("model.gguf", ["--memory", "50%"])])
def test_a_refusal_names_the_model_as_given(tmp_path, capsys, memory, name):
    """The positional MODEL is named MODEL in a refusal, --model-config as --model-config (a positional
    truncated GGUF had been called '--model-config x.gguf')."""
    bad = tmp_path / name
    bad.write_bytes(b"GGUF" + bytes(12) if name.endswith(".gguf") else b'{"num_experts": 0}')
    for argv, named in (([bad], f"MODEL {bad}: "), (["--model-config", bad], f"--model-config {bad}: ")):
        rc, _, err = run(capsys, "size", *argv, *memory)
        assert rc == 2 and err.count("\n") == 1 and named in err, err


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


# ------------------------------------------------------------------------------ the findings (b)-(d)
def test_reserve_reads_correctly_without_the_non_expert_weights(capsys):
    """Finding (b): the reserve is taken off the device memory, and the missing weights said apart."""
    rc, out, _ = run(capsys, "size", "--expert-mb", "12.6", "--experts", "64", "--top-k", "8", "--moe-layers", "16",
                     "--device-memory", "24GB", "--reserve", "5GB")
    assert rc == 0
    assert "19 GB available (24 GB - 5 GB reserve; non-expert weights not counted: give --model-config)" in out


def _quantized_gguf(path: Path) -> Path:
    """An OLMoE-class GGUF whose expert tensors are Q4_K but layer 0's ffn_down_exps Q6_K (as llama.cpp's
    Q4_K_M recipe does): experts of 2988 bytes in layer 0 and 2592 in layer 1; a 64 kB f32 embedding."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_block_count(2)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((64, 256), dtype=np.float32))
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    for b in range(2):
        w.add_tensor(f"blk.{b}.attn_q.weight", np.zeros((8, 256), dtype=np.float32))
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            qt = q6 if (b, name) == (0, "ffn_down_exps") else q4
            w.add_tensor(f"blk.{b}.{name}.weight", np.zeros((4, 6, gguf.GGML_QUANT_SIZES[qt][1]), dtype=np.uint8),
                         raw_dtype=qt)  # 6 rows of 256 weights per expert
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QL0, QL1 = 2 * 144 * 6 + 210 * 6, 3 * 144 * 6  # one expert of layer 0 (two Q4_K, one Q6_K slice) and of layer 1


def test_a_quantized_gguf_counts_its_dense_bytes_and_per_layer_experts(tmp_path, capsys):
    """Finding (c): at Q4 the sizes come from the file's own tensor table (read_geometry): each layer's
    expert bytes exactly, and the dense bytes counted against the device."""
    path = _quantized_gguf(tmp_path / "q4.gguf")
    spec = read_model(path)
    assert spec.layer_expert_bytes == (QL0, QL1) and spec.expert_bytes == (QL0 + QL1) // 2
    experts = 4 * (QL0 + QL1)
    dense = path.stat().st_size - experts
    assert spec.other_bytes == dense > 64 * 256 * 4 and spec.all_experts_bytes == experts
    rc, out, _ = run(capsys, "size", path, "--device-memory", str(dense + experts))
    assert rc == 0 and out.startswith("fits entirely") and "non-expert weights, GGUF tensor table (exact)" in out
    assert "x 0.00279 MB (mean; 0.002592-0.002988 MB by layer) = " in out
    # experts alone would fit in this much; with the dense part counted they do not
    device = dense + experts - 1
    (rec,) = records(run(capsys, "size", "--model-config", path, "--device-memory", str(device), "-p", "lru",
                         "--json")[1])
    assert rec["fits_entirely"] is False and rec["all_experts_bytes"] == experts
    assert rec["capacity_per_layer"] == (device - dense) // (QL0 + QL1) == 3
    assert rec["cache_bytes"] == 3 * (QL0 + QL1)


def test_host_memory_of_a_gguf_takes_its_dense_part_first(tmp_path, capsys):
    """Finding (d): the page cache holds the GGUF's dense part before any expert."""
    path = _quantized_gguf(tmp_path / "q4.gguf")
    spec = read_model(path)
    dense, experts = spec.other_bytes, spec.all_experts_bytes
    argv = ["size", path, "--device-memory", str(dense + 2 * (QL0 + QL1) + 10), "-p", "lru"]
    rc, out, _ = run(capsys, *argv, "--host-memory", str(experts + 1000))  # the experts alone would fit
    assert rc == 0 and "fit in" not in out.splitlines()[-1]
    assert "holds 0 experts" in out and "beside its" in out
    room = 5 * spec.expert_bytes + 100
    rc, out, _ = run(capsys, *argv, "--host-memory", str(dense + room))
    assert f"holds {room // spec.expert_bytes:,} of the 8 experts" in out and "first reads counted" in out
    rc, out, _ = run(capsys, *argv, "--host-memory", str(dense + experts))
    assert "fit in" in out.splitlines()[-1]


# ------------------------------------------------------------------------------ --memory: CPU and disk
TINY = dict(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=128, max_position_embeddings=256,
            rms_norm_eps=1e-5, norm_topk_prob=False)
WINDOW = 8192  # the readahead window the tests fix (the device's read_ahead_kb varies between machines)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random OLMoE-class f16 GGUF: 8 experts of 12,288 bytes (three 4,096-byte slices) in 2 layers."""
    pytest.importorskip("gguf", reason="the gguf package (llama or gguf extra) is not installed")
    from expertcache.llama.convert import convert_random

    out = tmp_path_factory.mktemp("disk") / "tiny.gguf"
    convert_random(TINY, out, "f16", seed=0)
    return out


@pytest.fixture
def window(monkeypatch):
    import expertcache.llama.forecast as dk

    monkeypatch.setattr(dk, "readahead_bytes", lambda path: (WINDOW, "fixed by the test"))


def _hand_trace(tmp_path: Path, T: int = 60):
    """Routing written by hand: a hot set of four experts per layer most of the time, others now and then."""
    rng = np.random.default_rng(5)
    rows = []
    for t in range(T):
        row = []
        for j in range(2):
            pool = [0, 1, 2, 3] if rng.random() < 0.8 else list(range(8))
            row.append(rng.choice(pool, size=2, replace=False))
        rows.append(row)
    import expertcache as ec

    experts = np.asarray(rows)
    return experts, ec.Trace.from_arrays(experts, num_experts=8).save(tmp_path / "hand.npz")


def _byte_lru(groups, capacity: int, size, read):
    """(bytes read, first-read bytes) of a byte-capacity LRU over ``groups``, started empty, written
    from scratch: a group's items become the most recent in id order; the least recent others are
    evicted until the misses fit; every miss reads ``read(item)``. A group larger than the capacity
    is read whole and leaves the cache empty."""
    from collections import OrderedDict

    cache, used, total, first, seen = OrderedDict(), 0, 0, 0, set()
    for group in groups:
        group = sorted(set(group))
        if sum(size(i) for i in group) > capacity:
            total += sum(read(i) for i in group)
            first += sum(read(i) for i in group if i not in seen)
            seen.update(group)
            cache, used = OrderedDict(), 0
            continue
        need = sum(size(i) for i in group if i not in cache)
        while used + need > capacity:
            victim = next(v for v in cache if v not in group)
            used -= size(victim)
            del cache[victim]
        for i in group:
            if i in cache:
                cache.move_to_end(i)
                continue
            cache[i] = True
            used += size(i)
            total += read(i)
            if i not in seen:
                first += read(i)
                seen.add(i)
    return total, first


def _window_units(g, experts, window: int):
    """The readahead-window items by brute force: every ``window``-byte aligned window of the file
    an expert's slices overlap; windows touched by exactly the same experts are one unit, numbered in
    file order; per (token, layer) the units touched, and each unit's bytes: the expert bytes of its
    windows (a window's dense pages are resident already), counted byte by byte."""
    E = g.num_experts
    expert_bytes: dict[int, int] = {}  # window -> expert bytes in it

    def windows(j, e):
        out = set()
        for t in g.experts[g.moe_layers[j]].values():  # each expert tensor: E slices of nbytes / E
            lo = t.offset + e * (t.nbytes // E)
            out.update(range(lo // window, (lo + t.nbytes // E - 1) // window + 1))
        return out

    for layer in g.moe_layers:
        for t in g.experts[layer].values():
            for byte in range(t.offset, t.offset + t.nbytes):  # the tiny file's expert bytes, one by one
                expert_bytes[byte // window] = expert_bytes.get(byte // window, 0) + 1

    who: dict[int, set] = {}
    for j in range(len(g.moe_layers)):
        for e in range(E):
            for w in windows(j, e):
                who.setdefault(w, set()).add((j, e))
    members: dict[frozenset, list[int]] = {}
    for w in sorted(who):
        members.setdefault(frozenset(who[w]), []).append(w)
    order = sorted(members.values(), key=min)
    unit_of = {w: u for u, ws in enumerate(order) for w in ws}
    usize = [sum(expert_bytes[w] for w in ws) for ws in order]
    groups = [sorted({unit_of[w] for e in experts[t, j] if e >= 0 for w in windows(j, int(e))})
              for t in range(len(experts)) for j in range(len(g.moe_layers))]
    return groups, usize.__getitem__


def _forecast(capsys, gguf_path, memory, trace, *extra):
    rc, out, err = run(capsys, "size", gguf_path, "--memory", str(memory), "--disk-bandwidth", "2", "--compute", "50",
                       "--trace", trace, "--json", *extra)
    assert rc == 0, err
    return {r["mode"]: r for r in records(out)}


def test_forecast_by_hand(tiny_gguf, tmp_path, capsys, window):
    """missed bytes per token from a replay written here, predicted = 1 / (1/c + D/B) exactly."""
    from expertcache.llama.forecast import KEYS
    from expertcache.formats.gguf import read_geometry

    g = read_geometry(str(tiny_gguf))
    E, S, dense = 8, 12288, g.dense_bytes
    assert g.layer_expert_bytes == [S, S]
    experts, trace = _hand_trace(tmp_path)
    T = len(experts)
    groups = [[j * E + int(e) for e in experts[t, j]] for t in range(T) for j in range(2)]
    room = 5 * S + 100  # 5 of the 16 experts beside the dense part: f = room / (16 S)
    recs = _forecast(capsys, tiny_gguf, dense + room, trace)
    assert list(recs) == ["mmap", "advise", "managed"] and all(list(r) == list(KEYS) for r in recs.values())
    c, B = 50.0, 2e9

    # advise: the kernel's two lists (tests/test_pagelists.py's reference) in the whole wall, over the
    # experts, a use no reference, the file loaded first; the LRU of room bytes is the demand printed
    lru, lru_first = _byte_lru(groups, room, lambda i: S, lambda i: S)
    counted = [(sorted(set(grp)), True) for grp in groups]  # a group's items in id order, as the forecast's
    adv_read, adv_fill = two_lists_ref(counted, dense + room, [S] * 16, dense, False)
    adv = recs["advise"]
    assert adv["cache_bytes"] == room and adv["dense_bytes"] == dense
    assert adv["demand_bytes_per_token"] == pytest.approx(lru / T)
    D = adv_read / T
    assert D > lru / T  # the lists read more than the LRU here
    assert adv["missed_bytes_per_token"] == pytest.approx(D) and adv["fill_bytes_per_token"] == pytest.approx(adv_fill / T)
    assert adv["amplification"] == pytest.approx(D / (lru / T))
    assert adv["predicted_tokens_per_s"] == pytest.approx(1 / (1 / c + D / B))
    assert adv["limit_tokens_per_s"] == pytest.approx(min(c, B / D))
    assert adv["device_read_bytes_per_s_1"] == adv["device_read_bytes_per_s_4"] == B
    assert adv["compute_tokens_per_s"] == c and adv["disk_bandwidth_source"] == "--disk-bandwidth"

    # mmap: the same lists over the WINDOW-byte windows an expert's slices lie in, a use a reference;
    # never less than advise's
    wgroups, wsize = _window_units(g, experts, 2 * WINDOW)  # llama.cpp's POSIX_FADV_SEQUENTIAL doubles it
    nunits = max(max(grp) for grp in wgroups) + 1
    mm_read, _ = two_lists_ref([(grp, True) for grp in wgroups], dense + room, [wsize(u) for u in range(nunits)],
                               dense, True)
    D = max(mm_read, adv_read) / T
    assert recs["mmap"]["missed_bytes_per_token"] == pytest.approx(D)
    assert recs["mmap"]["amplification"] == pytest.approx(D / (lru / T))
    assert recs["mmap"]["predicted_tokens_per_s"] == pytest.approx(1 / (1 / c + D / B))
    assert recs["mmap"]["readahead_bytes"] == WINDOW
    assert "16,384-byte readahead windows (twice fixed by the test: llama.cpp's POSIX_FADV_SEQUENTIAL)" in \
        recs["mmap"]["note"]

    # P% as 'llama run --memory-wall' reads it: the dense part + P% of the expert tensors
    pct = _forecast(capsys, tiny_gguf, "50%", trace)
    assert pct["advise"]["memory_wall"] == dense + 8 * S and pct["advise"]["cache_bytes"] == 8 * S

    # managed with room for its pool: exactly its LRU's misses over items of the whole pages an
    # expert's slices cover
    from expertcache.llama.advice import PAGE, managed_budget

    item = max(sum(((off + n + PAGE - 1) // PAGE - off // PAGE) * PAGE for off, n in g.expert_ranges(layer, e))
               for layer in g.moe_layers for e in range(E))
    assert S < item <= S + 2 * 3 * PAGE
    # managed where its pool (the wall less the dense part) is one byte short of one layer's routed
    # experts: refused as 'llama run' refuses it
    short = _forecast(capsys, tiny_gguf, dense + g.top_k * item - 1, trace)["managed"]
    assert managed_budget(g, dense + g.top_k * item - 1) < g.top_k * item
    assert short["predicted_tokens_per_s"] is None and "refused" in short["note"]
    memory = dense + 5 * item
    assert managed_budget(g, memory) == 5 * item
    recs = _forecast(capsys, tiny_gguf, memory, trace)
    man, man_first = _byte_lru(groups, 5 * item, lambda i: item, lambda i: S)
    D = man / T
    r = recs["managed"]
    assert r["cache_bytes"] == 5 * item and r["amplification"] == 1
    assert r["missed_bytes_per_token"] == pytest.approx(D) and r["fill_bytes_per_token"] == pytest.approx(man_first / T)
    assert r["predicted_tokens_per_s"] == pytest.approx(1 / (1 / c + D / B))
    assert r["bound_by"] == ("disk" if D / B > 1 / c else "compute")
    # a bandwidth given serves every read path: B1 for the kernel modes, the hinted reads for managed
    assert [(x["mode"], x["read_bytes_per_s"], x["read_source"]) for x in recs.values()] == [
        ("mmap", B, "--disk-bandwidth"), ("advise", B, "--disk-bandwidth"),
        ("managed", B, "--disk-bandwidth")]


def test_cold_fills_are_counted_as_reads(tiny_gguf, tmp_path, capsys, window):
    """Every expert fits beside the dense part: managed's pool starts empty (the run drops what the
    load left), so its only reads are the first ones, and they count; the kernel modes start with
    the file just loaded, every page of it held: they read nothing."""
    from expertcache.formats.gguf import read_geometry

    g = read_geometry(str(tiny_gguf))
    experts, trace = _hand_trace(tmp_path)
    recs = _forecast(capsys, tiny_gguf, g.file_bytes * 4, trace)  # managed too: its pool holds every expert
    distinct = len({(j, int(e)) for t in range(len(experts)) for j in range(2) for e in experts[t, j]})
    r = recs["managed"]
    assert r["missed_bytes_per_token"] == pytest.approx(distinct * 12288 / len(experts))
    assert r["fill_bytes_per_token"] == pytest.approx(r["missed_bytes_per_token"])
    assert r["predicted_tokens_per_s"] < 50
    for mode in ("mmap", "advise"):
        assert recs[mode]["missed_bytes_per_token"] == recs[mode]["fill_bytes_per_token"] == 0
        assert recs[mode]["predicted_tokens_per_s"] == 50


def test_prompt_rows_are_replayed_first(tiny_gguf, tmp_path, capsys, window):
    """A trace whose 'prefill' array flags prompt rows (``capture --generate N --keep-prompt``): each
    sequence's prompt is one forward (per layer, the union of its rows, as llama.cpp's prefill routes
    them) replayed uncounted before that sequence's decode rows, as a run's prefill reads before its
    decode: through the managed pool, the kernel's lists and the LRU demand alike."""
    import expertcache as ec
    from expertcache.formats.gguf import read_geometry
    from expertcache.llama.advice import PAGE

    g = read_geometry(str(tiny_gguf))
    E, S, dense = 8, 12288, g.dense_bytes
    experts, _ = _hand_trace(tmp_path, T=80)
    seq = np.repeat([0, 1], 40)
    flags = np.zeros(80, dtype=np.uint8)
    flags[:10] = flags[40:52] = 1  # a 10-row prompt, then a 12-row one
    experts[9:10, 1] = -1  # the prompt's last layer routed its output row only (llama.cpp)
    warm = ec.Trace.from_arrays(experts, seq, num_experts=8, extras={"prefill": flags}).save(tmp_path / "warm.npz")
    item = max(sum(((off + n + PAGE - 1) // PAGE - off // PAGE) * PAGE for off, n in g.expert_ranges(layer, e))
               for layer in g.moe_layers for e in range(E))
    memory = dense + 5 * item
    got = _forecast(capsys, tiny_gguf, memory, warm)
    groups, counted = [], []
    for lo, hi, dec in ((0, 10, 10), (40, 52, 52)):
        for j in range(2):  # the prompt: one forward, uncounted
            groups.append(sorted({j * E + int(e) for e in experts[lo:hi, j].ravel() if e >= 0}))
            counted.append(False)
        for t in range(hi, lo + 40):
            for j in range(2):
                groups.append(sorted({j * E + int(e) for e in experts[t, j]}))  # in id order, as the forecast's
                counted.append(True)
    # the counted reads: the whole replay's less those of its groups up to each uncounted one
    total = first = 0
    for i, c in enumerate(counted):
        if c:
            a, fa = _byte_lru(groups[:i + 1], 5 * item, lambda x: item, lambda x: S)
            b, fb = _byte_lru(groups[:i], 5 * item, lambda x: item, lambda x: S)
            total, first = total + a - b, first + fa - fb
    r = got["managed"]
    assert r["tokens"] == 58 and r["missed_bytes_per_token"] == pytest.approx(total / 58)
    # advise: the kernel's lists over the same groups (tests/test_pagelists.py's reference); the LRU
    # demand of the room (the wall less the dense part) over the experts' own bytes
    adv_read, adv_fill = two_lists_ref(list(zip(groups, counted)), memory, [S] * 16, dense, False)
    assert got["advise"]["tokens"] == 58
    assert got["advise"]["missed_bytes_per_token"] == pytest.approx(adv_read / 58)
    assert got["advise"]["fill_bytes_per_token"] == pytest.approx(adv_fill / 58)
    demand = 0
    for i, c in enumerate(counted):
        if c:
            demand += (_byte_lru(groups[:i + 1], 5 * item, lambda x: S, lambda x: S)[0]
                       - _byte_lru(groups[:i], 5 * item, lambda x: S, lambda x: S)[0])
    assert got["advise"]["demand_bytes_per_token"] == pytest.approx(demand / 58)
    assert r["fill_bytes_per_token"] == pytest.approx(first / 58)
    assert "warmed by the trace's 22 prompt rows" in r["note"]
    rc, out, _ = run(capsys, "size", tiny_gguf, "--memory", str(memory), "--disk-bandwidth", "2", "--compute", "50",
                     "--trace", warm)
    assert rc == 0 and "58 decode tokens in 2 sequence(s) (22 prompt rows besides" in out
    bad = ec.Trace.from_arrays(experts, seq, num_experts=8, extras={"prefill": np.ones(80, dtype=np.uint8)})
    rc, _, err = run(capsys, "size", tiny_gguf, "--memory", str(memory), "--disk-bandwidth", "2", "--compute", "50",
                     "--trace", bad.save(tmp_path / "all.npz"))
    assert rc == 2 and "no decode step" in err and len(err.strip().splitlines()) == 1
    for flags, message in ((np.arange(80) % 3, "row 2 holds"), (np.zeros(7, dtype=np.uint8), "got shape (7,)")):
        odd = ec.Trace.from_arrays(experts, seq, num_experts=8, extras={"prefill": flags}).save(tmp_path / "odd.npz")
        rc, _, err = run(capsys, "size", tiny_gguf, "--memory", str(memory), "--disk-bandwidth", "2", "--compute",
                         "50", "--trace", odd)
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_forecast_text_and_synthetic_trace(tiny_gguf, capsys, window):
    from expertcache.llama.forecast import synthetic_tokens

    rc, out, _ = run(capsys, "size", "--model-config", tiny_gguf, "--memory", "200kB", "--disk-bandwidth", "1.5GB/s",
                     "--compute", "40tok/s")
    assert rc == 0
    assert "SYNTHETIC" in out and f"{synthetic_tokens(8, 2)} tokens in 1 sequence(s)" in out
    assert "first reads counted" in out and "B1 = B4 = 1.5 GB/s (--disk-bandwidth)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["mmap"], ["advise"],
                                                                                                ["managed"])}
    assert set(rows) == {"mmap", "advise", "managed"}
    (rec,) = [r for r in records(run(capsys, "size", tiny_gguf, "--memory", "200kB", "--disk-bandwidth", "1.5",
                                     "--compute", "40", "--json")[1]) if r["mode"] == "advise"]
    assert rows["advise"][7] == f"{rec['predicted_tokens_per_s']:.4g}" and rec["tokens"] == synthetic_tokens(8, 2)
    assert "1 / (1/c + read/B)" in out and "a model" in out


def test_auto_measures_on_the_file(tiny_gguf, capsys, window, monkeypatch):
    """--auto (and the defaults): the bandwidths of O_DIRECT reads of one expert slice of the file,
    by 1 and 4 readers, the hinted and the faulted reads of its experts, and llama.cpp's compute
    rate, as the roofline module measures them: in both page states and as the managed and advise
    steps run, each mode's forecast taking its own (mmap: faulted pages; advise and managed: hinted,
    their step observing) and its own read rate (mmap: faulted reads, advise: hinted, both at a full
    cgroup; managed: hinted, dropped)."""
    import types

    import expertcache.llama.roofline as rl
    from expertcache.formats.gguf import read_geometry
    from expertcache.llama.runner import request_bytes

    seen = []

    def bandwidth(path, req, readers, fresh=False):
        seen.append((path, req, readers))
        return {"bytes_per_s": 1e9 * readers, "request_bytes": req, "cached": False, "note": None}

    def hinted(g, fresh=False):
        seen.append((g.path, "hinted"))
        return {"bytes_per_s": 0.5e9, "passes": 3, "cached": False, "note": None}

    def faulted(g, fresh=False):
        seen.append((g.path, "faulted"))
        return {"bytes_per_s": 0.25e9, "passes": 3, "cached": False, "note": None}

    def full(g, kind, fresh=False):
        seen.append((g.path, f"{kind} full"))
        return {"bytes_per_s": {"hinted": 0.4e9, "faulted": 0.2e9}[kind], "passes": 3, "cached": False, "note": None}

    monkeypatch.setattr(rl, "device_bandwidth", bandwidth)
    monkeypatch.setattr(rl, "hinted_bandwidth", hinted)
    monkeypatch.setattr(rl, "faulted_bandwidth", faulted)
    monkeypatch.setattr(rl, "full_bandwidth", full)
    timed = []

    def compute(path, prompt, tokens, threads, fresh=False, pages="faulted", step=None):
        timed.append((pages, step))
        return {"tokens_per_s": {"faulted": 25.0, "hinted": 20.0, "managed": 18.0, "advise": 17.0}[step or pages]
                * threads,
                "cached": True, "note": "hinted pages not watched (no mincore)" if pages == "hinted" and not step
                else None}

    monkeypatch.setattr(rl, "compute_rate", compute)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    g = read_geometry(str(tiny_gguf))
    c = {"mmap": 50.0, "advise": 34.0, "managed": 36.0}
    B = {"mmap": 0.2e9, "advise": 0.4e9, "managed": 0.5e9}  # the kernel modes' at a full cgroup
    ends = {"mmap": "faulted pages", "advise": "hinted pages, the advise step observing",
            "managed": "hinted pages, the managed step observing"}
    for argv in (["--auto"], [], ["--disk-bandwidth", "auto", "--compute", "auto"]):
        seen.clear()
        timed.clear()
        recs = records(run(capsys, "size", tiny_gguf, "--memory", "200kB", "--threads", "2", "--json", *argv)[1])
        assert seen == [(str(tiny_gguf), request_bytes(g), 1), (str(tiny_gguf), request_bytes(g), 4),
                        (str(tiny_gguf), "hinted"), (str(tiny_gguf), "faulted"), (str(tiny_gguf), "hinted full"),
                        (str(tiny_gguf), "faulted full")]
        assert timed == [("faulted", None), ("hinted", None), ("hinted", "managed"), ("hinted", "advise")]
        for r in recs:
            m = r["mode"]
            assert r["compute_pages"] == ("faulted" if m == "mmap" else "hinted")
            assert (r["device_read_bytes_per_s_1"], r["device_read_bytes_per_s_4"]) == (1e9, 4e9)
            assert r["compute_tokens_per_s"] == c[m] and r["threads"] == 2 and r["compute_source"].startswith("cached")
            assert r["compute_source"].endswith(ends[m])
            assert r["read_bytes_per_s"] == B[m]
            assert r["read_source"].startswith(f"measured: {g.top_k} experts' slices faulted" if m == "mmap" else
                                               f"measured: {g.top_k} experts' slices hinted")
            assert ("nothing dropped, in a memory cgroup" in r["read_source"]) == (m != "managed")
            assert r["limit_tokens_per_s"] == pytest.approx(min(c[m], 4e9 / r["missed_bytes_per_token"]))
            assert r["predicted_tokens_per_s"] == pytest.approx(1 / (1 / c[m] + r["missed_bytes_per_token"] / B[m]))
    # O_DIRECT requests of one small slice slower than a mode's own path: the device reads at least as
    # fast as that path was timed, so no limit is under its forecast (the 8 MB test model had printed
    # mmap's limit 200 against its forecast 222 tok/s)
    monkeypatch.setattr(rl, "device_bandwidth", lambda path, req, readers, fresh=False: {
        "bytes_per_s": 1e3 * readers, "request_bytes": req, "cached": False, "note": None})
    for r in records(run(capsys, "size", tiny_gguf, "--memory", "200kB", "--threads", "2", "--json")[1]):
        D = r["missed_bytes_per_token"]
        assert r["limit_tokens_per_s"] == pytest.approx(min(c[r["mode"]], B[r["mode"]] / D))
        assert r["limit_tokens_per_s"] >= r["predicted_tokens_per_s"]
    out = run(capsys, "size", tiny_gguf, "--memory", "200kB", "--threads", "2")[1]
    assert "c with every expert resident = 50 tok/s for mmap (cached" in out and "34 tok/s for advise (" in out
    assert "36 tok/s for managed (" in out and "managed's hinted reads 0.5 GB/s (measured: " in out
    assert "advise's hinted reads 0.4 GB/s (measured: " in out and "mmap's faulted reads 0.2 GB/s (measured: " in out


def test_a_step_that_cannot_run_takes_its_page_states_rate(tiny_gguf, capsys, window, monkeypatch):
    """Where the managed step refuses to run on this machine (its mlock of the dense part refused),
    managed's c is the hinted pages' rate, and its source says why."""
    import types

    import expertcache.llama.roofline as rl
    from expertcache.errors import ConfigError

    def compute(path, prompt, tokens, threads, fresh=False, pages="faulted", step=None):
        if step == "managed":
            raise ConfigError("--mode managed: mlock of 4096 bytes failed: Cannot allocate memory (RLIMIT_MEMLOCK)")
        return {"tokens_per_s": {"faulted": 25.0, "hinted": 20.0}[pages] - (step == "advise"), "cached": False,
                "note": None}

    monkeypatch.setattr(rl, "compute_rate", compute)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    recs = {r["mode"]: r for r in records(run(capsys, "size", tiny_gguf, "--memory", "200kB", "--json",
                                                  "--disk-bandwidth", "1")[1])}
    assert recs["managed"]["compute_tokens_per_s"] == 20.0 and recs["advise"]["compute_tokens_per_s"] == 19.0
    assert recs["advise"]["compute_source"].endswith("hinted pages, the advise step observing")
    assert recs["managed"]["compute_source"] == (
        "measured: llama.cpp, 16 tokens decoded, median of 3 passes, 1 thread, hinted pages (the managed step not "
        "timed: --mode managed: mlock of 4096 bytes failed: Cannot allocate memory (RLIMIT_MEMLOCK))")


@pytest.mark.parametrize("argv, message", [
    (["--memory", "8GB"], "--memory forecasts a GGUF"),
    (["--memory", "8GB", "--device-memory", "8GB"], "--device-memory sizes a GPU expert cache"),
    (["--device-memory", "8GB", "--disk-bandwidth", "2"], "--disk-bandwidth belongs to the CPU-and-disk forecast"),
    ([], "give --device-memory BYTES (a GPU expert cache) or --memory SIZE"),
])
def test_forecast_refusals_without_a_gguf(capsys, argv, message):
    rc, _, err = run(capsys, "size", "--model-config", OLMOE, *argv)
    assert rc == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--memory", "100kB"], "below the smallest memory this model decodes in"),
    (["--memory", "1MB", "--compute", "auto", "--disk-bandwidth", "2"], "give --compute TOK/S"),
    (["--memory", "1MB", "--auto", "--compute", "40"], "--auto measures both"),
    (["--memory", "1MB", "--tau", "1ms"], "--tau sizes a GPU expert cache"),
    (["--memory", "1MB", "--warm", "0.5"], "--warm"),
    (["--memory", "1MB", "--model-config", "x.gguf"], "MODEL and --model-config both"),
    (["--memory", "1MB", "--disk-bandwidth", "auto", "--compute", "9"], "give --disk-bandwidth GB/s"),
])
def test_forecast_refusals_are_one_line(tiny_gguf, capsys, monkeypatch, argv, message):
    import expertcache.llama.roofline as rl

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the llama extra missing
    monkeypatch.setattr(rl, "device_bandwidth", lambda *a, **k: {"bytes_per_s": None, "request_bytes": 4096,
                                                                 "note": "O_DIRECT open failed: Invalid argument"})
    rc, _, err = run(capsys, "size", tiny_gguf, *argv)
    assert rc == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--disk-bandwidth", "fast"], "expected auto or a number in GB/s"),
    (["--compute", "-3"], "positive number in tok/s"),
    (["--compute", "1e-300"], "from 1e-6 to 1e9"),  # was accepted: a forecast of 4.8e-298 tok/s
    (["--disk-bandwidth", "1e-300"], "from 1e-6 to 1e9"),
    (["--threads", "0"], "--threads"),
])
def test_forecast_argument_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["size", "m.gguf", "--memory", "1MB", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and message in err[0], err


def test_forecast_trace_must_be_the_models(tiny_gguf, tmp_path, capsys):
    import expertcache as ec

    rng = np.random.default_rng(0)
    one = ec.Trace.from_arrays(np.stack([rng.choice(8, 2, replace=False) for _ in range(10)])[:, None, :],
                               num_experts=8).save(tmp_path / "one.npz")
    rc, _, err = run(capsys, "size", tiny_gguf, "--memory", "1MB", "--disk-bandwidth", "2", "--compute", "9",
                     "--trace", one)
    assert rc == 2 and err.count("\n") == 1 and "1 layer(s), the model has 2 MoE layers" in err
    wide = ec.Trace.from_arrays(np.stack([[rng.choice(16, 2, replace=False) for _ in range(2)] for _ in range(10)]),
                                num_experts=16).save(tmp_path / "wide.npz")
    rc, _, err = run(capsys, "size", tiny_gguf, "--memory", "1MB", "--disk-bandwidth", "2", "--compute", "9",
                     "--trace", wide)
    assert rc == 2 and "E=16, the model has E=8" in err


@pytest.mark.parametrize("size", [1024, 4096, 8192, 1 << 16])
def test_window_units_by_brute_force(tiny_gguf, tmp_path, capsys, monkeypatch, size):
    """Windows smaller than a slice (interior windows one expert's alone), equal, larger (one window
    holding many slices): the units and the window LRU's reads as the brute force finds them."""
    import expertcache.llama.forecast as dk
    from expertcache.formats.gguf import read_geometry

    g = read_geometry(str(tiny_gguf))
    experts, trace = _hand_trace(tmp_path)
    groups, usize = _window_units(g, experts, size)
    units, sizes = dk.expert_windows(g, size)
    assert [usize(u) for u in range(len(sizes))] == sizes.tolist()
    got = [sorted(set(np.concatenate([units[j][int(e)] for e in experts[t, j]]).tolist()))
           for t in range(len(experts)) for j in range(2)]
    assert got == groups
    monkeypatch.setattr(dk, "readahead_bytes", lambda path: (size, "fixed by the test"))
    room = 6 * 12288
    recs = _forecast(capsys, tiny_gguf, g.dense_bytes + room, trace)
    rec, advise = recs["mmap"], recs["advise"]["missed_bytes_per_token"]
    T = len(experts)
    groups2, usize2 = _window_units(g, experts, 2 * size)  # llama.cpp's POSIX_FADV_SEQUENTIAL doubles the window
    n2 = len(dk.expert_windows(g, 2 * size)[1])
    mm, first = two_lists_ref([(grp, True) for grp in groups2], g.dense_bytes + room,
                              [usize2(u) for u in range(n2)], g.dense_bytes, True)
    assert rec["missed_bytes_per_token"] == pytest.approx(max(mm / T, advise))
    assert rec["note"].startswith("as advise") == (mm / T < advise)
    if mm / T >= advise:
        assert rec["fill_bytes_per_token"] == pytest.approx(first / T)


@pytest.mark.parametrize("size", [4096, 1 << 23])
def test_a_wall_that_holds_the_file_reads_each_expert_once_in_every_mode(tiny_gguf, tmp_path, capsys, monkeypatch,
                                                                          size):
    """At a wall of the whole file every expert fits: the kernel modes, started with the file just
    loaded, read nothing. The window model had counted each window's dense pages as room the
    experts lacked, and with windows larger than the expert tensors (8 MiB on the tiny file)
    forecast mmap thrashing beside "every expert fits"."""
    import expertcache.llama.forecast as dk
    from expertcache.formats.gguf import read_geometry

    g = read_geometry(str(tiny_gguf))
    experts, trace = _hand_trace(tmp_path)
    monkeypatch.setattr(dk, "readahead_bytes", lambda path: (size, "fixed by the test"))
    recs = _forecast(capsys, tiny_gguf, g.file_bytes, trace)
    for mode in ("mmap", "advise"):
        assert recs[mode]["missed_bytes_per_token"] == recs[mode]["fill_bytes_per_token"] == 0, mode


def test_first_reads_are_bounded_by_the_file(tiny_gguf, tmp_path, capsys):
    """A first read is an expert's first use that missed: never more than the file's expert bytes
    (the fitted amplification the lists replaced had once multiplied them to 1.55 times those)."""
    from expertcache.formats.gguf import read_geometry

    g = read_geometry(str(tiny_gguf))
    experts, trace = _hand_trace(tmp_path)
    for room in (2 * 12288, 6 * 12288):
        recs = _forecast(capsys, tiny_gguf, g.dense_bytes + room, trace)
        for mode in ("mmap", "advise"):
            r = recs[mode]
            assert r["fill_bytes_per_token"] * len(experts) <= g.expert_tensor_bytes, (mode, room)
            assert r["fill_bytes_per_token"] <= r["missed_bytes_per_token"]
