"""The offloaded experts forward, plugged into transformers' experts seam under the name ``expertcache``.

transformers v5 dispatches every ``@use_experts_implementation`` experts module through
``ExpertsInterface`` by ``config._experts_implementation``. Importing this module registers
:func:`experts_forward` there as ``"expertcache"``, so a model opts in by name
(``model.set_experts_implementation("expertcache")``, done by :func:`expertcache.offload`) and
no model class is patched. An experts module with an :class:`OffloadedLayer` attached is served
from its slot pool; any other experts module runs the implementation it had before
(``grouped_mm`` when none is recorded), so layers that are not offloaded are untouched.

The offloaded forward does not reimplement the experts: it calls the model's own experts
function (the implementation the model was using: ``grouped_mm``, ``batched_mm``, ``eager``, ...)
on a :class:`SlotView` of the module, whose ``gate_up_proj`` / ``down_proj`` are the C slot
tensors and whose router indices are slot ids. The matmuls are the same; only where the weights
are read from changes.

Decode order. A forward over N rows (a teacher-forced sequence, a prefill, or one decode token)
presents its rows to the layer's :class:`~expertcache.cache.ExpertCache` in order, one cache step
per row, exactly as token-by-token decoding would: with a pool per layer, the requests a layer
sees at token t do not depend on what other layers hold, so one full-sequence forward and N
decode steps drive every pool through the same steps. The rows are then computed in as few calls
as correctness allows: a *segment* is a run of rows whose loads overwrite no slot that an earlier
row of the same segment reads, so the segment's copies can all be queued first and its rows
computed in one call. At C = E nothing is ever evicted and a whole forward is one segment.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from ..cache import ExpertCache
from ..policies import Policy, StreamFuture
from .model import ExpertsSite
from .pool import SlotPool

IMPLEMENTATION = "expertcache"
#: What an experts module without a recorded implementation runs (transformers' own default).
DEFAULT_IMPLEMENTATION = "grouped_mm"

_LAYER_ATTR = "_expertcache_layer"
_FALLBACK_ATTR = "_expertcache_fallback"


def experts_forward(self: torch.nn.Module, hidden_states, top_k_index, top_k_weights):
    """The ``"expertcache"`` experts implementation: slot pool when offloaded, else the previous one."""
    layer = self.__dict__.get(_LAYER_ATTR)
    if layer is not None:
        return layer(hidden_states, top_k_index, top_k_weights)
    return implementation_of(self, self.__dict__.get(_FALLBACK_ATTR))(self, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def implementation_of(module: torch.nn.Module, name: str | None) -> Callable:
    """The experts function called ``name`` for ``module`` (``eager`` is the class's own forward)."""
    if name is None or name == IMPLEMENTATION:
        name = DEFAULT_IMPLEMENTATION
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, type(module).forward.__wrapped__)


def set_fallback(module: torch.nn.Module, name: str | None) -> None:
    """Record the implementation ``module`` runs while it is not offloaded (``None`` clears it)."""
    if name is None:
        module.__dict__.pop(_FALLBACK_ATTR, None)
    else:
        module.__dict__[_FALLBACK_ATTR] = name


class SlotView:
    """An experts module seen through its slot pool.

    Every attribute is the module's own except ``gate_up_proj`` / ``down_proj`` (the ``[C, ...]``
    slot tensors) and ``num_experts`` (C), so the model's experts function, given slot ids instead
    of expert ids, computes the same thing from the slots.
    """

    def __init__(self, module: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor):
        self._module = module
        self.gate_up_proj = gate_up
        self.down_proj = down
        self.num_experts = int(gate_up.shape[0])

    def __getattr__(self, name):
        return getattr(self._module, name)


class OffloadedLayer:
    """One MoE layer whose experts live in host memory and are served from C device slots.

    Invariants:

    * each call steps the layer's :class:`ExpertCache` once per row, in row order, and every
      row is computed only after the copies of its own step and before any later copy that
      overwrites a slot it reads;
    * the counters add up what the cache decided: ``copies_total`` every load, ``copies_steady``
      the loads that evicted a victim (DESIGN section 2), per stream from an empty pool;
    * ``future_mismatches`` counts rows whose requested experts differ from the recorded future a
      clairvoyant policy was given (then its choices, still lossless, were made on a stale future).
    """

    def __init__(
        self,
        site: ExpertsSite,
        capacity: int,
        policy: Policy,
        compute: Callable,
        device: torch.device | str,
    ):
        experts = site.experts
        self.layer = site.layer
        self.module = experts
        self.pool = SlotPool.from_weights((experts.gate_up_proj, experts.down_proj), capacity, device)
        self.capacity = int(capacity)
        self.policy = policy
        self.cache: ExpertCache | None = None  # made by the first start_stream (a clairvoyant policy needs its future)
        self.compute = compute
        self.view = SlotView(experts, *self.pool.slots)
        self._future: np.ndarray | None = None
        self.stream_tokens = 0  # rows served since the pool last started empty
        self.clear_counters()

    # -- streams and counters ---------------------------------------------------------------
    def start_stream(self, future: np.ndarray | None = None) -> None:
        """Empty the pool's map (a new stream); ``future`` is the stream's recorded ``[T, k]`` requests."""
        self._future = None if future is None else np.asarray(future)
        stream_future = None if future is None else StreamFuture(self._future)
        if self.cache is None:
            self.cache = ExpertCache(self.capacity, self.policy, self.pool.num_experts, future=stream_future)
        else:
            self.cache.reset(stream_future)
        self.stream_tokens = 0

    def clear_counters(self) -> None:
        self.tokens = self.requests = self.copies_total = self.copies_steady = 0
        self.future_mismatches = 0
        self.pool.clear_counters()

    # -- the forward --------------------------------------------------------------------------
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ids = top_k_index.detach().to("cpu", torch.int64).numpy()
        rows = ids.shape[0]
        slot_ids = np.empty_like(ids)
        segments: list[tuple[int, int, list[tuple[int, int]]]] = []
        start, loads, read = 0, [], set()
        for t in range(rows):
            self._check_future(ids[t])
            step = self.cache.prepare(ids[t])
            self.tokens += 1
            self.stream_tokens += 1
            self.requests += step.items.size
            self.copies_total += step.misses
            self.copies_steady += len(step.evicted)
            if read and any(slot in read for _, slot in step.loads):
                segments.append((start, t, loads))
                start, loads, read = t, [], set()
            loads.extend(step.loads)
            slots = step.slots.tolist()
            read.update(slots)
            slot_ids[t] = slots
        segments.append((start, rows, loads))
        slot_index = torch.from_numpy(slot_ids).to(top_k_index.device, non_blocking=True)
        outputs = []
        for a, b, seg_loads in segments:
            self.pool.load(seg_loads)
            outputs.append(self.compute(self.view, hidden_states[a:b], slot_index[a:b], top_k_weights[a:b]))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _check_future(self, ids: np.ndarray) -> None:
        if self._future is None:
            return
        t = self.cache.t
        if t >= len(self._future) or sorted(ids[ids >= 0].tolist()) != sorted(
            x for x in self._future[t].tolist() if x >= 0
        ):
            self.future_mismatches += 1

    # -- attachment ---------------------------------------------------------------------------
    def attach(self) -> None:
        self.module.__dict__[_LAYER_ATTR] = self

    def detach(self) -> None:
        self.module.__dict__.pop(_LAYER_ATTR, None)
