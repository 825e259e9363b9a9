"""Cross-check against libCacheSim (an independent, native implementation) through our exports:
the CSV export reads in libCacheSim (its LRU misses equal our copies), and the request flattening.
The per-rule counts (lru, belady, arc, s3fifo, sieve: copies equal to libCacheSim's misses on k = 1
traces, synthetic and real, per layer) are tests/test_rule_conformance.py's, for every registered
rule libCacheSim has. libcachesim is a test dependency only (GPL-3.0)."""

from __future__ import annotations

import numpy as np
import pytest

import expertcache as ec
from expertcache.trace.exporters import export_libcachesim, flatten_requests, next_access

lcs = pytest.importorskip("libcachesim")


def lcs_misses(path, n, policy, capacity, fmt="oracle"):
    if fmt == "oracle":
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    else:
        p = lcs.ReaderInitParam(has_header=True, has_header_set=True, delimiter=",")
        p.time_field, p.obj_id_field, p.obj_size_field = 1, 2, 3
        reader = lcs.TraceReader(str(path), lcs.TraceType.CSV_TRACE, p)
    cache = {"lru": lcs.LRU, "belady": lcs.Belady}[policy](capacity)
    return round(cache.process_trace(reader)[0] * n)


def k1_trace(n=20_000, E=300, seed=0):
    rng = np.random.default_rng(seed)
    p = np.arange(1, E + 1, dtype=float) ** -1.1
    ids = rng.choice(E, n, p=p / p.sum())
    burst = rng.random(n) < 0.3
    ids[1:][burst[1:]] = ids[:-1][burst[1:]]  # bursts of reuse
    return ec.Trace.from_arrays(ids[:, None], num_experts=E)


def test_csv_export_reads_in_libcachesim(tmp_path):
    trace = k1_trace(5000)
    path = tmp_path / "t.csv"
    n = export_libcachesim(trace, path, fmt="csv")
    assert lcs_misses(path, n, "lru", 32, fmt="csv") == ec.replay(trace, 32, "lru", reset="none").copies_total


def test_flatten_orders_and_next_access():
    t = ec.Trace.from_arrays(np.array([[[3, 1, -1], [0, 2, 1]], [[1, 3, 0], [2, -1, -1]]]), num_experts=4,
                             meta={"layer_ids": [5, 6]})
    assert flatten_requests(t, "router").tolist() == [23, 21, 24, 26, 25, 21, 23, 20, 26]
    assert flatten_requests(t, "ascending").tolist() == [21, 23, 24, 25, 26, 20, 21, 23, 26]
    assert flatten_requests(t, "descending").tolist() == [23, 21, 26, 25, 24, 23, 21, 20, 26]
    assert flatten_requests(t, "router", layers=[6]).tolist() == [24, 26, 25, 26]
    assert next_access(np.array([5, 7, 5, 5, 7, 9])).tolist() == [2, 4, 3, -1, -1, -1]
