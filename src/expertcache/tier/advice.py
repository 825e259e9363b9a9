"""Router advice: one bounded worker thread with ONE overwritable slot (docs/tier.md, "Advice").

While the harness reads access group g (one layer of one trace row) it posts the hints for group
g + 1 (the next layer, or layer 0 of the next row after the last layer). A post that finds the
slot still unconsumed overwrites it: the older hint is dropped and counted as ``overwritten``.
The worker takes the slot and delivers it:

* ``fadvise``: ``posix_fadvise(WILLNEED)`` on each hinted expert's byte range (advisory: the
  kernel starts readahead, the advisor never waits for the device);
* ``pread``: reads each hinted expert into the worker's own scratch buffer (blocking I/O in the
  advisor).

Counters (read under one lock, so they always add up): ``submitted`` = posts; ``overwritten`` =
posts replaced before the worker took them; ``completed`` = posts the worker finished delivering;
``pending`` = posts in the slot or being delivered when the counters are read. Invariant:
``submitted == overwritten + completed + pending``. ``hinted_experts`` counts expert ranges
delivered; ``skipped_resident`` hints dropped because the expert sits in the locked arena.

Hint sources: ``oracle`` (the trace itself: the hint for group g is exactly what g requests) or
``plan:PATH`` (an npz whose ``experts`` array has the trace's ``[T, L, k]`` shape; -1 pads).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from .._io import numpy_reason
from ..errors import ConfigError

DELIVERIES = ("fadvise", "pread")


def parse_advice(spec: str | None) -> tuple[str | None, str | None]:
    """``'oracle'`` -> ('oracle', None); ``'plan:PATH'`` -> ('plan', PATH); None -> (None, None)."""
    if spec is None:
        return None, None
    if spec == "oracle":
        return "oracle", None
    if spec.startswith("plan:") and len(spec) > 5:
        return "plan", spec[5:]
    raise ConfigError(f"--advice: {spec!r} is not 'oracle' or 'plan:PATH.npz'")


def load_plan(path: str | os.PathLike, shape: tuple[int, int, int], num_experts: int) -> np.ndarray:
    """The ``experts`` array of a plan file, checked against the trace's ids shape and expert range."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--advice plan:{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "experts" not in z.files:
                raise ConfigError(f"--advice plan:{path}: no 'experts' array (found: {', '.join(z.files) or 'none'})")
            arr = z["experts"]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--advice plan:{path}: not a readable npz ({numpy_reason(exc)})") from None
    if arr.dtype.kind not in "iu":
        raise ConfigError(f"--advice plan:{path}: 'experts' must be integers, got {arr.dtype}")
    T, L, _ = shape
    if arr.ndim != 3 or arr.shape[:2] != (T, L):
        raise ConfigError(f"--advice plan:{path}: 'experts' has shape {list(arr.shape)}, the trace's ids have {[T, L, shape[2]]}")
    bad = (arr < -1) | (arr >= num_experts)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise ConfigError(f"--advice plan:{path}: experts[{', '.join(map(str, i))}] = {int(arr[tuple(i)])} is outside [-1, {num_experts})")
    return arr.astype(np.int64)


class Advisor:
    """The one-slot advice worker; ``post(hints)`` never blocks on I/O. See the module docstring."""

    def __init__(self, pool, delivery: str = "fadvise", skip=None):
        if delivery not in DELIVERIES:
            raise ConfigError(f"--delivery: {delivery!r} is not one of {', '.join(DELIVERIES)}")
        self.pool = pool
        self.delivery = delivery
        self.skip = skip or (lambda key: False)
        self._cv = threading.Condition()
        self._slot = None
        self._busy = False
        self._stop = False
        self.submitted = self.overwritten = self.completed = 0
        self.hinted_experts = self.skipped_resident = 0
        self._fds: dict[str, int] = {}
        self._scratch = bytearray(pool.expert_bytes) if delivery == "pread" else None
        self._thread = threading.Thread(target=self._run, name="expertcache-advice", daemon=True)
        self._thread.start()

    def post(self, hints) -> None:
        """Put ``hints`` (a list of (layer index, expert)) in the slot, overwriting an unconsumed one."""
        with self._cv:
            if self._slot is not None:
                self.overwritten += 1
            self._slot = hints
            self.submitted += 1
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._slot is None and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                hints, self._slot, self._busy = self._slot, None, True
            try:
                self._deliver(hints)
            finally:
                with self._cv:
                    self._busy = False
                    self.completed += 1
                    self._cv.notify_all()

    def _deliver(self, hints) -> None:
        for key in hints:
            if self.skip(key):
                self.skipped_resident += 1
                continue
            ent = self.pool.entry(*key)
            fd = self._fds.get(ent.path)
            if fd is None:
                fd = self._fds[ent.path] = os.open(ent.path, os.O_RDONLY)
            if self.delivery == "fadvise":
                os.posix_fadvise(fd, ent.offset, ent.size, os.POSIX_FADV_WILLNEED)
            else:
                os.preadv(fd, [memoryview(self._scratch)[: ent.size]], ent.offset)
            self.hinted_experts += 1

    def counters(self) -> dict:
        """submitted / overwritten / completed / pending (they add up), plus hint counts."""
        with self._cv:
            pending = int(self._slot is not None) + int(self._busy)
            return {"delivery": self.delivery, "submitted": self.submitted, "overwritten": self.overwritten,
                    "completed": self.completed, "pending": pending, "hinted_experts": self.hinted_experts,
                    "skipped_resident": self.skipped_resident}

    def close(self) -> dict:
        """Stop the worker (an unconsumed slot stays counted as pending) and return the final counters."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()
        counters = self.counters()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        return counters
