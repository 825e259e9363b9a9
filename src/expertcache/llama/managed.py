"""The ``managed`` mode's pool step in compiled code: one numba call per MoE layer reads the layer's
routing from its ``ffn_moe_topk`` tensor, takes the LRU pool's step, drops the victims' pages and
hints the loads, where the Python path (a :class:`~expertcache.cache.SizedCache` and
``PageAdvisor._apply``) took 1.17 ms a decode token on the 12 MoE layers of the Qwen3-MoE benchmark
model with 2 threads (read 0.28, cache step 0.39, hints 0.26, the advisor's own code the rest;
docs/llama.md, "The managed step, compiled").

* :class:`LRUPool` is the pool: ``capacity_bytes`` over items of ``item_bytes``, the victims the
  least recently used (ties: the smaller id first). It has the part of ``SizedCache``'s interface
  the advisor uses (``prepare``, ``resident``, ``slots_of``, ``reset``, ``capacity``,
  ``capacity_bytes``, ``item_bytes``, ``policy.spec``).
* :class:`PageSteps` holds the file's geometry as arrays (each item's slices, each layer's
  tensors in compute order, the partial pages and their owners) and runs :func:`_layer`: the
  whole step of one layer, syscalls included (``madvise`` and ``posix_fadvise`` called by address
  from the compiled code, so the loop is cached on disk like the others).

Invariants (``tests/test_managed_step.py``):

* ``LRUPool`` decides exactly as ``SizedCache(capacity_bytes, "lru", item_bytes)``: the same hits,
  the same loads (ascending ids) and the same victims in the same order at every step, on random
  streams of mixed sizes; so the pool's reads are the LRU replay's.
* ``PageSteps.layer`` does exactly what the Python path does with that step without reader
  threads: each victim's whole pages dropped (``MADV_DONTNEED`` on the mapping, then
  ``POSIX_FADV_DONTNEED``), then its partial pages that no resident item and no dense tensor
  shares; a victim hinted within this forward queued to be dropped again (``_redrop``); the loads
  hinted with ``POSIX_FADV_WILLNEED`` tensor by tensor in compute order, experts ascending, in pieces
  of ``hint_piece`` bytes; the same counters. Tested against the Python path on a made-up
  geometry whose slices share partial pages: the same system calls in the same order with the
  same arguments (logged, not made), counters and routing; the benchmark's runs on real files
  give the same reads, tokens and proofs on both paths.
* A routing it cannot read as one contiguous int32 row (a prefill's rows, another type) is left to
  the Python path (:func:`_layer` returns :data:`NOT_ONE_ROW`); an id outside ``[0, E)`` or a
  failed system call is an error the caller raises as one line.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .._jit import AVAILABLE, njit
from ..cache import Step, check_sized_group, sized_items
from ..errors import ConfigError
from ..formats.gguf import compute_rank
from ..kernels import _append, _unlink  # the recency list's two operations, shared with the replay loops
from .ggml import GGML_TYPE_I32, GGMLTensor

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4
FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 3)
FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)
NOT_ONE_ROW = -1
""":func:`_layer`: the tensor is not one contiguous int32 row (the Python path reads it)."""
BAD_ID = -2
"""An expert id outside ``[0, E)``."""
SYSCALL_FAILED = -3
"""``madvise`` or ``posix_fadvise`` returned an error."""

# the scalars of a pool's state (``st``) and of its page-cache work (``ps``)
HEAD, TAIL, USED, T = range(4)
FORWARD, NPEND = range(2)
# the counters (``cnt``), in PageAdvisor's words
LOADS, HITS, MISSES, DROPS, EDGE_DROPS, HINTS, HINT_BYTES = range(7)

_OFF_TYPE = GGMLTensor.type.offset
_OFF_NE = GGMLTensor.ne.offset
_OFF_NB = GGMLTensor.nb.offset
_OFF_DATA = GGMLTensor.data.offset

_libc = ctypes.CDLL(None)


def _address(name: str) -> int:
    fn = getattr(_libc, name, None)
    return ctypes.cast(fn, ctypes.c_void_p).value or 0 if fn is not None else 0


MADVISE, FADVISE = _address("madvise"), _address("posix_fadvise")
"""Addresses of libc's ``madvise`` and ``posix_fadvise``, which the compiled step calls (0 where the
C library lacks one: macOS has no ``posix_fadvise``)."""
SUPPORTED = bool(MADVISE and FADVISE)
"""Whether the compiled step can run here (else the advisor keeps its Python path)."""


if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _madvise(typingctx, fn, addr, length, advice):
        """``int madvise(void *addr, size_t length, int advice)`` at address ``fn``."""
        def codegen(context, builder, signature, args):
            f, a, n, adv = args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            fnty = ir.FunctionType(i32, [i64, i64, i32])
            return builder.call(builder.inttoptr(f, fnty.as_pointer()), [a, n, builder.trunc(adv, i32)])

        return types.int32(types.int64, types.int64, types.int64, types.int64), codegen

    @intrinsic
    def _fadvise(typingctx, fn, fd, off, length, advice):
        """``int posix_fadvise(int fd, off_t offset, off_t len, int advice)`` at address ``fn``."""
        def codegen(context, builder, signature, args):
            f, d, o, n, adv = args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            fnty = ir.FunctionType(i32, [i32, i64, i64, i32])
            return builder.call(builder.inttoptr(f, fnty.as_pointer()),
                                [builder.trunc(d, i32), o, n, builder.trunc(adv, i32)])

        return types.int32(types.int64, types.int64, types.int64, types.int64, types.int64), codegen

    @intrinsic
    def _peek64(typingctx, addr):
        """The int64 at ``addr``."""
        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            return builder.load(builder.inttoptr(args[0], i64.as_pointer()))

        return types.int64(types.int64), codegen

    @intrinsic
    def _peek32(typingctx, addr):
        """The int32 at ``addr``, widened to int64."""
        def codegen(context, builder, signature, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            return builder.sext(builder.load(builder.inttoptr(args[0], i32.as_pointer())), i64)

        return types.int64(types.int64), codegen

else:  # plain Python (expertcache._jit): the same four, through ctypes
    _MADVISE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)
    _FADVISE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)

    def _madvise(fn, addr, length, advice):
        return _MADVISE_FN(int(fn))(int(addr), int(length), int(advice))

    def _fadvise(fn, fd, off, length, advice):
        return _FADVISE_FN(int(fn))(int(fd), int(off), int(length), int(advice))

    def _peek64(addr):
        return ctypes.c_int64.from_address(int(addr)).value

    def _peek32(addr):
        return ctypes.c_int32.from_address(int(addr)).value


# -- the pool ------------------------------------------------------------------------------------
@njit(cache=True)
def _pool_step(items, sizes, cap, st, prv, nxt, res, grp, loads, victims):
    """One LRU step over ``items`` (distinct, ascending); returns ``(hits, n_loads, n_victims)``
    with the loads (ascending) and victims (in eviction order) written to ``loads`` / ``victims``.
    The list runs from the least recent item (``st[HEAD]``) to the most recent; items used in one
    step stand in ascending id order, so it is the ``(last use, id)`` order of ``SizedCache``."""
    t = st[T]
    stamp = t + 1
    need = 0
    n_loads = 0
    for i in range(items.size):
        e = items[i]
        grp[e] = stamp
        if not res[e]:
            loads[n_loads] = e
            n_loads += 1
            need += sizes[e]
    hits = items.size - n_loads
    deficit = st[USED] + need - cap
    n_vic = 0
    v = st[HEAD]
    while deficit > 0 and v >= 0:
        nv = nxt[v]
        if grp[v] != stamp:
            victims[n_vic] = v
            n_vic += 1
            deficit -= sizes[v]
            st[HEAD], st[TAIL] = _unlink(prv, nxt, v, st[HEAD], st[TAIL])
            res[v] = 0
            st[USED] -= sizes[v]
        v = nv
    # every item of the group to the tail, ascending (a hit is unlinked first)
    for i in range(items.size):
        e = items[i]
        if res[e]:
            st[HEAD], st[TAIL] = _unlink(prv, nxt, e, st[HEAD], st[TAIL])
        else:
            res[e] = 1
            st[USED] += sizes[e]
        st[HEAD], st[TAIL] = _append(prv, nxt, e, st[HEAD], st[TAIL])
    st[T] = t + 1
    return hits, n_loads, n_vic


class _Spec:
    spec = "lru"


class LRUPool:
    """See the module docstring: ``SizedCache(capacity_bytes, "lru", item_bytes)``, compiled."""

    policy = _Spec()

    def __init__(self, capacity_bytes: int, item_bytes):
        sizes = sized_items(capacity_bytes, item_bytes)
        self.item_bytes = sizes
        self.capacity_bytes = int(capacity_bytes)
        self.capacity = max(1, int(capacity_bytes // sizes.mean()))
        self.n_items = sizes.size
        n = sizes.size
        self.st = np.zeros(8, dtype=np.int64)
        self.prv = np.empty(n, dtype=np.int64)
        self.nxt = np.empty(n, dtype=np.int64)
        self.res = np.zeros(n, dtype=np.int8)
        self.grp = np.zeros(n, dtype=np.int64)
        self._loads = np.empty(n, dtype=np.int64)
        self._victims = np.empty(n, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Empty the pool (step counter back to 0)."""
        self.st[:] = 0
        self.st[HEAD] = self.st[TAIL] = -1
        self.res[:] = 0
        self.grp[:] = 0

    @property
    def used_bytes(self) -> int:
        return int(self.st[USED])

    @property
    def t(self) -> int:
        return int(self.st[T])

    @property
    def resident(self) -> np.ndarray:
        """Resident item ids, ascending."""
        return np.flatnonzero(self.res)

    def slots_of(self, items) -> np.ndarray:
        """0 for a resident item, -1 otherwise (or for a pad), as ``SizedCache.slots_of``."""
        items = np.asarray(items, dtype=np.int64)
        return np.where((items >= 0) & (self.res[np.maximum(items, 0)] > 0), 0, -1)

    def prepare(self, items):
        """One step (``SizedCache.prepare``'s checks and result: a :class:`~expertcache.cache.Step`)."""
        items = np.asarray(items, dtype=np.int64).ravel()
        items = items[items >= 0]
        check_sized_group(items, self.item_bytes, self.capacity_bytes)
        order = np.sort(items)
        hits, nl, nv = _pool_step(order, self.item_bytes, self.capacity_bytes, self.st, self.prv, self.nxt,
                                  self.res, self.grp, self._loads, self._victims)
        return Step(items=items, slots=self.slots_of(items), loads=[(int(e), 0) for e in self._loads[:nl]],
                    evicted=[int(v) for v in self._victims[:nv]], hits=int(hits))


