"""The GGUF reader (``expertcache.formats.gguf``) on headers written byte by byte: a valid MoE file
reads, and each hostile variant is one ``ConfigError`` naming what is wrong, read in bounded memory
(tensors that overlap or share a name, a zero dimension, an unaligned offset, arrays nested without
end, a block count that disagrees with the tensors, a NaN hyperparameter, expert tensors whose
shapes disagree, a malformed architecture or expert count, a rope base of 0, a negative norm
epsilon). A file of these passed to ``llama generate`` or ``serve`` would otherwise reach llama.cpp,
which rejects it without saying why, computes nothing, or asserts (one line since ggml's abort
callback, naming llama.cpp's source line rather than the key: ``tests/test_serve.py``).

Needs the ``gguf`` package (the ggml type table); skips without it.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the llama extra (gguf) is not installed")

from expertcache.errors import ConfigError  # noqa: E402
from expertcache.formats.gguf import read_geometry  # noqa: E402

F32, U32, F32V, STR, ARR = 0, 4, 6, 8, 9


def _s(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, value) -> bytes:
    if vtype == U32:
        payload = struct.pack("<I", value)
    elif vtype == F32V:
        payload = struct.pack("<f", value)
    elif vtype == STR:
        payload = _s(value)
    else:  # ARR: value is the payload already
        payload = value
    return _s(key) + struct.pack("<I", vtype) + payload


def _gguf(path, *, arch="olmoe", blocks=2, E=4, k=2, shape=(32, 8), extra_kv=(), tensors=None, shapes=None,
          block_count=None):
    """An f32 OLMoE-class MoE: ``blocks`` layers of gate/up/down expert tensors ``shape + (E,)``
    (4 experts where ``E`` is None: no expert_count key)
    and a token embedding, each 32-byte aligned; ``tensors`` replaces the table
    (``(name, shape, offset)``); ``shapes`` overrides one tensor's shape by name; ``block_count``
    the metadata's count (default ``blocks``)."""
    kvs = [_kv("general.architecture", STR, arch), _kv(f"{arch}.block_count", U32, block_count or blocks),
           _kv(f"{arch}.expert_count", U32, E) if E is not None else b"", _kv(f"{arch}.expert_used_count", U32, k),
           *extra_kv]
    kvs = [x for x in kvs if x]
    if tensors is None:
        tensors, off = [], 0
        names = [f"blk.{b}.ffn_{kind}_exps.weight" for b in range(blocks) for kind in ("gate", "up", "down")]
        for name in names + ["token_embd.weight"]:
            dims = (shapes or {}).get(name, shape + (E or 4,) if name != "token_embd.weight" else (32, 16))
            tensors.append((name, dims, off))
            n = 4
            for d in dims:
                n *= d
            off += -(-n // 32) * 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    end = 0
    for name, dims, off in tensors:
        head += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", F32, off)
        n = 4
        for d in dims:
            n *= d
        end = max(end, off + n)
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * end)
    return path


def test_a_valid_header_reads(tmp_path):
    g = read_geometry(str(_gguf(tmp_path / "ok.gguf")))
    assert (g.num_experts, g.top_k, g.moe_layers) == (4, 2, [0, 1]) and g.expert_bytes_of(0) == 3 * 32 * 8 * 4


def test_the_pinned_llama_cpps_newer_moe_architectures_read(tmp_path):
    """NEWER: names the pinned llama.cpp's architecture table holds (its library's strings) and the
    gguf package's tables do not yet (then they belong in READ, checked against those tables); a
    header of each reads, its MTP block (``nextn_predict_layers``) skipped as GLM-4.5's is; a name
    llama.cpp does not know stays refused."""
    import gguf

    from expertcache.formats.gguf import NEWER

    llama_cpp = pytest.importorskip("llama_cpp")
    lib = next(Path(llama_cpp.__file__).parent.glob("lib/libllama.*"), None)
    if lib is None:
        pytest.skip("llama-cpp-python's library is not beside it")
    table = lib.read_bytes()
    known = set(gguf.MODEL_ARCH_NAMES.values())
    for arch in NEWER:
        assert b"\0" + arch.encode() + b"\0" in table and arch not in known, arch
        g = read_geometry(str(_gguf(tmp_path / f"{arch}.gguf", arch=arch, blocks=3,
                                    extra_kv=[_kv(f"{arch}.nextn_predict_layers", U32, 1)])))
        assert (g.architecture, g.moe_layers, g.tested) == (arch, [0, 1], False) and g.skipped_bytes > 0
    with pytest.raises(ConfigError, match="architecture 'deepseek9' is not read by expertcache"):
        read_geometry(str(_gguf(tmp_path / "x.gguf", arch="deepseek9")))


