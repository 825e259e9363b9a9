"""A seeded fuzzer of trace files and routing logs, and the judge of what the CLI did with them.

Used by ``tests/test_fuzz.py`` (a few hundred cases in every ``make test``) and by
``benchmarks/fuzz.py`` (10,000 cases). Each case is a hostile or valid input built from a random
valid one, with what is known about it:

* ``"invalid"``: made invalid on purpose (an id out of range, a float count in meta, a FIFO, ...):
  every command must refuse it;
* ``"valid"``: changed in a way that keeps it valid (another integer width, byte order, an extra
  array): every command must accept it;
* ``"any"``: random damage (flipped bytes, truncation): refusing is right, and accepting is right
  only when an independent checker (:func:`oracle_trace_problem`, written from the format's
  definition, sharing no code with expertcache) finds the file valid.

:func:`run_case` runs every command of a case in-process through ``expertcache.cli.main.main``
and returns a list of failures: a traceback or internal error (exit 70), an exit status other than
0 or 2, an error that is not exactly one line, a hang (each command gets ``timeout`` seconds), a
peak of traced memory above ``memory_limit``, an invalid input accepted, a valid one refused, or
commands disagreeing about the same file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import struct
import tracemalloc
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

MAX_TRACE_BYTES = 64 << 20
"""The loader's size limit during fuzzing (EXPERTCACHE_MAX_TRACE_BYTES)."""

PHASES = ("decode", "prefill", "teacher-forced", "mixed", "unknown")


# ============================================================================ writing archives
def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
    return buf.getvalue()


def npy_with_header(header: str, data: bytes, version: tuple[int, int] = (1, 0)) -> bytes:
    """A .npy member with a hand-written header dict (for headers that lie)."""
    text = header.encode("latin1")
    pre = 10 if version == (1, 0) else 12
    pad = (-(pre + len(text) + 1)) % 64
    text = text + b" " * pad + b"\n"
    length = struct.pack("<H", len(text)) if version == (1, 0) else struct.pack("<I", len(text))
    return b"\x93NUMPY" + bytes(version) + length + text + data


def zip_bytes(members: list[tuple[str, bytes]], compress: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compress) as zf:
        for name, data in members:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # duplicate names are made on purpose
                zf.writestr(name, data)
    return buf.getvalue()


def trace_members(arrays: dict[str, np.ndarray], meta) -> list[tuple[str, bytes]]:
    members = [(f"{name}.npy", npy_bytes(arr)) for name, arr in arrays.items()]
    if meta is not None:
        text = meta if isinstance(meta, str) else json.dumps(meta)
        members.append(("meta.npy", npy_bytes(np.array(text))))
    return members


# ============================================================================ random valid traces
def random_trace(rng: random.Random) -> tuple[dict[str, np.ndarray], dict]:
    """Arrays + meta of a small valid trace."""
    T, L = rng.randint(2, 40), rng.randint(1, 4)
    k = rng.randint(1, 3)
    E = rng.randint(k + 1, 12)
    nrng = np.random.default_rng(rng.getrandbits(32))
    experts = np.stack([[nrng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)]).astype(np.int16)
    if rng.random() < 0.2 and k > 1:  # some padding
        experts[rng.randrange(T), rng.randrange(L), k - 1] = -1
    S = rng.randint(1, min(3, T))
    cuts = sorted(rng.sample(range(1, T), S - 1)) if S > 1 else []
    seq = np.zeros(T, dtype=np.int32)
    for c in cuts:
        seq[c:] += 1
    arrays = {"experts": experts, "seq": seq}
    if rng.random() < 0.4:
        arrays["probs"] = nrng.random((T, L, k)).astype(rng.choice([np.float16, np.float32, np.float64]))
    if rng.random() < 0.2:
        arrays["router_probs"] = nrng.random((T, L, E)).astype(np.float32)
    if rng.random() < 0.4:
        arrays["step"] = np.arange(T, dtype=np.int32) * rng.randint(1, 3)
    layer_ids = sorted(rng.sample(range(0, 40), L))
    meta = {"model": "fuzz", "num_experts": E, "top_k": k, "num_layers": L, "layer_ids": layer_ids,
            "tokens": T, "sequences": S, "phase": rng.choice(PHASES)}
    return arrays, meta


# ============================================================================ cases
@dataclass
class Case:
    """One input: files to create (bytes, or 'fifo'/'dir'), the path given to the commands, and
    what is known about it ('valid', 'invalid' or 'any')."""

    kind: str
    what: str
    expect: str
    files: dict[str, bytes | str] = field(default_factory=dict)
    target: str = "t.npz"
    log_format: str | None = None  # set for routing-log cases
    log_args: list[str] = field(default_factory=list)
    oracle: Callable | None = None
    argv: list[str] | None = None  # one command with {path} and {root} placeholders (argument cases)


