"""One offloaded MoE layer: a cache step per decode step, copies into slots, the model's own matmuls.

Decode order. A forward over ``b`` rows of ``n`` tokens (``b = 1``: a teacher-forced sequence, a
prefill or one decode token; ``b > 1``: a batch) presents its steps to the layer's
:class:`~expertcache.cache.ExpertCache` in order, one cache step per token position, exactly as
token-by-token decoding would. A step requests the *union* of the ``b`` rows' experts at that
position (the tiering paper's batch union: one copy serves every row that needs the expert).
With a pool per layer the requests a layer sees at step t do not depend on what other layers
hold, so one full-sequence forward and n decode steps drive every pool through the same steps.

The rows are then computed in as few calls as correctness allows: a *segment* is a run of steps
whose loads overwrite no slot that an earlier step of the same segment reads, so the segment's
copies can all be queued first and its rows computed in one call. At C = E nothing is ever
evicted and a whole forward is one segment.

Prefetch (lossless; only for forwards of a single step, i.e. decoding). After queuing its own
compute, layer l asks the next offloaded layer to load, on the copy stream, the experts it is
predicted to need at the same step: ``next-layer`` predicts them as the top-k of the next layer's
router weights applied to the hidden states entering this layer's experts (layer l's output does
not exist until l has computed, and the residual stream changes little from one layer to the
next); ``oracle`` reads them from the recorded future (an upper bound). The demand step still
makes every requested expert resident before use, so outputs never change; see
:meth:`~expertcache.cache.ExpertCache.prefetch` for how prefetched experts enter the policy.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..cache import ExpertCache
from ..trace.context import LiveGroups, live_context
from ..errors import ConfigError
from ..policies import Policy, StreamFuture
from .experts import SlotView, attach_layer, detach_layer
from .holding import HoldingSpec, SetHolder, SlotMap
from .model import ExpertsSite
from .pool import SlotPool
from .routing import Route

PREFETCH = ("none", "next-layer", "oracle")


class PoolState:
    """One pool's slots, its cache and the recorded future of its current stream.

    A per-layer pool belongs to one :class:`OffloadedLayer`; a global pool is one state shared by
    every offloaded layer, whose cache numbers items ``layer index * E + expert`` and takes
    ``steps_per_token`` = number of layers steps per token, as the simulator's global pool does.
    """

    def __init__(self, pool: SlotPool, capacity: int, policy: Policy | None, steps_per_token: int = 1,
                 layer_ids=()):
        self.pool = pool
        self.capacity = int(capacity)
        self.policy = policy
        self.steps_per_token = int(steps_per_token)
        self.layer_ids = list(layer_ids)  # the model layers whose experts the pool holds, in item order
        self.cache: ExpertCache | None = None  # made by the first start (a clairvoyant policy needs its future)
        self.future: np.ndarray | None = None
        self.live: LiveGroups | None = None  # the stream's groups so far, for a policy that reads a context

    def start(self, future: np.ndarray | None = None) -> None:
        """Empty the pool's map (a new stream); ``future`` is the stream's recorded ``[G, k]`` steps."""
        self.future = None if future is None else np.asarray(future)
        stream_future = None if future is None else StreamFuture(self.future)
        if self.policy is None:  # a set-holding layer decides its set itself (no eviction cache)
            return
        if self.policy.wants_context:  # before the cache resets the policy
            self.live = LiveGroups(self.capacity)
            self.policy.set_context(live_context(self.live, self.layer_ids, self.pool.num_experts, self.steps_per_token))
        if self.cache is None:
            self.cache = ExpertCache(self.capacity, self.policy, self.pool.num_items, future=stream_future,
                                     steps_per_token=self.steps_per_token)
        else:
            self.cache.reset(stream_future)

    def clear_counters(self) -> None:
        if self.cache is not None:
            self.cache.prefetch_copies = self.cache.prefetch_hits = self.cache.prefetch_wasted = 0
        self.pool.clear_counters()

    def future_row(self) -> np.ndarray:
        """The recorded request of the step the cache takes next (empty past the stream's end)."""
        t = self.cache.t if self.cache is not None else 0
        if self.future is None or t >= len(self.future):
            return np.zeros(0, dtype=np.int64)
        return self.future[t]


class OffloadedLayer:
    """One MoE layer whose experts live in host memory and are served from C device slots.

    Invariants:

    * each call steps the layer's :class:`ExpertCache` once per token position, in order, over
      the union of the batch rows' experts; every row is computed only after the copies of its
      own step (the compute waits on their events) and before any later copy overwrites a slot
      it reads (the copy waits on the compute's events);
    * the counters add up what the cache decided: ``copies_total`` every demand load,
      ``copies_steady`` the demand loads that evicted a victim (docs/design.md section 2), per stream
      from an empty pool; prefetched loads are counted apart (``prefetch_*``);
    * ``future_mismatches`` counts steps whose requested experts differ from the recorded future a
      clairvoyant policy was given (then its choices, still lossless, were made on a stale future).
    """

    def __init__(self, site: ExpertsSite, state: PoolState, compute: Callable, top_k: int, offset: int = 0):
        self.site = site
        self.layer = site.layer
        self.module = site.experts
        self.top_k = int(top_k)
        self.state = state
        self.pool = state.pool
        self.offset = int(offset)  # this layer's first item id in its pool (0 unless the pool is global)
        self.capacity = state.capacity
        self.compute = compute
        self.view = SlotView(site.experts, *self.pool.slots)
        self.copy_watch = self.pool.stopwatch_for_copies()
        self.rows_per_step = 1  # the batch size of the forward being served (set by the run)
        self.single_step_only = state.steps_per_token > 1  # a global pool interleaves layers token by token
        self.next: OffloadedLayer | None = None  # the layer this one prefetches for
        self.prefetch_mode = "none"
        self._router_weight: torch.Tensor | None = None
        self.stream_tokens = 0  # steps served since the pool last started empty
        self._previous: list | None = None  # the last step's chosen experts (switch counting)
        self.holder: SetHolder | None = None
        self._route = None
        self._plan: list | None = None  # per step (loads, steady, slot map), made by the router hook
        self._hook = None
        self.clear_counters()

    def hold_sets(self, spec: HoldingSpec, route: Route) -> None:
        """Serve this layer with a set-holding policy (see :mod:`.holding`): the router hook decides,
        ``route`` (from :func:`.routing.route_for`) restricts the router's choice."""
        self._route = route
        make = getattr(spec, "holder", None)  # the learned controller brings its own holder
        self.holder = make(self.layer, self.pool.num_experts, self.capacity) if make else SetHolder(
            spec, self.pool.num_experts, self.capacity)
        self.slot_map = SlotMap(self.pool.num_experts, self.pool.capacity)

    @property
    def cache(self) -> ExpertCache | None:
        return self.state.cache

    # -- streams and counters ---------------------------------------------------------------
    def start_stream(self) -> None:
        """This layer's part of a new stream (the run starts its pool's state)."""
        self.stream_tokens = 0
        self._previous = None
        if self.holder is not None:
            self.holder.reset()
            self.slot_map.reset()

    def clear_counters(self) -> None:
        self.tokens = self.requests = self.copies_total = self.copies_steady = 0
        self.future_mismatches = self.switches = self.refreshes = 0
        self.copy_watch.clear()

    def _count_step(self, union: np.ndarray) -> None:
        self.tokens += 1
        self.stream_tokens += 1
        self.requests += union.size
        chosen = union.tolist()
        if self._previous is not None and chosen != self._previous:
            self.switches += 1
        self._previous = chosen

    @property
    def copy_seconds(self) -> float:
        return self.copy_watch.seconds

    def prefetch_counts(self) -> dict:
        c = self.cache
        if c is None or self.single_step_only:
            return {"prefetch_copies": 0, "prefetch_hits": 0, "prefetch_wasted": 0, "prefetch_pending": 0}
        return {"prefetch_copies": c.prefetch_copies, "prefetch_hits": c.prefetch_hits,
                "prefetch_wasted": c.prefetch_wasted, "prefetch_pending": c.prefetch_pending}

    def tier_counts(self) -> dict:
        """Where this layer's loads (demand and prefetch) were served from: host memory, the page
        cache (mmap, every page resident) or the device (mmap with a page missing; direct: always)."""
        files = self.pool.files[self.offset // self.pool.num_experts]
        if files is None:
            return {"host_loads": self.pool_loads(), "page_cache_loads": 0, "device_loads": 0,
                    "page_cache_bytes": 0, "device_bytes": 0}
        return {"host_loads": 0, "page_cache_loads": files.page_cache, "device_loads": files.device_loads,
                "page_cache_bytes": files.page_cache_bytes, "device_bytes": files.device_bytes}

    def pool_loads(self) -> int:
        """Loads made for this layer's experts: demand copies and prefetched ones."""
        return self.copies_total + self.prefetch_counts()["prefetch_copies"]

    # -- prefetch -----------------------------------------------------------------------------
    def prefetch_for(self, nxt: "OffloadedLayer | None", mode: str) -> None:
        """Prefetch for ``nxt`` (the next offloaded layer) with ``mode`` (see :data:`PREFETCH`)."""
        self.next, self.prefetch_mode = nxt, mode if nxt is not None else "none"
        self._router_weight = None
        if self.prefetch_mode != "none" and (self.single_step_only or nxt.state is self.state):
            raise ConfigError("prefetch needs a pool per layer (pool='layer')")
        if self.prefetch_mode == "next-layer":
            router = nxt.site.router
            weight = getattr(router, "weight", None)
            E = nxt.pool.num_experts
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != E:
                raise ConfigError(
                    f"prefetch next-layer: the router of layer {nxt.layer} has no [{E}, hidden] weight to predict with"
                )
            self._router_weight = weight

    def _predict(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The next layer's predicted experts for these rows, on the device (``next-layer`` only)."""
        if self._router_weight is None:
            return None
        w = self._router_weight
        logits = torch.nn.functional.linear(hidden_states.to(w.dtype), w)
        return torch.topk(logits, self.next.top_k, dim=-1).indices

    def prefetch(self, items: np.ndarray) -> None:
        """Load ``items`` (expert ids) ahead of this layer's next step (copies on the copy stream)."""
        if self.cache is None or items.size == 0:
            return
        items = items[items >= 0] + self.offset
        self.pool.load(self.cache.prefetch(items).loads, self.copy_watch)

    def _future_row(self) -> np.ndarray:
        row = self.state.future_row()
        return np.where(row >= 0, row - self.offset, -1)

    # -- the forward --------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        rows, k = top_k_index.shape
        b = self.rows_per_step
        if rows % b:
            b = 1  # not a forward of the batch the run saw (a direct call): rows in order
        n = rows // b
        single = n == 1
        if self.single_step_only and not single:
            raise ConfigError(
                f"layer {self.layer}: a global pool serves one token position per forward (decoding), in layer "
                f"order; this forward has {n} positions (a prefill or a teacher-forced pass)"
            )
        predicted = self._predict(hidden_states) if single and self.prefetch_mode == "next-layer" else None
        if predicted is None:
            ids = top_k_index.detach().to("cpu", torch.int64).numpy()
        else:  # one synchronisation for both
            both = torch.cat([top_k_index.detach().to(torch.int64), predicted.to(torch.int64)], dim=1).cpu().numpy()
            ids, predicted = both[:, :k], both[:, k:]
        if single and self.holder is None:
            out = self._one_step(hidden_states, ids, top_k_weights)
        else:
            out = self._steps(hidden_states, ids, top_k_weights, b, n, k)
        if single and self.prefetch_mode != "none":
            wanted = np.unique(predicted) if predicted is not None else self.next._future_row()
            self.next.prefetch(np.asarray(wanted, dtype=np.int64))
        return out

    def _one_step(self, hidden_states, ids: np.ndarray, top_k_weights):
        """A forward of one token position (decoding; every row of a batch at that position): the
        one cache step of :meth:`_steps` without its per-step bookkeeping, which one step does not
        need (one segment: every load queued, then one call)."""
        row = ids.reshape(-1)
        union = self._union(row, ids.shape[0], ids.shape[1])
        step, slots = self._demand_step(union, row)
        self.copies_total += len(step.loads)
        slot_ids = slots.reshape(ids.shape)
        index = torch.from_numpy(slot_ids).to(top_k_weights.device, non_blocking=True)
        read = step.slots.tolist()
        if step.loads:
            self.pool.load(step.loads, self.copy_watch)
        self.pool.before_read(read)
        out = self.compute(self.view, hidden_states, index, top_k_weights)
        self.pool.after_read(read)
        return out

    def _union(self, row: np.ndarray, b: int, k: int) -> np.ndarray:
        """The distinct experts one step's ``row`` (its ``b`` rows' ``k`` choices; -1 a pad) requests,
        within the capacity, counted as a step."""
        union = np.unique(row)
        if union.size and union[0] < 0:
            union = union[union >= 0]
        if union.size > self.capacity:
            raise ConfigError(
                f"layer {self.layer}: a batch of {b} rows requests {union.size} distinct experts at one step, "
                f"above the capacity of {self.capacity} slots (use a capacity >= {min(b * k, self.pool.num_experts)})"
            )
        self._count_step(union)
        return union

    def _demand_step(self, union: np.ndarray, row: np.ndarray):
        """The cache step of a step requesting ``union``: ``(its Step, the slot of each id of row)``;
        ``copies_steady`` counted (the caller counts the loads it queues)."""
        self._check_future(union)
        if self.state.live is not None:
            self.state.live.append(union + self.offset)  # the step has begun: its request is known
        step = self.cache.prepare(union + self.offset)
        self.copies_steady += len(step.evicted)
        items = row if self.offset == 0 else np.where(row >= 0, row + self.offset, -1)
        return step, self.cache.slots_of(items)

    def _steps(self, hidden_states, ids: np.ndarray, top_k_weights, b: int, n: int, k: int):
        """A forward of ``n`` token positions of ``b`` rows: one cache step per position, in order,
        and the rows computed segment by segment (see the module docstring)."""
        # step-major order: step t holds rows t, n + t, 2n + t, ... of the forward
        by_step = ids.reshape(b, n, k).transpose(1, 0, 2).reshape(n, b * k)
        plan, self._plan = self._plan, None
        if self.holder is not None and (plan is None or len(plan) != n):
            raise RuntimeError(f"layer {self.layer}: the experts ran without their router's decision")
        slot_ids = np.empty_like(by_step)
        segments: list[tuple[int, int, list[tuple[int, int]], set]] = []
        start, loads, read = 0, [], set()
        for t in range(n):
            union = self._union(by_step[t], b, k)
            if plan is not None:  # set-holding: the router hook decided the copies and the slots
                step_loads, steady, slot_of = plan[t]
                self.copies_steady += steady
                step_slots = slot_of[union]
                slot_ids[t] = np.where(by_step[t] >= 0, slot_of[np.maximum(by_step[t], 0)], -1)
                if (step_slots < 0).any():
                    raise RuntimeError(f"layer {self.layer}: the router chose an expert outside the held set")
            else:
                step, slot_ids[t] = self._demand_step(union, by_step[t])
                step_loads, step_slots = step.loads, step.slots
            self.copies_total += len(step_loads)
            if read and any(slot in read for _, slot in step_loads):
                segments.append((start, t, loads, read))
                start, loads, read = t, [], set()
            loads.extend(step_loads)
            read.update(step_slots.tolist())
        segments.append((start, n, loads, read))
        return self._compute(hidden_states, slot_ids, top_k_weights, b, n, k, segments)

    def _compute(self, hidden_states, slot_ids, top_k_weights, b, n, k, segments):
        device = top_k_weights.device
        if b > 1 and n > 1:  # compute in step-major order, then put the rows back
            hs = hidden_states.reshape(b, n, -1).transpose(0, 1).reshape(b * n, -1)
            wt = top_k_weights.reshape(b, n, k).transpose(0, 1).reshape(b * n, k)
        else:
            hs, wt = hidden_states, top_k_weights
        index = torch.from_numpy(slot_ids.reshape(n * b, k)).to(device, non_blocking=True)
        outputs = []
        for a, e, seg_loads, read in segments:
            self.pool.load(seg_loads, self.copy_watch)
            self.pool.before_read(read)
            outputs.append(self.compute(self.view, hs[a * b : e * b], index[a * b : e * b], wt[a * b : e * b]))
            self.pool.after_read(read)
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        if b > 1 and n > 1:
            out = out.reshape(n, b, -1).transpose(0, 1).reshape(b * n, -1)
        return out

    def _check_future(self, union: np.ndarray) -> None:
        if self.state.future is None:
            return
        row = self.state.future_row()
        if row.size == 0 or union.tolist() != sorted(x - self.offset for x in row.tolist() if x >= 0):
            self.future_mismatches += 1

    # -- set-holding: the router hook -----------------------------------------------------------
    @torch.no_grad()
    def _on_router(self, module, args, output):
        """Step the held set over this forward's token positions and restrict the router's choice to it."""
        logits, index = output[0], output[2]
        rows, k = index.shape
        b = self.rows_per_step if rows % self.rows_per_step == 0 else 1
        n = rows // b
        own = index.detach().to("cpu", torch.int64).numpy()
        demand = own.reshape(b, n, k).transpose(1, 0, 2).reshape(n, b * k)
        allowed = np.zeros((n, self.pool.num_experts), dtype=bool)
        if hasattr(self.holder, "observe"):  # the learned controller's heads read the router's input
            self.holder.observe(args[0], logits, own, b, n)
        plan = []
        for t in range(n):
            new = self.holder.step(demand[t])
            loads, steady = ([], 0) if new is None else self.slot_map.refresh(new)
            self.refreshes += new is not None
            allowed[t, self.holder.current] = True
            plan.append((loads, steady, self.slot_map.slot_of.copy()))
        self._plan = plan
        allowed_rows = np.tile(allowed, (b, 1))  # row i * n + t of the forward is position t
        if allowed_rows[np.arange(rows)[:, None], own].all():
            return output  # every row's own choice is held: the router's output, untouched
        weights, chosen = self._route(module, logits, torch.from_numpy(allowed_rows).to(logits.device))
        return (logits, weights, chosen, *tuple(output[3:]))

    # -- attachment ---------------------------------------------------------------------------
    def attach(self) -> None:
        attach_layer(self.module, self)
        if self.holder is not None:
            self._hook = self.site.router.register_forward_hook(self._on_router)

    def detach(self) -> None:
        detach_layer(self.module)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
