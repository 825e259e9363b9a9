"""``expertcache.offload(model, capacity, policy, layers)``: a model whose experts live in host memory.

Inside the ``with`` block the chosen MoE layers keep their E experts in host memory (page-locked
when the model is on a CUDA device) and serve every forward from C device slots, a policy
deciding the copies through the same :class:`~expertcache.cache.ExpertCache` and policy objects
the simulator replays. Leaving the block puts the weights back where they were and restores the
model's experts implementation, so the model is exactly as before.

Pools. As in the simulator (docs/design.md section 2), ``pool="layer"`` (default) gives each offloaded
layer C slots of its own; ``pool="global"`` shares C slots among all of them, one cache over items
``layer index * E + expert`` stepped token by token, layer by layer (so it serves one token
position per forward: decoding).

Streams. Every pool starts empty at each sequence: with ``reset="sequence"`` (the default) a forward whose KV cache is empty
(a prefill, or a teacher-forced pass) starts a new sequence; decode steps continue it. With
``reset="none"`` the pools carry over until :meth:`OffloadRun.reset`. A batched forward (b rows)
makes one cache step per token position over the union of the rows' experts (see
:mod:`.layer`); counts equal a replay of the trace :func:`~expertcache.capture` records, which
holds that union per step.

Clairvoyant policies (``belady``, ``foresight:h``) need ``future=``, a :class:`~expertcache.Trace`
recorded in a first pass over the same sequences with every position captured (a lossless policy
never changes routing, so the first pass's requests are this pass's). With ``reset="sequence"``
sequence i of the run reads sequence i of the trace; with ``reset="none"`` the whole trace is one
stream, as the simulator replays it.

Devices. The slots live on ``device`` (default: where the model's input embeddings are). The
offloaded experts stay in host memory, page-locked when the slots are on a CUDA device; a model
loaded with its experts already in (pinned) host memory, as :func:`~expertcache.hf.load_offloaded`
does, is used as it is, so the device never holds more than the C slots of an offloaded layer.

Offloaded experts are for inference: copies run under ``no_grad``.
"""

from __future__ import annotations

import copy as _copy
from typing import Iterable

import numpy as np
import torch

from .._text import short
from ..costmodel.runs import check_slow_copies
from ..errors import ConfigError, is_int
from ..policies import Policy
from ..policies.registry import check_kind
from ..trace import Trace
from .experts import IMPLEMENTATION, implementation_of, set_fallback
from .host import host_of
from .layer import PREFETCH, OffloadedLayer, PoolState
from .pool import SlotPool
from .routing import route_for
from .model import (ExpertsSite, find_sites, forward_info, model_device, model_label, resolve_device, select_sites,
                    top_k_of)
from .stats import LayerStats, Memory, OffloadStats

RESETS = ("sequence", "none")
POOLS = ("layer", "global")


