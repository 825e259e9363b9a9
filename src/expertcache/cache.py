"""A lossless, demand-fetch expert cache: slots, residency and the eviction decision.

This is the one cache step the live harness (``offload``), the file tier and the simulator's
reference path all share. It moves no data: it says which items to load into which slots, and
the caller performs the copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._text import short
from .errors import ConfigError, is_int
from .trace.validate import MAX_ITEMS
from .policies import Policy, StreamFuture, make_policy


def _count(value, name: str, most: int) -> int:
    """A positive integer ``value`` (not a bool, not a float such as 2.5) at most ``most``."""
    if not is_int(value, 1, most):
        raise ConfigError(f"{name} must be an integer in [1, {most:,}], got {str(value)[:40]!r}")
    return int(value)


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
      ascending ``(policy key, last use, item id)`` order, except that prefetched items not yet
      used go first (see :meth:`prefetch`);
    * the outcome does not depend on the order of ids within a group.

    :meth:`prefetch` loads items ahead of demand between two steps. A prefetched item enters the
    policy's state only when a step first requests it (``on_access``); until then it is a
    *speculative* resident, evicted before any item a step has used. Counters, per cache since
    it was made: ``prefetch_copies`` = ``prefetch_hits`` (later requested while still resident)
    + ``prefetch_wasted`` (evicted, or emptied by a reset, before any request) +
    ``prefetch_pending`` (still resident and unused).

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
        self.capacity = _count(capacity, "capacity", 1 << 62)
        self.n_items = _count(n_items, "n_items", MAX_ITEMS)
        self.policy = make_policy(policy)
        self.policy.bind(min(self.capacity, self.n_items))
        # a step whose items are all resident and not speculative only tells on_hit/on_access when
        # the rule's miss, evict and admit hooks are the base class's no-ops (a rule that overrides
        # one is told of the empty sets too, as on every step)
        cls = type(self.policy)
        self._all_hit_fast = not self.policy.hooked and all(
            getattr(cls, m) is getattr(Policy, m) for m in ("on_miss", "on_evict", "on_admit"))
        self.steps_per_token = _count(steps_per_token, "steps_per_token", 1 << 62)
        self._slot = np.full(self.n_items, -1, dtype=np.int64)
        self._last = np.full(self.n_items, -1, dtype=np.int64)
        self._speculative = np.zeros(self.n_items, dtype=bool)
        self._stamp = np.full(self.n_items, -1, dtype=np.int64)
        self.prefetch_copies = self.prefetch_hits = self.prefetch_wasted = 0
        self.reset(future)

    def reset(self, future: StreamFuture | None = None) -> None:
        """Empty every slot and start a new stream at step 0 (unused prefetched items count as wasted)."""
        self.prefetch_wasted += int(np.count_nonzero(self._speculative))
        self._speculative.fill(False)
        self._slot.fill(-1)
        self._last.fill(-1)
        self._stamp.fill(-1)
        self._free = list(range(min(self.capacity, self.n_items) - 1, -1, -1))  # more slots are never used
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
        """The slot of one id (an integer in ``[0, n_items)``, or -1 for a pad); -1 if not resident.
        Before, -1 had read the last item's slot and ``(1, 2)`` item 1's."""
        if not is_int(item, -1, self.n_items - 1):
            raise ConfigError(f"slot_of: an id must be an integer in [0, {self.n_items}) or -1 (padding), "
                              f"got {short(item, 40)}")
        return int(self._slot[item]) if item >= 0 else -1

    def slots_of(self, items: np.ndarray) -> np.ndarray:
        """Slots of ``items`` (ids of any shape, checked as :meth:`prepare` checks them; -1 for a
        pad or a non-resident item)."""
        items = self._checked(items, "slots_of")
        return np.where(items >= 0, self._slot[np.maximum(items, 0)], -1)

    @property
    def prefetch_pending(self) -> int:
        """Prefetched items still resident and not yet requested."""
        return int(np.count_nonzero(self._speculative))

    def _victims(self, candidates: np.ndarray, need: int, t: int) -> np.ndarray:
        keys = np.asarray(self.policy.keys(candidates, t), dtype=np.float64)
        order = np.lexsort((candidates, self._last[candidates], keys, ~self._speculative[candidates]))
        return candidates[order[:need]]

    def _unused_prefetched(self, candidates: np.ndarray) -> np.ndarray:
        """The prefetched, not yet requested items among ``candidates``, in victim order for a hooked
        rule (they are not in its state): oldest last request, then smallest id."""
        spec = candidates[self._speculative[candidates]]
        return spec[np.lexsort((spec, self._last[spec]))]

    def _hooked_prefetch_victims(self, candidates: np.ndarray, incoming: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Victims for prefetched items under a hooked rule: unused prefetched items first, then
        the rule's victims (told as evictions), the prefetched ``items`` protected."""
        spec = self._unused_prefetched(candidates)
        out = list(spec[: incoming.size])
        if len(out) < incoming.size:
            mark = np.full(self.n_items, -1, dtype=np.int64)
            mark[items] = 0
            mark[spec] = 0  # already chosen
            res = np.flatnonzero((self._slot >= 0) & ~self._speculative)
            for e in incoming[len(out):]:
                v = self.policy.hook_victim(int(e), self.t - 1, mark, 0, res)
                if v < 0 or self._slot[v] < 0 or mark[v] == 0:
                    raise ConfigError(f"policy {self.policy.spec!r} proposed victim {v} for a prefetch: not resident, or protected")
                self.policy.hook_evict(v, self.t - 1)
                mark[v] = 0
                res = res[res != v]
                out.append(v)
        return np.asarray(out, dtype=np.int64)

    def prefetch(self, items) -> Step:
        """Load the non-resident ``items`` before the next step requests anything (no step is taken).

        Ids are deduplicated in the order given and at most ``capacity`` are kept. Victims are
        residents outside ``items``: unused prefetched items first, then the policy's order as
        seen just after the last step. The step's ``hits`` counts items already resident.
        """
        items = self._ids(items, "prefetch")
        items = items[items >= 0]
        _, first = np.unique(items, return_index=True)
        items = items[np.sort(first)][: self.capacity]
        missing = items[self._slot[items] < 0]
        need = missing.size - len(self._free)
        victims = np.zeros(0, dtype=np.int64)
        if need > 0:
            resident = np.flatnonzero(self._slot >= 0)
            candidates = np.setdiff1d(resident, items, assume_unique=True)
            if self.policy.hooked:
                victims = self._hooked_prefetch_victims(candidates, missing[len(self._free):], items)
            else:
                victims = self._victims(candidates, need, self.t - 1)
        step = Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(items.size - missing.size))
        self._place(missing, victims, step)
        self._speculative[missing] = True
        self.prefetch_copies += missing.size
        step.slots = self._slot[items].copy()
        return step

    def _place(self, missing: np.ndarray, victims: np.ndarray, step: Step) -> None:
        vi = 0
        for item in missing:
            if self._free:
                slot = self._free.pop()
            else:
                victim = int(victims[vi])
                vi += 1
                slot = int(self._slot[victim])
                self._slot[victim] = -1
                if self._speculative[victim]:
                    self._speculative[victim] = False
                    self.prefetch_wasted += 1
                step.evicted.append(victim)
            self._slot[item] = slot
            step.loads.append((int(item), slot))

    def prepare(self, items) -> Step:
        """Make every item of this access group resident; see the class invariants."""
        items = self._ids(items, "prepare")
        items = items[items >= 0]
        if items.size and np.unique(items).size != items.size:
            raise ConfigError(f"prepare: ids must be distinct, got {items.tolist()}")
        if items.size > self.capacity:
            raise ConfigError(f"prepare: {items.size} experts requested at once but capacity is {self.capacity}")
        t = self.t
        if self._all_hit_fast and self._all_resident(items):
            step = Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(items.size))
            self.policy.on_hit(items, t)
        elif self.policy.hooked:
            step = self._prepare_hooked(np.sort(items), t)
        else:
            missing = np.sort(items[self._slot[items] < 0])
            need = missing.size - len(self._free)
            victims: np.ndarray = np.zeros(0, dtype=np.int64)
            if need > 0:
                resident = np.flatnonzero(self._slot >= 0)
                candidates = np.setdiff1d(resident, items, assume_unique=True)
                victims = self._victims(candidates, need, t)
            step = Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(items.size - missing.size))
            self.policy.on_hit(items[self._slot[items] >= 0], t)
            self.policy.on_miss(missing, t)
            self._place(missing, victims, step)
            self.policy.on_evict(np.asarray(step.evicted, dtype=np.int64), t)
            self.policy.on_admit(missing, t)
        return self._finish(items, step, t)

    def _ids(self, items, where: str) -> np.ndarray:
        """``items`` as a flat int64 array of ids (:meth:`_checked`)."""
        return self._checked(items, where).ravel()

    def _checked(self, items, where: str) -> np.ndarray:
        """``items`` as int64 ids of the same shape, each in ``[0, n_items)`` or -1 (padding); a
        ConfigError otherwise (-5 had been dropped as padding, 1.7 truncated to 1, uint64 2**64 - 1
        wrapped to -1; ``prefetch`` had dropped ids past ``n_items``, ``slots_of`` raised
        IndexError on them). ``True`` is not an id."""
        arr = _array(items)
        if arr.size and arr.dtype.kind not in "iu":
            raise ConfigError(f"{where}: expert ids must be integers, got {arr.dtype} {short(items, 60)}")
        bad = arr.size and (int(arr.min()) < -1 or int(arr.max()) >= self.n_items)
        if bad:
            raise ConfigError(f"{where}: ids must be in [0, {self.n_items}) or -1 (padding), got "
                              f"{str(arr.ravel().tolist())[:60]}")
        return arr.astype(np.int64)

    def _all_resident(self, items: np.ndarray) -> bool:
        """Every item resident and none an unused prefetched one (a step of hits alone: the decode
        steps of a warm pool, where :meth:`prepare` skips the victim search)."""
        return bool((self._slot[items] >= 0).all()) and not self._speculative[items].any()

    def _finish(self, items: np.ndarray, step: Step, t: int) -> Step:
        """The end of every step: prefetched items now used, last uses, counters, ``on_access``."""
        used = items[self._speculative[items]]
        if used.size:
            self.prefetch_hits += used.size
            self._speculative[used] = False
        self._last[items] = t
        self.copies += len(step.loads)
        self.evictions += len(step.evicted)
        self.policy.on_access(items, t)
        step.slots = self._slot[items].copy()
        self.t = t + 1
        return step

    def _prepare_hooked(self, items: np.ndarray, t: int) -> Step:
        """The engine's order (:mod:`expertcache.policies.driver`): ids ascending, hits first, then each miss
        (miss; victim and evict when full; admit). A prefetched item is new to the rule: its first
        request is a miss and an admission for the rule, a hit for the counts."""
        pol = self.policy
        self._stamp[items] = t
        resident = self._slot[items] >= 0
        step = Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(np.count_nonzero(resident)))
        for e in items[resident]:
            if self._speculative[e]:
                pol.hook_miss(int(e), t)
                pol.hook_admit(int(e), t)
            else:
                pol.hook_hit(int(e), t)
        for e in items[~resident]:
            e = int(e)
            pol.hook_miss(e, t)
            self._place_hooked(e, t, step)
            pol.hook_admit(e, t)
        return step

    def _place_hooked(self, e: int, t: int, step: Step) -> None:
        """Give miss ``e`` a slot: a free one, else the slot of one victim (:meth:`_hooked_victim`)."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._hooked_victim(e, t)
            slot = int(self._slot[victim])
            self._slot[victim] = -1
            step.evicted.append(victim)
        self._slot[e] = slot
        step.loads.append((e, slot))

    def _hooked_victim(self, e: int, t: int) -> int:
        """The next victim for miss ``e`` at step ``t``: the oldest unused prefetched item (counted as
        wasted), else the rule's own (told as an eviction), never an item of the current group."""
        spec = self._unused_prefetched(np.flatnonzero((self._slot >= 0) & (self._stamp != t)))
        if spec.size:  # unused prefetched items go first
            victim = int(spec[0])
            self._speculative[victim] = False
            self.prefetch_wasted += 1
            return victim
        # the rule's residents: every resident but the unused prefetched ones (the group's
        # prefetched items entered the rule above)
        pol = self.policy
        res = np.flatnonzero((self._slot >= 0) & (~self._speculative | (self._stamp == t)))
        victim = pol.hook_victim(e, t, self._stamp, t, res)
        if victim < 0 or self._slot[victim] < 0 or self._stamp[victim] == t:
            raise ConfigError(f"policy {pol.spec!r} proposed victim {victim}: not resident, "
                              "or requested by the current group")
        pol.hook_evict(victim, t)
        return int(victim)


