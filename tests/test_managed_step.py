"""The ``managed`` mode's compiled step (llama/managed.py) against the Python path it stands in for:

* :class:`LRUPool` decides as ``SizedCache(capacity_bytes, "lru", item_bytes)`` (hits, loads, victims
  in order, residents, bytes used) on random streams of mixed sizes, resets included;
* a :class:`PageAdvisor` taking its one-row steps in compiled code makes the same system calls, in
  the same order, with the same arguments, as one on the Python path, keeps the same counters and
  records the same routing, over decode steps, a prefill (rows > 1: the Python path in both) and
  victims evicted within the forward that hinted them (dropped again a layer later). The calls are
  logged instead of made: the Python path's ``madvise`` and ``os.posix_fadvise`` are replaced, the
  compiled step is handed the addresses of logging callbacks; the geometry is made up
  (tests/test_managed_pages.py: slices off page boundaries, so partial pages are shared).

No llama.cpp: the ``ffn_moe_topk`` tensors are ``struct ggml_tensor`` mirrors over int32 arrays.
``tests/test_jit_fallback.py`` runs :func:`drive` without numba too (the pure-Python twins).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import tempfile
import threading
import types

import numpy as np
import pytest

from expertcache.cache import SizedCache
from expertcache.errors import ConfigError
from expertcache.llama import advice
from expertcache.llama.advice import PageAdvisor, managed_item_bytes
from expertcache.llama.ggml import GGML_TYPE_I32, GGMLTensor
from expertcache.llama.managed import LRUPool, PageSteps
from expertcache.llama.textgen import Session
from test_managed_pages import E, geometry

BASE = 1 << 40
"""A made-up mapping address (page aligned): the calls are logged, never made."""


@pytest.mark.parametrize("seed", range(8))
def test_pool_decides_as_the_sized_cache(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(6, 80))
    sizes = rng.integers(1, 6, n) * 4096 + rng.integers(0, 3, n) * int(rng.integers(0, 2))  # mixed, or equal-ish
    cap = int(sizes.max()) * int(rng.integers(1, 12)) + int(rng.integers(0, 4096))
    pool, ref = LRUPool(cap, sizes), SizedCache(cap, "lru", sizes)
    assert (pool.capacity, pool.capacity_bytes) == (ref.capacity, ref.capacity_bytes)
    for step in range(500):
        if step in (170, 171, 340):
            pool.reset()
            ref.reset()
        items = rng.permutation(n)[: int(rng.integers(0, 7))]
        while items.size and sizes[items].sum() > cap:
            items = items[:-1]
        a, b = pool.prepare(items), ref.prepare(items)
        assert (a.hits, a.loads, a.evicted) == (b.hits, b.loads, b.evicted), step
        assert a.slots.tolist() == b.slots.tolist() and a.items.tolist() == b.items.tolist()
        assert pool.resident.tolist() == ref.resident.tolist() and pool.used_bytes == ref.used_bytes
        assert pool.slots_of(np.array([-1, 0, n - 1])).tolist() == ref.slots_of(np.array([-1, 0, n - 1])).tolist()


def test_pool_refuses_as_the_sized_cache():
    sizes = np.array([4096, 8192, 4096])
    pool = LRUPool(8192, sizes)
    with pytest.raises(ConfigError, match="distinct"):
        pool.prepare([0, 0])
    with pytest.raises(ConfigError, match="distinct and below 3"):
        pool.prepare([3])
    with pytest.raises(ConfigError, match="capacity is 8192 bytes"):
        pool.prepare([0, 1])
    with pytest.raises(ConfigError, match="below the largest item"):
        LRUPool(4096, sizes)


class _Topk:
    """A ``struct ggml_tensor`` mirror of a ``ffn_moe_topk`` tensor: int32 ids, ``[rows, k]``."""

    def __init__(self, ids: np.ndarray):
        self.ids = np.ascontiguousarray(ids, dtype=np.int32)
        self.t = GGMLTensor()
        self.t.type = GGML_TYPE_I32
        k, rows = self.ids.shape[1], self.ids.shape[0]
        self.t.ne[:] = (k, rows, 1, 1)
        self.t.nb[:] = (4, 4 * k, 4 * k * rows, 4 * k * rows)
        self.t.data = self.ids.ctypes.data

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self.t)


def forwards(seed: int, n: int = 40):
    """Per forward, per layer: the routed ids (rows x k). The 6th forward is a prefill of 3 rows."""
    rng = np.random.default_rng(seed)
    out = []
    for f in range(n):
        rows = 3 if f == 5 else 1
        out.append([np.stack([rng.permutation(E)[:2] for _ in range(rows)]) for _ in (0, 1)])
    return out


def drive(compiled: bool, seed: int, capacity_items: float, n: int = 40, readers: int = 0) -> dict:
    """Run one advisor over ``n`` :func:`forwards` with its system calls logged; its log, stats,
    routing. ``readers``: threads that meanwhile read the counters as a server's ``/metrics`` does
    (``Session.snapshot``), over and over; what each read (``reads``)."""
    g = geometry()
    log: list = []
    madvise_cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)(
        lambda a, n, adv: log.append(("madvise", a, n, adv)) or 0)
    fadvise_cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)(
        lambda fd, off, n, adv: log.append(("fadvise", off, n, adv)) or 0)
    with tempfile.NamedTemporaryFile(suffix=".gguf") as fh:
        fh.truncate(g.file_bytes)
        g = dataclasses.replace(g, path=fh.name)
        cap = int(managed_item_bytes(g).max() * capacity_items)
        adv = PageAdvisor(g, "managed", capacity=cap, compiled=compiled, record=True)
        assert (adv.steps is not None) == compiled
        adv.base, adv.hint_piece = BASE, 4096  # pieces of a page: a slice takes several hints
        if adv.steps is not None:
            adv.steps.base, adv.steps.piece = BASE, 4096
            adv.steps.fns = np.asarray([ctypes.cast(madvise_cb, ctypes.c_void_p).value,
                                        ctypes.cast(fadvise_cb, ctypes.c_void_p).value], dtype=np.int64)
        saved = advice.madvise, os.posix_fadvise
        advice.madvise = lambda a, n, a2: log.append(("madvise", a, n, a2))
        os.posix_fadvise = lambda fd, off, n, a2: log.append(("fadvise", off, n, a2))
        session = Session.__new__(Session)  # only what snapshot reads
        session.llama, session.advisor = types.SimpleNamespace(stats={}, io=None), adv
        done, reads = threading.Event(), [[] for _ in range(readers)]

        def read(out: list) -> None:
            while not done.is_set():
                snap = session.snapshot()
                out.append((snap["expert_hits"], snap["expert_misses"]))

        threads = [threading.Thread(target=read, args=(out,)) for out in reads]
        for t in threads:
            t.start()
        try:
            for f in forwards(seed, n):
                adv.begin(f[0].shape[0], False, False)
                for layer, ids in enumerate(f):
                    t = _Topk(ids)
                    adv.seen(f"ffn_moe_topk-{layer}".encode(), t.ptr)
            done.set()
            for t in threads:
                t.join()
            stats = adv.stats()
        finally:
            done.set()
            advice.madvise, os.posix_fadvise = saved
            adv.close()
    routing = [{k: v.tolist() for k, v in f.items()} for f in adv.routing]
    return {"log": log, "stats": stats, "routing": routing, "resident": adv.cache.resident.tolist(), "reads": reads}


@pytest.mark.parametrize("compiled", [True, False])
def test_counters_read_beside_the_decode_count_each_step_once(compiled):
    """A server renders ``/metrics`` on its own thread while its decode thread steps the pool
    (docs/serve.md, "Threads"): the counters it reads (``Session.snapshot``) never go down, never pass
    the end's, and reading them changes nothing. The thread switch is made as frequent as Python
    allows. Before, the read moved the compiled step's counters too: a step was counted twice when
    both threads moved it, or lost when it was counted between a move's read and its reset (the
    compiled case failed in 3 runs of 3)."""
    alone = drive(compiled, 0, 3, n=1500)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        read = drive(compiled, 0, 3, n=1500, readers=2)
    finally:
        sys.setswitchinterval(interval)
    assert read["stats"] == alone["stats"]
    end = (alone["stats"]["expert_hits"], alone["stats"]["expert_misses"])
    for seq in read["reads"]:
        assert seq, "a reader read nothing"
        assert all(b[0] >= a[0] and b[1] >= a[1] for a, b in zip(seq, seq[1:])), "a counter went down"
        assert all(h <= end[0] and m <= end[1] for h, m in seq)


@pytest.mark.parametrize("seed,capacity_items", [(0, 3), (1, 3.5), (2, 5), (3, 8)])
def test_compiled_step_makes_the_python_paths_calls(seed, capacity_items):
    fast, slow = drive(True, seed, capacity_items), drive(False, seed, capacity_items)
    assert fast["routing"] == slow["routing"]
    assert fast["stats"] == slow["stats"]
    assert fast["resident"] == slow["resident"]
    assert fast["log"] == slow["log"]
    s = fast["stats"]
    assert s["managed_loads"] > 0 and s["hints"] > 0
    if capacity_items < 8:  # a pool below the 8 items evicts, drops partial pages, drops again
        assert s["managed_drops"] > 0 and s["edge_page_drops"] > 0
        assert any(c[0] == "madvise" for c in fast["log"])


def test_a_routed_id_outside_the_experts_is_one_line():
    g = geometry()
    with tempfile.NamedTemporaryFile(suffix=".gguf") as fh:
        fh.truncate(g.file_bytes)
        g = dataclasses.replace(g, path=fh.name)
        pool = LRUPool(int(managed_item_bytes(g).sum()), managed_item_bytes(g))
        fd = os.open(fh.name, os.O_RDONLY)
        try:
            steps = PageSteps(g, pool, fd, 4096, advice.EdgePages(g))
            t = _Topk(np.array([[1, E]]))
            with pytest.raises(ConfigError, match=r"outside \[0, 4\)"):
                steps.layer(t.ptr, 0)
            assert steps.layer(_Topk(np.array([[1, 2], [0, 3]])).ptr, 0) is None  # two rows: the Python path's
        finally:
            os.close(fd)
