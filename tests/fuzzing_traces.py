"""Trace-file cases for the fuzzer (see ``tests/fuzzing.py``): a random valid trace, damaged.

Meta mutations (wrong types, contradictions, giant or deeply nested JSON), array mutations (ids out
of range or repeated, other dtypes and byte orders, wrong shapes, bad probabilities), zip and
``.npy`` level damage (lying headers, pickled dtypes, extra or repeated members, encryption,
unknown compression), flipped bits, truncation, and files that are not traces at all.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import struct
import zipfile

import numpy as np

from fuzzing import Case, npy_bytes, npy_with_header, random_trace, trace_members, zip_bytes


def _mutate_meta(rng: random.Random, meta: dict, arrays: dict) -> tuple[str, object, str]:
    """(what, new meta or raw JSON text, expectation)."""
    m = dict(meta)
    key = rng.choice(["num_experts", "top_k", "num_layers", "tokens", "sequences"])
    choice = rng.randrange(16)
    if choice == 0:
        m[key] = float(m[key])
        return f"meta {key} as a float", m, "invalid"
    if choice == 1:
        m[key] = True
        return f"meta {key} as true", m, "invalid"
    if choice == 2:
        m[key] = str(m[key])
        return f"meta {key} as a string", m, "invalid"
    if choice == 3:
        text = json.dumps(m).replace(f'"{key}": {m[key]}', f'"{key}": 1{"0" * 5000}', 1)
        return f"meta {key} a 5001-digit integer", text, "invalid"
    if choice == 4:
        depth = rng.choice([2000, 100_000])
        text = json.dumps(m)[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
        return f"meta nested {depth} deep", text, "invalid" if depth > 1500 else "valid"
    if choice == 5:
        if key == "num_experts":  # E above the largest id is valid (unused experts); below it is not
            m[key] = int(arrays["experts"].max()) if rng.random() < 0.5 else m[key] + rng.randint(1, 30)
            valid = m[key] > arrays["experts"].max() and "router_probs" not in arrays  # router_probs is [T, L, E]
            return "meta num_experts changed", m, "valid" if valid else "invalid"
        m[key] = m[key] + rng.randint(1, 3)
        return f"meta {key} contradicts the arrays", m, "invalid"
    if choice == 6:
        m["num_experts"] = rng.choice([2**40, 2**31, 1 << 21])
        return "meta num_experts huge", m, "invalid"
    if choice == 7:
        m["layer_ids"] = m["layer_ids"][:-1] + [m["layer_ids"][0]] if len(m["layer_ids"]) > 1 else [-1]
        return "meta layer_ids repeated or negative", m, "invalid"
    if choice == 8:
        m["layer_ids"] = [True] * len(m["layer_ids"]) if len(m["layer_ids"]) == 1 else [float(x) for x in m["layer_ids"]]
        return "meta layer_ids not integers", m, "invalid"
    if choice == 9:
        m["phase"] = rng.choice(["training", 3, None])
        return "meta phase unknown", m, "invalid"
    if choice == 10:
        del m["num_experts"]
        return "meta without num_experts", m, "invalid"
    if choice == 11:
        return "meta not an object", json.dumps([m]), "invalid"
    if choice == 12:
        text = json.dumps(m)
        return "meta truncated JSON", text[: rng.randrange(1, len(text) - 1)], "invalid"
    if choice == 13:
        m["extra_info"] = {"nested": [1, 2, {"x": 10**30}], "note": "kept as is"}
        return "meta with unknown keys", m, "valid"
    if choice == 14:
        m["name"] = {"not": "a string"}
        return "meta name not a string", m, "invalid"
    m["expert_bytes"] = rng.choice([0, -5, 1.5, "12MB"])
    return "meta expert_bytes not a positive integer", m, "invalid"


def _mutate_arrays(rng: random.Random, arrays: dict, meta: dict) -> tuple[str, dict, str]:
    a = {k: v.copy() for k, v in arrays.items()}
    ex = a["experts"]
    T, L, k = ex.shape
    E = meta["num_experts"]
    t, l, j = rng.randrange(T), rng.randrange(L), rng.randrange(k)
    choice = rng.randrange(22)
    if choice == 0:
        a["experts"] = ex.astype(np.int64)
        a["experts"][t, l, j] = rng.choice([E, E + 7, 2**40, -2, -(2**40)])
        return "an id outside [0, E) or below -1", a, "invalid"
    if choice == 1 and k > 1:
        ex[t, l, :] = -1
        ex[t, l, 0] = ex[t, l, 1] = rng.randrange(E)
        return "an id twice in one group", a, "invalid"
    if choice == 2:
        dt = rng.choice([np.int8, np.uint8, np.uint16, np.uint32, np.uint64, np.int32, np.int64, ">i2", ">i8", ">u4"])
        if np.dtype(dt).kind == "u":
            if (ex < 0).any():
                return "padding (-1) cannot be unsigned: wrapped", {**a, "experts": ex.astype(dt)}, "invalid"
        a["experts"] = ex.astype(dt)
        return f"experts as {np.dtype(dt).str}", a, "valid"
    if choice == 3:
        a["experts"] = np.asfortranarray(ex)
        a["seq"] = a["seq"].astype(rng.choice([np.int64, np.uint16, ">i4", np.uint64]))
        return "Fortran-ordered experts, other seq dtype", a, "valid"
    if choice == 4:
        a["experts"] = ex.astype(rng.choice([np.float32, np.bool_, np.complex64]))
        return "experts not integers", a, "invalid"
    if choice == 5:
        a["experts"] = ex.reshape(T, L * k) if rng.random() < 0.5 else ex[None]
        return "experts of the wrong rank", a, "invalid"
    if choice == 6:
        a["experts"] = ex[:0]
        return "no tokens", a, "invalid"
    if choice == 7 and T >= 3:
        a["seq"] = np.zeros(T, dtype=np.int32)
        a["seq"][T // 3: 2 * T // 3] = 1
        return "a sequence resumes after another", a, "invalid"
    if choice == 8:
        a["seq"] = a["seq"][:-1]
        return "seq of the wrong length", a, "invalid"
    if choice == 9:
        a["seq"] = a["seq"].astype(np.float64)
        return "seq not integers", a, "invalid"
    if choice == 10:
        p = np.random.default_rng(t).random((T, L, k)).astype(np.float32)
        p[t, l, j] = rng.choice([np.nan, np.inf, -0.5])
        if ex[t, l, j] < 0:
            ex[t, l, j] = next(e for e in range(E) if e not in ex[t, l])
        a["probs"] = p
        return "probs non-finite or negative at a used slot", a, "invalid"
    if choice == 11:
        a["probs"] = np.ones((T, L, k + 1), dtype=np.float32)
        return "probs of the wrong shape", a, "invalid"
    if choice == 12:
        a["probs"] = np.ones((T, L, k), dtype=np.int32)
        return "probs not floats", a, "invalid"
    if choice == 13:
        a["router_probs"] = np.full((T, L, E), rng.choice([1.5, -0.1, np.nan]), dtype=np.float32)
        return "router_probs outside [0, 1]", a, "invalid"
    if choice == 14:
        a["step"] = np.full(T, 3, dtype=np.int32) if T > 1 and (a["seq"][1:] == a["seq"][:-1]).any() else np.zeros(T + 1, np.int32)
        return "step not rising or wrong length", a, "invalid"
    if choice == 15:
        a["notes"] = np.random.default_rng(0).random((rng.randint(0, 5), 3))
        a["flags"] = np.zeros((T, L), dtype=bool)
        return "extra arrays", a, "valid"
    if choice == 16:
        a["aligned"] = np.ones((T, L + 1), dtype=bool)
        return "aligned of the wrong shape", a, "invalid"
    if choice == 17:
        del a["seq"]
        return "no seq", a, "invalid"
    if choice == 18:
        del a["experts"]
        return "no experts", a, "invalid"
    if choice == 19:
        a["experts"] = ex.astype(np.uint16)
        a["experts"][t, l, j] = 65535
        return "an unsigned id at the dtype's maximum", a, "invalid"
    if choice == 20:
        a["step"] = np.arange(T, dtype=np.uint64) + np.uint64(2**63)
        return "step as large unsigned integers", a, "valid"
    a["experts"] = ex.astype(np.int32)
    return "experts as int32", a, "valid"


def _hostile_member(rng: random.Random, members: list[tuple[str, bytes]]) -> tuple[str, list, str, int]:
    """(what, members, expectation, compression) with one member damaged at the zip or npy level."""
    members = list(members)
    i = rng.randrange(len(members))
    name, data = members[i]
    choice = rng.randrange(10)
    if choice == 0:
        shape = rng.choice(["(1000000000000,)", "(4294967296, 4294967296)", "(-1,)", "(2**40,)", "(10, 10, 10, 10, 10, 10, 10, 10, 10, 10)"])
        members[i] = (name, npy_with_header(f"{{'descr': '<i2', 'fortran_order': False, 'shape': {shape}, }}", b"\0" * 32))
        return f"{name} header claims shape {shape}", members, "invalid", zipfile.ZIP_DEFLATED
    if choice == 1:
        members[i] = (name, npy_with_header("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", b"\x80\x04N." * 4))
        return f"{name} claims an object (pickle) dtype", members, "invalid", zipfile.ZIP_STORED
    if choice == 2:
        members[i] = (name, b"\x93NUMPY\x01\x00" + b"\xff\xff" + b"{" * 70000)
        return f"{name} header longer than numpy allows", members, "invalid", zipfile.ZIP_STORED
    if choice == 3:
        members[i] = (name, npy_with_header("{'descr': '<i2', 'fortran_order': False, 'shape': (3,), 'x': __import__('os')}", b"\0" * 6))
        return f"{name} header with code in it", members, "invalid", zipfile.ZIP_STORED
    if choice == 4:
        members.append(("README.txt", b"hello"))
        return "a member that is not an array", members, "invalid", zipfile.ZIP_DEFLATED
    if choice == 5:
        members.append((name, data))
        return f"{name} twice", members, "invalid", zipfile.ZIP_STORED
    if choice == 6:
        members += [(f"x{n}.npy", npy_bytes(np.zeros(1))) for n in range(300)]
        return "300 extra members", members, "invalid", zipfile.ZIP_STORED
    if choice == 7:
        members[i] = (name, npy_with_header("{'descr': '<i2', 'fortran_order': False, 'shape': (5,), }", b"\0" * 6, (2, 0)))
        return f"{name} data shorter than its header claims", members, "invalid", zipfile.ZIP_STORED
    if choice == 8:
        members[i] = (name, data[: rng.randrange(0, 10)])
        return f"{name} cut inside its magic", members, "invalid", zipfile.ZIP_STORED
    members[i] = (name, npy_with_header("{'descr': '<V0', 'fortran_order': False, 'shape': (1000000000000,), }", b""))
    return f"{name} of zero-size items", members, "invalid", zipfile.ZIP_STORED


def _zip_flags(rng: random.Random, blob: bytes) -> tuple[str, bytes, str]:
    """Set the encryption bit or an unknown compression method in every header."""
    b = bytearray(blob)
    encrypt = rng.random() < 0.5
    for sig, flag_at, method_at in ((b"PK\x03\x04", 6, 8), (b"PK\x01\x02", 8, 10)):
        pos = b.find(sig)
        while pos >= 0:
            if encrypt:
                b[pos + flag_at] |= 1
            else:
                b[pos + method_at: pos + method_at + 2] = struct.pack("<H", 97)
            pos = b.find(sig, pos + 4)
    return ("members marked encrypted" if encrypt else "unknown compression method 97"), bytes(b), "invalid"


def trace_case(rng: random.Random) -> Case:
    arrays, meta = random_trace(rng)
    good = zip_bytes(trace_members(arrays, meta), rng.choice([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))
    r = rng.random()
    if r < 0.22:
        what, new_meta, expect = _mutate_meta(rng, meta, arrays)
        return Case("trace", what, expect, {"t.npz": zip_bytes(trace_members(arrays, new_meta))})
    if r < 0.50:
        what, new_arrays, expect = _mutate_arrays(rng, arrays, meta)
        m = dict(meta)
        if what in ("no experts",):
            m = meta
        return Case("trace", what, expect, {"t.npz": zip_bytes(trace_members(new_arrays, m))})
    if r < 0.62:
        what, members, expect, comp = _hostile_member(rng, trace_members(arrays, meta))
        return Case("trace", what, expect, {"t.npz": zip_bytes(members, comp)})
    if r < 0.66:
        what, blob, expect = _zip_flags(rng, good)
        return Case("trace", what, expect, {"t.npz": blob})
    if r < 0.80:
        b = bytearray(good)
        n = rng.randint(1, 8)
        for _ in range(n):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return Case("trace", f"{n} flipped bits", "any", {"t.npz": bytes(b)})
    if r < 0.86:
        cut = rng.randrange(0, len(good))
        return Case("trace", f"truncated at byte {cut} of {len(good)}", "invalid", {"t.npz": good[:cut]})
    if r < 0.89:
        return Case("trace", "garbage appended", "any", {"t.npz": good + os.urandom(rng.randint(1, 200))})
    if r < 0.93:
        return Case("trace", "valid, untouched", "valid", {"t.npz": good})
    return _file_kind_case(rng, good, arrays)


def _file_kind_case(rng: random.Random, good: bytes, arrays: dict) -> Case:
    choice = rng.randrange(9)
    if choice == 0:
        return Case("file", "a single .npy array", "invalid", {"t.npz": npy_bytes(arrays["experts"])})
    if choice == 1:
        return Case("file", "text", "invalid", {"t.npz": b"experts,seq\n1,2\n"})
    if choice == 2:
        return Case("file", "gzip of a valid trace", "invalid", {"t.npz": gzip.compress(good)})
    if choice == 3:
        return Case("file", "empty file", "invalid", {"t.npz": b""})
    if choice == 4:
        return Case("file", "a FIFO", "invalid", {"t.npz": "fifo"})
    if choice == 5:
        return Case("file", "a folder named t.npz", "invalid", {"t.npz": "dir"})
    if choice == 6:
        return Case("file", "a folder without routing.npz", "invalid", {"d": "dir"}, target="d")
    if choice == 7:
        return Case("file", "a folder holding a valid routing.npz", "valid", {"d": "dir", "d/routing.npz": good}, target="d")
    return Case("file", "no such file", "invalid", {}, target="missing.npz")
