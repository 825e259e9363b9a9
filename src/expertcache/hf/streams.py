"""Ordering copies into slots against the compute that reads them: a copy stream and two events per slot.

On a CUDA device the copies of a :class:`~expertcache.hf.pool.SlotPool` run on their own
stream, so they can overlap the expert matmuls (and, with prefetching, the next layer's copies
can run while this layer computes). Two events per slot keep that correct:

* ``ready[s]``, recorded on the copy stream after a copy into slot ``s``: the compute stream waits
  on it before the first matmul that reads ``s`` after that copy;
* ``read[s]``, recorded on the compute stream after a matmul that reads slot ``s``: the copy stream
  waits on it before a later copy overwrites ``s``.

Invariants: a matmul never reads a slot whose copy is still in flight, and a copy never overwrites
a slot that a queued matmul has yet to read. The events are re-recorded in place (2C per pool),
so nothing accumulates as decoding goes on. On the CPU there is one stream of work: every method
here is a no-op and copies are ordinary synchronous ``memcpy``.

``delay_cycles`` (tests only) queues a busy-wait kernel before each group of copies on the copy
stream, so a missing wait would make a matmul read a slot before its copy lands.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch


class SlotSync:
    """The copy stream and per-slot events of one pool on ``device`` (no-ops off CUDA)."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.delay_cycles = 0
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready = [torch.cuda.Event() for _ in range(capacity)] if self.cuda else []
        self._read = [torch.cuda.Event() for _ in range(capacity)] if self.cuda else []
        self._was_read = [False] * capacity
        self._pending: set[int] = set()  # slots copied since the compute stream last waited on them

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Run the copies issued inside the block on the copy stream (after the optional delay)."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.copy_stream):
            if self.delay_cycles:
                torch.cuda._sleep(int(self.delay_cycles))
            yield

    def before_overwrite(self, slot: int) -> None:
        """The copy stream waits until every matmul queued so far that reads ``slot`` is done."""
        if self.cuda and self._was_read[slot]:
            self.copy_stream.wait_event(self._read[slot])

    def copied(self, slot: int) -> None:
        """Mark the end of a copy into ``slot`` (call on the copy stream, inside :meth:`copying`)."""
        if self.cuda:
            self._ready[slot].record(self.copy_stream)
            self._pending.add(slot)

    def before_read(self, slots: Iterable[int]) -> None:
        """The compute stream waits for the copies still in flight into any of ``slots``."""
        if not self._pending:
            return
        stream = torch.cuda.current_stream(self.device)
        for s in set(slots) & self._pending:
            stream.wait_event(self._ready[s])
            self._pending.discard(s)

    def after_read(self, slots: Iterable[int]) -> None:
        """Mark the matmuls just queued on the compute stream as readers of ``slots``."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for s in set(slots):
            self._read[s].record(stream)
            self._was_read[s] = True
