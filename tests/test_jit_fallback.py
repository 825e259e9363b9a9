"""Without numba the package runs as plain Python and computes the same numbers (expertcache._jit).

A subprocess with ``EXPERTCACHE_NO_NUMBA=1`` runs :func:`compute` (synthesis, replays of every
kind of compiled loop, an LRU stack curve on both counting paths, the exact optimum, and the
pure-Python twins of numba-only helpers) and prints it as JSON; the same function run in this
process, with numba's compiled loops wherever numba is installed, must give identical results.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import expertcache as ec
from expertcache import _jit
from expertcache.bounds import optimal_total
from expertcache.policies.randomized import mix64
from expertcache.sim.curves import sweep
from expertcache.sim.curves.stack import _lowest_bit, _popcount, stack_histograms
from expertcache.sim.layout import build_layout
from expertcache.trace.synth import SynthParams, synthesize, synthesize_preset
from test_rule_conformance import plain_specs
from test_managed_step import drive

POLICIES = plain_specs() + ["decayed:0.8"]
"""Every registered rule that replays on both engines from a plain trace (with the parameter examples of
tests/test_rule_conformance.py), and one more decay rate."""


def compute() -> dict:
    """Everything the comparison covers, as plain JSON values (no timings)."""
    out = {"available": _jit.AVAILABLE, "reason": _jit.REASON}
    trace = synthesize_preset("olmoe", seed=0, tokens=192, sequences=2, num_layers=3)
    out["trace"] = hashlib.sha256(np.ascontiguousarray(trace.experts, dtype=np.int64).tobytes()).hexdigest()
    out["layer_pool"] = [[r.policy, r.engine, r.copies_total, r.copies_steady]
                         for r in ec.replay_many(trace, 16, POLICIES)]
    out["global_pool"] = [[r.policy, r.copies_total, r.copies_steady]
                          for r in ec.replay_many(trace, 40, ["lru", "foresight:16", "random:1"], pool="global",
                                                  reset="none", warm=0.25)]
    (curve,) = sweep(trace, [8, 12, 20, 40, 64], ["lru"], warm=0.1)
    out["lru_curve"] = [curve.method, curve.copies_total.tolist(), curve.copies_steady.tolist()]

    layout = build_layout(trace, pool="global")  # direct popcounts and the Fenwick tree (direct_words=0)
    L, T = len(layout.layer_ids), layout.token_scored.size
    gl, gs = np.tile(np.arange(L), T), np.repeat(layout.token_scored, L)
    for name, words in (("stack_direct", 256), ("stack_tree", 0)):
        depth, first = stack_histograms(layout.groups, layout.starts, layout.n_items, gl, gs, L, words)
        out[name] = [depth.tolist(), first.sum(axis=1).tolist()]

    small = synthesize(SynthParams(num_experts=10, top_k=2, tokens=40, reuse_prob=0.3), seed=1)
    out["exact"] = [optimal_total(small.experts[:, 0, :], c).total for c in (3, 4, 6)]

    values = np.array([1, 2, 3, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF, 0x9E3779B97F4A7C15, 1 << 40],
                      dtype=np.uint64)

    def bits(xs):
        pop = np.empty(xs.size, dtype=np.int64)
        low = np.empty(xs.size, dtype=np.int64)
        for i in range(xs.size):
            pop[i] = _popcount(xs[i])
            low[i] = _lowest_bit(xs[i])
        return pop, low

    pop, low = _jit.njit(bits)(values)  # the intrinsics are callable from compiled code only
    out["bits"] = [pop.tolist(), low.tolist()]
    out["mix64"] = [mix64(s, t, e) for s, t, e in ((0, 0, 0), (3, 1, 7), (2**62, 12345, 99), (7, 2**40, 2**20))]
    # the managed mode's compiled step (its pool, the tensor reads and system calls by address)
    out["managed_step"] = json.loads(json.dumps(drive(True, 0, 3)))
    return out


def run_python(code: str, env: dict):
    """Run ``code`` in a fresh interpreter (warnings are errors) and parse the JSON it prints."""
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_without_numba_counts_are_the_same():
    env = {**os.environ, _jit.ENV_VAR: "1"}
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from expertcache import _jit\n"
        "import test_jit_fallback as t\n"
        "f = lambda x: x\n"
        "assert _jit.njit(f) is f and _jit.njit(cache=True)(f) is f and _jit.njit(cache=True, inline='always')(f) is f\n"
        "out = t.compute()\n"
        "out['numba_imported'] = 'numba' in sys.modules or 'llvmlite' in sys.modules\n"
        "print(json.dumps(out))\n"
    )
    plain = run_python(code, env)
    assert plain.pop("available") is False
    assert plain.pop("reason") == f"{_jit.ENV_VAR}=1"
    assert plain.pop("numba_imported") is False  # nothing reaches numba except through _jit

    here = compute()
    here.pop("available"), here.pop("reason")
    assert plain == here


def test_a_numba_that_cannot_be_imported_falls_back():
    """Without the variable, a failing ``import numba`` (here: blocked) also selects plain Python."""
    env = {k: v for k, v in os.environ.items() if k != _jit.ENV_VAR}
    code = (
        "import json, sys\n"
        "sys.modules['numba'] = None\n"  # makes `import numba` raise ImportError
        "import expertcache as ec\n"
        "from expertcache import _jit\n"
        "from expertcache.trace.synth import synthesize_preset\n"
        "trace = synthesize_preset('olmoe', seed=0, tokens=64, num_layers=2)\n"
        "print(json.dumps([_jit.AVAILABLE, _jit.REASON, ec.replay(trace, 16, 'foresight:4').copies_total]))\n"
    )
    available, reason, copies = run_python(code, env)
    assert available is False and reason.startswith("numba cannot be imported")
    assert copies == ec.replay(synthesize_preset("olmoe", seed=0, tokens=64, num_layers=2), 16, "foresight:4").copies_total
