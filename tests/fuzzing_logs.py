"""Routing-log cases for the fuzzer (see ``tests/fuzzing.py``): JSONL routing logs, damaged.

A valid log is written from a random trace in one of the JSONL shapes users have: ``vllm-jsonl``
(one record per sequence, token and layer) or ``token-jsonl`` (one record per token, the layers as
a list or as an object keyed by layer id), plain or gzip. Mutations are either invalid by
construction (invalid UTF-8, deep nesting, a 5,000-digit integer, a float or a boolean where an
integer is meant, a non-finite weight, a record with another k, a duplicate record, a missing
field, ...), valid by construction (another valid id, a record removed under
``--drop-incomplete``), or random damage. Whatever is accepted must import to exactly what an
independent reading of the log says (:func:`log_oracle`).
"""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

from fuzzing import Case, random_trace


def _vllm_records(rng: random.Random) -> tuple[list[dict], int, list[int]]:
    arrays, meta = random_trace(rng)
    ex = arrays["experts"]
    T, L, k = ex.shape
    probs = arrays.get("probs")
    seq = arrays["seq"]
    E = meta["num_experts"]
    names = [f"p{rng.randrange(100)}-{s}" if rng.random() < 0.3 else int(s) for s in range(int(seq.max()) + 1)]
    recs, pos = [], 0
    for t in range(T):
        if t and seq[t] != seq[t - 1]:
            pos = 0
        for li in range(L):
            row = [int(x) for x in ex[t, li]]
            if -1 in row:  # one k throughout: padding is what --pad is for
                row = [x for x in row if x >= 0]
                row += [e for e in range(E) if e not in row][: k - len(row)]
            rec = {"problem_id": names[int(seq[t])], "layer": meta["layer_ids"][li], "token_idx": pos, "experts": row}
            if probs is not None:
                rec["gating_probs"] = [round(abs(float(x)), 4) for x in probs[t, li]]
            recs.append(rec)
        pos += rng.choice([1, 1, 1, 2])
    return recs, E, meta["layer_ids"]


def _token_records(recs: list[dict], layer_ids: list[int], rng: random.Random) -> list[dict]:
    """The same log as one record per token: experts as a list in layer order or an object."""
    by_token: dict = {}
    for r in recs:
        by_token.setdefault((json.dumps(r["problem_id"]), r["token_idx"]), []).append(r)
    as_dict = rng.random() < 0.5
    named = not as_dict and (layer_ids != list(range(len(layer_ids))) or rng.random() < 0.3)
    out = []
    for group in by_token.values():
        group.sort(key=lambda r: r["layer"])
        rec = {"problem_id": group[0]["problem_id"], "token_idx": group[0]["token_idx"]}
        if as_dict:
            rec["experts"] = {str(r["layer"]): r["experts"] for r in group}
            if "gating_probs" in group[0]:
                rec["gating_probs"] = {str(r["layer"]): r["gating_probs"] for r in group}
        else:
            rec["experts"] = [r["experts"] for r in group]
            if named:
                rec["layer_ids"] = [r["layer"] for r in group]
            if "gating_probs" in group[0]:
                rec["gating_probs"] = [r["gating_probs"] for r in group]
        out.append(rec)
    return out


def _ids(rec: dict) -> list:
    """The first id list of a record (a mutable reference), whatever its shape."""
    ex = rec["experts"]
    if isinstance(ex, dict):
        return next(iter(ex.values()))
    return ex[0] if ex and isinstance(ex[0], list) else ex


def _weights(rec: dict) -> list | None:
    pr = rec.get("gating_probs")
    if pr is None:
        return None
    if isinstance(pr, dict):
        return next(iter(pr.values()))
    return pr[0] if pr and isinstance(pr[0], list) else pr


def _lines(recs: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in recs)


