"""Quantized GGUFs as people download them (docs/llama.md): files made by llama.cpp's own
``llama_model_quantize`` (Q4_K_M, whose ``ffn_down_exps`` are Q6_K in some layers and Q4_K in
others; Q6_K; IQ4_NL, an i-quant that needs no importance matrix) are read, captured, run in every
page-cache mode, generated from and served; and each expert's byte ranges are checked by behaviour,
not by the size formula alone: zeroing exactly one expert's bytes in a copy of the file changes the
logits only when that expert routes, and after a ``managed`` decode the experts ``mincore`` finds
resident are exactly the pool's residents.

Needs the llama extra and torch/transformers (the random checkpoint); skips otherwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")
pytest.importorskip("gguf", reason="the llama extra (gguf) is not installed")
torch = pytest.importorskip("torch", reason="torch is needed for the random checkpoint")
pytest.importorskip("transformers", reason="transformers is needed for the random checkpoint")

from expertcache.formats.gguf import read_geometry  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "small-moe"
TYPES = ("q4_k_m", "q6_k", "iq4_nl")
PROMPT = "def parse(text):"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Random checkpoints of K-quant-able widths (hidden 256, experts 256 wide, E=8, k=2) with
    small-moe's byte-level BPE tokenizer, converted to f16 and quantized by llama.cpp: an OLMoE of 4
    layers as every type of ``TYPES``; a DeepSeek-V3 (one leading dense layer, then 2 MoE layers) as
    Q4_K_M; a gpt-oss (expert biases) as MXFP4 (``mxfp4_moe``, its released type)."""
    from expertcache.llama.convert import convert
    from expertcache.llama.quantize import quantize
    from expertcache.hf.toy import save_toy_checkpoint

    if not (SMALL / "tokenizer.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    d = tmp_path_factory.mktemp("quant")
    out = {}
    for family, layers, types in (("olmoe", 4, TYPES), ("deepseek_v3", 3, ("q4_k_m",)), ("gpt_oss", 2, ("mxfp4_moe",))):
        hf = d / family
        save_toy_checkpoint(family, hf, seed=4, hidden=256, intermediate=256, experts=8, top_k=2, layers=layers,
                            heads=4, vocab=2048)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(SMALL / name, hf / name)
        convert(hf, d / f"{family}-f16.gguf", "f16")
        for q in types:
            out[q if family == "olmoe" else f"{family}-{q}"] = Path(quantize(d / f"{family}-f16.gguf",
                                                                             d / f"{family}-{q}.gguf", q)["out"])
        if family == "olmoe":
            out["f16"] = d / f"{family}-f16.gguf"
    return out


ALL = TYPES + ("deepseek_v3-q4_k_m", "gpt_oss-mxfp4_moe")


def cli(*argv):
    return subprocess.run([sys.executable, "-m", "expertcache.cli.main", *map(str, argv)], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def test_geometry_of_each_type(files):
    f16 = read_geometry(str(files["f16"]))
    for q in TYPES:
        g = read_geometry(str(files[q]))
        assert (g.architecture, g.num_experts, g.top_k, g.moe_layers) == ("olmoe", 8, 2, [0, 1, 2, 3])
        assert g.expert_tensor_bytes < f16.expert_tensor_bytes and g.file_bytes < f16.file_bytes
        for layer in g.moe_layers:  # each expert tensor is E equal contiguous slices
            for t in g.experts[layer].values():
                assert t.nbytes % g.num_experts == 0 and t.shape[-1] == g.num_experts
    k_m = read_geometry(str(files["q4_k_m"]))
    assert k_m.summary()["expert_types"] == ["q4_k", "q6_k"]  # the recipe: ffn_down Q6_K in some layers only
    assert len(set(k_m.layer_expert_bytes)) == 2 and k_m.uniform_expert_bytes is None
    assert "iq4_nl" in read_geometry(str(files["iq4_nl"])).summary()["expert_types"]
    ds = read_geometry(str(files["deepseek_v3-q4_k_m"]))
    assert (ds.architecture, ds.moe_layers) == ("deepseek2", [1, 2])  # the leading dense layer is dense
    oss = read_geometry(str(files["gpt_oss-mxfp4_moe"]))
    assert oss.architecture == "gpt-oss" and "mxfp4" in oss.summary()["expert_types"]
    assert {"ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"} <= set(oss.experts[0])
    done = cli("llama", "info", files["q4_k_m"])
    assert done.returncode == 0 and "by layer" in done.stdout and "q6_k" in done.stdout, done.stderr


def _logits(path, ids):
    from expertcache.llama.engine import Engine

    with Engine(str(path), n_ctx=32) as eng:
        return eng.forward(ids, logits="all")


def _routes(path, ids):
    from expertcache.llama.capture import capture_gguf

    return capture_gguf(str(path), np.asarray([ids]), max_len=32).experts  # [tokens, layers, k]


@pytest.mark.parametrize("qtype", ALL)
def test_an_experts_bytes_matter_exactly_when_it_routes(files, qtype, tmp_path):
    """Zero one expert's byte ranges in a copy: the logits are bit-identical when it does not route,
    and differ when it does (so the ranges are that expert's, and not a neighbour's)."""
    g = read_geometry(str(files[qtype]))
    ids = [5, 17, 230]
    routes = _routes(files[qtype], ids)
    base = _logits(files[qtype], ids)
    raw = files[qtype].read_bytes()
    checked = {"unrouted": 0, "routed": 0}
    for j, layer in enumerate(g.moe_layers):
        used = set(routes[:, j].ravel().tolist())
        unused = [e for e in range(g.num_experts) if e not in used]
        picks = [("routed", sorted(used)[0])] + ([("unrouted", unused[0])] if unused else [])
        for kind, e in picks:
            data = bytearray(raw)
            for off, n in g.expert_ranges(layer, e):
                data[off:off + n] = bytes(n)
            path = tmp_path / f"{layer}-{e}.gguf"
            path.write_bytes(bytes(data))
            same = np.array_equal(_logits(path, ids), base)
            assert same == (kind == "unrouted"), (qtype, layer, e, kind)
            checked[kind] += 1
            path.unlink()
    assert checked["unrouted"] >= 1 and checked["routed"] == len(g.moe_layers)


@pytest.mark.parametrize("qtype", ("q4_k_m", "iq4_nl", "deepseek_v3-q4_k_m"))
def test_after_a_managed_decode_the_resident_experts_are_the_pools(files, qtype):
    from expertcache.llama.advice import resident
    from expertcache.llama.textgen import Session, stream_text

    g = read_geometry(str(files[qtype]))
    with Session.open(str(files[qtype]), mode="managed", cache_bytes=_wall(g, 0.4), n_ctx=128) as s:
        out = list(stream_text(s, prompt=PROMPT, max_tokens=12, temperature=0))
        assert out[-1]["decode_steps"] == 11
        cache, adv = s.advisor.cache, s.advisor
        pool = set(cache.resident.tolist())
        assert 0 < len(pool) < g.num_experts * len(g.moe_layers)  # a pool below the whole model
        assert cache.used_bytes <= cache.capacity_bytes
        found = {j * g.num_experts + e for j, layer in enumerate(g.moe_layers) for e in range(g.num_experts)
                 if all(resident(adv.base + off, n) for off, n in g.expert_ranges(layer, e))}
        assert found == pool


def _wall(g, frac):
    return int(g.dense_bytes + frac * g.expert_tensor_bytes)


@pytest.mark.parametrize("qtype", ALL)
def test_every_mode_runs_a_quantized_file_to_the_same_tokens(files, qtype):
    from expertcache.llama.runner import run_one

    g = read_geometry(str(files[qtype]))
    prompt = np.asarray([5, 17, 230, 11], dtype=np.int64)
    shas = {m: run_one(g, prompt, 6, m)["output_sha256"] for m in ("mmap", "advise", "pin", "nocache", "nommap")}
    shas["managed"] = run_one(g, prompt, 6, "managed", wall_bytes=_wall(g, 0.6), wall="none")["output_sha256"]
    assert len(set(shas.values())) == 1, shas
    trace = _routes(files[qtype], [5, 17, 230, 11])
    assert trace.shape == (4, len(g.moe_layers), 2)


def test_generate_and_capture_take_a_q4_k_m_file(files, tmp_path):
    text = {}
    for mode, extra in (("mmap", ()), ("managed", ("--cache-memory", "50%"))):
        done = cli("llama", "generate", files["q4_k_m"], "--prompt", PROMPT, "--max-new-tokens", "8", "--mode", mode,
                   *extra, "--json")
        assert done.returncode == 0, done.stderr
        text[mode] = json.loads(done.stdout)["text"]
    assert text["mmap"] == text["managed"] and text["mmap"]
    np.save(tmp_path / "ids.npy", np.asarray([[5, 17, 230, 11, 40, 41]]))
    done = cli("capture", "--model", files["q4_k_m"], "--tokens", tmp_path / "ids.npy", "--out", tmp_path / "t.npz",
               "--json")
    assert done.returncode == 0, done.stderr
    meta = json.loads(done.stdout)
    assert meta["tokens"] == 6 and meta["expert_bytes"] is None  # sizes differ by layer: no single size


@pytest.mark.parametrize("quantize", [[], ["--quantize", "q4_k_m"]])
def test_a_written_file_that_fails_its_check_leaves_the_output_as_it_was(tmp_path, capsys, monkeypatch, quantize):
    """convert checks the GGUF it wrote before it replaces --out: a file that fails leaves the one
    that was there (it had been renamed over --out, then removed: the earlier file was lost)."""
    import expertcache.formats.gguf as fg
    from expertcache.cli.main import main
    from expertcache.errors import ConfigError

    out = tmp_path / "m.gguf"
    out.write_bytes(b"the file that was there")

    def refuse(path, option=None):
        raise ConfigError(f"{option} {path}: ggml type 42 is not known")

    monkeypatch.setattr(fg, "read_geometry", refuse)
    assert main(["convert", str(SMALL), "--out", str(out), "--dtype", "f16", *quantize]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"so it was not written to {out} (--out {out}: ggml type 42" in err[0], err
    assert out.read_bytes() == b"the file that was there"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporaries
    monkeypatch.undo()
    assert main(["convert", str(SMALL), "--out", str(out), "--dtype", "f16", *quantize, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["out"] == rec["gguf"] == str(out) and rec["bytes"] == out.stat().st_size
    assert read_geometry(str(out)).num_experts == 16 and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
