"""Cost of the hardened loader: ``load_trace`` against a bare ``np.load`` of the same archive.

    python benchmarks/bench_load.py

``load_trace`` checks every header before reading, reads members in chunks into one buffer, and
validates the whole trace (ids, duplicates, sequences, meta). The baseline is numpy reading every
member and nothing else, measured in the same run on the same file; best of 5. Traces: the
synthetic presets kimi-k3 (E=896, k=16, L=92: 1.8 M ids) and bench-k1 (2 M tokens, k=1), saved
compressed (the tool's own format) and uncompressed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from expertcache import load_trace
from expertcache.trace.synth import synthesize_preset


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bare(path: Path) -> None:
    with np.load(path, allow_pickle=False) as z:
        for name in z.files:
            z[name]


def main() -> int:
    print(f"{'trace':26} {'ids':>10} {'np.load s':>10} {'load_trace s':>13} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("kimi-k3", "bench-k1"):
            trace = synthesize_preset(preset, seed=0)
            compressed = trace.save(Path(tmp) / f"{preset}.npz")
            plain = Path(tmp) / f"{preset}-stored.npz"
            np.savez(plain, experts=trace.experts, seq=trace.seq, meta=np.array(__import__("json").dumps(trace.meta)))
            for label, path in ((f"{preset} (compressed)", compressed), (f"{preset} (stored)", plain)):
                b = best(lambda: bare(path))
                t = best(lambda: load_trace(path))
                print(f"{label:26} {trace.experts.size:>10,} {b:>10.3f} {t:>13.3f} {t / b:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
