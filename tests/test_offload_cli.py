"""``expertcache eval`` on tiny saved checkpoints: JSON records, the capture, and one-line errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from expertcache import load_trace, replay  # noqa: E402
from expertcache.cli.main import main  # noqa: E402
from expertcache.hf.toy import save_toy_checkpoint  # noqa: E402

REQUIRED = {"policy", "capacity", "tokens", "nll", "nll_reference", "exact", "copies_total", "copies_steady",
            "copies_per_token", "tokens_per_s", "copy_seconds"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_toy_checkpoint("olmoe", tmp_path_factory.mktemp("olmoe"), tokenizer=True)


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    path = tmp_path_factory.mktemp("ids") / "ids.npy"
    np.save(path, np.random.default_rng(0).integers(0, 95, 60))
    return path


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_json_capture_and_replay_agree(capsys, ckpt, ids, tmp_path):
    out_npz = tmp_path / "out.npz"
    code, out, err = run_cli(
        capsys, "eval", "--model", ckpt, "--tokens", ids, "--capacity", 3, "--policy", "lru", "--policy", "belady",
        "--layers", "1-2", "--max-len", 32, "--capture", out_npz, "--router-probs", "--json",
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["policy"] for r in records] == ["lru", "belady"]
    for r in records:
        assert REQUIRED <= r.keys()
        assert r["exact"] and r["replay_agrees"] and r["capacity"] == 3 and r["tokens"] == 60
        assert r["mode"] == "decode" and r["device"] == "cpu" and r["layers"] == [1, 2]
    trace = load_trace(out_npz)
    assert trace.num_tokens == 60 and trace.num_sequences == 2 and trace.router_probs is not None
    assert all(r["num_experts"] == trace.num_experts for r in records)  # what choose --add-replay checks
    for r in records:
        replayed = replay(trace, 3, r["policy"], layers=[1, 2])
        assert (replayed.copies_total, replayed.copies_steady) == (r["copies_total"], r["copies_steady"])


def test_eval_prints_its_results_before_a_capture_that_cannot_be_written(capsys, ckpt, ids, tmp_path, monkeypatch):
    """A full disk at --capture is one line and exit 2, after the records: the passes' results are not lost."""
    import errno

    from expertcache.trace.core import Trace

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(Trace, "save", full)
    out_npz = tmp_path / "out.npz"
    for json_out in (True, False):
        code, out, err = run_cli(capsys, "eval", "--model", ckpt, "--tokens", ids, "-c", 3, "-p", "lru", "--mode",
                                 "forward", "--max-len", 20, "--capture", out_npz, *(["--json"] if json_out else []))
        assert code == 2 and err.count("\n") == 1 and "out.npz" in err and "Traceback" not in err, err
        if json_out:
            assert json.loads(out)["policy"] == "lru"
        else:
            assert "copies/token" in out and "saved to" not in out
        assert not out_npz.exists()