def _array(values) -> np.ndarray:
    """``np.asarray(values)``, or an object array where numpy makes none (a ragged list, an integer
    past int64), which the integer checks of ids and sizes then refuse."""
    try:
        return np.asarray(values)
    except (ValueError, TypeError, OverflowError, RecursionError):
        return np.asarray([None])


def sized_items(capacity_bytes: int, item_bytes) -> np.ndarray:
    """``item_bytes`` as int64, checked: integers (1.5 had been truncated to 1), non-empty, positive,
    none above ``capacity_bytes`` (a positive integer: NaN had passed the comparison)."""
    if not is_int(capacity_bytes, 1, 1 << 62):
        raise ConfigError(f"capacity_bytes must be an integer in [1, 2**62], got {short(capacity_bytes, 40)}")
    sizes = _array(item_bytes).ravel()
    if (sizes.size and sizes.dtype.kind not in "iu") or np.any(sizes > (1 << 62)):
        raise ConfigError(f"item_bytes must be integer sizes in bytes, got {short(item_bytes, 60)}")
    sizes = sizes.astype(np.int64)
    if sizes.size == 0 or int(sizes.min()) < 1:
        raise ConfigError("item_bytes must be a non-empty array of positive sizes")
    if capacity_bytes < int(sizes.max()):
        raise ConfigError(f"capacity {capacity_bytes} bytes is below the largest item ({int(sizes.max())} bytes)")
    return sizes