# ============================================================================ running
@dataclass
class Outcome:
    argv: list[str]
    rc: int | None
    err: str
    peak: int
    seconds: float
    problem: str | None = None


class Hang(BaseException):
    """Raised by the alarm inside a command that runs too long."""


def _alarm(signum, frame):
    raise Hang()


def materialize(case: Case, root: Path) -> Path:
    for name, content in sorted(case.files.items()):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if content == "fifo":
            os.mkfifo(p)
        elif content == "dir":
            p.mkdir(exist_ok=True)
        else:
            p.write_bytes(content)
    return root / case.target


def trace_commands(path: Path, out: Path) -> list[list[str]]:
    return [
        ["replay", str(path), "-c", "3", "-p", "lru", "-p", "belady", "--json"],
        ["stats", str(path), "--json"],
        ["bounds", str(path), "-c", "3", "--json"],
        ["export", "libcachesim", str(path), "--out", str(out / "x.csv")],
    ]


def run_command(argv: list[str], *, timeout: float, memory_limit: int) -> Outcome:
    """Run one CLI command in-process; never raises."""
    from expertcache.cli.main import main

    import time

    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    tracemalloc.start()
    t0 = time.perf_counter()
    rc: int | None
    problem = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 2
    except Hang:
        rc, problem = None, f"hang: still running after {timeout:g} s"
    except BaseException as exc:  # noqa: BLE001 - anything escaping main is a failure to report
        rc, problem = None, f"exception escaped main: {type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    text = err.getvalue()
    o = Outcome(argv, rc, text, peak, time.perf_counter() - t0, problem)
    if o.problem is None:
        lines = text.strip().splitlines()
        if rc == 70:
            o.problem = f"internal error: {text.strip()}"
        elif rc not in (0, 2):
            o.problem = f"exit status {rc}: {text.strip()[:300]}"
        elif rc == 2 and (len(lines) != 1 or ": error: " not in lines[0]):
            o.problem = f"error output is not one line: {text[:500]!r}"
        elif peak > memory_limit:
            o.problem = f"peak traced memory {peak:,} bytes > {memory_limit:,}"
    return o


def run_case(case: Case, root: Path, *, timeout: float = 20.0, memory_limit: int = 256 << 20) -> tuple[list[str], bool | None]:
    """(failures, accepted): failures is empty when the case passed; accepted says whether the
    commands accepted the input (None when they failed before agreeing)."""
    os.environ["EXPERTCACHE_MAX_TRACE_BYTES"] = str(MAX_TRACE_BYTES)
    os.environ.pop("EXPERTCACHE_DEBUG", None)
    root.mkdir(parents=True, exist_ok=True)
    path = materialize(case, root)
    if case.argv is not None:
        commands = [[a.replace("{path}", str(path)).replace("{root}", str(root)) for a in case.argv]]
    elif case.log_format is not None:
        commands = [["import", *([case.log_format] if case.log_format != "auto" else []), str(path),
                     "--out", str(root / "imported.npz"), *case.log_args]]
    else:
        commands = trace_commands(path, root)
    outcomes = [run_command(argv, timeout=timeout, memory_limit=memory_limit) for argv in commands]
    failures = [f"{case.what}: {' '.join(o.argv[:2])}: {o.problem}" for o in outcomes if o.problem]
    if failures:
        return failures, None
    accepted = [o.rc == 0 for o in outcomes]
    if len(set(accepted)) > 1:
        detail = "; ".join(f"{o.argv[0]} -> {o.rc} {o.err.strip()[:120]}" for o in outcomes)
        return [f"{case.what}: commands disagree: {detail}"], None
    ok = accepted[0]
    if case.expect == "invalid" and ok:
        return [f"{case.what}: invalid input accepted"], ok
    if case.expect == "valid" and not ok:
        return [f"{case.what}: valid input refused: {outcomes[0].err.strip()}"], ok
    if ok and case.log_format is None and case.argv is None:
        from fuzzing_oracle import oracle_trace_problem

        problem = oracle_trace_problem(path)
        if problem is not None:
            return [f"{case.what}: accepted, but the independent checker finds it invalid ({problem})"], ok
    if ok and case.oracle is not None:
        problem = case.oracle(path, root / "imported.npz")
        if problem is not None:
            return [f"{case.what}: {problem}"], ok
    return [], ok


def make_case(rng: random.Random, kinds: tuple[str, ...] = ("trace",)) -> Case:
    kind = rng.choice(kinds)
    if kind == "trace":
        from fuzzing_traces import trace_case  # trace files: structured and byte-level damage

        return trace_case(rng)
    if kind == "args":
        from fuzzing_args import args_case  # hostile option values

        return args_case(rng)
    if kind == "sglang":
        from fuzzing_sglang import sglang_case  # torch.save dumps (needs torch to write them)

        return sglang_case(rng)
    from fuzzing_logs import log_case  # routing logs (JSONL)

    return log_case(rng)
