"""Arrays handed to worker processes through shared memory instead of pickling them.

:class:`SharedArrays` copies named arrays once into POSIX shared-memory blocks (``/dev/shm``) and
gives a small picklable description of them; :func:`attach` maps them in a worker as read-only
numpy views, without a copy, and keeps them mapped for the worker's life (a persistent pool
attaches once). The parent owns the blocks: leaving the ``with`` block unlinks them, and if the
parent is killed outright Python's resource tracker unlinks them when it notices.

Invariants: workers never write into the shared arrays (the views are read-only); a description
names blocks by a name unique to the parent process and the set (``ec_<pid>_<n>_<field>``).
"""

from __future__ import annotations

import itertools
import os
from multiprocessing import shared_memory

import numpy as np

_COUNTER = itertools.count()
_ATTACHED: dict[str, tuple[shared_memory.SharedMemory, np.ndarray]] = {}


class SharedArrays:
    """Named arrays in shared memory for the life of the ``with`` block (see the module docstring)."""

    def __init__(self, **arrays: np.ndarray):
        self._blocks: list[shared_memory.SharedMemory] = []
        self.spec: dict[str, tuple[str, tuple[int, ...], str]] = {}
        tag = f"ec_{os.getpid()}_{next(_COUNTER)}"
        try:
            for field, a in arrays.items():
                a = np.ascontiguousarray(a)
                block = shared_memory.SharedMemory(name=f"{tag}_{field}", create=True, size=max(1, a.nbytes))
                self._blocks.append(block)
                np.ndarray(a.shape, a.dtype, buffer=block.buf)[...] = a
                self.spec[field] = (block.name, a.shape, a.dtype.str)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "SharedArrays":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Unmap and unlink every block (idempotent)."""
        while self._blocks:
            block = self._blocks.pop()
            block.close()
            try:
                block.unlink()
            except FileNotFoundError:
                pass


def attach(spec: dict[str, tuple[str, tuple[int, ...], str]]) -> dict[str, np.ndarray]:
    """Read-only views of the arrays a :class:`SharedArrays` describes (mapped once per process)."""
    out = {}
    for field, (name, shape, dtype) in spec.items():
        if name not in _ATTACHED:
            block = shared_memory.SharedMemory(name=name, create=False)
            view = np.ndarray(shape, np.dtype(dtype), buffer=block.buf)
            view.flags.writeable = False
            _ATTACHED[name] = (block, view)
        out[field] = _ATTACHED[name][1]
    return out
