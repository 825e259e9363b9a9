"""Hostile and unusual trace files, one by one: each refused in one line naming the file and
what is wrong, before anything large is allocated; valid files in any integer width or byte
order accepted, with the same counts in every command."""

from __future__ import annotations

import gzip
import os
import re
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

import expertcache as ec
from expertcache.cli.main import main
from expertcache.errors import TraceError

sys.path.insert(0, str(Path(__file__).parent))
from fuzzing import npy_bytes, npy_with_header, trace_members, zip_bytes  # noqa: E402

EXPERTS = np.array([[[0, 1], [2, 3]], [[2, 3], [0, 1]], [[0, 1], [1, 2]], [[3, 0], [2, 1]]], dtype=np.int16)
META = {"num_experts": 4, "top_k": 2, "num_layers": 2, "layer_ids": [3, 5], "phase": "decode"}


def members(meta=META, **arrays):
    base = {"experts": EXPERTS, "seq": np.array([0, 0, 1, 1], dtype=np.int32)}
    base.update(arrays)
    return trace_members({k: v for k, v in base.items() if v is not None}, meta)


def write(tmp_path, data: bytes, name="t.npz") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def refused(path, pattern):
    with pytest.raises(TraceError, match=pattern) as info:
        ec.load_trace(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text
    return text


# ------------------------------------------------------------------------------ not an archive
def test_files_that_are_not_npz_archives(tmp_path):
    refused(write(tmp_path, npy_bytes(EXPERTS)), r"not a readable .npz trace \(it is a single .npy array")
    refused(write(tmp_path, b"experts,seq\n1,2\n"), r"it looks like text")
    refused(write(tmp_path, gzip.compress(zip_bytes(members()))), r"it is gzip-compressed")
    refused(write(tmp_path, b""), r"the file is empty")
    refused(write(tmp_path, zip_bytes(members())[:200]), r"not a readable .npz trace")


def test_fifo_folder_and_missing_paths(tmp_path):
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    refused(fifo, r"is a FIFO, not a trace file")  # never opened: it would block
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", r"is a folder without routing.npz")
    (tmp_path / "named.npz").mkdir()
    refused(tmp_path / "named.npz", r"named.npz: is a folder without routing.npz")
    refused(tmp_path / "missing.npz", r"no such file or folder")
    (tmp_path / "holder").mkdir()
    write(tmp_path / "holder", zip_bytes(members()), "routing.npz")
    assert ec.load_trace(tmp_path / "holder").layer_ids == [3, 5]


# ------------------------------------------------------------------------------ archive members
def test_members_that_are_not_arrays_repeated_or_too_many(tmp_path):
    refused(write(tmp_path, zip_bytes(members() + [("notes.txt", b"hi")])), r"member 'notes.txt' is not a .npy array")
    refused(write(tmp_path, zip_bytes(members() + [("seq.npy", npy_bytes(np.zeros(4, np.int32)))])),
            r"member 'seq.npy' appears twice")
    extra = [(f"x{i}.npy", npy_bytes(np.zeros(1))) for i in range(300)]
    refused(write(tmp_path, zip_bytes(members() + extra)), r"303 members in the archive \(at most 256\)")


def test_encrypted_and_unsupported_compression(tmp_path):
    blob = bytearray(zip_bytes(members(), zipfile.ZIP_STORED))
    enc = bytearray(blob)
    for sig, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        pos = enc.find(sig)
        while pos >= 0:
            enc[pos + at] |= 1
            pos = enc.find(sig, pos + 4)
    refused(write(tmp_path, bytes(enc)), r"member 'experts.npy' is encrypted")
    odd = bytearray(blob)
    for sig, at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        pos = odd.find(sig)
        while pos >= 0:
            odd[pos + at: pos + at + 2] = (97).to_bytes(2, "little")
            pos = odd.find(sig, pos + 4)
    refused(write(tmp_path, bytes(odd)), r"unsupported compression method 97")
    for method in (zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):  # valid, if unusual
        assert ec.load_trace(write(tmp_path, zip_bytes(members(), method))).num_tokens == 4


@pytest.mark.parametrize("header, data, pattern", [
    ("{'descr': '<i2', 'fortran_order': False, 'shape': (1000000000000,), }", b"\0" * 8,
     r"header claims shape \(1000000000000,\) of int16 \(2,000,000,000,000 bytes\) but it holds 8 bytes"),
    ("{'descr': '<i2', 'fortran_order': False, 'shape': (-1,), }", b"", r"invalid shape \(-1,\)"),
    ("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", b"\x80\x04N.", r"object \(pickled\) arrays"),
    ("{'descr': '<i2', 'fortran_order': False, 'shape': (3,), 'x': __import__('os')}", b"\0" * 6, r"not a valid .npy header"),
    ("{'descr': '<V0', 'fortran_order': False, 'shape': (10**12,), }", b"", r"not a valid .npy header"),
    ("{'descr': '<i2', 'fortran_order': False, 'shape': ((3, 2), }", b"\0" * 12, r"not a valid .npy header \(\('EOF in multi-line"),
])
def test_array_headers_that_lie_are_refused_before_allocating(tmp_path, header, data, pattern):
    blob = zip_bytes([(n, d) for n, d in members() if n != "experts.npy"] + [("experts.npy", npy_with_header(header, data))])
    path = write(tmp_path, blob)
    tracemalloc.start()
    try:
        refused(path, pattern)
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_total_size_limit_is_checked_from_the_headers(tmp_path, monkeypatch):
    path = write(tmp_path, zip_bytes(members(notes=np.zeros(1 << 16))))
    assert ec.load_trace(path).num_tokens == 4
    monkeypatch.setenv("EXPERTCACHE_MAX_TRACE_BYTES", str(1 << 16))
    refused(path, r"its arrays claim [\d,]+ bytes, more than the limit of 65,536 \(set EXPERTCACHE_MAX_TRACE_BYTES")
    monkeypatch.setenv("EXPERTCACHE_MAX_TRACE_BYTES", "lots")
    with pytest.raises(TraceError, match=r"EXPERTCACHE_MAX_TRACE_BYTES: expected a positive integer"):
        ec.load_trace(path)
    # unset, the limit follows the memory available: arrays that a command holding them (up to
    # WORK_FACTOR times their bytes) could not fit are refused before they are read
    from expertcache.trace import npz

    monkeypatch.delenv("EXPERTCACHE_MAX_TRACE_BYTES")
    monkeypatch.setattr(npz, "available_bytes", lambda: npz.WORK_FACTOR * (1 << 16))
    refused(path, r"more than the limit of 65,536 \(a command holding it needs up to 24x its arrays")
    monkeypatch.setattr(npz, "available_bytes", lambda: None)  # no /proc/meminfo: 8 GiB
    assert npz.max_bytes() == npz.DEFAULT_MAX_BYTES and ec.load_trace(path).num_tokens == 4


def test_batch_holds_its_inputs_together_to_the_limit(tmp_path, monkeypatch, capsys):
    """``batch`` holds every input at once and builds their union (up to WORK_FACTOR times their
    bytes): the inputs are held to the trace limit together, not only one by one."""
    from expertcache.trace import npz

    path = write(tmp_path, zip_bytes(members(notes=np.zeros(1 << 13))))
    one = npz.array_bytes(ec.load_trace(path))
    assert one > 1 << 16  # the notes alone are 65,536 bytes
    monkeypatch.setenv("EXPERTCACHE_MAX_TRACE_BYTES", str(one + one // 2))
    assert main(["batch", str(path), "--out", str(tmp_path / "one.npz")]) == 0
    capsys.readouterr()
    assert main(["batch", str(path), str(path), "--out", str(tmp_path / "two.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and not (tmp_path / "two.npz").exists()
    assert f"the traces up to this one hold {2 * one:,} bytes of arrays, more than the trace limit of " \
           f"{one + one // 2:,} for all of them together" in err, err


# ------------------------------------------------------------------------------ meta
@pytest.mark.parametrize("meta, pattern", [
    ('{"num_experts": 4, "deep": ' + "[" * 100_000 + "]" * 100_000 + "}", r"meta: JSON nested too deeply"),
    ('{"num_experts": 1' + "0" * 5000 + "}", r"meta: not valid JSON \(Exceeds the limit"),
    ({**META, "num_experts": 4.0}, r"meta: num_experts must be a positive integer, got 4.0"),
    ({**META, "top_k": True}, r"meta: top_k must be a positive integer, got True"),
    ({**META, "tokens": "4"}, r"meta: tokens must be a positive integer, got '4'"),
    ({**META, "num_experts": 1 << 21}, r"meta: num_experts = 2,097,152 is more than the limit of 1,048,576"),
    ({**META, "layer_ids": [3.0, 5]}, r"meta: layer_ids must be 2 distinct integers in \[0, 2\*\*31\)"),
    ({**META, "layer_ids": [3, -5]}, r"meta: layer_ids must be 2 distinct integers"),
    ({**META, "name": 7}, r"meta: name must be a string, got 7"),
    ({**META, "expert_bytes": 1.5}, r"meta: expert_bytes must be a positive integer up to 10\*\*13, got 1.5"),
    ({**META, "expert_bytes": 10**13 + 1}, r"meta: expert_bytes must be a positive integer up to 10\*\*13, got 10000000000001"),
    ({**META, "phase": None}, r"meta: phase must be a string, got None"),
    ([META], r"meta: expected a JSON object, got list"),
])
def test_meta_is_checked_strictly(tmp_path, meta, pattern):
    refused(write(tmp_path, zip_bytes(members(meta))), pattern)


def test_the_global_item_space_is_bounded(tmp_path):
    wide = np.tile(EXPERTS[:, :1], (1, 5, 1))
    meta = {"num_experts": 1 << 20, "layer_ids": [0, 1, 2, 3, 4]}
    refused(write(tmp_path, zip_bytes(members(meta, experts=wide))), r"5 layers x 1,048,576 experts is more than 4,194,304")
    meta["num_experts"] = 1 << 19  # 5 x 524,288 fits
    assert ec.load_trace(write(tmp_path, zip_bytes(members(meta, experts=wide)))).num_experts == 1 << 19


# ------------------------------------------------------------------------------ arrays
@pytest.mark.parametrize("dtype", ["u1", "u2", "u4", "u8", "i1", "i4", "i8", ">i2", ">u8"])
def test_any_integer_width_and_byte_order_gives_the_same_counts_everywhere(tmp_path, capsys, dtype):
    ref = write(tmp_path, zip_bytes(members()), "ref.npz")
    seq = np.array([0, 0, 1, 1], dtype=np.dtype(dtype))
    other = write(tmp_path, zip_bytes(members(experts=np.asfortranarray(EXPERTS.astype(dtype)), seq=seq)), "other.npz")
    t = ec.load_trace(other)
    assert t.experts.dtype == np.int16 and t.experts.dtype.isnative and np.array_equal(t.experts, EXPERTS)
    for argv in (["replay", "{}", "-c", "2", "-p", "lru", "-p", "belady", "--json"], ["stats", "{}", "--json"],
                 ["bounds", "{}", "-c", "2", "--json"], ["export", "libcachesim", "{}", "--out", "{}.csv"]):
        outs = []
        for path in (ref, other):
            assert main([a.format(path) for a in argv]) == 0
            out = capsys.readouterr().out.replace(str(path), "T").replace(path.stem, "T")
            outs.append(re.sub(r'"seconds": [^,}]+', '"seconds": 0', out))  # timing is the only difference
        assert outs[0] == outs[1]
    assert (tmp_path / "ref.npz.csv").read_bytes() == (tmp_path / "other.npz.csv").read_bytes()


def test_unsigned_ids_cannot_pad_and_wide_ids_must_be_in_range(tmp_path):
    padded = EXPERTS.astype(np.int64)
    padded[1, 0, 1] = -1
    refused(write(tmp_path, zip_bytes(members(experts=padded.astype(np.uint16)))),
            r"experts: id 65535 at token 1, layer 0, slot 1 is outside \[0, 4\)")
    huge = EXPERTS.astype(np.uint64)
    huge[2, 1, 0] = np.uint64(2**64 - 1)
    refused(write(tmp_path, zip_bytes(members(experts=huge))), r"id 18446744073709551615 at token 2, layer 1, slot 0")
    assert ec.load_trace(write(tmp_path, zip_bytes(members(experts=padded)))).experts[1, 0, 1] == -1


def test_probs_and_router_probs_ranges(tmp_path):
    p = np.full(EXPERTS.shape, 0.5, dtype=np.float32)
    p[0, 1, 0] = -0.25
    refused(write(tmp_path, zip_bytes(members(probs=p))), r"probs: value -0.25 at index \(0, 1, 0\) is outside non-negative")
    rp = np.full((4, 2, 4), 0.25, dtype=np.float16)
    rp[3, 0, 2] = 1.5
    refused(write(tmp_path, zip_bytes(members(router_probs=rp))), r"router_probs: value 1.5 at index \(3, 0, 2\) is outside \[0, 1\]")


def test_step_and_aligned_are_validated_at_load(tmp_path):
    refused(write(tmp_path, zip_bytes(members(step=np.array([0, 0, 0, 1])))), r"step: not increasing inside a sequence at token 1")
    refused(write(tmp_path, zip_bytes(members(aligned=np.ones((4, 3), bool)))), r"aligned: expected bool shape \(4, 2\)")
    t = ec.load_trace(write(tmp_path, zip_bytes(members(step=np.array([4, 9, 0, 2], dtype=">u8")))))
    assert t.extras["step"].tolist() == [4, 9, 0, 2] and t.extras["step"].dtype == np.int64


def test_every_command_reports_a_bad_trace_in_one_line(tmp_path, capsys):
    bad = write(tmp_path, zip_bytes(members({**META, "top_k": 2.0})))
    for argv in (["replay", str(bad), "-c", "2"], ["stats", str(bad)], ["bounds", str(bad), "-c", "2"],
                 ["sweep", str(bad)], ["foresight", str(bad), "-c", "2"], ["compare-pools", str(bad), "-c", "2"],
                 ["export", "libcachesim", str(bad), "--out", str(tmp_path / "x.csv")], ["demo", "--trace", str(bad), "--json"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "meta: top_k must be a positive integer, got 2.0" in err[0], argv