# -- the page-cache work of a step ------------------------------------------------------------------
@njit(cache=True, inline="always")
def _drop_range(fns, fd, base, off, n):
    """The whole pages inside file bytes ``[off, off + n)``: unmapped, then dropped (``advice.drop``)."""
    lo = (off + PAGE - 1) // PAGE * PAGE
    hi = (off + n) // PAGE * PAGE
    if hi > lo:
        if _madvise(fns[0], base + lo, hi - lo, MADV_DONTNEED) != 0:
            return False
        if _fadvise(fns[1], fd, lo, hi - lo, FADV_DONTNEED) != 0:
            return False
    return True


@njit(cache=True)
def _drop_item(v, fns, fd, base, slices, edge_ptr, edge_page, own_ptr, owners, res, cnt):
    """Evict item ``v``'s pages: its slices' whole pages, then each partial page no resident item
    and no dense tensor (owner -1) shares. False where a system call failed."""
    for s in range(slices.shape[1]):
        if slices[v, s, 1] > 0 and not _drop_range(fns, fd, base, slices[v, s, 0], slices[v, s, 1]):
            return False
    for i in range(edge_ptr[v], edge_ptr[v + 1]):
        keep = False
        for q in range(own_ptr[i], own_ptr[i + 1]):
            o = owners[q]
            if o < 0 or res[o]:
                keep = True
                break
        if not keep:
            if not _drop_range(fns, fd, base, edge_page[i], PAGE):
                return False
            cnt[EDGE_DROPS] += 1
    return True


