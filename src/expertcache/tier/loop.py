"""The replay loop: one pass of a trace against a pool in one mode (docs/tier.md, "Iterations").

Units. A trace row is one router pass; rows of one sequence sharing the ``iteration`` extra form
one engine iteration (without the extra every row is one iteration). A pass visits the rows in
trace order; within a row the layers in order; a layer's experts (an *access group*) are split
into ``threads`` contiguous chunks read in parallel by a bounded thread pool, each chunk into its
own reused destination buffer, and the next layer starts when the whole group is read. The wall
time of an iteration runs from the start of its first group to the end of its last.

Invariants: every non-padding id is one access and one real read of ``entry.size`` bytes;
``bytes_read == bytes_from_arena + bytes_from_files``; with ``verify`` every read's bytes are
hashed and compared with the manifest (``verify_mismatches`` counts differences).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .pool import checksum
from .readers import aligned_buffer


def iteration_starts(seq: np.ndarray, iteration: np.ndarray | None) -> np.ndarray:
    """Row offsets ``[I + 1]`` of the iterations: a new one starts where (seq, iteration) changes."""
    T = len(seq)
    if T == 0:
        return np.zeros(1, dtype=np.int64)
    change = np.ones(T, dtype=bool)
    if iteration is not None:
        change[1:] = (seq[1:] != seq[:-1]) | (iteration[1:] != iteration[:-1])
    return np.r_[np.flatnonzero(change), T].astype(np.int64)


@dataclass
class PassResult:
    """Counts and per-iteration wall times (seconds) of one pass."""

    seconds: list = field(default_factory=list)
    accesses: int = 0
    bytes_read: int = 0
    bytes_from_arena: int = 0
    bytes_from_files: int = 0
    verified_reads: int = 0
    verify_mismatches: int = 0
    first_mismatch: str | None = None
    wall_seconds: float = 0.0


class Replayer:
    """Serves passes of ``experts[T, L, k]`` (ids per row and layer index) from ``reader`` and an
    optional ``arena``; ``advisor``/``hints`` post the hints for the next access group."""

    def __init__(self, pool, reader, *, threads: int = 1, arena=None, verify: bool = False, widest: int = 1 << 30):
        self.pool = pool
        self.reader = reader
        self.arena = arena
        self.threads = max(1, int(threads))
        self.verify = verify
        size = reader.buffer_bytes()
        self.threads = min(self.threads, max(1, int(widest)))  # a group never splits into more chunks than ids
        self.buffers = [aligned_buffer(size) for _ in range(self.threads)]
        self.executor = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def close(self) -> None:
        if self.executor:
            self.executor.shutdown(wait=True)
        for b in self.buffers:
            b.close()

    def _serve(self, li: int, chunk, buf, res: PassResult) -> tuple[int, int, int, str | None]:
        arena_b = files_b = bad = 0
        first = None
        for e in chunk:
            key = (li, int(e))
            ent = self.pool.entry(li, int(e))
            if self.arena is not None and key in self.arena.slots:
                arena_b += self.arena.read(key, ent, buf)
            else:
                files_b += self.reader.read(ent, buf)
            if self.verify:
                with memoryview(buf) as view:
                    if checksum(view[: ent.size]) != ent.digest:
                        bad += 1
                        first = first or f"{ent.path} @ {ent.offset}"
        return arena_b, files_b, bad, first

    def run_pass(self, experts: np.ndarray, starts: np.ndarray, *, advisor=None, hints=None) -> PassResult:
        """One pass over every row; ``hints[t, l]`` (ids, -1 pads) is posted to ``advisor`` while
        group (t, l) is read, as the prediction for the next group."""
        res = PassResult()
        T, L, _ = experts.shape
        order = [(t, li) for t in range(T) for li in range(L)]
        t_pass = time.perf_counter()
        for i in range(len(starts) - 1):
            t0 = time.perf_counter()
            for t in range(int(starts[i]), int(starts[i + 1])):
                for li in range(L):
                    if advisor is not None:
                        g = t * L + li + 1
                        if g < len(order):
                            nt, nl = order[g]
                            row = hints[nt, nl]
                            advisor.post([(nl, int(x)) for x in row if x >= 0])
                    self._group(li, experts[t, li], res)
            res.seconds.append(time.perf_counter() - t0)
        end_pass = getattr(self.reader, "end_pass", None)
        if end_pass is not None:
            end_pass()
        res.wall_seconds = time.perf_counter() - t_pass
        return res

    def _group(self, li: int, ids: np.ndarray, res: PassResult) -> None:
        ids = ids[ids >= 0]
        if ids.size == 0:
            return
        n = min(self.threads, ids.size)
        if n == 1 or self.executor is None:
            outs = [self._serve(li, ids, self.buffers[0], res)]
        else:
            chunks = np.array_split(ids, n)
            outs = list(self.executor.map(lambda a: self._serve(li, a[0], a[1], res), zip(chunks, self.buffers)))
        for arena_b, files_b, bad, first in outs:
            res.bytes_from_arena += arena_b
            res.bytes_from_files += files_b
            res.verify_mismatches += bad
            res.first_mismatch = res.first_mismatch or first
        res.accesses += int(ids.size)
        res.bytes_read = res.bytes_from_arena + res.bytes_from_files
        if self.verify:
            res.verified_reads += int(ids.size)
