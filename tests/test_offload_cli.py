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
    for r in records:
        replayed = replay(trace, 3, r["policy"], layers=[1, 2])
        assert (replayed.copies_total, replayed.copies_steady) == (r["copies_total"], r["copies_steady"])


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
    text.write_text("w1 w2", encoding="utf-8")
    gpt = save_toy_checkpoint("gpt_oss", root / "gpt")
    return {"missing": root / "nowhere", "gpt": gpt, "ids": ids, "ckpt": ckpt, "big": big, "text": text}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "{missing}", "--tokens", "{ids}"], "no such folder"),
        (["--model", "{gpt}", "--tokens", "{ids}"], "not supported by expertcache.hf"),
        (["--model", "{ckpt}", "--tokens", "{ids}", "--layers", "7-9"], "not MoE layers"),
        (["--model", "{ckpt}", "--tokens", "{big}"], "outside the model's vocabulary"),
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