@njit(cache=True)
def _layer(tensor, j, E, cap, pool_cap, sizes, st, prv, nxt, res, grp, ps, hinted, pending, queued, fns, fd, base, piece,
           slices, tensors, edge_ptr, edge_page, own_ptr, owners, cnt, ids, loads, victims):
    """The managed step of MoE layer row ``j`` whose ``ffn_moe_topk`` tensor is at ``tensor``:
    the pending victims dropped again where no longer resident, the routed ids read (sorted into
    ``ids``), the pool's step, its victims dropped and its loads hinted. Returns how many distinct
    ids were routed, or :data:`NOT_ONE_ROW`, :data:`BAD_ID`, :data:`SYSCALL_FAILED`. ``pool_cap``: the
    experts one pool step may take (``cap`` // the largest item)."""
    typ = _peek32(tensor + _OFF_TYPE)
    k = _peek64(tensor + _OFF_NE)
    rows = _peek64(tensor + _OFF_NE + 8) * _peek64(tensor + _OFF_NE + 16) * _peek64(tensor + _OFF_NE + 24)
    if typ != GGML_TYPE_I32 or rows != 1 or _peek64(tensor + _OFF_NB) != 4 or k < 1 or k > E:
        return NOT_ONE_ROW
    # what an earlier layer of this forward evicted while its read was in flight: dropped again
    npend = ps[NPEND]
    ps[NPEND] = 0
    for i in range(npend):
        v = pending[i]
        queued[v] = 0
        if not res[v]:
            if not _drop_item(v, fns, fd, base, slices, edge_ptr, edge_page, own_ptr, owners, res, cnt):
                return SYSCALL_FAILED
    data = _peek64(tensor + _OFF_DATA)
    n = 0
    for i in range(k):  # insertion sort, duplicates dropped
        e = _peek32(data + 4 * i)
        if e < 0 or e >= E:
            return BAD_ID
        pos = n
        while pos > 0 and ids[pos - 1] > e:
            pos -= 1
        if pos > 0 and ids[pos - 1] == e:
            continue
        for q in range(n, pos, -1):
            ids[q] = ids[q - 1]
        ids[pos] = e
        n += 1
    fwd = ps[FORWARD]
    for start in range(0, n, pool_cap):  # a layer routing more than the pool holds: one step per pool-full
        stop = min(n, start + pool_cap)
        items = ids[start:stop] + j * E
        hits, nl, nv = _pool_step(items, sizes, cap, st, prv, nxt, res, grp, loads, victims)
        cnt[LOADS] += nl
        cnt[HITS] += hits
        cnt[MISSES] += nl
        cnt[DROPS] += nv
        for i in range(nv):
            v = victims[i]
            if not _drop_item(v, fns, fd, base, slices, edge_ptr, edge_page, own_ptr, owners, res, cnt):
                return SYSCALL_FAILED
            if hinted[v] == fwd and not queued[v]:  # its read may still be under way
                queued[v] = 1
                pending[ps[NPEND]] = v
                ps[NPEND] += 1
        for i in range(nl):
            hinted[loads[i]] = fwd
        for s in range(tensors.shape[1]):
            width = tensors[j, s, 1]
            if width <= 0:
                continue
            for i in range(nl):
                off = tensors[j, s, 0] + (loads[i] - j * E) * width
                end = off + width
                lo = off
                while lo < end:
                    if _fadvise(fns[1], fd, lo, min(piece, end - lo), FADV_WILLNEED) != 0:
                        return SYSCALL_FAILED
                    lo += piece
                cnt[HINTS] += 1
                cnt[HINT_BYTES] += width
    return n