def log_case(rng: random.Random) -> Case:
    recs, E, layer_ids = _vllm_records(rng)
    fmt = rng.choice(["vllm-jsonl", "token-jsonl", "auto"])
    if fmt == "token-jsonl" or (fmt == "auto" and rng.random() < 0.5):
        recs = _token_records(recs, layer_ids, rng)
    if rng.random() < 0.3:
        rng.shuffle(recs)
    args = ["--num-experts", str(E)] if rng.random() < 0.5 else []
    i = rng.randrange(len(recs))
    rec = json.loads(json.dumps(recs[i]))
    choice = rng.randrange(21)

    def case(what, expect, data, extra=()):
        return Case("log", what, expect, {"log.jsonl": data}, target="log.jsonl", log_format=fmt,
                    log_args=[*args, *extra], oracle=log_oracle if expect != "invalid" else None)

    def with_line(line: bytes):
        body = [json.dumps(r).encode() for r in recs]
        body[i] = line
        return b"\n".join(body) + b"\n"

    def line(r) -> bytes:
        return with_line(json.dumps(r).encode())

    if choice == 0:
        return case("valid log", "valid", _lines(recs))
    if choice == 1:
        return case("gzip-compressed valid log", "valid", gzip.compress(_lines(recs)))
    if choice == 2:
        return case("invalid UTF-8 in a line", "invalid", with_line(json.dumps(rec).encode()[:-2] + b'\xff\xfe"}'))
    if choice == 3:
        depth = rng.choice([5000, 200_000])
        return case(f"JSON nested {depth} deep", "invalid", with_line(b"[" * depth + b"]" * depth))
    if choice == 4:
        big = "1" + "0" * 5000
        text = json.dumps(rec).replace('"token_idx": ', f'"token_idx": {big}, "_": ', 1)
        return case("a 5001-digit token index", "invalid", with_line(text.encode()))
    if choice == 5:
        rec["token_idx"] = rng.choice([2**31, 2**63, -1])
        return case("token index out of range", "invalid", line(rec))
    if choice == 6:
        ids = _ids(rec)
        ids[0] = ids[0] + rng.choice([2**31, 2**64, 1 << 20])
        return case("an expert id beyond the limits", "invalid", line(rec))
    if choice == 7:
        rec["token_idx"] = rng.choice([float(rec["token_idx"]) + 0.5, True, str(rec["token_idx"]), None])
        return case("token index not an integer", "invalid", line(rec))
    if choice == 8:
        ids = _ids(rec)
        ids[0] = rng.choice([float(ids[0]), True, str(ids[0])])
        return case("an expert id not an integer", "invalid", line(rec))
    if choice == 9 and _weights(rec) is not None:
        _weights(rec)[0] = "__X__"
        token = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-0.5"])
        return case(f"gate weight {token}", "invalid", with_line(json.dumps(rec).replace('"__X__"', token).encode()))
    if choice == 10:
        ids = _ids(rec)
        ids.append(next(e for e in range(E + 1) if e not in ids))
        if _weights(rec) is not None:
            _weights(rec).append(0.1)
        return case("a record with k + 1 ids", "invalid", line(rec))
    if choice == 11:
        return case("a duplicate record", "invalid", _lines(recs + [recs[i]]))
    if choice == 12:
        del rec[rng.choice(["problem_id", "token_idx", "experts"])]
        return case("a record without a field", "invalid", line(rec))
    if choice == 13:
        return case("a line that is not an object", "invalid", with_line(rng.choice([b"[1, 2]", b"42", b'"x"', b"null"])))
    if choice == 14:
        return case("empty file", "invalid", b"")
    if choice == 15:
        data = gzip.compress(_lines(recs))
        return case("truncated gzip", "invalid", data[: rng.randrange(10, len(data) - 1)])
    if choice == 16:
        return case("a 10 MB line of digits", "invalid", with_line(b"9" * (10 << 20)))
    if choice == 17 and len(_ids(rec)) > 1:
        ids = _ids(rec)
        ids[1] = ids[0]
        return case("an id twice in one list", "invalid", line(rec))
    if choice == 18:
        ids = _ids(rec)
        free = [e for e in range(E) if e not in ids]
        if free:
            ids[rng.randrange(len(ids))] = rng.choice(free)
        return case("another valid id", "valid", line(rec))
    if choice == 19 and "layer" in rec and len(recs) > 1:
        del recs[i]
        return case("a record removed, --drop-incomplete", "valid", _lines(recs), ["--drop-incomplete"])
    data = bytearray(_lines(recs))
    n = rng.randint(1, 6)
    for _ in range(n):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return case(f"{n} random bytes", "any", bytes(data))


def _read_log(log: Path) -> dict:
    """{seq key: {token: {layer: (ids, weights)}}} in order of first appearance, read directly."""
    raw = log.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    groups: dict = {}
    for text in raw.decode("utf-8").splitlines():
        if not text.strip():
            continue
        r = json.loads(text)
        tok = groups.setdefault(json.dumps(r["problem_id"]), {}).setdefault(r["token_idx"], {})
        if "layer" in r:
            tok[r["layer"]] = (r["experts"], r.get("gating_probs"))
        elif isinstance(r["experts"], dict):
            for key, ids in r["experts"].items():
                tok[int(key)] = (ids, r["gating_probs"][key] if "gating_probs" in r else None)
        else:
            lids = r.get("layer_ids", list(range(len(r["experts"]))))
            for n, (lid, ids) in enumerate(zip(lids, r["experts"])):
                tok[lid] = (ids, r["gating_probs"][n] if "gating_probs" in r else None)
    return groups


def log_oracle(log: Path, out: Path) -> str | None:
    """Compare the imported trace with an independent reading of the log; a problem or None."""
    from expertcache.trace import load_trace

    groups = _read_log(log)
    trace = load_trace(out)
    layers = sorted({lid for g in groups.values() for tok in g.values() for lid in tok})
    rows = [(key, t) for key in groups for t in sorted(groups[key]) if len(groups[key][t]) == len(layers)]
    if trace.num_tokens != len(rows):
        return f"{trace.num_tokens} tokens imported, the log holds {len(rows)} complete ones"
    if trace.layer_ids != layers:
        return f"layers {trace.layer_ids} != {layers}"
    for t, (key, tok) in enumerate(rows):
        for li, lid in enumerate(layers):
            ids, weights = groups[key][tok][lid]
            got = [int(x) for x in trace.experts[t, li] if x >= 0]
            if got != ids:
                return f"token {t} layer {lid}: {got} != {ids}"
            if weights is not None and trace.probs is not None:
                if any(not math.isclose(float(a), float(b), rel_tol=1e-3, abs_tol=1e-3)
                       for a, b in zip(trace.probs[t, li, : len(ids)], weights)):
                    return f"token {t} layer {lid}: gate weights differ"
        if int(trace.extras["step"][t]) != tok:
            return f"token {t}: step {int(trace.extras['step'][t])} != {tok}"
    return None
