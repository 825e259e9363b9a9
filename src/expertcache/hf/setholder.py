"""The resident sets of set-holding rules (:mod:`.holding`, :mod:`.controller`): which experts one
layer holds, token by token (:class:`SetHolder`, the refresh rule of :mod:`.holding`'s docstring),
and which slot each held expert is in (:class:`SlotMap`). Numpy only: the learned controller's
holder (torch) builds on it from above."""

from __future__ import annotations

from collections import deque

import numpy as np

from ..policies.registry import HoldingSpec

__all__ = ["SetHolder", "SlotMap"]


class SetHolder:
    """Which experts one layer holds, token by token (see the module docstring)."""

    def __init__(self, spec: HoldingSpec, num_experts: int, capacity: int):
        self.spec = spec
        self.E = int(num_experts)
        self.C = int(min(capacity, num_experts))
        self.counts = np.zeros(self.E, dtype=np.int64)
        self.last = np.full(self.E, -1, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        self.t = 0
        self.window: deque[np.ndarray] = deque()
        self.counts.fill(0)
        self.last.fill(-1)
        self.current = np.zeros(0, dtype=np.int64)

    def due(self) -> bool:
        """Whether the set is refreshed at the current token."""
        w, k = self.spec.window, self.spec.hold
        return self.t < w or (k is not None and (self.t - (w - 1)) % k == 0)

    def step(self, demand: np.ndarray) -> np.ndarray | None:
        """Record token t's unrestricted demand; return the new set when refreshed at t, else None."""
        demand = np.unique(np.asarray(demand, dtype=np.int64))
        demand = demand[demand >= 0]
        self.window.append(demand)
        self.counts[demand] += 1
        self.last[demand] = self.t
        if len(self.window) > self.spec.window:
            self.counts[self.window.popleft()] -= 1
        new = self._choose() if self.due() else None
        if new is not None:
            self.current = new
        self.t += 1
        return new

    def _choose(self) -> np.ndarray:
        cand = np.flatnonzero(self.counts > 0)
        order = np.lexsort((cand, -self.last[cand], -self.counts[cand]))
        chosen = cand[order[: self.C]]
        if chosen.size < self.C and self.current.size:
            keep = np.setdiff1d(self.current, chosen)
            keep = keep[np.lexsort((keep, -self.last[keep]))][: self.C - chosen.size]
            chosen = np.concatenate([chosen, keep])
        return np.sort(chosen)


class SlotMap:
    """Expert -> slot for a set-holding layer: a refresh moves entering experts into leaving ones' slots."""

    def __init__(self, num_experts: int, capacity: int):
        self.slot_of = np.full(num_experts, -1, dtype=np.int64)
        self.capacity = int(capacity)
        self.reset()

    def reset(self) -> None:
        self.slot_of.fill(-1)
        self.free = list(range(self.capacity - 1, -1, -1))

    def refresh(self, new: np.ndarray) -> tuple[list[tuple[int, int]], int]:
        """Make ``new`` the resident set: the ``(expert, slot)`` copies and how many evicted a member."""
        slot_of = self.slot_of
        keep = set(new.tolist())
        leaving = [e for e in np.flatnonzero(slot_of >= 0).tolist() if e not in keep]
        loads, steady = [], 0
        for e in new.tolist():
            if slot_of[e] >= 0:
                continue
            if self.free:
                slot = self.free.pop()
            else:
                gone = leaving.pop(0)
                slot = int(slot_of[gone])
                slot_of[gone] = -1
                steady += 1
            slot_of[e] = slot
            loads.append((e, slot))
        for gone in leaving:  # a smaller set than before (not produced by SetHolder): free the rest
            self.free.append(int(slot_of[gone]))
            slot_of[gone] = -1
        return loads, steady
