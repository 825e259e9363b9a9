"""Wall time of work queued on a device: CUDA events on a GPU, ``perf_counter`` on the CPU.

A :class:`Stopwatch` sums intervals. On CUDA each interval is a pair of events recorded on the
stream that does the work (the given ``stream``, else the current stream of the watch's device),
so it measures when the queued work ran, not when Python enqueued it. Finished intervals are
folded into the sum as each new one starts (``Event.query`` does not block), so at most the
intervals still in flight are held; :attr:`Stopwatch.seconds` waits for those.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class Stopwatch:
    """Sum of timed intervals on ``device`` (``cuda`` devices use events, others ``perf_counter``)."""

    def __init__(self, device: torch.device | str = "cpu", stream=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = stream
        self.clear()

    def clear(self) -> None:
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.intervals = 0

    def _stream(self):
        return self.stream if self.stream is not None else torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def time(self) -> Iterator[None]:
        """Time the work issued inside the block."""
        if self.cuda:
            self._fold(block=False)
            stream = self._stream()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0
        self.intervals += 1

    def _fold(self, block: bool) -> None:
        """Add finished intervals to the sum and release their events (all of them when ``block``)."""
        done = 0
        for start, end in self._events:
            if not block and not end.query():
                break
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0
            done += 1
        del self._events[:done]

    @property
    def in_flight(self) -> int:
        """Intervals recorded but not yet folded into the sum."""
        return len(self._events)

    @property
    def seconds(self) -> float:
        """Total seconds of all intervals so far (waits for pending CUDA events)."""
        self._fold(block=True)
        return self._seconds