def check_sized_group(items: np.ndarray, item_bytes: np.ndarray, capacity_bytes: int) -> None:
    """One access group of a byte-capacity pool: distinct ids below ``len(item_bytes)`` whose sizes
    fit the capacity together; a one-line ConfigError otherwise."""
    n = item_bytes.size
    if items.size and (items.max() >= n or len(set(items.tolist())) != items.size):
        raise ConfigError(f"prepare: ids must be distinct and below {n}, got {items.tolist()}")
    need = int(item_bytes[items].sum())
    if need > capacity_bytes:
        raise ConfigError(f"prepare: {items.size} experts of {need} bytes requested at once but the capacity is "
                          f"{capacity_bytes} bytes")


class SizedCache(ExpertCache):
    """:class:`ExpertCache` with a capacity in bytes over items of different sizes (``item_bytes``),
    as libCacheSim sizes objects: a GGUF whose expert tensors differ in type by layer (Q4_K_M) has
    experts of different sizes. There are no slots (``slot_of`` is 0 for a resident item, -1 else).

    Invariants: those of :class:`ExpertCache` with "at most ``capacity`` items are resident"
    replaced by "the resident items' sizes sum to at most ``capacity_bytes``", and a miss that does
    not fit evicting victims in the same order (unused prefetched items first, then the policy's
    ``(key, last use, id)`` order, or a hooked rule's victims one at a time) until it fits. With
    every size equal to ``s`` and ``capacity_bytes = C * s`` it decides exactly as
    ``ExpertCache(C)``: the same hits, loads and victims at every step (tested for every online
    rule). The policy is bound to ``capacity_bytes // mean(item_bytes)`` items (what capacity-aware
    rules such as ARC size their lists by). ``used_bytes`` is the resident items' total.
    """

    def __init__(self, capacity_bytes: int, policy: Policy | str, item_bytes, *,
                 future: StreamFuture | None = None, steps_per_token: int = 1):
        sizes = sized_items(capacity_bytes, item_bytes)
        self.item_bytes = sizes
        self.capacity_bytes = int(capacity_bytes)
        self.used_bytes = 0
        super().__init__(max(1, int(capacity_bytes // sizes.mean())), policy, sizes.size, future=future,
                         steps_per_token=steps_per_token)

    def reset(self, future: StreamFuture | None = None) -> None:
        super().reset(future)
        self._free = []
        self.used_bytes = 0
        self._evicted_once = False

    @property
    def filling(self) -> bool:
        """True until the first eviction."""
        return not self._evicted_once

    def _add(self, item: int, step: Step) -> None:
        self._slot[item] = 0
        self.used_bytes += int(self.item_bytes[item])
        step.loads.append((int(item), 0))

    def _drop(self, victim: int, step: Step) -> None:
        self._slot[victim] = -1
        self.used_bytes -= int(self.item_bytes[victim])
        if self._speculative[victim]:
            self._speculative[victim] = False
            self.prefetch_wasted += 1
        self._evicted_once = True
        step.evicted.append(int(victim))

    def _victims_for(self, candidates: np.ndarray, deficit: int, t: int) -> np.ndarray:
        """The shortest prefix of the victim order whose sizes free ``deficit`` bytes."""
        if deficit <= 0:
            return np.zeros(0, dtype=np.int64)
        order = self._victims(candidates, candidates.size, t)
        n = int(np.searchsorted(np.cumsum(self.item_bytes[order]), deficit)) + 1
        return order[:n]

    def _check_group(self, items: np.ndarray) -> None:
        check_sized_group(items, self.item_bytes, self.capacity_bytes)

    def prepare(self, items) -> Step:
        """Make every item of this access group resident; see the class invariants."""
        items = self._ids(items, "prepare")
        items = items[items >= 0]
        self._check_group(items)
        t = self.t
        if self._all_hit_fast and self._all_resident(items):
            self.policy.on_hit(items, t)
            return self._finish(items, Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(items.size)), t)
        if self.policy.hooked:
            return self._finish(items, self._prepare_hooked(np.sort(items), t), t)
        missing = np.sort(items[self._slot[items] < 0])
        deficit = self.used_bytes + int(self.item_bytes[missing].sum()) - self.capacity_bytes
        victims = ()
        if deficit > 0:  # the candidates only where something must go (most steps hit or fit)
            mask = self._slot >= 0
            mask[items] = False
            victims = self._victims_for(np.flatnonzero(mask), deficit, t)
        step = Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(items.size - missing.size))
        self.policy.on_hit(items[self._slot[items] >= 0], t)
        self.policy.on_miss(missing, t)
        for v in victims:
            self._drop(int(v), step)
        for e in missing:
            self._add(int(e), step)
        self.policy.on_evict(np.asarray(step.evicted, dtype=np.int64), t)
        self.policy.on_admit(missing, t)
        return self._finish(items, step, t)

    def _fits(self, item: int) -> bool:
        return self.used_bytes + int(self.item_bytes[item]) <= self.capacity_bytes

    def _place_hooked(self, e: int, t: int, step: Step) -> None:
        """:meth:`ExpertCache._place_hooked` with "no free slot" read as "the miss does not fit":
        victims are taken one at a time until it does (an unused prefetched victim was counted as
        wasted by :meth:`_hooked_victim` and is no longer speculative when dropped)."""
        while not self._fits(e):
            self._drop(self._hooked_victim(e, t), step)
        self._add(e, step)

    def prefetch(self, items) -> Step:
        """:meth:`ExpertCache.prefetch` by bytes: the ids kept are the longest prefix (deduplicated,
        in the order given) that fits the capacity; victims free what the missing ones need."""
        items = self._ids(items, "prefetch")
        items = items[items >= 0]
        _, first = np.unique(items, return_index=True)
        items = items[np.sort(first)]
        items = items[: int(np.searchsorted(np.cumsum(self.item_bytes[items]), self.capacity_bytes, side="right"))]
        missing = items[self._slot[items] < 0]
        deficit = self.used_bytes + int(self.item_bytes[missing].sum()) - self.capacity_bytes
        candidates = np.setdiff1d(np.flatnonzero(self._slot >= 0), items, assume_unique=True)
        step = Step(items=items, slots=np.empty(0, dtype=np.int64), hits=int(items.size - missing.size))
        if deficit > 0 and self.policy.hooked:
            spec = list(self._unused_prefetched(candidates))
            mark = np.full(self.n_items, -1, dtype=np.int64)
            mark[items] = 0
            res = np.flatnonzero((self._slot >= 0) & ~self._speculative)
            mark[spec] = 0
            for e in missing:  # as ExpertCache: each incoming item that does not fit takes victims
                while self.used_bytes + int(self.item_bytes[e]) > self.capacity_bytes:
                    if spec:
                        v = int(spec.pop(0))
                    else:
                        v = self.policy.hook_victim(int(e), self.t - 1, mark, 0, res)
                        if v < 0 or self._slot[v] < 0 or mark[v] == 0:
                            raise ConfigError(f"policy {self.policy.spec!r} proposed victim {v} for a prefetch: "
                                              "not resident, or protected")
                        self.policy.hook_evict(v, self.t - 1)
                        mark[v] = 0
                        res = res[res != v]
                    self._drop(v, step)
                self.used_bytes += int(self.item_bytes[e])  # its room is taken now; it is added below
            self.used_bytes -= int(self.item_bytes[missing].sum())
        else:
            for v in self._victims_for(candidates, deficit, self.t - 1):
                self._drop(int(v), step)
        for e in missing:
            self._add(int(e), step)
        self._speculative[missing] = True
        self.prefetch_copies += missing.size
        step.slots = self._slot[items].copy()
        return step
