"""A lossless, demand-fetch expert cache: slots, residency and the eviction decision.

This is the one cache step the live harness (``offload``), the file tier and the simulator's
reference path all share. It moves no data: it says which items to load into which slots, and
the caller performs the copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError
from .policies import Policy, StreamFuture, make_policy


@dataclass
class Step:
    """What one :meth:`ExpertCache.prepare` call decided.

    ``slots[i]`` is the slot holding ``items[i]`` after the step; ``loads`` lists ``(item, slot)``
    copies to perform (misses), ``evicted`` the items whose slots those copies overwrite (in the
    order the loads reuse them), ``hits`` the requested items already resident.
    """

    items: np.ndarray
    slots: np.ndarray
    loads: list[tuple[int, int]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    hits: int = 0

    @property
    def misses(self) -> int:
        return len(self.loads)


class ExpertCache:
    """``capacity`` slots over items ``0..n_items-1``, filled on demand, emptied by a policy.

    Invariants of :meth:`prepare` (one call per access group, steps ``t = 0, 1, 2, ...``):

    * afterwards every requested item is resident and ``slot_of(item)`` is its slot;
    * at most ``capacity`` items are ever resident;
    * an item requested by the current group is never evicted while serving that group;
    * a miss takes a free slot while one exists (the pool is *filling*); after that it takes the
      slot of a victim, and victims are the candidates (residents the group does not request) in
      ascending ``(policy key, last use, item id)`` order;
    * the outcome does not depend on the order of ids within a group.

    ``reset()`` empties the pool and starts a new stream (the policy forgets its history).
    """

    def __init__(
        self,
        capacity: int,
        policy: Policy | str,
        n_items: int,
        *,
        future: StreamFuture | None = None,
        steps_per_token: int = 1,
    ):
        if capacity < 1:
            raise ConfigError(f"capacity must be at least 1, got {capacity}")
        self.capacity = int(capacity)
        self.n_items = int(n_items)
        self.policy = make_policy(policy)
        self.steps_per_token = steps_per_token
        self._slot = np.full(self.n_items, -1, dtype=np.int64)
        self._last = np.full(self.n_items, -1, dtype=np.int64)
        self.reset(future)

    def reset(self, future: StreamFuture | None = None) -> None:
        """Empty every slot and start a new stream at step 0."""
        self._slot.fill(-1)
        self._last.fill(-1)
        self._free = list(range(self.capacity - 1, -1, -1))
        self.t = 0
        self.copies = 0
        self.evictions = 0
        self.policy.reset(self.n_items, future=future, steps_per_token=self.steps_per_token)

    @property
    def resident(self) -> np.ndarray:
        """Resident item ids, ascending."""
        return np.flatnonzero(self._slot >= 0)

    @property
    def filling(self) -> bool:
        """True until the pool has held ``capacity`` items once (slots are never freed mid-stream)."""
        return bool(self._free)

    def slot_of(self, item: int) -> int:
        return int(self._slot[item])

    def prepare(self, items) -> Step:
        """Make every item of this access group resident; see the class invariants."""
        items = np.asarray(items, dtype=np.int64).ravel()
        items = items[items >= 0]
        if items.size and (items.max() >= self.n_items or np.unique(items).size != items.size):
            raise ConfigError(f"prepare: ids must be distinct and below {self.n_items}, got {items.tolist()}")
        if items.size > self.capacity:
            raise ConfigError(f"prepare: {items.size} experts requested at once but capacity is {self.capacity}")
        t = self.t
        missing = np.sort(items[self._slot[items] < 0])
        need = missing.size - len(self._free)
        victims: np.ndarray = np.zeros(0, dtype=np.int64)
        if need > 0:
            resident = np.flatnonzero(self._slot >= 0)
            candidates = np.setdiff1d(resident, items, assume_unique=True)
            keys = np.asarray(self.policy.keys(candidates, t), dtype=np.float64)
            order = np.lexsort((candidates, self._last[candidates], keys))
            victims = candidates[order[:need]]
        step = Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(items.size - missing.size))
        vi = 0
        for item in missing:
            if self._free:
                slot = self._free.pop()
            else:
                victim = int(victims[vi])
                vi += 1
                slot = int(self._slot[victim])
                self._slot[victim] = -1
                step.evicted.append(victim)
            self._slot[item] = slot
            step.loads.append((int(item), slot))
        self._last[items] = t
        self.copies += len(step.loads)
        self.evictions += len(step.evicted)
        self.policy.on_access(items, t)
        step.slots = self._slot[items].copy()
        self.t = t + 1
        return step
