"""SGLang dump cases for the fuzzer (see ``tests/fuzzing.py``): ``torch.save`` archives, damaged.

A valid dump is written the way SGLang's per-token expert-distribution recorder writes one (a dict
of per-pass records whose ``topk_ids_of_layer`` is an int32 ``[layers, tokens, 8]`` tensor padded
with -1, and the physical-to-logical map), with torch; it needs torch (the kind is skipped without
it). Mutations: flipped bits, truncation, a missing storage, and hostile pickles in ``data.pkl``
(a global such as ``os.system``, nesting 100,000 deep, bytes that are no pickle), a storage
shorter than its tensor that
must be refused without ever being unpickled.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import zipfile

from fuzzing import Case


def _dump(rng: random.Random) -> bytes:
    import numpy as np
    import torch

    L, E, k = rng.randint(2, 4), rng.randint(4, 10), rng.randint(1, 3)
    nrng = np.random.default_rng(rng.getrandbits(32))
    records, pos = [], 0
    for fp in range(rng.randint(1, 6)):
        n = rng.randint(1, 4) if fp == 0 else 1
        buf = torch.full((L, 32, 8), -1, dtype=torch.int32)
        for layer in range(1, L):  # layer 0 dense: never routed
            ids = np.stack([nrng.choice(E, k, replace=False) for _ in range(n)])
            buf[layer, :n, :k] = torch.as_tensor(ids, dtype=torch.int32)
        positions = list(range(pos, pos + n))
        pos += n
        records.append(dict(forward_pass_id=fp, rank=0, gatherer_key="primary", input_ids=[7] * n,
                            positions=positions, extend_seq_lens=[n] if fp == 0 else None,
                            forward_mode=1 if fp == 0 else 2, topk_ids_of_layer=buf[:, :n, :].clone(),
                            misc_objects=[], global_physical_count=torch.zeros((L, E), dtype=torch.int32)))
    out = dict(records=records, last_physical_to_logical_map=torch.arange(E).repeat(L, 1))
    f = io.BytesIO()
    torch.save(out, f)
    return f.getvalue()


def _replace_member(blob: bytes, suffix: str, data: bytes | None) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(blob))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            if info.filename.endswith(suffix):
                if data is not None:
                    dst.writestr(info.filename, data)
            else:
                dst.writestr(info.filename, src.read(info))
    return buf.getvalue()


def sglang_case(rng: random.Random) -> Case:
    good = _dump(rng)
    choice = rng.randrange(9)

    def case(what, expect, data):
        return Case("sglang", what, expect, {"dump.pt": data}, target="dump.pt", log_format="sglang")

    if choice == 0:
        return case("valid dump", "valid", good)
    if choice in (1, 2):
        b = bytearray(good)
        n = rng.randint(1, 8)
        for _ in range(n):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return case(f"{n} flipped bits", "any", bytes(b))
    if choice == 3:
        return case("truncated", "invalid", good[: rng.randrange(0, len(good))])
    if choice == 4:
        return case("a storage missing", "invalid", _replace_member(good, "/data/0", None))
    if choice == 5:
        return case("data.pkl naming os.system", "invalid",
                    _replace_member(good, "data.pkl", pickle.dumps({"records": [os.system]}, protocol=2)))
    if choice == 6:
        n = 100_000
        return case("data.pkl nested 100,000 deep", "invalid",
                    _replace_member(good, "data.pkl", b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."))
    if choice == 7:
        return case("data.pkl that is not a pickle", "invalid", _replace_member(good, "data.pkl", os.urandom(64)))
    src = zipfile.ZipFile(io.BytesIO(good))
    name = next(n for n in src.namelist() if n.endswith("/data/0"))
    data = src.read(name)
    return case("a storage shorter than its tensor", "invalid", _replace_member(good, "/data/0", data[: len(data) // 2]))