def pool_step(capacity_bytes: int, item_bytes: np.ndarray) -> int:
    """Experts one step of a pool of ``capacity_bytes`` may take, whatever their sizes: a prefill's
    layer routing more takes one step per pool-full."""
    return max(1, int(capacity_bytes) // int(item_bytes.max()))


class PageSteps:
    """The geometry of one file as arrays and a pool's page-cache state, for :func:`_layer`."""

    def __init__(self, g, pool: LRUPool, fd: int, piece: int, edges):
        E, L = g.num_experts, len(g.moe_layers)
        S = max(len(g.experts[layer]) for layer in g.moe_layers)
        self.E, self.pool, self.fd, self.piece = E, pool, int(fd), int(piece)
        self.pool_step = pool_step(pool.capacity_bytes, pool.item_bytes)
        self.slices = np.zeros((L * E, S, 2), dtype=np.int64)  # each item's (offset, length), file order
        self.tensors = np.zeros((L, S, 2), dtype=np.int64)  # each layer's (tensor offset, slice), compute order
        for j, layer in enumerate(g.moe_layers):
            for e in range(E):
                for s, (off, n) in enumerate(g.expert_ranges(layer, e)):
                    self.slices[j * E + e, s] = (off, n)
            ordered = sorted(g.experts[layer].items(), key=lambda kv: compute_rank(kv[0]))
            for s, (_, t) in enumerate(ordered):
                self.tensors[j, s] = (t.offset, t.nbytes // E)
        ptr, pages, optr, owners = [0], [], [0], []
        for item in range(L * E):
            for page, others in edges.edges.get(item, ()):
                pages.append(page)
                owners.extend(others)
                optr.append(len(owners))
            ptr.append(len(pages))
        self.edge_ptr = np.asarray(ptr, dtype=np.int64)
        self.edge_page = np.asarray(pages, dtype=np.int64)
        self.own_ptr = np.asarray(optr, dtype=np.int64)
        self.owners = np.asarray(owners, dtype=np.int64)  # DENSE is -1
        self.ps = np.zeros(2, dtype=np.int64)
        self.hinted = np.full(L * E, -1, dtype=np.int64)  # the forward each item was last hinted in
        self.pending = np.zeros(L * E, dtype=np.int64)  # victims to drop again (each once: queued)
        self.queued = np.zeros(L * E, dtype=np.int8)
        self.cnt = np.zeros(8, dtype=np.int64)
        self.ids = np.zeros(E, dtype=np.int64)
        self.fns = np.asarray([MADVISE, FADVISE], dtype=np.int64)
        self.base = 0

    def begin(self) -> None:
        """A new forward (the items hinted in the last one are no longer in flight)."""
        self.ps[FORWARD] += 1

    def reset(self) -> None:
        """Forget the hints, the queued victims and the counters (the pool is reset apart)."""
        self.ps[:] = 0
        self.hinted[:] = -1
        self.queued[:] = 0
        self.cnt[:] = 0

    def mark_hinted(self, items) -> None:
        self.hinted[np.asarray(items, dtype=np.int64)] = self.ps[FORWARD]

    def hinted_now(self, item: int) -> bool:
        """Whether ``item`` was hinted within this forward (its read may be under way)."""
        return bool(self.hinted[item] == self.ps[FORWARD])

    def queue(self, item: int) -> None:
        """Drop ``item`` again at the next layer's step (or the next forward)."""
        if not self.queued[item]:
            self.queued[item] = 1
            self.pending[self.ps[NPEND]] = item
            self.ps[NPEND] += 1

    def take_pending(self) -> list[int]:
        out = self.pending[:int(self.ps[NPEND])].tolist()
        self.queued[out] = 0
        self.ps[NPEND] = 0
        return out

    def layer(self, tensor: int, j: int) -> np.ndarray | None:
        """The step of MoE layer row ``j`` (see :func:`_layer`): the routed ids (a view, sorted), or
        None where the tensor is not one contiguous row (the Python path reads it)."""
        p = self.pool
        n = _layer(int(tensor), int(j), self.E, p.capacity_bytes, self.pool_step, p.item_bytes, p.st, p.prv, p.nxt, p.res, p.grp,
                   self.ps, self.hinted, self.pending, self.queued, self.fns, self.fd, self.base, self.piece, self.slices, self.tensors,
                   self.edge_ptr, self.edge_page, self.own_ptr, self.owners, self.cnt, self.ids, p._loads,
                   p._victims)
        if n == NOT_ONE_ROW:
            return None
        if n == BAD_ID:
            raise ConfigError(f"managed: MoE layer row {j} routed an expert id outside [0, {self.E})")
        if n == SYSCALL_FAILED:
            raise ConfigError(f"managed: madvise or posix_fadvise failed in the step of MoE layer row {j} of {self.pool.n_items // self.E}")
        return self.ids[:n]


def compile_step() -> None:
    """Compile (or load from numba's disk cache) the pool's step and :func:`_layer` in this process:
    the runner calls it before it starts a walled worker, so that no worker compiles inside its
    wall. The call reads a two-row tensor, which :func:`_layer` leaves to the Python path before
    any system call."""
    pool = LRUPool(2 * PAGE, np.full(4, PAGE, dtype=np.int64))
    pool.prepare([0])
    t = GGMLTensor()
    t.type = GGML_TYPE_I32
    t.ne[:] = (1, 2, 1, 1)
    t.nb[:] = (4, 4, 8, 8)
    z1, z3 = np.zeros(1, dtype=np.int64), np.zeros((1, 1, 2), dtype=np.int64)
    _layer(ctypes.addressof(t), 0, 4, pool.capacity_bytes, 2, pool.item_bytes, pool.st, pool.prv, pool.nxt, pool.res,
           pool.grp, np.zeros(2, dtype=np.int64), np.full(4, -1, dtype=np.int64), np.zeros(4, dtype=np.int64),
           np.zeros(4, dtype=np.int8), np.zeros(2, dtype=np.int64), -1, 0, PAGE, np.zeros((4, 1, 2), dtype=np.int64),
           z3, np.zeros(5, dtype=np.int64), z1[:0], z1, z1[:0], np.zeros(8, dtype=np.int64), np.zeros(4, dtype=np.int64),
           pool._loads, pool._victims)

