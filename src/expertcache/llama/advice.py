"""The page-cache modes of a llama.cpp run: how the kernel tier holding the GGUF is advised.

llama.cpp mmaps the whole GGUF (``MAP_SHARED``, read-only, offset 0; by default also
``MAP_POPULATE``), so the page cache is the expert tier. :class:`PageAdvisor` is an engine
observer acting on that mapping (found in ``/proc/self/maps`` by the file's device and inode) and
on the file through its own descriptor:

* ``mmap``: nothing (llama.cpp's default);
* ``random``: ``madvise(MADV_RANDOM)`` on the expert tensors' pages: a fault reads its page, not
  the device's readahead window;
* ``advise``: random, plus ``posix_fadvise(WILLNEED)`` of exactly the routed experts' byte ranges
  (gate, up, down) as soon as a layer's ``ffn_moe_topk`` is computed, before its expert matmuls;
* ``lookahead``: advise, plus WILLNEED of the NEXT MoE layer's predicted experts when this layer's
  ``ffn_inp`` (the residual stream entering its FFN) is computed. Predictor: the next layer's own
  router applied to this residual, ``topk(W_gate[l+1] . rmsnorm(h) * ffn_norm[l+1], k)`` (the
  paper's router lookahead, section 7; it ignores this layer's MoE output and the next attention).
  Decode steps only (a one-row forward). ``lookahead_recall`` = predicted experts the next layer
  then routed / experts it routed;
* ``pin``: advise, plus the dense part (every tensor but the expert tensors: attention, norms,
  routers, embeddings; read every step) locked in memory with ``mlock`` once loaded, so that only
  experts compete for the page cache (a dense page evicted and refaulted reads the device's whole
  readahead window, mostly expert pages). A wall counts the locked pages as tier bytes;
* ``managed``: pin, plus an expertcache :class:`~expertcache.cache.ExpertCache` (``policy``, LRU by
  default; any online eviction rule) of ``capacity`` experts deciding the page cache's expert
  residency: once loaded, every expert page the load left is dropped (whole tensors: the load's
  large folios span experts) and the pool starts empty; when a layer routes, the cache's step is taken, its victims are dropped from the page
  cache (as ``nocache`` drops: the whole pages of their slices) and only its loads are hinted with WILLNEED. The
  runner sizes ``capacity`` below the wall (:func:`managed_capacity`), so the kernel never has to
  reclaim: the device reads are the policy's misses, the same policies deciding real copies as
  in the live harness. A policy's eviction replaces the kernel's, whose page-granular two-list LRU
  under a cgroup limit read 2-3x the LRU demand at a 25% wall (docs/llama.md). With ``lru``, no
  readers and no prediction, a one-row step (every decode step) is one compiled call
  (:mod:`expertcache.llama.managed`), which makes the same system calls as the Python path;
* ``nocache``: advise (the routed experts read whole, as the incumbent's ``pread`` reads them), plus,
  after each layer's ``ffn_moe_out``, its three expert tensors dropped: ``madvise(MADV_DONTNEED)``
  on the mapping (unmaps this process's pages) then ``posix_fadvise(DONTNEED)`` (evicts the clean
  pages): every use pays the device, the in-engine analogue of the incumbent's F_NOCACHE. Against
  ``advise`` it differs only in admission (the paper's section 9 A/B);
* ``prefetch``: ``mmap`` (llama.cpp's mapping as it is), plus what ik_llama.cpp's
  ``--prefetch-experts`` does (its pull request 2101): when a layer routes, a pool of reader threads
  (:class:`Readers`; as many as the hardware's threads, at most 8) ``pread``s its routed experts in
  2 MiB pieces into the page cache, ahead of anything queued, skipping pieces already resident,
  while the compute goes on without waiting (its faults take what is not read yet); in a prefill the whole
  expert tensors of the next 3 MoE layers stream behind them, and the pieces so read are marked cold
  (``MADV_COLD``: the first the kernel takes back) once their layer is computed (``ffn_moe_out``).
  No eviction of its own. The closest mechanism a user can get elsewhere, for the same-run A/B;
* ``nommap``: the weights are read into anonymous memory at load (no tier; ``Engine(mmap=False)``).

``predict="lookahead"`` (``managed`` only): when a layer's ``ffn_inp`` is computed in a decode step,
the pool loads the next MoE layer's experts the router lookahead predicts (``ExpertCache.prefetch``:
unused prefetched experts are evicted first), so their reads overlap this layer's compute; its
loads count in ``predicted_loads`` (docs/llama.md: it loses, each wrong prediction a whole read).

``readers`` (``managed``, ``prefetch``) hands loaded slices to threads that populate their pages
(``managed``) or read them into the page cache (``prefetch``).
A prefill under ``managed`` reads each routed expert once, at its layer's routing (a 512-token
prefill at a 25% wall read 1.00x the routed experts' bytes; docs/llama.md).

Advice never changes what is computed: all modes give the same tokens (tested).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading

import numpy as np

from ..errors import ConfigError
from .capture import layer_of
from ..formats.gguf import Geometry
from ..wall.procfs import MAPS_CAP, OpenProcFile, file_mappings
from .ggml import read_2d, read_ids
from .managed import DROPS, EDGE_DROPS, HINT_BYTES, HINTS, HITS, LOADS, MISSES, SUPPORTED, LRUPool, PageSteps, pool_step

MODES = ("mmap", "random", "advise", "pin", "managed", "lookahead", "nocache", "prefetch", "nommap")
MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED, MADV_COLD = 1, 3, 4, 20
PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mlock2 = getattr(_libc, "mlock2", None)  # glibc 2.27+
if _mlock2 is not None:
    _mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MLOCK_ONFAULT = 1


def _file_maps(path: str, maps: OpenProcFile):
    """``(start, end, file offset)`` of this process's mappings of ``path`` (``maps``: its
    /proc/self/maps, opened before the engine loaded: :class:`~expertcache.wall.procfs.OpenProcFile`)."""
    text, why = maps.read()
    if text is None:
        raise ConfigError(f"cannot find llama.cpp's mapping of {path}: {why}")
    return file_mappings(text, path)


def mapping_base(path: str, maps: OpenProcFile) -> int | None:
    """The address where this process maps byte 0 of ``path`` (llama.cpp's mapping), or None."""
    for lo, _, off in _file_maps(path, maps):
        return lo - off
    return None


def mapped_ranges(path: str, maps: OpenProcFile) -> list[tuple[int, int]]:
    """``(file offset, length)`` of every part of ``path`` this process maps (llama.cpp unmaps the
    fragments no tensor uses, so its mapping may have holes)."""
    return [(off, hi - lo) for lo, hi, off in _file_maps(path, maps)]


def managed_item_bytes(g: Geometry) -> np.ndarray:
    """What one expert of the ``managed`` pool may hold in the page cache, per pool item (item
    ``j * E + e`` is expert ``e`` of the j-th MoE layer): the whole pages covering its slices of the
    layer's expert tensors (a slice not on page boundaries touches a partial page at an end, which it
    shares with its neighbour: counted in both). Layers differ where their tensor types do."""
    E = g.num_experts
    out = np.zeros(len(g.moe_layers) * E, dtype=np.int64)
    for j, layer in enumerate(g.moe_layers):
        for t in g.experts[layer].values():
            n = t.nbytes // E
            lo = t.offset + np.arange(E, dtype=np.int64) * n
            out[j * E:(j + 1) * E] += ((lo + n + PAGE - 1) // PAGE - lo // PAGE) * PAGE
    return out


def managed_budget(g: Geometry, wall_bytes: int | None) -> int:
    """Bytes the ``managed`` pool's experts may take beside the dense part inside ``wall_bytes``
    (the wall, or ``--cache-memory``): the wall less the dense part; every expert of the file
    without a wall. A page two slices share is kept only while one of its owners is resident
    (:class:`EdgePages`), so the resident pages are at most the residents'
    :func:`managed_item_bytes`. May be below one layer's routed set (the caller refuses it).

    No expert of slack is set aside any more: it had no measured reason, and it was what kept
    Qwen3 Q4_K_M at a 25% wall reading 1.12x the LRU demand (1.06x without it, 0 major faults, every
    proof held beside the load harness: docs/llama.md). A victim whose pages are still in flight
    when dropped stays until the next layer drops it again; the wall's margin above the capacity
    holds that."""
    items = managed_item_bytes(g)
    if wall_bytes is None:
        return int(items.sum())
    return int(max(0, min(int(items.sum()), wall_bytes - g.dense_bytes)))


DENSE = -1
"""An owner of a page that is not a pool item: a dense tensor (locked; never dropped)."""


class EdgePages:
    """The partial pages of the ``managed`` pool's slices: a slice whose ends are not on page
    boundaries shares its end pages with whatever lies beside it (the neighbouring expert's slice,
    another tensor). :func:`drop` keeps such a page; :meth:`droppable` says which of a victim's may
    go now: those whose every other owner is a pool item not resident (no dense tensor). Without
    them a drop left the pages behind: on a Q4_K_M file (slices 32-byte aligned) they grew to every
    boundary page of the file, 19 MB a 393 MB wall had to set aside (8% of its pool)."""

    def __init__(self, g: Geometry):
        E = g.num_experts
        spans = []  # (start, end, owner)
        for j, layer in enumerate(g.moe_layers):
            for t in g.experts[layer].values():
                n = t.nbytes // E
                spans += [(t.offset + e * n, t.offset + (e + 1) * n, j * E + e) for e in range(E)]
        spans += [(t.offset, t.offset + t.nbytes, DENSE) for t in g.dense_tensors if t.nbytes]
        spans.sort()
        starts = [a for a, _, _ in spans]

        def owners(page: int, me: int) -> tuple[int, ...]:
            """Owners of the spans overlapping ``[page, page + PAGE)`` but ``me`` (the spans are
            disjoint, so sorted by start they are sorted by end too)."""
            found, i = set(), bisect.bisect_left(starts, page + PAGE)
            while i > 0 and spans[i - 1][1] > page:
                found.add(spans[i - 1][2])
                i -= 1
            return tuple(sorted(found - {me}))

        self.edges: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        for a, b, who in spans:
            if who == DENSE:
                continue
            pages = {a // PAGE * PAGE} if a % PAGE else set()
            if b % PAGE:
                pages.add(b // PAGE * PAGE)
            if pages:
                self.edges.setdefault(who, []).extend((p, owners(p, who)) for p in sorted(pages))

    def droppable(self, item: int, resident) -> list[int]:
        """File offsets of ``item``'s partial pages no resident item and no dense tensor shares
        (``resident(items)``: a boolean per item)."""
        out = []
        for page, others in self.edges.get(item, ()):
            if DENSE in others:
                continue
            if not others or not resident(others).any():
                out.append(page)
        return out


def managed_capacity(g: Geometry, wall_bytes: int | None) -> int:
    """Experts of the largest size that :func:`managed_budget` holds (the pool holds at least this
    many; exactly this many where every layer's experts have one size)."""
    return managed_budget(g, wall_bytes) // int(managed_item_bytes(g).max())


def hint_piece(path: str) -> int:
    """Bytes one ``POSIX_FADV_WILLNEED`` call reads at most: the larger of the device's readahead
    (``read_ahead_kb``) and its largest request (``max_sectors_kb``), as the kernel's
    ``force_page_cache_ra`` caps it (a 3 MB hint on a device of 128 KB readahead and 512 KB requests
    would read its first 512 KB)."""
    from ..tier.readers import queue_value, readahead_bytes

    sectors = queue_value(path, "max_sectors_kb")
    return max(readahead_bytes(path), (sectors or 0) * 1024)


def hint_range(fd: int, off: int, n: int, piece: int) -> None:
    """``POSIX_FADV_WILLNEED`` of file bytes ``[off, off + n)`` in pieces of ``piece`` bytes, which the
    kernel reads whole (:func:`hint_piece`)."""
    for lo in range(off, off + n, piece):
        os.posix_fadvise(fd, lo, min(piece, off + n - lo), os.POSIX_FADV_WILLNEED)


def drop_file(fd: int, base: int | None, ranges) -> None:
    """Every page of the file behind ``fd`` out of the page cache: this process's mapping of it
    (``ranges``: ``(file offset, length)`` mapped at ``base``, :func:`mapped_ranges`) unmapped with
    ``MADV_DONTNEED``, then the whole file's clean pages dropped (``POSIX_FADV_DONTNEED``)."""
    if base is not None:
        for off, n in ranges:
            madvise(base + off, n, MADV_DONTNEED)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # 0, 0: the whole file


def drop(fd: int, base: int, off: int, n: int) -> None:
    """Evict the whole pages inside file bytes ``[off, off + n)``: unmap them from this process
    (MADV_DONTNEED on the mapping), then drop the clean pages (POSIX_FADV_DONTNEED). A page the
    range shares with a neighbour stays (the neighbour may be in use, or locked)."""
    lo = (off + PAGE - 1) & ~(PAGE - 1)
    hi = (off + n) & ~(PAGE - 1)
    if hi > lo:
        madvise(base + lo, hi - lo, MADV_DONTNEED)
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)


def _pages(addr: int, length: int) -> tuple[int, int]:
    """``(lo, hi)``: the whole pages covering ``[addr, addr + length)``."""
    return addr & ~(PAGE - 1), (addr + length + PAGE - 1) & ~(PAGE - 1)


def resident(addr: int, length: int) -> bool:
    """Whether every page of the mapped range ``[addr, addr + length)`` is in memory (``mincore``)."""
    lo, hi = _pages(addr, length)
    vec = (ctypes.c_ubyte * ((hi - lo) // PAGE))()
    if _libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        raise ConfigError(f"mincore failed: {os.strerror(ctypes.get_errno())}")
    return all(b & 1 for b in vec)


def madvise(addr: int, length: int, advice: int) -> None:
    lo, hi = _pages(addr, length)
    if _libc.madvise(lo, hi - lo, advice) != 0:
        raise ConfigError(f"madvise({advice}) failed: {os.strerror(ctypes.get_errno())}")


def mlock(addr: int, length: int, mode: str = "pin") -> None:
    """Lock the mapped range ``[addr, addr + length)`` in memory, its pages read in by this thread's
    own faults: the range is locked on fault (``mlock2(MLOCK_ONFAULT)``), then one byte of each page
    is read. Not a plain ``mlock``: that populates the range inside the system call, where a memory
    cgroup at its limit fails the charge (EAGAIN) instead of waiting; a fault waits for the following
    wall to raise its limit (the wall disables the v1 OOM killer: docs/robustness.md). Seen: a
    following 3.2 MB wall, its worker's own memory just grown by the load, beside two CPU-bound
    processes (the limit follows a sample late): ``mlock`` of the 0.5 MB dense part failed 3 runs
    in 4. Without ``mlock2`` (glibc < 2.27), a plain ``mlock``."""
    import errno

    from ..wall.cgroupfs import retry_at_limit

    lo, hi = _pages(addr, length)

    def lock() -> None:
        rc = _mlock2(lo, hi - lo, MLOCK_ONFAULT) if _mlock2 is not None else _libc.mlock(lo, hi - lo)
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    try:  # the split mapping's kernel memory, charged at a v1 limit, fails instead of waiting (seen:
        # a served DeepSeek at a 3.2 MB wall, in a quiet fresh-clone suite)
        retry_at_limit(lock, MLOCK_RETRY_S, (errno.ENOMEM, errno.EAGAIN))
    except OSError as exc:
        raise ConfigError(f"--mode {mode}: mlock of {hi - lo} bytes failed: {exc.strerror} "
                          "(RLIMIT_MEMLOCK: ulimit -l, or CAP_IPC_LOCK)") from None
    if _mlock2 is not None:
        pages = np.frombuffer((ctypes.c_char * (hi - lo)).from_address(lo), dtype=np.uint8)
        int(pages[::PAGE].sum())  # each page faulted in and locked (a user fault waits for memory)


MLOCK_RETRY_S = 2.0
"""How long :func:`mlock` tries again a lock refused for memory (ENOMEM, EAGAIN) before it fails."""
MADV_POPULATE_READ = 22
"""Linux 5.14+: fault the range's pages in (reading them where needed) and map them, in the caller."""
DEFAULT_READERS = {"prefetch": min(8, os.cpu_count() or 1)}
"""Reader threads per mode unless given (``--readers``): ``prefetch`` takes ik_llama.cpp's default
(``GGML_MOE_PREFETCH_THREADS``: the hardware's threads, at most 8); ``managed`` takes none by default
(measured: no faster with them on this machine, docs/llama.md)."""
SEQUENTIAL = 2
"""llama.cpp opens the GGUF with ``POSIX_FADV_SEQUENTIAL``, which sets the file's readahead to twice
the device's: a fault through its mapping reads a window of that size around it (the forecast's
windows, ``roofline.faulted_bandwidth``'s spill)."""
PREFETCH_CHUNK = 2 << 20
"""``prefetch``'s request: ik_llama.cpp's ``GGML_MOE_PREFETCH_CHUNK`` (2 MiB), skipped when resident."""
PREFETCH_AHEAD = 3
"""``prefetch`` in a prefill: MoE layers whose whole expert tensors stream ahead of the one computing
(ik_llama.cpp's ``GGML_MOE_PREFETCH_AHEAD``)."""


READER_MODES = ("managed", "prefetch")
"""The modes with expert readers (``--readers``)."""


def mode_options(modes, policy: str | None, readers: int | None) -> str:
    """The eviction rule of ``managed`` (``policy``, default ``lru``), after a one-line refusal of a
    ``--policy`` or ``--readers`` that none of ``modes`` uses: both had been ignored without a word
    (``--mode advise --readers 8`` ran with none, ``--mode pin --policy lfu`` with no rule)."""
    shown = ", ".join(modes)
    if policy is not None and "managed" not in modes:
        raise ConfigError(f"--policy {policy}: it decides the managed mode's expert residency; --mode {shown} "
                          "leaves residency to the kernel")
    if readers is not None and not set(modes) & set(READER_MODES):
        raise ConfigError(f"--readers {readers}: --mode {shown} has no expert readers "
                          f"({' and '.join(READER_MODES)} have)")
    return "lru" if policy is None else policy


def readers_for(mode: str, readers: int | None) -> int:
    return DEFAULT_READERS.get(mode, 0) if readers is None else int(readers)


CHUNK = 256 << 10
"""A reader's request: a loaded slice is populated in pieces of this many bytes, in parallel."""


class Readers:
    """Threads that map the pages of experts being loaded before the compute thread touches them.

    ``managed``: the compute thread hints a loaded slice (``POSIX_FADV_WILLNEED``: its read is
    submitted at once, asynchronously, in large requests) and hands its pieces (:data:`CHUNK`) to
    the readers (:meth:`submit`), which ``madvise(MADV_POPULATE_READ)`` them: each waits for its
    pages to arrive and maps them, so the compute thread's matmul finds them mapped instead of
    faulting page by page (``MADV_RANDOM`` turns fault-around off), and the device has several
    requests in flight. Each item's pieces are counted so that a victim is dropped only once its own
    population has finished (:meth:`settle`): a populate racing a drop would bring its pages back.

    ``prefetch`` (:meth:`warm`), as ik_llama.cpp's pool does: pieces of :data:`PREFETCH_CHUNK`
    ``pread`` from ``path`` into each thread's own buffer, through a descriptor opened
    ``POSIX_FADV_SEQUENTIAL`` as llama.cpp opens the file its pool reads (the page cache reads
    around and ahead of each, as for any read of the file), a piece whose pages are all resident (``mincore``) skipped,
    the routed experts' pieces put ahead of the queue (``urgent``) and a prefill's lookahead behind
    it; the pieces a ``track`` job read (not resident before) are kept under its key, for
    :meth:`take_read` to mark cold after use."""

    def __init__(self, n: int, path: str | None = None):
        import collections

        self.jobs: collections.deque = collections.deque()
        self.pending: dict[int, int] = {}
        mutex = threading.Lock()
        self.lock = threading.Condition(mutex)  # a piece done (settle waits on it)
        self.work = threading.Condition(mutex)  # a piece queued, or closing
        self.read: dict[object, list[tuple[int, int]]] = {}
        self.populated = self.errors = self.skipped = 0
        self.closing = False
        self.fd = None
        if path is not None:
            self.fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def submit(self, item: int, addr: int, length: int) -> None:
        """Populate ``[addr, addr + length)`` for ``item``, in pieces."""
        pieces = [(item, addr + off, min(CHUNK, length - off), None, None) for off in range(0, length, CHUNK)]
        with self.lock:
            self.pending[item] = self.pending.get(item, 0) + len(pieces)
            self.jobs.extend(pieces)
            self.work.notify_all()

    def warm(self, base: int, ranges, urgent: bool, track=None) -> None:
        """Read the file's ``(offset, length)`` ``ranges`` (mapped at ``base``) in
        :data:`PREFETCH_CHUNK` pieces, each skipped when resident; ``urgent`` ahead of every queued
        piece (in order), else behind; ``track``: a key the pieces read are kept under
        (:meth:`take_read`, as mapped ``(address, length)``)."""
        pieces = [(None, base + o + off, min(PREFETCH_CHUNK, n - off), o + off, track)
                  for o, n in ranges for off in range(0, n, PREFETCH_CHUNK)]
        with self.lock:
            if urgent:
                self.jobs.extendleft(reversed(pieces))
            else:
                self.jobs.extend(pieces)
            self.work.notify_all()

    def take_read(self, key) -> list[tuple[int, int]]:
        """The pieces read so far under ``key`` (forgotten here)."""
        with self.lock:
            return self.read.pop(key, [])

    def take_all(self) -> None:
        """Forget every piece read under any key."""
        with self.lock:
            self.read.clear()

    def _run(self) -> None:
        buf = memoryview(bytearray(PREFETCH_CHUNK)) if self.fd is not None else None
        while True:
            with self.lock:
                while not self.jobs and not self.closing:
                    self.work.wait()
                if not self.jobs:  # closing, and every queued piece done
                    return
                item, addr, n, off, track = self.jobs.popleft()
            if off is None:  # managed: populate the mapping
                lo, hi = _pages(addr, n)
                failed = _libc.madvise(lo, hi - lo, MADV_POPULATE_READ) != 0
            else:  # prefetch: read through the page cache (a short read leaves the rest to faults)
                try:
                    if resident(addr, n):
                        with self.lock:
                            self.skipped += 1
                        continue
                    failed = os.preadv(self.fd, [buf[:n]], off) <= 0
                except (OSError, ConfigError):  # the mapping gone (an engine closed before its
                    failed = True  # advisor, with pieces still queued): nothing left to warm
            with self.lock:
                self.errors += failed
                self.populated += n
                if track is not None and not failed:
                    self.read.setdefault(track, []).append((addr, n))
                if item is not None:
                    self.pending[item] -= 1
                    if not self.pending[item]:
                        del self.pending[item]
                        self.lock.notify_all()

    def settle(self, item: int) -> None:
        """Wait until no piece of ``item`` is being populated."""
        with self.lock:
            while item in self.pending:
                self.lock.wait()

    def close(self) -> None:
        with self.lock:
            self.closing = True
            self.work.notify_all()
        for t in self.threads:
            t.join(timeout=5)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class PageAdvisor:
    """The engine observer of one mode (see the module docstring); ``stats()`` its counters."""

    _TOPK, _INP, _OUT = (b"ffn_moe_topk-",), (b"ffn_inp-",), (b"ffn_moe_out-",)

    def __init__(self, geometry: Geometry, mode: str, *, capacity: int | None = None, policy: str = "lru",
                 count_hits: bool = False, readers: int = 0, predict: str | None = None,
                 compiled: bool = True, record: bool = False):
        """``capacity``: the ``managed`` pool in bytes (:func:`managed_budget`; default every expert).
        ``count_hits``: count ``expert_hits`` / ``expert_misses`` of the modes that observe the routing
        (``managed``: its cache's step; the others: whether every page of a routed expert was
        resident, by ``mincore``, when its layer routed). ``compiled``: ``managed`` with ``lru``, no
        readers and no prediction takes each one-row step in compiled code
        (:mod:`expertcache.llama.managed`; False: the Python path, for the A/B). ``record``: keep
        each forward's routed experts per MoE layer (:attr:`routing`; modes that observe the
        routing), so that no second observer reads them again."""
        if mode not in MODES:
            raise ConfigError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
        self.g, self.mode = geometry, mode
        self.moving = threading.Lock()
        """Held while the compiled step's counters move into the advisor's (:meth:`sync_counters`) and
        while :meth:`hit_counts` reads both, so that a reader on another thread counts each step once."""
        self.cache = None
        self.steps = None
        self.managed_loads = self.managed_drops = 0
        self.fd = os.open(geometry.path, os.O_RDONLY)
        self.hint_piece = hint_piece(geometry.path)
        if mode == "managed":
            items = managed_item_bytes(geometry)
            budget = int(capacity if capacity is not None else items.sum())
            self.edges = EdgePages(geometry)
            if compiled and SUPPORTED and policy == "lru" and readers == 0 and predict is None:
                self.cache = LRUPool(budget, items)
                self.steps = PageSteps(geometry, self.cache, self.fd, self.hint_piece, self.edges)
            else:
                from ..cache import SizedCache

                self.cache = SizedCache(budget, policy, items, steps_per_token=len(geometry.moe_layers))
            self.row = {layer: j for j, layer in enumerate(geometry.moe_layers)}
            self.pool_step = pool_step(self.cache.capacity_bytes, self.cache.item_bytes)
            """Experts one cache step may take: a prefill layer routing more takes one step per pool-full."""
        self.edge_drops = 0
        self.hinted_now: set[int] = set()  # managed items hinted within the current forward
        self.pending_drops: set[int] = set()  # victims among them, to be dropped again
        # before the engine loads: inside a wall the engine fills, a later open may fail (ENOMEM)
        self.maps = OpenProcFile("/proc/self/maps", MAPS_CAP) if mode != "nommap" else None
        self.base: int | None = None
        self.record = record
        self.routing: list[dict[int, np.ndarray]] = []
        """With ``record``: per forward, each MoE layer's routed experts (distinct, ascending)."""
        self.hints = self.hint_bytes = self.drops = self.locked_bytes = 0
        self.predicted: dict[int, set] = {}
        self.look_hits = self.look_total = 0
        self.predicted_loads = 0
        self.next_layer = dict(zip(geometry.moe_layers, geometry.moe_layers[1:]))
        if predict not in (None, "lookahead") or (predict and mode != "managed"):
            raise ConfigError(f"--predict: {predict!r} (lookahead, for the managed mode)")
        self.predict_next = predict == "lookahead"
        self.routers = self._routers() if mode == "lookahead" or self.predict_next else {}

        self.n_tokens = 0
        self.count_hits = count_hits
        self.expert_hits = self.expert_misses = 0
        self.readers = Readers(readers, geometry.path if mode == "prefetch" else None) \
            if readers > 0 and mode in ("managed", "prefetch") else None

        self.ahead: set[int] = set()  # prefetch: the MoE layers this prefill forward streams ahead
        self.prefixes = (self._TOPK if self.observes_routing else ()) + \
            (self._INP if mode == "lookahead" or self.predict_next else ()) + \
            (self._OUT if mode in ("nocache", "prefetch") else ())

    def start(self) -> None:
        """After the engine has loaded: find the mapping and apply MADV_RANDOM where the mode asks."""
        if self.mode == "nommap":
            return
        self.base = mapping_base(self.g.path, self.maps)
        if self.base is None:
            raise ConfigError(f"{self.g.path}: llama.cpp has not mapped the file (mode {self.mode} needs the mapping)")
        if self.mode not in ("mmap", "prefetch"):  # prefetch: llama.cpp's mapping as it is, as in ik_llama.cpp
            for layer in self.g.moe_layers:
                for off, n in self.g.layer_span(layer):
                    madvise(self.base + off, n, MADV_RANDOM)
        if self.mode in ("managed", "nocache"):
            try:  # a freshly written file's dirty pages cannot be dropped until they are written back
                os.fsync(self.fd)
            except OSError:
                pass  # a read-only filesystem has nothing dirty
        if self.steps is not None:
            self.steps.base = self.base
        if self.mode == "managed":
            self._start_empty()
        if self.mode in ("pin", "managed"):
            for t in self.g.dense_tensors:
                if t.nbytes:
                    mlock(self.base + t.offset, t.nbytes, self.mode)
                    self.locked_bytes += t.nbytes

    def _start_empty(self) -> None:
        """The load left the file in the page cache (llama.cpp maps it with MAP_POPULATE), in large
        folios that span neighbouring experts and tensors; the kernel drops a folio only whole, so
        dropping one expert's range left a quarter of its pages (70 MB beside a 790 MB pool, outside
        its account: the tier then sat at the wall and every load reclaimed). So every page of the
        file is dropped (the pool starts empty; a layer the graph never runs, such as DeepSeek's MTP
        layer, is never read again) and the dense part read back as single pages (hints read single
        pages; ``MADV_RANDOM`` keeps a fault from reading around), to be locked: from here every page
        of the tier is one the pool or the dense part accounts for, and an expert drops whole."""
        ranges = mapped_ranges(self.g.path, self.maps)
        for off, n in ranges:
            madvise(self.base + off, n, MADV_RANDOM)
        drop_file(self.fd, self.base, ranges)
        for t in self.g.dense_tensors:
            if t.nbytes:
                self.hint(t.offset, t.nbytes)

    def restart(self) -> None:
        """Empty the ``managed`` pool after a warm-up forward and forget what the warm-up counted:
        every resident expert's pages dropped (its partial pages too, once nothing resident or dense
        shares them), the cache's state and every counter reset. The dense part stays locked. A
        no-op for the other modes' state but their counters."""
        if self.cache is not None:
            resident = self.cache.resident.tolist()
            self.cache.reset()  # first: then no page two of them share is kept for the other
            if self.base is not None:
                for item in resident:
                    self._drop_expert(item)
        self.managed_loads = self.managed_drops = self.edge_drops = self.predicted_loads = 0
        self.hints = self.hint_bytes = self.drops = 0
        self.expert_hits = self.expert_misses = self.look_hits = self.look_total = 0
        self.predicted.clear()
        self.ahead.clear()
        self._redrop()
        self.hinted_now.clear()
        if self.steps is not None:
            self.steps.reset()
        self.routing.clear()

    def hint(self, off: int, n: int) -> None:
        """``POSIX_FADV_WILLNEED`` of file bytes ``[off, off + n)`` in pieces the kernel reads whole (it
        reads at most the larger of the device's readahead and its largest request per call)."""
        hint_range(self.fd, off, n, self.hint_piece)

    def _routers(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per MoE layer: (ffn_norm weight [H], router [E, H]) as float32, read from the file."""
        out = {}
        for layer in self.g.moe_layers:
            norm = self.g.tensors.get(f"blk.{layer}.ffn_norm.weight")
            gate = self.g.tensors.get(f"blk.{layer}.ffn_gate_inp.weight")
            if norm is None or gate is None or norm.type_name != "f32" or gate.type_name not in ("f32", "f16"):
                raise ConfigError(f"{self.g.path}: lookahead needs f32 ffn_norm and f32/f16 ffn_gate_inp of layer {layer}")
            w = np.fromfile(self.g.path, dtype=np.float32 if gate.type_name == "f32" else np.float16,
                            count=gate.shape[0] * gate.shape[1], offset=gate.offset)
            n = np.fromfile(self.g.path, dtype=np.float32, count=norm.shape[0], offset=norm.offset)
            out[layer] = (n, w.reshape(gate.shape[1], gate.shape[0]).astype(np.float32))
        return out

    # -- observer --------------------------------------------------------------------------
    def begin(self, n_tokens: int, starts_sequence: bool, all_logits: bool) -> None:
        self.n_tokens = n_tokens
        if self.mode == "prefetch" and self.readers is not None and self.base is not None:
            self.ahead.clear()
            self.readers.take_all()  # a last forward's reads not yet marked: not this one's to mark
            if n_tokens > 1:
                self._stream_ahead(self.g.moe_layers[:PREFETCH_AHEAD])
        self.sync_counters()
        self._redrop()
        self.hinted_now.clear()
        if self.steps is not None:
            self.steps.begin()
        if self.record:
            self.routing.append({})

    def sync_counters(self) -> None:
        """Move the compiled step's counters into the advisor's. Called on the thread that runs the
        forwards (each forward's :meth:`begin`, :meth:`stats`): the Python step adds to the same
        counters there. A reader on another thread (a server's ``/metrics``) calls
        :meth:`hit_counts`, which moves nothing: two threads moving had counted some steps twice,
        and a step counted between a move's read and its reset was lost."""
        if self.steps is not None and self.steps.cnt.any():
            with self.moving:
                moved = self.steps.cnt.copy()
                c = moved.tolist()
                self.managed_loads += c[LOADS]
                self.expert_hits += c[HITS]
                self.expert_misses += c[MISSES]
                self.managed_drops += c[DROPS]
                self.edge_drops += c[EDGE_DROPS]
                self.hints += c[HINTS]
                self.hint_bytes += c[HINT_BYTES]
                self.steps.cnt -= moved  # not zeroed: what a step counted meanwhile stays to be moved

    def hit_counts(self) -> tuple[int | None, int | None]:
        """``(expert_hits, expert_misses)`` so far, from any thread: the advisor's counters plus what
        the compiled step has counted since they last moved, read together under :attr:`moving`;
        ``(None, None)`` where they are not counted (:attr:`counts_hits`). Each never decreases."""
        if not self.counts_hits:
            return None, None
        with self.moving:
            pending = self.steps.cnt.tolist() if self.steps is not None else None
            hits, misses = self.expert_hits, self.expert_misses
        if pending is not None:
            hits, misses = hits + pending[HITS], misses + pending[MISSES]
        return hits, misses

    def _redrop(self) -> None:
        """Drop again the victims whose pages may have been in flight when they were dropped (loaded
        within this forward, then evicted: an unused lookahead guess, a prefill's pool-full step):
        ``POSIX_FADV_DONTNEED`` skips a page still being read, which then stayed in the page cache
        outside the pool's account (0.6 MB past a 2.3 MB pool with ``--predict lookahead``)."""
        if self.steps is not None:
            self.pending_drops.update(self.steps.take_pending())
        if self.pending_drops and self.base is not None:
            for item in self.pending_drops:
                if not self._resident([item])[0]:
                    self.edge_drops += self._drop_expert(item)
        self.pending_drops.clear()

    def wants(self, name: bytes) -> bool:
        if self.observes_routing and layer_of(name, self._TOPK) is not None:
            return True
        if (self.mode == "lookahead" or self.predict_next) and layer_of(name, self._INP) is not None:
            return True
        # prefetch: only a prefill's lookahead marks what it read cold after use (ik_llama.cpp's
        # GGML_MOE_PREFETCH_AHEAD); a decode step's routed experts stay as they are
        return (self.mode == "nocache" or (self.mode == "prefetch" and self.n_tokens > 1 and self.readers is not None)) \
            and layer_of(name, self._OUT) is not None

    def seen(self, name: bytes, ptr: int) -> None:
        layer = layer_of(name, self._TOPK)
        if layer is not None:
            if self.steps is not None and self.base is not None:
                routed = self.steps.layer(ptr, self.row[layer])
                if routed is not None:  # one row: the whole step taken in compiled code
                    if self.record:
                        self._record(layer, routed.copy())
                    return
            routed = read_ids(ptr)
            if self.record:
                self._record(layer, routed)
            if layer in self.predicted:
                self.look_hits += len(self.predicted.pop(layer) & set(routed.tolist()))
                self.look_total += routed.size
            if self.cache is not None:
                self.manage(layer, routed)
                return
            if self.count_hits and self.base is not None:  # resident when its layer routed (prefetch's too)
                hit = sum(all(resident(self.base + off, n) for off, n in self.g.expert_ranges(layer, int(e)))
                          for e in routed.tolist())
                self.expert_hits += hit
                self.expert_misses += routed.size - hit
            if self.mode == "prefetch":
                self.warm(layer, routed)
            else:
                self.willneed(layer, routed)
            return
        layer = layer_of(name, self._INP)
        if layer is not None:
            nxt = self.next_layer.get(layer)
            if nxt is not None and self.n_tokens == 1:
                guess = self.predict(nxt, read_2d(ptr, np.float32)[-1])
                self.predicted[nxt] = set(guess.tolist())
                if self.cache is not None:  # managed: the pool loads them now, evicted first if unused
                    step = self.cache.prefetch(guess.astype(np.int64) + self.row[nxt] * self.g.num_experts)
                    self.managed_loads += len(step.loads)
                    self.predicted_loads += len(step.loads)
                    self._apply(step)
                else:
                    self.willneed(nxt, guess)
            return
        layer = layer_of(name, self._OUT)
        if layer is not None and self.base is not None and self.mode == "prefetch":
            for addr, n in self.readers.take_read(layer):  # streamed for this layer, now used: the
                madvise(addr, n, MADV_COLD)  # first pages the kernel may take back
        elif layer is not None and self.base is not None:
            for off, n in self.g.layer_span(layer):
                drop(self.fd, self.base, off, n)
            self.drops += 1

    def _record(self, layer: int, routed: np.ndarray) -> None:
        if not self.routing:
            self.routing.append({})
        f = self.routing[-1]
        f[layer] = routed if layer not in f else np.union1d(f[layer], routed)  # a forward of several graphs

    def manage(self, layer: int, routed: np.ndarray) -> None:
        """The ``managed`` step of one layer's routed experts: drop the victims, hint the loads."""
        E, j, c = self.g.num_experts, self.row[layer], self.pool_step
        self._redrop()  # the last layer's computed: what it evicted in flight has landed
        items = routed.astype(np.int64) + j * E
        # a prefill layer may route more experts than the pool holds: one step per pool-full
        for part in (items[i:i + c] for i in range(0, items.size, c)):
            step = self.cache.prepare(part)
            self.managed_loads += step.misses
            self.expert_hits += step.hits
            self.expert_misses += step.misses
            self._apply(step)

    def _apply(self, step) -> None:
        """Carry out a cache step in the page cache: drop its victims (once their population is
        over), hint its loads (and hand them to the readers)."""
        E = self.g.num_experts
        if self.base is not None:
            for item in step.evicted:
                self.edge_drops += self._drop_expert(item)
                if self.steps is not None:  # the hints and the queue of the compiled step
                    if self.steps.hinted_now(item):
                        self.steps.queue(item)
                elif item in self.hinted_now:  # its read may still be under way: dropped again later
                    self.pending_drops.add(item)
        self.managed_drops += len(step.evicted)
        by_layer: dict[int, list[int]] = {}
        for item, _ in step.loads:
            by_layer.setdefault(item // E, []).append(item % E)
        for j, experts in by_layer.items():
            layer = self.g.moe_layers[j]
            if self.steps is not None:
                self.steps.mark_hinted([j * E + e for e in experts])
            else:
                self.hinted_now.update(j * E + e for e in experts)
            owner = {off: e for e in experts for off, _ in self.g.expert_ranges(layer, e)}
            for off, n in self.g.compute_ranges(layer, experts):
                self.hint(off, n)
                self.hints += 1
                self.hint_bytes += n
                if self.readers is not None and self.base is not None:
                    self.readers.submit(j * E + owner[off], self.base + off, n)

    def _drop_expert(self, item: int) -> int:
        """Evict pool item ``item``'s pages (once the readers' population of it is over): the whole
        pages inside its slices, then its partial pages that no resident item and no dense tensor
        shares (the cache's residency is read, so call it once the step has taken ``item`` out).
        Returns how many partial pages went."""
        E = self.g.num_experts
        if self.readers is not None:
            self.readers.settle(item)
        for off, n in self.g.expert_ranges(self.g.moe_layers[item // E], item % E):
            drop(self.fd, self.base, off, n)
        pages = self.edges.droppable(item, self._resident)
        for page in pages:
            drop(self.fd, self.base, page, PAGE)
        return len(pages)

    def _resident(self, items) -> np.ndarray:
        return self.cache.slots_of(np.asarray(items, dtype=np.int64)) >= 0

    def warm(self, layer: int, routed: np.ndarray) -> None:
        """``prefetch``, as ik_llama.cpp's ``--prefetch-experts`` does (its pull request 2101): the
        routed experts' pages read by the readers ahead of every queued piece, those already
        resident skipped, with no wait; in a prefill, also the whole expert tensors of the MoE layer
        :data:`PREFETCH_AHEAD` ahead streamed behind them, whose pieces read are marked cold once
        that layer is computed. Without readers, the routed experts hinted (its fallback)."""
        if self.readers is None or self.base is None:
            self.willneed(layer, routed)
            return
        self.readers.warm(self.base, self.g.compute_ranges(layer, routed.tolist()), urgent=True)
        if self.n_tokens > 1:
            i = self.g.moe_layers.index(layer)
            self._stream_ahead(self.g.moe_layers[i + 1:i + 1 + PREFETCH_AHEAD])

    def _stream_ahead(self, layers) -> None:
        """``prefetch`` in a prefill: queue each of ``layers``' whole expert tensors once a forward."""
        for nxt in layers:
            if nxt not in self.ahead:
                self.ahead.add(nxt)
                self.readers.warm(self.base, self.g.layer_span(nxt), urgent=False, track=nxt)

    def predict(self, layer: int, h: np.ndarray) -> np.ndarray:
        """The router lookahead's top-k for one residual row ``h`` (see the module docstring)."""
        return self.predict_rows(layer, h[None, :])[0]

    def predict_rows(self, layer: int, h: np.ndarray) -> np.ndarray:
        """``[rows, k]``: the router lookahead applied to every row of ``h`` ``[rows, H]``."""
        norm, w = self.routers[layer]
        eps = float(self.g.metadata.get(f"{self.g.architecture}.attention.layer_norm_rms_eps", 1e-6))
        x = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + eps) * norm
        return np.argsort(-(x @ w.T), axis=1, kind="stable")[:, : self.g.top_k]

    def willneed(self, layer: int, experts: np.ndarray) -> None:
        for off, n in self.g.compute_ranges(layer, experts.tolist()):
            self.hint(off, n)
            self.hints += 1
            self.hint_bytes += n

    @property
    def observes_routing(self) -> bool:
        """Whether this mode reads each layer's routing (its hit counters mean something)."""
        return self.mode in ("advise", "pin", "managed", "lookahead", "nocache", "prefetch")

    @property
    def counts_hits(self) -> bool:
        """Whether ``expert_hits`` / ``expert_misses`` are counted: ``managed``'s by its cache's step,
        the other observing modes' only with ``count_hits`` (a ``llama run`` does not pay for the
        ``mincore`` probes); elsewhere they are ``None``, never a 0 that was not counted."""
        return self.observes_routing and (self.cache is not None or self.count_hits)

    def resident_expert_bytes(self) -> int | None:
        """Expert bytes in the page cache now: the ``managed`` pool's residents (their slices), else
        every expert whose pages are all resident (``mincore``); None without the mapping."""
        if self.cache is not None:
            sizes = np.repeat(np.asarray(self.g.layer_expert_bytes, dtype=np.int64), self.g.num_experts)
            return int(sizes[self.cache.resident].sum())
        if self.base is None:
            return None
        return sum(self.g.expert_bytes_of(layer) for layer in self.g.moe_layers for e in range(self.g.num_experts)
                   if all(resident(self.base + off, n) for off, n in self.g.expert_ranges(layer, e)))

    def stats(self) -> dict:
        self.sync_counters()
        return {"hints": self.hints, "hint_bytes": self.hint_bytes, "layer_drops": self.drops,
                "locked_bytes": self.locked_bytes,
                "managed_capacity": self.cache.capacity if self.cache is not None else None,
                "managed_capacity_bytes": self.cache.capacity_bytes if self.cache is not None else None,
                "managed_policy": self.cache.policy.spec if self.cache is not None else None,
                "managed_loads": self.managed_loads, "managed_drops": self.managed_drops,
                "edge_page_drops": self.edge_drops,
                "readers": len(self.readers.threads) if self.readers is not None else 0,
                "populated_bytes": self.readers.populated if self.readers is not None else 0,
                "resident_pieces_skipped": self.readers.skipped if self.readers is not None else 0,
                "expert_hits": self.expert_hits if self.counts_hits else None,
                "expert_misses": self.expert_misses if self.counts_hits else None,
                "lookahead_recall": self.look_hits / self.look_total if self.look_total else None,
                "predicted_loads": self.predicted_loads}

    def close(self) -> None:
        if self.readers is not None:
            self.readers.close()
        if self.maps is not None:
            self.maps.close()
        os.close(self.fd)