def _nested(depth: int) -> bytes:
    inner = struct.pack("<IQ", U32, 1) + struct.pack("<I", 7)
    for _ in range(depth):
        inner = struct.pack("<IQ", ARR, 1) + inner
    return inner


@pytest.mark.parametrize("case, kwargs, match", [
    ("overlap", {"tensors": [("blk.0.ffn_gate_exps.weight", (32, 8, 4), 0), ("blk.0.ffn_up_exps.weight", (32, 8, 4), 0),
                             ("blk.0.ffn_down_exps.weight", (32, 8, 4), 4096)], "blocks": 1}, "overlaps"),
    ("duplicate", {"tensors": [("blk.0.ffn_up_exps.weight", (32, 8, 4), 0), ("blk.0.ffn_up_exps.weight", (32, 8, 4),
                                                                             4096)], "blocks": 1}, "appears twice"),
    ("unnamed", {"tensors": [("", (8,), 0), ("blk.0.ffn_up_exps.weight", (32, 8, 4), 32)], "blocks": 1},
     "has no name"),
    ("zero dimension", {"shapes": {"blk.0.ffn_gate_exps.weight": (0, 8, 4)}}, "zero dimension"),
    ("unaligned", {"tensors": [("blk.0.ffn_up_exps.weight", (32, 8, 4), 3)], "blocks": 1}, "not a multiple of the"),
    ("nested arrays", {"extra_kv": [_s("deep") + struct.pack("<I", ARR) + _nested(5000)]}, "nests arrays deeper"),
    ("huge block count", {"block_count": 2**31}, "block_count 2147483648 but the file has tensors of blocks 0..1"),
    ("NaN hyperparameter", {"extra_kv": [_kv("olmoe.rope.freq_base", F32V, float("nan"))]}, "not a finite number"),
    ("zero key length", {"extra_kv": [_kv("olmoe.attention.key_length", U32, 0)]}, "key_length 0 is not a positive"),
    ("zero rope base", {"extra_kv": [_kv("olmoe.rope.freq_base", F32V, 0.0)]}, "freq_base is 0.0, not above 0"),
    ("negative norm epsilon", {"extra_kv": [_kv("olmoe.attention.layer_norm_rms_epsilon", F32V, -1.0)]},
     "layer_norm_rms_epsilon is -1.0, not at least 0"),
    ("gate and up disagree", {"shapes": {"blk.1.ffn_up_exps.weight": (32, 4, 4)}}, "does not match"),
    ("architecture not a name", {"arch": "ol\x00moe"}, "is not an architecture name"),
    ("expert count missing", {"E": None}, "no olmoe.expert_count"),
])
def test_hostile_headers_are_one_line(tmp_path, case, kwargs, match):
    path = _gguf(tmp_path / "h.gguf", **kwargs)
    with pytest.raises(ConfigError, match=match) as exc:
        read_geometry(str(path))
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 400


def test_expert_counts_of_the_wrong_type_are_named(tmp_path):
    path = _gguf(tmp_path / "k.gguf", k=0)
    with pytest.raises(ConfigError, match="olmoe.expert_used_count 0 is not a positive integer"):
        read_geometry(str(path))
    path = _gguf(tmp_path / "e.gguf", E=None, extra_kv=[_kv("olmoe.expert_count", STR, "4")])
    with pytest.raises(ConfigError, match="olmoe.expert_count '4' is not an integer of at least 2"):
        read_geometry(str(path))


def test_text_needs_a_tokenizer(tmp_path):
    """A GGUF without ``tokenizer.ggml.*`` (``convert`` of a checkpoint without tokenizer files) is
    refused in one line where text goes in or out: llama.cpp asserts on it, ending the process."""
    pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")
    from expertcache.llama.textgen import Session, tokenize

    path = _gguf(tmp_path / "novocab.gguf")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        tokenize(str(path), "hello")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        Session.open(str(path))
