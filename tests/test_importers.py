"""Importers: vllm-jsonl, token-jsonl and SGLang dumps, plain or compressed, through the CLI.

Real files in tmp_path, real gzip/zstd streams, hand-computed expected arrays, a round-trip
property per format, and one test per hostile input: each must be one TraceError/ConfigError line
naming the file and line (or dump record) and the field, never a traceback.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expertcache as ec
from expertcache.cli.main import main
from expertcache.errors import ConfigError, TraceError
from expertcache.trace import importers
from expertcache.trace.importers import (
    JsonlFields,
    TokenFields,
    detect_format,
    import_sglang,
    import_token_jsonl,
    import_trace,
    import_vllm_jsonl,
    read_torch_save,
)

try:
    import zstandard
except ImportError:  # the tests that need it skip
    zstandard = None

needs_zstd = pytest.mark.skipif(zstandard is None, reason="zstandard is not installed")
PACKAGE = Path(importers.__file__).parent


def write(path: Path, lines, compression: str | None = None) -> Path:
    data = b"".join((ln if isinstance(ln, bytes) else (ln if isinstance(ln, str) else json.dumps(ln)).encode()) + b"\n" for ln in lines)
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def cli(*argv) -> tuple[int, dict | None]:
    """Run the CLI in-process with --json; returns (exit status, the JSON record or None)."""
    out = io.StringIO()
    old = sys.stdout
    sys.stdout = out
    try:
        rc = main(["import", *map(str, argv), "--json"])
    finally:
        sys.stdout = old
    return rc, (json.loads(out.getvalue()) if rc == 0 else None)


def one_line_error(exc_info, path) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and text.startswith(str(path)), text
    return text


# ---------------------------------------------------------------------- vllm-jsonl
VLLM = [
    {"problem_id": "b", "layer": 3, "token_idx": 7, "experts": [4, 1], "gating_probs": [0.75, 0.25]},
    {"problem_id": "b", "layer": 1, "token_idx": 7, "experts": [0, 2], "gating_probs": [0.5, 0.5]},
    {"problem_id": "a", "layer": 1, "token_idx": 0, "experts": [3, 2], "gating_probs": [1.0, 0.0]},
    {"problem_id": "b", "layer": 1, "token_idx": 2, "experts": [5, 0], "gating_probs": [0.625, 0.375]},
    {"problem_id": "b", "layer": 3, "token_idx": 2, "experts": [1, 3], "gating_probs": [0.5, 0.5]},
    {"problem_id": "a", "layer": 3, "token_idx": 0, "experts": [2, 4], "gating_probs": [0.25, 0.75]},
]
# b first (first appearance), its tokens sorted by index (2, 7); layers sorted (1, 3)
VLLM_EXPERTS = [[[5, 0], [1, 3]], [[0, 2], [4, 1]], [[3, 2], [2, 4]]]
VLLM_PROBS = [[[0.625, 0.375], [0.5, 0.5]], [[0.5, 0.5], [0.75, 0.25]], [[1.0, 0.0], [0.25, 0.75]]]


@pytest.mark.parametrize("compression", [None, "gzip", pytest.param("zstd", marks=needs_zstd)])
def test_vllm_jsonl_hand_computed(tmp_path, compression):
    log = write(tmp_path / "routing.log", VLLM, compression)  # the name says nothing: magic bytes decide
    rc, info = cli("vllm-jsonl", log, "--out", tmp_path / "t.npz")
    assert rc == 0
    assert info == {"out": str(tmp_path / "t.npz"), "format": "vllm-jsonl", "tokens": 3, "sequences": 2,
                    "layers": [1, 3], "num_layers": 2, "top_k": 2, "num_experts": 6, "tokens_dropped": 0}
    t = ec.load_trace(tmp_path / "t.npz")
    assert t.experts.tolist() == VLLM_EXPERTS
    assert t.probs.tolist() == VLLM_PROBS
    assert t.seq.tolist() == [0, 0, 1] and t.extras["step"].tolist() == [2, 7, 0]
    assert t.meta["sequence_ids"] == {"0": "b", "1": "a"} and t.meta["num_experts_inferred"] is True
    # --format auto and a path alone read the same
    for argv in (["--format", "auto"], []):
        rc, info2 = cli(log, "--out", tmp_path / "u.npz", *argv)
        assert rc == 0 and info2["format"] == "vllm-jsonl"
        assert ec.load_trace(tmp_path / "u.npz").experts.tolist() == VLLM_EXPERTS


def test_vllm_renamed_fields_and_no_probs(tmp_path):
    recs = [{"req": r["problem_id"], "L": r["layer"], "pos": r["token_idx"], "ids": r["experts"], "w": r["gating_probs"]} for r in VLLM]
    log = write(tmp_path / "r.jsonl", recs)
    rc, info = cli("vllm-jsonl", log, "--out", tmp_path / "t.npz", "--seq-field", "req", "--layer-field", "L",
                   "--token-field", "pos", "--experts-field", "ids", "--probs-field", "w", "--num-experts", "8")
    assert rc == 0 and info["num_experts"] == 8
    t = ec.load_trace(tmp_path / "t.npz")
    assert t.experts.tolist() == VLLM_EXPERTS and t.probs.tolist() == VLLM_PROBS
    assert "num_experts_inferred" not in t.meta
    rc, _ = cli("vllm-jsonl", log, "--out", tmp_path / "t2.npz", "--seq-field", "req", "--layer-field", "L",
                "--token-field", "pos", "--experts-field", "ids", "--probs-field", "")
    assert rc == 0 and ec.load_trace(tmp_path / "t2.npz").probs is None


def test_python_api_is_compatible(tmp_path):
    log = write(tmp_path / "r.jsonl", VLLM)
    t = import_vllm_jsonl(log, fields=JsonlFields(), num_experts=6)
    assert t.experts.tolist() == VLLM_EXPERTS and t.meta["source"]["format"] == "vllm-jsonl"
    t2, fmt = import_trace(log)
    assert fmt == "vllm-jsonl" and np.array_equal(t2.experts, t.experts)


def test_pad_is_explicit(tmp_path):
    recs = [dict(VLLM[0]), dict(VLLM[1], experts=[0], gating_probs=[1.0])] + VLLM[2:]
    log = write(tmp_path / "r.jsonl", recs)
    with pytest.raises(TraceError) as info:
        import_vllm_jsonl(log)
    text = one_line_error(info, f"{log}:2")
    assert "field 'experts' holds 1 ids where" in text and f"{log}:1 holds 2" in text and "--pad" in text
    t = import_vllm_jsonl(log, pad=True)
    assert t.experts[1, 0].tolist() == [0, -1] and t.meta["validation"]["padded"] is True
    assert t.probs[1, 0, 0] == 1.0


def test_drop_incomplete(tmp_path):
    log = write(tmp_path / "r.jsonl", VLLM[:-1])  # token a/0 lacks layer 3
    with pytest.raises(TraceError, match=r"no entry for problem_id='a', token_idx=0, layer 3"):
        import_vllm_jsonl(log)
    rc, info = cli("vllm-jsonl", log, "--out", tmp_path / "t.npz", "--drop-incomplete")
    assert rc == 0 and info["tokens"] == 2 and info["tokens_dropped"] == 1 and info["sequences"] == 1


# ---------------------------------------------------------------------- token-jsonl
TOKEN_LIST = [
    {"problem_id": 9, "token_idx": 1, "experts": [[1, 2], [3, 0]], "gating_probs": [[0.5, 0.5], [0.75, 0.25]]},
    {"problem_id": 9, "token_idx": 0, "experts": [[2, 3], [0, 1]], "gating_probs": [[0.25, 0.75], [1.0, 0.0]]},
    {"problem_id": 4, "token_idx": 5, "experts": [[0, 3], [2, 1]], "gating_probs": [[0.5, 0.5], [0.5, 0.5]]},
]
TOKEN_EXPERTS = [[[2, 3], [0, 1]], [[1, 2], [3, 0]], [[0, 3], [2, 1]]]
TOKEN_PROBS = [[[0.25, 0.75], [1.0, 0.0]], [[0.5, 0.5], [0.75, 0.25]], [[0.5, 0.5], [0.5, 0.5]]]


@pytest.mark.parametrize("compression", [None, "gzip", pytest.param("zstd", marks=needs_zstd)])
@pytest.mark.parametrize("form", ["list", "named", "dict"])
def test_token_jsonl_hand_computed(tmp_path, compression, form):
    recs = []
    for r in TOKEN_LIST:
        r = dict(r)
        if form == "named":
            r["layer_ids"] = [2, 6]
        if form == "dict":  # keys in any order
            r["experts"] = {"6": r["experts"][1], "2": r["experts"][0]}
            r["gating_probs"] = {"2": r["gating_probs"][0], "6": r["gating_probs"][1]}
        recs.append(r)
    log = write(tmp_path / "tokens.jsonl", recs, compression)
    rc, info = cli("token-jsonl", log, "--out", tmp_path / "t.npz")
    assert rc == 0
    layers = [0, 1] if form == "list" else [2, 6]
    assert info == {"out": str(tmp_path / "t.npz"), "format": "token-jsonl", "tokens": 3, "sequences": 2,
                    "layers": layers, "num_layers": 2, "top_k": 2, "num_experts": 4, "tokens_dropped": 0}
    t = ec.load_trace(tmp_path / "t.npz")
    assert t.experts.tolist() == TOKEN_EXPERTS and t.probs.tolist() == TOKEN_PROBS
    assert t.seq.tolist() == [0, 0, 1] and t.extras["step"].tolist() == [0, 1, 5]
    assert t.meta["sequence_ids"] == {"0": 9, "1": 4}
    assert detect_format(log) == "token-jsonl"
    rc, info = cli(log, "--out", tmp_path / "u.npz")
    assert rc == 0 and info["format"] == "token-jsonl" and info["layers"] == layers


def test_token_jsonl_renamed_fields(tmp_path):
    recs = [{"s": r["problem_id"], "t": r["token_idx"], "e": r["experts"], "p": r["gating_probs"], "ls": [5, 7]} for r in TOKEN_LIST]
    log = write(tmp_path / "tokens.jsonl", recs)
    t = import_token_jsonl(log, fields=TokenFields(seq="s", token="t", experts="e", probs="p", layers="ls"))
    assert t.experts.tolist() == TOKEN_EXPERTS and t.layer_ids == [5, 7] and t.probs.tolist() == TOKEN_PROBS
    rc, info = cli(log, "--out", tmp_path / "t.npz", "--seq-field", "s", "--token-field", "t",
                   "--experts-field", "e", "--probs-field", "p", "--layers-field", "ls")
    assert rc == 0 and info["format"] == "token-jsonl" and info["layers"] == [5, 7]


def test_token_jsonl_missing_layer_and_pad(tmp_path):
    recs = [{"problem_id": 0, "token_idx": 0, "experts": {"0": [1, 2], "1": [3, 4]}},
            {"problem_id": 0, "token_idx": 1, "experts": {"0": [1]}}]
    log = write(tmp_path / "tokens.jsonl", recs)
    with pytest.raises(TraceError) as info:
        import_token_jsonl(log)
    assert "holds 1 ids where" in one_line_error(info, f"{log}:2")
    with pytest.raises(TraceError, match="no entry for problem_id=0, token_idx=1, layer 1"):
        import_token_jsonl(log, pad=True)
    t = import_token_jsonl(log, pad=True, drop_incomplete=True)
    assert t.experts.tolist() == [[[1, 2], [3, 4]]] and t.meta["validation"]["tokens_dropped"] == 1


# ---------------------------------------------------------------------- hostile input
def _err(tmp_path, lines, *argv, fmt="vllm-jsonl", exc=TraceError, name="bad.jsonl", raw=None):
    """Import through the library entry point, expecting one error line; returns its text."""
    path = tmp_path / name
    if raw is not None:
        path.write_bytes(raw)
    else:
        write(path, lines)
    kwargs = dict(argv)
    with pytest.raises(exc) as info:
        import_trace(path, fmt, **kwargs)
    text = str(info.value)
    assert "\n" not in text and str(path) in text, text
    return text


GOOD = {"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5]}


def test_field_named_by_an_option_must_exist(tmp_path):
    text = _err(tmp_path, [GOOD], ("vllm_fields", JsonlFields(probs="gate")))
    assert text.startswith(f"{tmp_path / 'bad.jsonl'}:1: missing field 'gate'")
    text = _err(tmp_path, [GOOD], ("vllm_fields", JsonlFields(seq="request")))
    assert ":1: missing field 'request'" in text
    tok = {"problem_id": 0, "token_idx": 0, "experts": [[1, 2]]}
    text = _err(tmp_path, [tok], ("token_fields", TokenFields(layers="layer_list")), fmt="token-jsonl")
    assert ":1: missing field 'layer_list'" in text
    # through the CLI: exit 2
    log = write(tmp_path / "ok.jsonl", [GOOD])
    assert cli("vllm-jsonl", log, "--out", tmp_path / "t.npz", "--probs-field", "gate")[0] == 2
    assert not (tmp_path / "t.npz").exists()


def test_probs_all_or_none(tmp_path):
    rec = dict(GOOD)
    del rec["gating_probs"]
    text = _err(tmp_path, [GOOD, dict(rec, token_idx=1)])
    assert ":2: field 'gating_probs' is missing here but present at" in text and ":1 (all records or none)" in text


@pytest.mark.parametrize("raw, message", [
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}\n{"problem_id": "\xff\xfe"}\n', ":2: invalid UTF-8 at byte 16"),
    (b'[' * 100_000 + b']' * 100_000 + b"\n", ":1: JSON nested too deeply"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1' + b"0" * 5000 + b']}\n', ":1: field 'experts': <integer of 5001 digits> is out of range"),
    (b'{"problem_id": 0, "layer": 1' + b"0" * 5000 + b', "token_idx": 0, "experts": [1]}\n', ":1: field 'layer': <integer of 5001 digits> is out of range"),
    (b'{"problem_id": 0, "layer": 2147483648, "token_idx": 0, "experts": [1]}\n', ":1: field 'layer': 2147483648 is outside [0, 2^31)"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": -1, "experts": [1]}\n', ":1: field 'token_idx': -1 is outside [0, 2^31)"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1048576]}\n', ":1: field 'experts': expert id 1048576 is outside [0, 1048576)"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [NaN, 0.5]}\n', ":1: field 'gating_probs': non-finite value nan"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [1e999, 0.5]}\n', ":1: field 'gating_probs': non-finite value inf"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [-Infinity, 0.5]}\n', ":1: field 'gating_probs': non-finite value -inf"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [1e39, 0.5]}\n', ":1: field 'gating_probs': 1e+39 is outside [0, float32 max]"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [-0.5, 0.5]}\n', ":1: field 'gating_probs': -0.5 is outside [0, float32 max]"),
    (b'{"problem_id": 0, "layer": true, "token_idx": 0, "experts": [1]}\n', ":1: field 'layer' must be an integer, got True"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [true, 2]}\n', ":1: field 'experts': expert id True is not an integer"),
    (b'{"problem_id": false, "layer": 0, "token_idx": 0, "experts": [1]}\n', ":1: field 'problem_id' must be an integer or a string, got False"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0.0, "experts": [1]}\n', ":1: field 'token_idx' must be an integer, got 0.0"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 1]}\n', ":1: field 'experts': an id appears twice"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": []}\n', ":1: field 'experts' must be a non-empty list"),
    (b'[1, 2]\n', ":1: expected a JSON object per line, got an array"),
    (b'{"problem_id": 0, "layer": 0\n', ":1: not valid JSON"),
    (b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1]}\n{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [2]}\n',
     ":2: a second entry for problem_id=0, token_idx=0, layer 0"),
])
def test_hostile_vllm_lines(tmp_path, raw, message):
    text = _err(tmp_path, None, raw=raw)
    assert message in text and text.startswith(str(tmp_path / "bad.jsonl") + ":"), text


@pytest.mark.parametrize("rec, message", [
    ({"problem_id": 0, "token_idx": 0, "experts": {"a": [1]}}, "field 'experts': layer key 'a' is not a non-negative integer"),
    ({"problem_id": 0, "token_idx": 0, "experts": {"99999999999": [1]}}, "layer key '99999999999' is not a non-negative integer"),
    ({"problem_id": 0, "token_idx": 0, "experts": {"0": [1, True]}}, "field 'experts.0': expert id True is not an integer"),
    ({"problem_id": 0, "token_idx": 0, "experts": [[1], [2, 2]]}, "field 'experts[1]': an id appears twice"),
    ({"problem_id": 0, "token_idx": 0, "experts": [[1], 2]}, "field 'experts' must be a list of id lists"),
    ({"problem_id": 0, "token_idx": 0, "experts": [[1]], "layer_ids": [0, 1]}, "field 'layer_ids' must list 1 layer ids"),
    ({"problem_id": 0, "token_idx": 0, "experts": [[1], [2]], "layer_ids": [3, 3]}, "field 'layer_ids': a layer appears twice"),
    ({"problem_id": 0, "token_idx": 0, "experts": [[1]], "gating_probs": [[0.5], [0.5]]}, "field 'gating_probs' must be a list of 1 weight lists"),
    ({"problem_id": 0, "token_idx": 0, "experts": {"0": [1]}, "gating_probs": {"1": [0.5]}}, "field 'gating_probs' must be an object with the same layer keys"),
    ({"problem_id": 0, "token_idx": 0, "experts": [[1, 2]], "gating_probs": [[0.5, float("inf")]]}, "field 'gating_probs[0]': non-finite value inf"),
])
def test_hostile_token_records(tmp_path, rec, message):
    text = _err(tmp_path, [rec], fmt="token-jsonl")
    assert text.startswith(f"{tmp_path / 'bad.jsonl'}:1: ") and message in text, text


def test_empty_files(tmp_path):
    for name, raw in (("empty.jsonl", b""), ("blank.jsonl", b"\n  \n"), ("empty.jsonl.gz", gzip.compress(b""))):
        for fmt in ("vllm-jsonl", "token-jsonl", "auto"):
            text = _err(tmp_path, None, fmt=fmt, name=name, raw=raw)
            assert text == f"{tmp_path / name}: empty file (no records)"


def test_directory_and_fifo_are_refused(tmp_path):
    (tmp_path / "dir").mkdir()
    for fmt in ("vllm-jsonl", "token-jsonl"):
        with pytest.raises(TraceError, match=r"dir: is a directory; expected a regular file"):
            import_trace(tmp_path / "dir", fmt)
    with pytest.raises(TraceError, match=r"no such file"):
        import_trace(tmp_path / "missing.jsonl", "vllm-jsonl")
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(tmp_path / "fifo")
    for argv in (["vllm-jsonl"], ["token-jsonl"], ["sglang"], []):  # a FIFO must not hang, whatever the format
        proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "import", *argv, str(tmp_path / "fifo"),
                               "--out", str(tmp_path / "t.npz")], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "fifo: is a FIFO; expected a regular file" in proc.stderr, (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1


def test_line_length_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(importers.records, "MAX_LINE_BYTES", 100)
    assert importers.MAX_LINE_BYTES == 64 << 20  # the documented cap
    line = json.dumps(dict(GOOD, pad="x" * 200)).encode()
    for compression in COMPRESSIONS:
        path = write(tmp_path / f"long-{compression}", [GOOD, line], compression)
        with pytest.raises(TraceError) as info:
            import_vllm_jsonl(path)
        assert one_line_error(info, path) == f"{path}:2: line longer than 100 bytes (the limit for one record)"
    # a file without any newline is cut at the cap, not read whole
    path = tmp_path / "nonl"
    path.write_bytes(b"9" * 1000)
    with pytest.raises(TraceError, match=r"nonl:1: line longer than"):
        import_vllm_jsonl(path)


def test_corrupt_and_truncated_gzip(tmp_path):
    data = write(tmp_path / "x", [dict(GOOD, token_idx=t) for t in range(2000)], "gzip").read_bytes()
    (tmp_path / "trunc.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError) as info:
        import_vllm_jsonl(tmp_path / "trunc.gz")
    assert "trunc.gz: corrupt or truncated gzip stream after line" in one_line_error(info, tmp_path / "trunc.gz")
    bad = bytearray(data)
    bad[-6] ^= 0xFF  # the CRC in the trailer
    (tmp_path / "bad.gz").write_bytes(bytes(bad))
    with pytest.raises(TraceError) as info:
        import_vllm_jsonl(tmp_path / "bad.gz")
    assert "bad.gz: corrupt or truncated gzip stream after line 2000 (CRC check failed" in one_line_error(info, tmp_path / "bad.gz")
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF  # damage in the middle: a decoding error, or garbage that fails as JSON first
    (tmp_path / "mid.gz").write_bytes(bytes(bad))
    with pytest.raises(TraceError) as info:
        import_vllm_jsonl(tmp_path / "mid.gz")
    one_line_error(info, tmp_path / "mid.gz")


@needs_zstd
def test_corrupt_and_truncated_zstd(tmp_path):
    recs = [dict(GOOD, token_idx=t) for t in range(2000)]
    data = write(tmp_path / "x", recs, "zstd").read_bytes()
    for cut in (len(data) // 2, len(data) - 3):
        (tmp_path / "trunc.zst").write_bytes(data[:cut])
        with pytest.raises(TraceError) as info:
            import_vllm_jsonl(tmp_path / "trunc.zst")
        assert "corrupt or truncated zstd stream after line" in one_line_error(info, tmp_path / "trunc.zst")
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    bad[len(bad) // 2 + 7] ^= 0xFF
    (tmp_path / "bad.zst").write_bytes(bytes(bad))
    with pytest.raises(TraceError) as info:
        import_vllm_jsonl(tmp_path / "bad.zst")
    assert one_line_error(info, tmp_path / "bad.zst")
    # several frames (as pzstd writes) read as one stream
    half = len(recs) // 2
    two = write(tmp_path / "a", recs[:half], "zstd").read_bytes() + write(tmp_path / "b", recs[half:], "zstd").read_bytes()
    (tmp_path / "two.zst").write_bytes(two)
    assert import_vllm_jsonl(tmp_path / "two.zst").num_tokens == len(recs)


def test_zstd_without_zstandard_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "x.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 20)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(TraceError) as info:
        import_vllm_jsonl(path)
    assert one_line_error(info, path) == f"{path}: is zstd-compressed; reading it needs the zstandard package (pip install zstandard)"


def test_auto_fits_none(tmp_path):
    text = _err(tmp_path, [{"hello": 1}], fmt="auto")
    assert text.startswith(f"{tmp_path / 'bad.jsonl'}:1: this record has no known shape; fits none of: vllm-jsonl (")
    assert "token-jsonl (" in text and "sglang (" in text and "problem_id/layer/token_idx/experts" in text
    text = _err(tmp_path, None, fmt="auto", raw=b"\x00\x01binary\n")
    assert "line 1 is no JSON record" in text and "fits none of:" in text
    np.savez(tmp_path / "t.npz", a=np.zeros(1))
    with pytest.raises(TraceError, match=r"t.npz: a zip archive without data.pkl; fits none of"):
        detect_format(tmp_path / "t.npz")
    tok = {"problem_id": 0, "token_idx": 0, "experts": [[1]]}
    text = _err(tmp_path, [GOOD, tok], fmt="auto")
    assert ":2: a token-jsonl record, but" in text and ":1 is a vllm-jsonl record" in text


# ---------------------------------------------------------------------- CLI shape
def test_cli_shapes_and_option_errors(tmp_path):
    log = write(tmp_path / "r.jsonl", VLLM)
    nope = tmp_path / "nope" / "t.npz"
    for argv, message in [
        # --out in a missing folder is named, and checked before the input is read
        (["import", "vllm-jsonl", str(log), "--out", str(nope)], f"--out {nope}: folder {nope.parent} does not exist"),
        (["import", str(tmp_path / "missing.jsonl"), "--out", str(nope)], f"folder {nope.parent} does not exist"),
        (["import", str(log), "--out", str(tmp_path)], "is a folder, expected a file name"),
        (["import", "sglang", "--out", str(tmp_path / "t.npz")], "missing the path after the format sglang"),
        (["import", "csv", str(log), "--out", str(tmp_path / "t.npz")], "'csv' is not a format"),
        (["import", "token-jsonl", str(log), "--format", "vllm-jsonl", "--out", str(tmp_path / "t.npz")], "contradicts --format"),
        (["import", str(log), "--layers-field", "x", "--out", str(tmp_path / "t.npz")], "--layers-field does not apply to vllm-jsonl"),
        (["import", str(log), "--rank", "0", "--out", str(tmp_path / "t.npz")], "--rank does not apply to vllm-jsonl"),
        (["import", str(log), "--phase", "training", "--out", str(tmp_path / "t.npz")], "--phase: 'training' is not one of"),
        (["import", "a", "b", "c", "--out", str(tmp_path / "t.npz")], "expected [FORMAT] PATH, got 3 arguments"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *argv], capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.npz").exists()


def test_help_lists_the_formats():
    proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "import", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for word in ("vllm-jsonl", "token-jsonl", "sglang", "[FORMAT] PATH", "--format", "gzip", "zstd", "--pad", "64 MiB"):
        assert word in proc.stdout


def test_no_unpickling_and_no_torch_in_the_package():
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        for banned in ("pickle.load", "torch.load", "import torch", "Unpickler", "eval(", "exec("):
            assert banned not in text, (path.name, banned)
        assert len(text.splitlines()) < 400, path.name
    code = "import sys, expertcache.trace.importers, expertcache.cli.import_cmd, expertcache.cli.export_cmd; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# ---------------------------------------------------------------------- round trips
def _random_trace(seed: int):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(2, 10))
    k = int(rng.integers(1, min(E, 4) + 1))
    L = int(rng.integers(1, 4))
    layer_ids = sorted(rng.choice(12, L, replace=False).tolist())
    lens = rng.integers(1, 5, size=int(rng.integers(1, 4)))
    T = int(lens.sum())
    ex = np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)]).astype(np.int32)
    probs = rng.random((T, L, k)).astype(np.float32)
    seq = np.repeat(np.arange(len(lens)), lens)
    step = np.concatenate([np.cumsum(rng.integers(1, 3, n)) - 1 for n in lens])
    names = [f"s{i}" if rng.random() < 0.5 else int(100 - i) for i in range(len(lens))]
    return dict(E=E, k=k, L=L, layer_ids=layer_ids, ex=ex, probs=probs, seq=seq, step=step, names=names)


def _jsonl(tr, form: str) -> list[dict]:
    recs = []
    for t in range(len(tr["seq"])):
        s, tok = tr["names"][tr["seq"][t]], int(tr["step"][t])
        ids = [[int(x) for x in tr["ex"][t, i]] for i in range(tr["L"])]
        pr = [[float(x) for x in tr["probs"][t, i]] for i in range(tr["L"])]
        if form == "vllm-jsonl":
            recs += [{"problem_id": s, "layer": lid, "token_idx": tok, "experts": ids[i], "gating_probs": pr[i]}
                     for i, lid in enumerate(tr["layer_ids"])]
        elif form == "dict":
            recs.append({"problem_id": s, "token_idx": tok, "experts": {str(l): ids[i] for i, l in enumerate(tr["layer_ids"])},
                         "gating_probs": {str(l): pr[i] for i, l in enumerate(tr["layer_ids"])}})
        else:
            recs.append({"problem_id": s, "token_idx": tok, "experts": ids, "gating_probs": pr, "layer_ids": tr["layer_ids"]})
    return recs


COMPRESSIONS = [None, "gzip"] + (["zstd"] if zstandard is not None else [])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), form=st.sampled_from(["vllm-jsonl", "list", "dict"]),
       compression=st.sampled_from(COMPRESSIONS), auto=st.booleans())
def test_jsonl_round_trip(tmp_path, seed, form, compression, auto):
    tr = _random_trace(seed)
    log = write(tmp_path / f"log-{seed}", _jsonl(tr, form), compression)
    fmt = "auto" if auto else ("vllm-jsonl" if form == "vllm-jsonl" else "token-jsonl")
    t, got = import_trace(log, fmt, num_experts=tr["E"])
    assert got == ("vllm-jsonl" if form == "vllm-jsonl" else "token-jsonl")
    t = ec.load_trace(t.save(tmp_path / f"t-{seed}.npz"))
    assert np.array_equal(t.experts, tr["ex"]) and np.array_equal(t.probs, tr["probs"])
    assert np.array_equal(t.seq, tr["seq"]) and np.array_equal(t.extras["step"], tr["step"])
    assert t.layer_ids == tr["layer_ids"] and t.num_experts == tr["E"]
    assert list(t.meta["sequence_ids"].values()) == tr["names"]


# ---------------------------------------------------------------------- SGLang
def sglang_dump(path: Path, passes, *, num_layers: int, pmap=None, rank: int = 0, chunk: int = 16):
    """Write a dump the way SGLang's per_token recorder does (python/sglang/srt/eplb/expert_distribution.py):
    ``_DetailSinglePassGatherer`` keeps an int32 ``[layers, chunked_prefill_size * 8, 8]`` buffer reset
    to -1 and fills ``[layer, :tokens, :k]`` from ``topk_ids``; ``collect`` returns the pass metadata
    plus ``topk_ids_of_layer=buf[:, :num_tokens, :].clone().cpu()``; ``_DetailAccumulator.append``
    adds ``forward_pass_id``, ``rank``, ``gatherer_key``; ``dump`` calls ``torch.save(dict(records=...,
    last_physical_to_logical_map=...))``. ``passes``: (positions, extend_seq_lens or None,
    {layer: int [tokens, k] physical ids})."""
    torch = pytest.importorskip("torch")
    records = []
    for fp, (positions, extend, topk) in enumerate(passes):
        n = len(positions)
        buf = torch.full((num_layers, chunk * 8, 8), -1, dtype=torch.int32)
        for layer, ids in topk.items():
            ids = torch.as_tensor(np.asarray(ids), dtype=torch.int32)
            buf[layer, : ids.shape[0], : ids.shape[1]] = ids
        count = torch.zeros((num_layers, 64), dtype=torch.int32)
        records.append(dict(forward_pass_id=fp, rank=rank, gatherer_key="primary",
                            input_ids=[1000 + int(p) for p in positions], positions=[int(p) for p in positions],
                            extend_seq_lens=None if extend is None else [int(x) for x in extend],
                            forward_mode=1 if extend is not None else 2, topk_ids_of_layer=buf[:, :n, :].clone().cpu(),
                            misc_objects=[], global_physical_count=count))
    out = dict(records=records)
    out["last_physical_to_logical_map"] = torch.as_tensor(np.asarray(pmap), dtype=torch.int64) if pmap is not None else None
    torch.save(out, str(path))
    return path


# 3 model layers, layer 0 dense (never routed); 6 physical experts, 4 logical (physical 4 -> 0, 5 -> 1)
PMAP = [[0, 1, 2, 3, 0, 1]] * 3
SGLANG_PASSES = [
    ([0, 1, 2], [3], {1: [[0, 5], [2, 3], [4, 1]], 2: [[3, 2], [1, 0], [5, 2]]}),   # request A prefill
    ([3], None, {1: [[1, 2]], 2: [[4, 3]]}),                                       # A decodes
    ([4], None, {1: [[2, 3]], 2: [[0, 5]]}),
    ([0, 1], [2], {1: [[3, 0], [5, 2]], 2: [[1, 2], [2, 3]]}),                     # request B prefill
    ([2], None, {1: [[0, 2]], 2: [[3, 1]]}),
]
SGLANG_EXPERTS = [  # logical ids, layers 1 and 2
    [[0, 1], [3, 2]], [[2, 3], [1, 0]], [[0, 1], [1, 2]], [[1, 2], [0, 3]], [[2, 3], [0, 1]],
    [[3, 0], [1, 2]], [[1, 2], [2, 3]], [[0, 2], [3, 1]],
]


def test_sglang_dump_hand_computed(tmp_path):
    dump = sglang_dump(tmp_path / "expert_distribution_recorder_1718000000.5_0.pt", SGLANG_PASSES, num_layers=3, pmap=PMAP)
    rc, info = cli("sglang", dump, "--out", tmp_path / "t.npz")
    assert rc == 0
    assert info == {"out": str(tmp_path / "t.npz"), "format": "sglang", "tokens": 8, "sequences": 2, "layers": [1, 2],
                    "num_layers": 2, "top_k": 2, "num_experts": 4, "tokens_dropped": 0}
    t = ec.load_trace(tmp_path / "t.npz")
    assert t.experts.tolist() == SGLANG_EXPERTS
    assert t.seq.tolist() == [0] * 5 + [1] * 3 and t.extras["step"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert t.extras["position"].tolist() == t.extras["step"].tolist()
    assert t.extras["forward_pass"].tolist() == [0, 0, 0, 1, 2, 3, 3, 4]
    assert t.extras["token_ids"].tolist() == [1000, 1001, 1002, 1003, 1004, 1000, 1001, 1002]
    assert t.meta["phase"] == "mixed" and t.meta["source"]["sequences"] == "positions" and t.probs is None
    assert "num_experts_inferred" not in t.meta
    rc, info = cli(dump, "--out", tmp_path / "u.npz", "--sequences", "stream")  # auto-detected
    assert rc == 0 and info["format"] == "sglang" and info["sequences"] == 1
    u = ec.load_trace(tmp_path / "u.npz")
    assert u.extras["step"].tolist() == list(range(8)) and u.extras["position"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    rc, info = cli("sglang", dump, "--out", tmp_path / "chunks", "--chunk-sequences", "1")  # read whole, then chunked
    assert rc == 0 and (info["chunks"], info["sequences"], info["tokens"]) == (2, 2, 8)
    back = ec.trace.chunked.open_chunked(tmp_path / "chunks").load()
    assert back.experts.tolist() == SGLANG_EXPERTS and back.extras["forward_pass"].tolist() == [0, 0, 0, 1, 2, 3, 3, 4]


def test_sglang_folder_ranks_and_batched_passes(tmp_path):
    folder = tmp_path / "dumps"
    folder.mkdir()
    sglang_dump(folder / "expert_distribution_recorder_1718000000.5_1.pt", SGLANG_PASSES[3:], num_layers=3, pmap=PMAP, rank=1)
    sglang_dump(folder / "expert_distribution_recorder_1718000000.5_0.pt", SGLANG_PASSES[:3], num_layers=3, pmap=PMAP, rank=0)
    (folder / "notes.txt").write_text("ignored")
    rc, info = cli(folder, "--out", tmp_path / "t.npz")
    assert rc == 0 and info["format"] == "sglang" and info["tokens"] == 8 and info["sequences"] == 2
    t = ec.load_trace(tmp_path / "t.npz")
    assert t.experts.tolist() == SGLANG_EXPERTS and t.extras["rank"].tolist() == [0] * 5 + [1] * 3
    rc, info = cli("sglang", folder, "--out", tmp_path / "r1.npz", "--rank", "1")
    assert rc == 0 and info["tokens"] == 3
    # a batched decode pass (two requests) makes auto choose one sequence per file
    batched = [([0, 1], [1, 1], {1: [[0, 1], [2, 3]]}), ([1, 2], None, {1: [[1, 2], [3, 0]]})]
    dump = sglang_dump(tmp_path / "b.pt", batched, num_layers=2)
    t = import_sglang(dump)
    assert t.meta["source"]["sequences"] == "stream" and t.num_sequences == 1
    assert t.experts[:, 0].tolist() == [[0, 1], [2, 3], [1, 2], [3, 0]] and t.meta["num_experts_inferred"]
    assert import_sglang(dump, sequences="positions").seq.tolist() == [0, 0, 1, 1]  # positions 0 1 | 1 2


def test_sglang_incomplete_and_short_rows(tmp_path):
    passes = [([0, 1], [2], {1: [[0, 1], [2, -1]], 2: [[1, 2], [0, 3]]}),   # token 1 has one id at layer 1
              ([2], None, {2: [[1, 0]]})]                                   # token 2 has no id at layer 1
    dump = sglang_dump(tmp_path / "d.pt", passes, num_layers=3)
    with pytest.raises(TraceError) as info:
        import_sglang(dump)
    assert one_line_error(info, dump) == f"{dump}: records[1] (forward_pass_id 1), token 0, layer 1: no expert id (--drop-incomplete drops such tokens)"
    with pytest.raises(TraceError, match=r"records\[0\] \(forward_pass_id 0\), token 1, layer 1: 1 expert ids where others have 2 \(--pad"):
        import_sglang(dump, drop_incomplete=True)
    t = import_sglang(dump, drop_incomplete=True, pad=True)
    assert t.experts.tolist() == [[[0, 1], [1, 2]], [[2, -1], [0, 3]]] and t.meta["validation"]["tokens_dropped"] == 1


def test_sglang_other_modes_are_named(tmp_path):
    torch = pytest.importorskip("torch")
    # mode 'stat' (_StatAccumulator.dump): logical_count [buffered passes, layers, logical experts]
    torch.save(dict(rank=0, logical_count=torch.zeros((4, 3, 8), dtype=torch.int32), average_utilization_rate_over_window=None),
               str(tmp_path / "stat.pt"))
    with pytest.raises(TraceError, match=r"stat.pt: an SGLang 'stat' dump .*per_token"):
        import_sglang(tmp_path / "stat.pt")
    # mode 'per_pass' (_DetailAccumulator with a counting gatherer): global_physical_count per pass
    torch.save(dict(records=[dict(forward_pass_id=0, rank=0, gatherer_key="primary",
                                  global_physical_count=torch.zeros((3, 8), dtype=torch.int32))],
                    last_physical_to_logical_map=torch.arange(8).repeat(3, 1)), str(tmp_path / "pass.pt"))
    with pytest.raises(TraceError, match=r"pass.pt: records\[0\]: an SGLang 'per_pass' record"):
        import_sglang(tmp_path / "pass.pt")


def _zip_pickle(path: Path, pkl: bytes, members: dict | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        for name, data in (members or {}).items():
            z.writestr(f"archive/{name}", data)
    return path


def test_restricted_pickle_reader(tmp_path):
    torch = pytest.importorskip("torch")
    x = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)
    obj = {"view": x[1, 1:, ::2], "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "half": torch.tensor([0.25], dtype=torch.float16),
           "b": torch.tensor([True, False]), "nested": [1, 2**40, -3, 0.5, None, True, "s", (1, 2)], "empty": torch.zeros((0, 3))}
    torch.save(obj, str(tmp_path / "x.pt"))
    got = read_torch_save(tmp_path / "x.pt")
    assert got["view"].tolist() == [[16, 18], [20, 22]] and got["view"].dtype == np.int32
    assert got["bf"].tolist() == [1.5, -2.0] and got["half"].tolist() == [0.25] and got["b"].tolist() == [True, False]
    assert got["nested"] == [1, 2**40, -3, 0.5, None, True, "s", (1, 2)] and got["empty"].shape == (0, 3)
    # a pickle that would run code: refused before anything is called
    evil = b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03."
    with pytest.raises(TraceError) as info:
        read_torch_save(_zip_pickle(tmp_path / "evil.pt", evil))
    assert "global 'os.system' is not allowed" in one_line_error(info, tmp_path / "evil.pt")
    with pytest.raises(TraceError, match=r"opcode INST is not allowed|opcode .* is not allowed"):
        read_torch_save(_zip_pickle(tmp_path / "inst.pt", b"(ios\nsystem\nS'true'\n."))
    # a storage whose member is smaller than its reference claims
    pkl = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nIntStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu"
           b"J\x00\x00\x00\x01tQK\x00K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR.")
    with pytest.raises(TraceError, match=r"storage member 'archive/data/0' holds 16 bytes, expected 67108864"):
        read_torch_save(_zip_pickle(tmp_path / "big.pt", pkl, {"data/0": b"\0" * 16}))
    deep = 100_000  # nesting is interpreted without recursion, and printed without it
    with pytest.raises(TraceError, match=r"persistent id <deeply nested list> is not a storage reference"):
        read_torch_save(_zip_pickle(tmp_path / "deep.pt", b"\x80\x02" + b"]" * deep + b"a" * (deep - 1) + b"Q."))
    with pytest.raises(TraceError, match=r"stack underflow"):
        read_torch_save(_zip_pickle(tmp_path / "under.pt", b"\x80\x02t."))
    with pytest.raises(TraceError, match=r"not a torch.save zip archive"):
        read_torch_save(write(tmp_path / "text.pt", [GOOD]))
    with pytest.raises(TraceError, match=r"not an SGLang expert-distribution dump"):
        import_sglang(tmp_path / "x.pt")


def test_views_of_one_storage_are_read_once_and_bounded(tmp_path, monkeypatch):
    """100 tensors viewing one 4 MiB storage: each is a read-only view of the storage read once (the
    reader used to copy every view: a 16.8 MB file took 1.76 GB), and the bytes they claim in all
    are held to the trace limit, since a consumer will copy them."""
    import tracemalloc

    torch = pytest.importorskip("torch")
    x = torch.arange(1 << 20, dtype=torch.int32)
    big = x.reshape(1, 1 << 18, 4).expand(2, -1, -1)  # stride 0 on the first axis: 2M elements of a 1M storage
    torch.save({"views": [x.reshape(1 << 10, 1 << 10)[i % 7:] for i in range(100)], "whole": x}, str(tmp_path / "v.pt"))
    torch.save({"big": big}, str(tmp_path / "big.pt"))
    size = (tmp_path / "v.pt").stat().st_size
    monkeypatch.setenv("EXPERTCACHE_MAX_TRACE_BYTES", str(1 << 30))  # the 100 views claim about 400 MiB in all
    tracemalloc.start()
    try:
        got = read_torch_save(tmp_path / "v.pt")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * size, (peak, size)  # copies would be 100 x 4 MiB
    assert got["views"][3][0, :3].tolist() == [3 << 10, (3 << 10) + 1, (3 << 10) + 2]
    assert np.array_equal(got["whole"], np.arange(1 << 20, dtype=np.int32))
    assert not got["views"][0].flags.writeable and np.shares_memory(got["views"][0], got["whole"])
    with pytest.raises(TraceError, match=r"tensor of size \(2, 262144, 4\) has more elements than its storage"):
        read_torch_save(tmp_path / "big.pt")
    monkeypatch.setenv("EXPERTCACHE_MAX_TRACE_BYTES", str(50 << 20))
    with pytest.raises(TraceError) as info:
        read_torch_save(tmp_path / "v.pt")
    assert re.search(r"data\.pkl at byte \d+: its tensors claim [\d,]+ bytes in all, more than the trace limit "
                     r"of 52,428,800", one_line_error(info, tmp_path / "v.pt"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_sglang_round_trip(tmp_path, seed):
    pytest.importorskip("torch")
    tr = _random_trace(seed)
    rng = np.random.default_rng(seed)
    num_layers = max(tr["layer_ids"]) + 1 + int(rng.integers(0, 2))
    replicas = rng.integers(0, tr["E"], size=int(rng.integers(0, 3)))
    phys_of = {e: [e] for e in range(tr["E"])}
    pmap = list(range(tr["E"]))
    for e in replicas:  # redundant physical copies, as EPLB makes
        phys_of[int(e)].append(len(pmap))
        pmap.append(int(e))
    passes, bounds = [], np.r_[0, np.flatnonzero(np.diff(tr["seq"])) + 1, len(tr["seq"])]
    for a, b in zip(bounds[:-1], bounds[1:]):
        cut = a + int(rng.integers(1, b - a + 1))  # a prefill pass, then one decode pass per token
        for lo, hi in [(a, cut)] + [(t, t + 1) for t in range(cut, b)]:
            topk = {lid: [[int(rng.choice(phys_of[int(e)])) for e in tr["ex"][t, i]] for t in range(lo, hi)]
                    for i, lid in enumerate(tr["layer_ids"])}
            passes.append((list(range(lo - a, hi - a)), [hi - lo] if hi - lo > 1 or lo == a else None, topk))
    dump = sglang_dump(tmp_path / f"d{seed}.pt", passes, num_layers=num_layers, pmap=[pmap] * num_layers)
    t = ec.load_trace(import_sglang(dump).save(tmp_path / f"t{seed}.npz"))
    assert np.array_equal(t.experts, tr["ex"]) and t.layer_ids == tr["layer_ids"] and t.num_experts == tr["E"]
    assert np.array_equal(t.seq, tr["seq"])
    assert t.extras["step"].tolist() == [p for pos, _, _ in passes for p in pos]


def test_option_values_are_config_errors(tmp_path):
    log = write(tmp_path / "r.jsonl", VLLM)
    with pytest.raises(ConfigError, match=r"--num-experts: 1048577 is outside \[1, 1048576\] \(MAX_EXPERTS\)"):
        import_vllm_jsonl(log, num_experts=importers.MAX_EXPERTS + 1)
    with pytest.raises(ConfigError, match=r"--phase: 'training'"):
        import_token_jsonl(log, phase="training")
    with pytest.raises(ConfigError, match=r"--sequences: 'bogus'"):
        import_sglang(log, sequences="bogus")
    with pytest.raises(ConfigError, match=r"--format: 'csv'"):
        import_trace(log, "csv")
    with pytest.raises(TraceError, match=r"r.jsonl:1: field 'experts': expert id 4 is outside \[0, 4\) \(--num-experts 4\)"):
        import_vllm_jsonl(log, num_experts=4)


def test_a_flood_of_blank_lines_ends_quickly(tmp_path):
    from expertcache.trace.importers.records import MAX_BLANK_LINES

    path = tmp_path / "blank.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n" * (MAX_BLANK_LINES + 5)))  # 1 kB that would expand to a million lines
    with pytest.raises(TraceError, match=rf"blank.jsonl.gz:{MAX_BLANK_LINES + 1}: more than 1,000,000 blank lines"):
        import_vllm_jsonl(path)


def test_sglang_a_pass_with_no_expert_slots_is_one_line(tmp_path):
    """``topk_ids_of_layer`` of shape [layers, tokens, 0] (and a map): the id check took the max of an
    empty array, a ValueError that ended in exit 70."""
    torch = pytest.importorskip("torch")
    torch.save(dict(records=[dict(forward_pass_id=0, rank=0, gatherer_key="primary", input_ids=[1, 2, 3],
                                  positions=[0, 1, 2], extend_seq_lens=[3], forward_mode=1,
                                  topk_ids_of_layer=torch.zeros((3, 3, 0), dtype=torch.int32), misc_objects=[],
                                  global_physical_count=torch.zeros((3, 6), dtype=torch.int32))],
                    last_physical_to_logical_map=torch.as_tensor(np.asarray(PMAP), dtype=torch.int64)),
               str(tmp_path / "k0.pt"))
    want = r"k0.pt: records\[0\]: topk_ids_of_layer is \[3, 3, 0\]: no layers or no expert slots"
    with pytest.raises(TraceError, match=want):
        import_sglang(tmp_path / "k0.pt")


def test_a_key_named_twice_in_a_record_is_refused(tmp_path):
    """json keeps the last of two values of one key: {"experts": [0, 1], "experts": [5, 6]} had
    imported as [5, 6] with exit 0 (a repeated "layer" would have moved the record)."""
    log = tmp_path / "dup.jsonl"
    log.write_text('{"problem_id": 0, "token_idx": 0, "layer": 0, "experts": [0, 1]}\n'
                   '{"problem_id": 0, "token_idx": 1, "layer": 0, "experts": [0, 1], "experts": [5, 6]}\n')
    with pytest.raises(TraceError, match=r"dup.jsonl:2: key 'experts' appears twice in one object"):
        import_vllm_jsonl(log, num_experts=8)
    nested = tmp_path / "nested.jsonl"  # inside a nested object too
    nested.write_text('{"problem_id": 0, "token_idx": 0, "experts": {"0": [1, 2], "0": [3, 4]}}\n')
    with pytest.raises(TraceError, match="key '0' appears twice"):
        import_token_jsonl(nested, num_experts=8)


def test_garbage_after_the_last_zstd_frame_names_the_lines_read(tmp_path):
    """Bytes after the last frame that are no frame: the lines before them are read, and the error
    says after which (it had said "after line 0" for a 16-line log: the decoded bytes were lost)."""
    zstandard = pytest.importorskip("zstandard")
    lines = "".join(json.dumps({"problem_id": 0, "token_idx": t, "layer": 0, "experts": [0, 1]}) + "\n"
                    for t in range(16))
    path = tmp_path / "z.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()) + b"\x00garbage")
    with pytest.raises(TraceError, match="corrupt or truncated zstd stream after line 16"):
        import_vllm_jsonl(path, num_experts=8)
