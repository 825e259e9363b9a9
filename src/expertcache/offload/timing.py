"""Wall time of work queued on a device: CUDA events on a GPU, ``perf_counter`` on the CPU.

A :class:`Stopwatch` sums intervals. On CUDA each interval is a pair of events recorded on the
current stream, so it measures when the queued work ran, not when Python enqueued it; the events
are read (one synchronisation) only when :attr:`Stopwatch.seconds` is asked for.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class Stopwatch:
    """Sum of timed intervals on ``device`` (``cuda`` devices use events, others ``perf_counter``)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.clear()

    def clear(self) -> None:
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.intervals = 0

    @contextlib.contextmanager
    def time(self) -> Iterator[None]:
        """Time the work issued inside the block."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0
        self.intervals += 1

    @property
    def seconds(self) -> float:
        """Total seconds of all intervals so far (waits for pending CUDA events)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
            self._events.clear()
        return self._seconds