class OffloadRun:
    """The live state of :func:`offload`: attached on ``__enter__``, undone on ``__exit__``."""

    def __init__(
        self,
        model: torch.nn.Module,
        capacity: int,
        policy: "str | Policy" = "lru",
        layers: Iterable[int] | None = None,
        *,
        future: Trace | None = None,
        reset: str = "sequence",
        prefetch: str = "none",
        device: "torch.device | str | None" = None,
        pool: str = "layer",
        slow_copies: int = 1,
    ):
        if not is_int(capacity, None, 1 << 62):
            raise ConfigError(f"capacity must be an integer (at most 2**62), got {short(capacity, 40)}")
        if reset not in RESETS:
            raise ConfigError(f"reset: {reset!r} is not one of {', '.join(RESETS)}")
        if prefetch not in PREFETCH:
            raise ConfigError(f"prefetch: {prefetch!r} is not one of {', '.join(PREFETCH)}")
        if pool not in POOLS:
            raise ConfigError(f"pool: {pool!r} is not one of {', '.join(POOLS)}")
        if pool == "global" and prefetch != "none":
            raise ConfigError("prefetch needs a pool per layer (pool='layer')")
        self.slow_copies = check_slow_copies(slow_copies)
        self.pool = pool
        self.model = model
        self.capacity = int(capacity)
        rule = check_kind(policy, ("eviction", "set-holding"))  # parsed once: a Policy or a holding spec
        self.holding = None if isinstance(rule, Policy) else rule
        self.policy = rule
        if self.holding and (pool != "layer" or prefetch != "none"):
            raise ConfigError(f"policy {self.holding.spec} holds a set per layer: it needs pool='layer' and no prefetch")
        self.reset_mode = reset
        self._all_sites = find_sites(model)
        self.sites: list[ExpertsSite] = select_sites(self._all_sites, layers, model_label(model))
        self.layer_ids = [s.layer for s in self.sites]
        hosts = {host_of(s.experts).mode if host_of(s.experts) else "memory" for s in self.sites}
        if len(hosts) > 1:
            raise ConfigError(f"the offloaded layers' experts are held in several ways ({', '.join(sorted(hosts))})")
        self.host = hosts.pop()  # where the experts live between copies: memory, mmap or direct (see .host)
        # each held layer's restricted routing, checked here so unsupported routers are refused up front
        self._routes = {s.layer: route_for(s.router, s.layer, self.holding.spec) for s in self.sites} if self.holding else {}
        if hasattr(self.holding, "check_sites"):  # a learned controller's heads must fit these layers
            self.holding.check_sites(self.sites, self.capacity)
        top_k = top_k_of(model)
        self.top_k = max(top_k, 1)
        self.prefetch = prefetch
        self.device = resolve_device(device) if device is not None else model_device(model)
        if self.capacity < max(top_k, 1):
            raise ConfigError(
                f"capacity {self.capacity} is below the {top_k} experts one token requests at a layer: "
                "they could not all be resident at once"
            )
        self.future = future
        self.layers: list[OffloadedLayer] = []
        self.states: list[PoolState] = []
        self._hooks: list = []
        self._saved: list = []
        self._stream = 0  # index of the current stream (the sequence of `future` it reads)
        self._sequences = 0  # sequences started since the counters were last cleared
        self._batch = 1
        self._final_stats: OffloadStats | None = None

    # -- context --------------------------------------------------------------------------------
    def __enter__(self) -> "OffloadRun":
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        return bool(self.layers)

    def attach(self) -> None:
        """Move the experts of the chosen layers to host memory and serve them from slots."""
        if self.attached:
            raise ConfigError("this offload run is already active")
        self._check_future(self.future)
        previous = {id(s.experts): s.experts.config._experts_implementation for s in self._all_sites}
        try:
            self._offload_sites(previous)
            for site in self._all_sites:
                set_fallback(site.experts, previous[id(site.experts)])
            self._saved_impl = self.model.get_experts_implementation()
            self.model.set_experts_implementation(IMPLEMENTATION)
            for site in self.sites:
                if site.experts.config._experts_implementation != IMPLEMENTATION:
                    raise ConfigError(
                        f"{model_label(self.model)}: cannot switch the experts at layer {site.layer} to the "
                        f"{IMPLEMENTATION!r} implementation"
                    )
            for layer, nxt in zip(self.layers, [*self.layers[1:], None]):
                layer.prefetch_for(nxt, self.prefetch)
            for layer in self.layers:
                layer.attach()
            self._hooks.append(self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
            self._stream = self._sequences = 0
            self._start_streams()  # inside: a failure here had left the hook on the model, failing every later forward
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Undo :meth:`attach`: weights back on their device, the previous implementation restored."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if hasattr(self, "_saved_impl"):
            self.model.set_experts_implementation(self._saved_impl)
            del self._saved_impl
        for site in self._all_sites:
            set_fallback(site.experts, None)
        for layer in self.layers:
            layer.detach()
        for param, device, host in reversed(self._saved):
            if host.device != device:
                param.data = host.to(device)
        self._saved.clear()
        if self.layers:
            self._final_stats = self.stats()
        self.layers = []
        self.states = []

    def _offload_sites(self, previous: dict) -> None:
        """A pool per layer (one layer's experts pinned at a time), or one global pool over all."""
        def weights(site):
            return (site.experts.gate_up_proj, site.experts.down_proj)

        def compute(site):
            return implementation_of(site.experts, previous[id(site.experts)])

        if self.pool == "global":
            slots = SlotPool.from_weights(weights(self.sites[0]), self.capacity, self.device,
                                          *[weights(s) for s in self.sites[1:]],
                                          files=[host_of(s.experts) for s in self.sites])
            slots.repeat = self.slow_copies
            state = PoolState(slots, self.capacity, _copy.deepcopy(self.policy), steps_per_token=len(self.sites),
                              layer_ids=[s.layer for s in self.sites])
            self.states.append(state)
            for i, site in enumerate(self.sites):
                self._hold(site, slots.sources[i])
                self.layers.append(OffloadedLayer(site, state, compute(site), self.top_k, offset=i * slots.num_experts))
            return
        for site in self.sites:
            slots = SlotPool.from_weights(weights(site), self.capacity, self.device, files=[host_of(site.experts)])
            slots.repeat = self.slow_copies
            state = PoolState(slots, self.capacity, None if self.holding else _copy.deepcopy(self.policy),
                              layer_ids=[site.layer])
            self.states.append(state)
            self._hold(site, slots.host)
            layer = OffloadedLayer(site, state, compute(site), self.top_k)
            if self.holding:
                layer.hold_sets(self.holding, self._routes[site.layer])
            self.layers.append(layer)

    def _hold(self, site: ExpertsSite, host) -> None:
        """Point the site's expert parameters at their host tensors (a device copy is released)."""
        for param, h in zip((site.experts.gate_up_proj, site.experts.down_proj), host):
            self._saved.append((param, param.device, h))
            if h.data_ptr() != param.data_ptr():
                param.data = h

    # -- streams --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new stream: every pool empties (with ``reset="sequence"``, the next sequence of
        ``future`` is used; with ``"none"``, a stream after the first has no recorded future)."""
        if self._served():
            self._stream += 1
        self._start_streams()

    def clear_counters(self) -> None:
        """Zero the counters (as each layer's and pool's ``clear_counters``); pools keep what they hold
        and the stream goes on (e.g. to time a warm pool)."""
        for layer in self.layers:
            layer.clear_counters()
        for state in self.states:
            state.clear_counters()
        self._sequences = 0
        self._batch = 1

    def rewind(self) -> None:
        """Forget everything served so far: back at sequence 0 of ``future`` with empty pools, counters
        cleared (:meth:`reset` only starts the next stream; :meth:`clear_counters` only zeroes counts)."""
        self._stream = 0
        self._start_streams()
        self.clear_counters()

    def _served(self) -> bool:
        """Whether the current sequence has served any token yet."""
        return any(layer.stream_tokens for layer in self.layers)

    def _start_streams(self) -> None:
        for layer in self.layers:
            layer.start_stream()
        if self.pool == "global":
            self.states[0].start(self._global_future(self._stream))
        else:
            for layer in self.layers:
                layer.state.start(self._future_of(layer.layer, self._stream))

    def _on_forward(self, module, args, kwargs):
        info = forward_info(args, kwargs)
        if info.starts_sequence:
            if self.reset_mode == "sequence":
                self.reset()
            self._sequences += 1
        self._batch = max(self._batch, info.batch)
        for layer in self.layers:
            layer.rows_per_step = info.batch

    def _future_of(self, layer: int, stream: int) -> np.ndarray | None:
        """The recorded requests of ``layer`` in stream ``stream`` (``[T, k]``), for clairvoyant
        policies and oracle prefetch; ``None`` when neither needs it."""
        if self.future is None or not (self.policy.needs_future or self.prefetch == "oracle"):
            return None
        col = self.future.layer_ids.index(layer)
        empty = np.zeros((0, self.future.top_k), dtype=np.int64)
        if self.reset_mode == "none":  # one stream over the whole trace, as the simulator replays it
            return self.future.experts[:, col] if stream == 0 else empty
        bounds = self.future.seq_bounds
        if stream >= len(bounds) - 1:
            return empty
        return self.future.experts[bounds[stream] : bounds[stream + 1], col]

    def _global_future(self, stream: int) -> np.ndarray | None:
        """The global pool's recorded steps: token by token, layer by layer, items ``i * E + e``."""
        parts = [self._future_of(layer.layer, stream) for layer in self.layers]
        if parts[0] is None:
            return None
        ex = np.stack(parts, axis=1).astype(np.int64)  # [T, L, k]
        offsets = np.array([layer.offset for layer in self.layers], dtype=np.int64)[None, :, None]
        return np.where(ex >= 0, ex + offsets, -1).reshape(-1, ex.shape[2])

    def _check_future(self, future: Trace | None) -> None:
        if not (self.policy.needs_future or self.prefetch == "oracle"):
            return
        if future is None:
            who = f"policy {self.policy.spec!r} is clairvoyant" if self.policy.needs_future else "prefetch 'oracle' reads the future"
            raise ConfigError(
                f"{who}: pass future=<a Trace recorded in a first pass "
                "over the same sequences> (e.g. with expertcache.capture)"
            )
        missing = [lid for lid in self.layer_ids if lid not in future.layer_ids]
        if missing:
            raise ConfigError(f"future: the recorded trace has no layer {missing[0]} (its layers: {future.layer_ids})")
        E = self.sites[0].num_experts
        if future.num_experts != E:
            raise ConfigError(f"future: the recorded trace has {future.num_experts} experts, the model {E}")

    # -- results --------------------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        """Counts so far (after the block ends: the final counts)."""
        if not self.layers:
            if self._final_stats is None:
                raise ConfigError("this offload run has not served anything yet")
            return self._final_stats
        per_layer = [
            LayerStats(
                l.layer, l.requests, l.copies_total, l.copies_steady,
                copy_seconds=l.copy_seconds, future_mismatches=l.future_mismatches, switches=l.switches,
                refreshes=l.refreshes, **l.prefetch_counts(), **l.tier_counts(),
            )
            for l in self.layers
        ]
        first = self.layers[0]
        return OffloadStats(
            policy=self.policy.spec, capacity=self.capacity, pool=self.pool, reset=self.reset_mode, warm=0.0,
            layers=list(self.layer_ids), tokens=first.tokens,
            requests=sum(c.requests for c in per_layer),
            copies_total=sum(c.copies_total for c in per_layer),
            copies_steady=sum(c.copies_steady for c in per_layer),
            per_layer=per_layer, engine="live", needs_future=self.policy.needs_future,
            device=str(first.pool.device), sequences=max(self._sequences, int(first.tokens > 0)), batch=self._batch,
            expert_bytes=first.pool.expert_bytes, prefetch=self.prefetch, slow_copies=self.slow_copies,
            host=self.host,
            lossless=self.holding is None,
            memory=self.memory(),
        )

    def memory(self) -> Memory:
        """Host bytes of the offloaded experts, device bytes of the slots and of the other weights,
        and (CUDA) torch's peak allocated bytes on the device."""
        host = {id(t): t for state in self.states for src in state.pool.sources for t in src}
        on_device = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.device.type == self.device.type and id(t) not in host and t.untyped_storage().data_ptr():
                on_device[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return Memory(
            host_expert_bytes=sum(state.pool.host_bytes for state in self.states),
            file_expert_bytes=sum(state.pool.file_bytes for state in self.states),
            slot_bytes=sum(state.pool.nbytes for state in self.states),
            device_weight_bytes=sum(on_device.values()) if self.device.type == "cuda" else 0,
            device_peak_bytes=peak,
            pinned=any(f is None for st in self.states for f in st.pool.files) and all(
                h.is_pinned() for st in self.states for src, f in zip(st.pool.sources, st.pool.files) if f is None
                for h in src),
        )


def offload(model: torch.nn.Module, capacity: int, policy: "str | Policy" = "lru",
            layers: Iterable[int] | None = None, **options) -> OffloadRun:
    """Offload the experts of ``layers`` (default: every MoE layer) behind ``capacity`` slots each.

    Use as a context manager; see the module docstring. ``policy`` is a spec such as ``"lru"``,
    ``"decayed:0.9"`` or ``"belady"``, or a policy object (each layer gets its own copy). Options:
    ``future=`` (a recorded :class:`~expertcache.Trace`, required by clairvoyant policies and by
    ``prefetch="oracle"``), ``reset=`` (``"sequence"``, the default, or ``"none"``), ``prefetch=``
    (``"none"``, the default, ``"next-layer"`` or ``"oracle"``; see :mod:`.layer`), ``device=``
    (where the slots live; default: the device of the model's input embeddings) and ``pool=``
    (``"layer"``, the default: ``capacity`` slots per layer; ``"global"``: ``capacity`` slots shared
    by all offloaded layers, one token position per forward) and ``slow_copies=N`` (every copy
    made N times and counted once: a slower link). ``policy`` may also be a set-holding (lossy)
    rule, ``"dwell:k[:w]"``, ``"prefix:P"`` (see :mod:`.holding`) or the learned controller
    ``"controller:heads.pt:THR[:W]"`` (see :mod:`.controller`).
    """
    return OffloadRun(model, capacity, policy, layers, **options)