def test_eval_text_with_local_tokenizer_and_table(capsys, ckpt, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{(i * 7) % 90}" for i in range(40)), encoding="utf-8")
    code, out, err = run_cli(capsys, "eval", "--model", ckpt, "--text", text, "--capacity", 4, "--policy", "lfu",
                             "--mode", "forward", "--max-len", 20)
    assert code == 0, err
    assert "reference (all experts resident)" in out and "lfu" in out and "copies/token" in out


def test_eval_fails_loudly_when_inexact(capsys, ckpt, ids, monkeypatch):
    from expertcache.hf.layer import OffloadedLayer

    original = OffloadedLayer.__call__
    monkeypatch.setattr(OffloadedLayer, "__call__", lambda self, h, i, w: original(self, h, i, w) + 1.0)
    code, out, err = run_cli(capsys, "eval", "--model", ckpt, "--tokens", ids, "--capacity", 4, "--policy", "lru",
                             "--mode", "forward", "--json")
    assert code == 1
    assert json.loads(out)["exact"] is False
    assert "expertcache eval: error: policy lru at C=4" in err and "Traceback" not in err


def test_eval_prefetch_batch_and_timing(capsys, ckpt, ids, tmp_path):
    code, out, err = run_cli(capsys, "eval", "--model", ckpt, "--tokens", ids, "-c", 3, "-p", "lru", "-p", "belady",
                             "--max-len", 20, "--prefetch", "next-layer", "--json")
    assert code == 0, err
    for r in map(json.loads, out.splitlines()):
        assert r["exact"] and r["replay_agrees"] is None and r["prefetch"] == "next-layer"
        assert r["prefetch_copies"] == r["prefetch_hits"] + r["prefetch_wasted"] + r["prefetch_pending"] > 0
        assert r["ms_blocking"] >= r["ms_overlapped"] >= r["c_ms_reference"] > 0 and r["memory"]["host_expert_bytes"] > 0
    out_npz = tmp_path / "batch.npz"
    code, out, err = run_cli(capsys, "eval", "--model", ckpt, "--tokens", ids, "-c", 4, "-p", "lru", "--max-len", 20,
                             "--batch", 2, "--capture", out_npz)
    assert code == 0, err
    assert "--batch 2 leaves out the last 1 sequence(s)" in err and "= replay" in out and "memory:" in out
    trace = load_trace(out_npz)
    assert trace.meta["batch"] == 2 and trace.num_tokens == 20 and trace.top_k == 4
    code, out, err = run_cli(capsys, "eval", "--model", ckpt, "--tokens", ids, "-c", 5, "-p", "lru", "-p", "belady",
                             "--max-len", 20, "--pool", "global")
    assert code == 0, err
    assert "capacity 5 slots shared by layers 0,1,2" in out and "NO" not in out
    code, out, err = run_cli(capsys, "eval", "--model", ckpt, "--tokens", ids, "-c", 3, "--mode", "forward",
                             "--prefetch", "oracle")
    assert code == 2 and "prefetch needs mode decode" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, ckpt, ids):
    root = tmp_path_factory.mktemp("bad")
    big, text = root / "big.npy", root / "t.txt"
    np.save(big, np.array([1, 2, 500]))
    np.save(root / "u64.npy", np.array([[1, 2, 2**63 + 5]], dtype=np.uint64))  # int64 would print it negative
    text.write_text("w1 w2", encoding="utf-8")
    gpt = save_toy_checkpoint("gpt_oss", root / "gpt")
    return {"missing": root / "nowhere", "gpt": gpt, "ids": ids, "ckpt": ckpt, "big": big, "text": text,
            "u64": root / "u64.npy"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "{missing}", "--tokens", "{ids}"], "no such folder"),
        (["--model", "{gpt}", "--tokens", "{ids}"], "not supported by expertcache.hf"),
        (["--model", "{ckpt}", "--tokens", "{ids}", "--layers", "7-9"], "not MoE layers"),
        (["--model", "{ckpt}", "--tokens", "{big}"], "outside the model's vocabulary"),
        (["--model", "{ckpt}", "--tokens", "{u64}"], "token id 9223372036854775813 is above any vocabulary"),
        (["--model", "{ckpt}", "--tokens", "{text}"], "not a valid .npy header"),
        (["--model", "{gpt}", "--text", "{text}"], "needs a tokenizer"),
        (["--model", "{ckpt}", "--tokens", "{ids}", "--policy", "nope"], "unknown policy"),
        (["--model", "{ckpt}", "--tokens", "{ids}", "--max-len", "1"], "max-len must be at least 2"),
        (["--model", "{ckpt}", "--tokens", "{ids}", "--batch", "3", "--max-len", "40"], "do not form a batch"),
    ],
)
def test_eval_errors_are_one_line(capsys, bad_inputs, argv, message):
    code, out, err = run_cli(capsys, "eval", *[a.format(**bad_inputs) for a in argv], "--capacity", 4)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("expertcache eval: error:") and message in err


@pytest.mark.parametrize("argv, message", [(["--batch", "0"], "argument --batch"), (["--prefetch", "x"], "argument --prefetch"),
                                           (["--reference", "x"], "argument --reference")])
