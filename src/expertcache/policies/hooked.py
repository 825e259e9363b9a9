"""Rules written once, as compiled hooks: the base class of ``arc``, ``s3fifo``, ``sieve``, ``random``.

A hooked rule is a state machine (queues, ghosts, a hand) rather than a key per candidate. Its
file defines the six hooks of :mod:`expertcache.policies.driver` as module-level ``@njit`` functions, a
three-line cached loop that inlines :func:`expertcache.policies.driver.run` with them, and a subclass of
:class:`HookedPolicy` naming both. The same compiled hooks then run

* in the compiled replay (``plan`` -> :class:`~expertcache.policies.driver.HookPlan`), and
* in :class:`~expertcache.cache.ExpertCache` (the live harness, the tier, ``engine="python"``),
  which calls them one at a time through :meth:`hook_hit` ... :meth:`hook_admit`;

so the rule exists once, and the two drivers are checked against each other and against
libCacheSim (``tests/test_rule_conformance.py``).

Recipe for a new rule (the whole change is its own file: ``policies/__init__`` imports every module
of the package, so ``@register`` makes it known):

1. choose its state: ``ROWS`` int64 rows per item (rows 0-2 are the engine's linked-list
   prev/next/list, :mod:`expertcache.policies.driver`), int64 scalars (list heads at ``3q``, ``3q+1``,
   ``3q+2``, then parameters) and float64 scalars;
2. write ``init``, ``hit``, ``miss``, ``victim``, ``evict``, ``admit`` with ``@njit(cache=True,
   inline="always")`` (inlined into the engine's loop; ``ExpertCache`` calls them all the same);
   ``victim`` must skip items with ``stamp[v] == g`` (the current group's), and should read
   scalars it loops over into locals first (numba cannot hoist ``sc[i]`` out of a loop: hoisting
   the seed and inlining made ``random`` 1.3x faster);
3. ``@njit(cache=True) def loop(groups, starts, n_items, capacity, rows, sc0, fs0): return
   driver.run(groups, starts, n_items, capacity, rows, sc0, fs0, init, hit, miss, victim, evict, admit)``;
4. ``@register class MyRule(HookedPolicy)`` with ``name``, ``hooks = (init, hit, miss, victim,
   evict, admit)``, ``loop = staticmethod(loop)``, ``rows``, ``n_int`` and, for parameters,
   :meth:`params`, ``takes_parameter = True``, an ``__init__`` that checks its parameter and a
   ``spec`` (as :mod:`.randomized` does).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .driver import HookPlan
from ..errors import PolicyError
from .base import Policy


class HookedPolicy(Policy):
    """A rule driven by engine hooks; see the module docstring."""

    hooked = True
    rows: ClassVar[int] = 3
    n_int: ClassVar[int] = 3
    """int64 scalars the rule's state holds (3 per linked list, then parameters)."""
    hooks: ClassVar[tuple] = ()
    """``(init, hit, miss, victim, evict, admit)``: the rule's compiled hooks."""
    loop: ClassVar = None
    """The rule's cached compiled loop over a layout (inlining :func:`expertcache.policies.driver.run`)."""

    def params(self) -> tuple[np.ndarray, np.ndarray]:
        """Templates of the int64 and float64 scalars at a stream start (parameters set, lists empty)."""
        return np.full(self.n_int, -1, dtype=np.int64), np.zeros(1, dtype=np.float64)

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        if self.capacity is None:
            raise PolicyError(f"policy {self.spec!r} needs its capacity: drive it through an ExpertCache or a replay")
        self.st = np.full((self.rows, self.n_items), -1, dtype=np.int64)
        self.sc, self.fs = (a.copy() for a in self.params())
        self.hooks[0](self.st, self.sc, self.fs, self.n_items, self.capacity)

    def keys(self, candidates, t):
        raise PolicyError(f"policy {self.spec!r} is a hooked rule: it has no keys")

    # -- the hooks, one call each (ExpertCache's driver) ---------------------------------------
    def hook_hit(self, e: int, t: int) -> None:
        self.hooks[1](self.st, self.sc, self.fs, e, t)

    def hook_miss(self, e: int, t: int) -> None:
        self.hooks[2](self.st, self.sc, self.fs, e, t)

    def hook_victim(self, e: int, t: int, stamp: np.ndarray, g: int, res: np.ndarray) -> int:
        return int(self.hooks[3](self.st, self.sc, self.fs, e, t, stamp, g, res, res.size))

    def hook_evict(self, v: int, t: int) -> None:
        self.hooks[4](self.st, self.sc, self.fs, v, t)

    def hook_admit(self, e: int, t: int) -> None:
        self.hooks[5](self.st, self.sc, self.fs, e, t)

    def plan(self, layout):
        sc0, fs0 = self.params()
        return HookPlan(type(self).loop, self.rows, sc0, fs0)