def test_eval_usage_errors_are_one_line(capsys, ckpt, ids, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", str(ckpt), "--tokens", str(ids), "-c", "3", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


def _damaged(root, ckpt, name, *, config=None, tensors=None, raw=None):
    """A copy of ``ckpt`` with config.json values replaced (``config``), its weights filtered or
    changed (``tensors``: a function of the name -> array dict), or model.safetensors replaced by
    ``raw`` bytes."""
    import shutil

    from safetensors.numpy import load_file, save_file

    d = root / name
    shutil.copytree(ckpt, d)
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        save_file(tensors(load_file(str(ckpt / "model.safetensors"))), str(d / "model.safetensors"),
                  metadata={"format": "pt"})
    if raw is not None:
        (d / "model.safetensors").write_bytes(raw)
    return d


def test_a_damaged_checkpoint_is_refused_in_one_line_before_it_runs(capsys, ckpt, ids, tmp_path):
    """transformers fills weights a checkpoint lacks with random values and builds what the config
    declares before any check, so a missing router gave a capture that differed run to run (exit 0),
    an empty weights file a full eval of noise, and num_hidden_layers 10^7 gigabytes of random layers;
    a truncated file, a mistyped config or a top-k above E were exit 70. Each is now one line naming
    what is wrong, before a forward; a config that leaves weights unused is one warning."""
    full = (ckpt / "model.safetensors").read_bytes()
    cases = [
        (dict(tensors=lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.gate.weight"}),
         "lacks 1 weight(s) its config needs, e.g. model.layers.1.mlp.gate.weight (transformers would fill them"),
        (dict(tensors=lambda t: {}), "its safetensors files hold no weights"),
        (dict(config={"num_hidden_layers": 10_000_000}),
         "config.json has num_hidden_layers 10000000, but the weights hold no model.layers.3.* "
         "(they hold layers 0..2)"),
        (dict(config={"vocab_size": 100_000_000}), "config.json has vocab_size 100000000 and hidden_size 32, but "
                                                   "model.embed_tokens.weight is [96, 32]"),
        (dict(config={"num_experts": 16}), "in the checkpoint but [16, "),
        (dict(config={"num_experts_per_tok": 9}), "config.json has num_experts_per_tok 9, not 1..8"),
        (dict(config={"num_experts": "8"}), "cannot load it (Validation error for field 'num_experts':"),
        (dict(config={"dtype": "x"}), "cannot load it (module 'torch' has no attribute 'x')"),  # were exit 70
        (dict(config={"dtype": []}), "cannot load it (list index out of range)"),
        (dict(config={"num_attention_heads": 0}), "config.json has num_attention_heads 0, not 1..hidden_size (32)"),
        (dict(config={"pad_token_id": 10**30}),
         "config.json has pad_token_id 1000000000000000000000000000000, outside"),
        (dict(config={"num_hidden_layers": 0}), "config.json has num_hidden_layers 0; a model has at least 1"),
        (dict(raw=full[: len(full) // 2]), "data_offsets missing or outside the file"),
        (dict(raw=b""), "too short for a safetensors file"),
    ]
    for i, (change, message) in enumerate(cases):
        bad = _damaged(tmp_path, ckpt, f"bad{i}", **change)
        code, out, err = run_cli(capsys, "capture", "--model", bad, "--tokens", ids, "--out", tmp_path / "t.npz")
        assert code == 2 and err.count("\n") == 1 and message in err, (change, err)
        assert not (tmp_path / "t.npz").exists()
    fewer = _damaged(tmp_path, ckpt, "fewer", config={"num_hidden_layers": 1})
    code, out, err = run_cli(capsys, "capture", "--model", fewer, "--tokens", ids, "--out", tmp_path / "t.npz")
    assert code == 0 and err.count("\n") == 1 and "weight(s) in the checkpoint are not used by its config" in err
    assert load_trace(tmp_path / "t.npz").layer_ids == [0]


@pytest.mark.parametrize("name, text", [
    ("tokenizer.json", "[" * 100_000 + "]" * 100_000),  # RecursionError
    ("tokenizer.json", "5"),  # AttributeError
    ("tokenizer.json", '{"added_tokens": [], "model": {"type": "XYZ"}}'),  # the Rust tokenizers' plain Exception
    ("tokenizer_config.json", "[1]"),  # AttributeError
])
def test_a_damaged_tokenizer_for_text_is_one_line(capsys, tmp_path, name, text):
    """``--text`` with tokenizer files transformers cannot read: each had been exit 70."""
    import shutil
    from pathlib import Path

    small = Path(__file__).resolve().parents[1] / "models" / "small-moe"
    if not (small / "tokenizer.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    model = tmp_path / "m"
    shutil.copytree(small, model)
    (model / name).write_text(text)
    (tmp_path / "t.txt").write_text("hello world")
    code, _, err = run_cli(capsys, "capture", "--model", model, "--text", tmp_path / "t.txt", "--out",
                           tmp_path / "t.npz")
    assert code == 2 and err.count("\n") == 1 and f"--text needs a tokenizer saved in {model} (" in err, err
    assert not (tmp_path / "t.npz").exists()


def test_capture_inputs_that_said_nothing(capsys, ckpt, ids, tmp_path):
    """Refused where they were accepted silently or ended in exit 70: a signal recorded twice, more
    next-token candidates than the vocabulary, token rows of fewer than 2 tokens, a text file larger
    than the tokenizer should hold (a byte-order mark is not text), a NaN model in eval."""
    out = tmp_path / "t.npz"
    code, _, err = run_cli(capsys, "capture", "--model", ckpt, "--tokens", ids, "--out", out, "--record",
                           "next-top:2,next-top:3")
    assert code == 2 and "next-top is given twice" in err, err
    small = save_toy_checkpoint("olmoe", tmp_path / "v16", vocab=16)
    np.save(tmp_path / "ids16.npy", np.arange(40) % 16)
    code, _, err = run_cli(capsys, "capture", "--model", small, "--tokens", tmp_path / "ids16.npy", "--out", out,
                           "--record", "next-top:32")
    assert code == 2 and "next-top:32: more than the model's vocabulary of 16 tokens" in err, err
    for cols in (0, 1):
        np.save(tmp_path / "short.npy", np.zeros((3, cols), np.int64))
        code, _, err = run_cli(capsys, "capture", "--model", ckpt, "--tokens", tmp_path / "short.npy", "--out", out)
        assert code == 2 and f"rows of {cols} token(s); a sequence needs at least 2" in err, err
    from expertcache.cli.inputs import MAX_TEXT_BYTES

    (tmp_path / "big.txt").write_text("w1 " * (MAX_TEXT_BYTES // 3 + 1), encoding="utf-8")
    code, _, err = run_cli(capsys, "capture", "--model", ckpt, "--text", tmp_path / "big.txt", "--out", out)
    assert code == 2 and "more than 8,388,608" in err and "--tokens ids.npy" in err, err
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfw1 w2 w3")
    code, _, err = run_cli(capsys, "capture", "--model", ckpt, "--text", tmp_path / "bom.txt", "--out", out)
    assert code == 0 and load_trace(out).num_tokens == 3, err
    from safetensors.numpy import load_file

    nan = _damaged(tmp_path, ckpt, "nan", tensors=lambda t: {k: (v * np.nan if k == "lm_head.weight" else v)
                                                             for k, v in t.items()})
    assert "lm_head.weight" in load_file(str(nan / "model.safetensors"))
    code, _, err = run_cli(capsys, "eval", "--model", nan, "--tokens", ids, "-c", 4, "--max-len", 20)
    assert code == 2 and "the reference pass (every expert resident) gives NLL nan" in err, err
    positions = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    np.save(tmp_path / "long.npy", np.arange(positions + 1) % 90)
    for cmd in (["capture", "--out", out], ["eval", "-c", 4]):  # positions the model was never trained for
        code, _, err = run_cli(capsys, *cmd, "--model", ckpt, "--tokens", tmp_path / "long.npy", "--max-len",
                               positions + 1)
        assert code == 2 and f"a sequence of {positions + 1} tokens is longer than the model's {positions}" in err, err


def test_counts_the_model_bounds(capsys, ckpt, ids, tmp_path):
    """``controller train --batch`` at most the windows its tokens hold (100,000 passed 4 GB on this
    toy), ``calibrate --tokens`` at most the model's positions (10^8 grew its KV cache for ever)."""
    code, _, err = run_cli(capsys, "controller", "train", "--model", ckpt, "--tokens", ids, "-c", 4, "--steps", 1,
                           "--seq-len", 16, "--batch", 100000, "--out", tmp_path / "h.pt")
    assert code == 2 and "--batch 100000: more than the 44 windows of --seq-len 16 the 60 training tokens hold" \
        in err, err
    positions = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    code, _, err = run_cli(capsys, "calibrate", "--model", ckpt, "--repeats", 3, "--tokens", positions + 1)
    assert code == 2 and f"--tokens {positions + 1}: more than the model's {positions} positions" in err, err
