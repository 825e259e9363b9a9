"""``expertcache.offload(model, capacity, policy, layers)``: a model whose experts live in host memory.

Inside the ``with`` block the chosen MoE layers keep their E experts in host memory (page-locked
when the model is on a CUDA device) and serve every forward from C device slots, a policy
deciding the copies through the same :class:`~expertcache.cache.ExpertCache` and policy objects
the simulator replays. Leaving the block puts the weights back where they were and restores the
model's experts implementation, so the model is exactly as before.

Streams. As in the simulator (DESIGN section 2) each layer has its own pool and every pool starts
empty at each sequence: with ``reset="sequence"`` (the default) a forward whose KV cache is empty
(a prefill, or a teacher-forced pass) starts a new sequence; decode steps continue it. With
``reset="none"`` the pools carry over until :meth:`OffloadRun.reset`. Rows of a batched forward are
served in order as one stream; counts equal a replay of the captured trace for batch size 1.

Clairvoyant policies (``belady``, ``foresight:h``) need ``future=``, a :class:`~expertcache.Trace`
recorded in a first pass over the same sequences with every position captured (a lossless policy
never changes routing, so the first pass's requests are this pass's). Sequence i of the run
reads sequence i of the trace.

Offloaded experts are for inference: copies run under ``no_grad``.
"""

from __future__ import annotations

import copy as _copy
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from ..errors import ConfigError
from ..policies import Policy, make_policy
from ..sim.replay import LayerCounts, ReplayResult
from ..trace import Trace
from .experts import IMPLEMENTATION, OffloadedLayer, implementation_of, set_fallback
from .model import ExpertsSite, find_sites, forward_info, model_label, select_sites

RESETS = ("sequence", "none")


@dataclass
class LayerStats(LayerCounts):
    """One offloaded layer's counts (as :class:`~expertcache.sim.LayerCounts`) and its copy time."""

    copy_seconds: float = 0.0
    future_mismatches: int = 0

    @property
    def copies_fill(self) -> int:
        return self.copies_total - self.copies_steady

    def to_dict(self) -> dict:
        return {**super().to_dict(), "copies_fill": self.copies_fill}


@dataclass
class OffloadStats(ReplayResult):
    """Counts of a live run: a :class:`~expertcache.sim.ReplayResult` (same fields, same definitions,
    equal to the replay of the run's captured trace) plus what only a live run measures.

    ``tokens`` is the number of positions served (cache steps of one layer); ``copies_steady``
    counts loads that evicted a victim (a pool is filling until it first holds C experts);
    ``copies_per_token`` = steady copies over all offloaded layers / tokens; ``copy_seconds`` is the
    measured time of the copies (device events on CUDA, ``perf_counter`` on the CPU).
    """

    device: str = "cpu"
    sequences: int = 0
    copy_seconds: float = 0.0
    expert_bytes: int = 0
    future_mismatches: int = 0

    @property
    def copy_bandwidth(self) -> float:
        """Bytes per second over all copies (NaN before the first copy)."""
        moved = self.copies_total * self.expert_bytes
        return moved / self.copy_seconds if self.copy_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        d = super().to_dict()
        for replay_only in ("gap_recovered", "engine", "seconds", "warm"):
            d.pop(replay_only)
        d.update(
            device=self.device, sequences=self.sequences, copy_seconds=self.copy_seconds,
            copy_bytes_per_s=self.copy_bandwidth, expert_bytes=self.expert_bytes,
            future_mismatches=self.future_mismatches,
        )
        return d

    def __str__(self) -> str:
        head = (
            f"offload {self.policy} at C={self.capacity} on {self.device}, layers {','.join(map(str, self.layers))}: "
            f"{self.tokens} tokens in {self.sequences} sequence(s); copies {self.copies_total} "
            f"(fill {self.copies_fill}, steady {self.copies_steady}), {self.copies_per_token:.3f} steady copies/token, "
            f"copy time {self.copy_seconds:.4f} s"
        )
        if self.future_mismatches:
            head += f"; {self.future_mismatches} steps differed from the recorded future"
        rows = ["layer  requests  copies  fill  steady  copy_s"]
        for c in self.per_layer:
            rows.append(
                f"{c.layer:>5}  {c.requests:>8}  {c.copies_total:>6}  {c.copies_fill:>4}  {c.copies_steady:>6}  {c.copy_seconds:.4f}"
            )
        return "\n".join([head, *rows])


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
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise ConfigError(f"capacity must be an integer, got {capacity!r}")
        if reset not in RESETS:
            raise ConfigError(f"reset: {reset!r} is not one of {', '.join(RESETS)}")
        self.model = model
        self.capacity = int(capacity)
        self.policy = make_policy(policy)
        self.reset_mode = reset
        self._all_sites = find_sites(model)
        self.sites: list[ExpertsSite] = select_sites(self._all_sites, layers, model_label(model))
        self.layer_ids = [s.layer for s in self.sites]
        top_k = _top_k(model)
        if self.capacity < max(top_k, 1):
            raise ConfigError(
                f"capacity {self.capacity} is below the {top_k} experts one token requests at a layer: "
                "they could not all be resident at once"
            )
        self.future = future
        self.layers: list[OffloadedLayer] = []
        self._hooks: list = []
        self._saved: list = []
        self._sequence = 0
        self._finished = 0  # sequences served to the end since the counters were last cleared
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
            for site in self.sites:
                self.layers.append(self._offload_site(site, previous[id(site.experts)]))
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
            for layer in self.layers:
                layer.attach()
            self._hooks.append(self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        except BaseException:
            self.detach()
            raise
        self._sequence = self._finished = 0
        self._start_streams()

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

    def _offload_site(self, site: ExpertsSite, previous: str | None) -> OffloadedLayer:
        experts = site.experts
        device = experts.gate_up_proj.device
        layer = OffloadedLayer(
            site, self.capacity, _copy.deepcopy(self.policy), implementation_of(experts, previous), device
        )
        for param, host in zip((experts.gate_up_proj, experts.down_proj), layer.pool.host):
            self._saved.append((param, param.device, host))
            if host.data_ptr() != param.data_ptr():
                param.data = host  # the device copy is released; the model now holds host memory
        return layer

    # -- streams --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new sequence: every pool empties (the next sequence of ``future`` is used)."""
        if self._served():
            self._sequence += 1
            self._finished += 1
        self._start_streams()

    def clear_stats(self) -> None:
        """Zero the counters; pools keep what they hold (e.g. to time a warm pool)."""
        for layer in self.layers:
            layer.clear_counters()
        self._finished = 0

    def restart(self) -> None:
        """Forget everything served so far: counters cleared, back at sequence 0 with empty pools."""
        self.clear_stats()
        self._sequence = 0
        self._start_streams()

    def _served(self) -> bool:
        """Whether the current sequence has served any token yet."""
        return any(layer.stream_tokens for layer in self.layers)

    def _start_streams(self) -> None:
        for layer in self.layers:
            layer.start_stream(self._future_of(layer.layer, self._sequence))

    def _on_forward(self, module, args, kwargs):
        if self.reset_mode == "sequence" and forward_info(args, kwargs).starts_sequence:
            self.reset()

    def _future_of(self, layer: int, sequence: int) -> np.ndarray | None:
        if self.future is None or not self.policy.needs_future:
            return None
        bounds = self.future.seq_bounds
        if sequence >= len(bounds) - 1:
            return np.zeros((0, self.future.top_k), dtype=np.int64)
        col = self.future.layer_ids.index(layer)
        return self.future.experts[bounds[sequence] : bounds[sequence + 1], col]

    def _check_future(self, future: Trace | None) -> None:
        if not self.policy.needs_future:
            return
        if future is None:
            raise ConfigError(
                f"policy {self.policy.spec!r} is clairvoyant: pass future=<a Trace recorded in a first pass "
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
                copy_seconds=l.pool.copy_seconds, future_mismatches=l.future_mismatches,
            )
            for l in self.layers
        ]
        first = self.layers[0]
        return OffloadStats(
            policy=self.policy.spec, capacity=self.capacity, pool="layer", reset=self.reset_mode, warm=0.0,
            layers=list(self.layer_ids), tokens=first.tokens,
            requests=sum(c.requests for c in per_layer),
            copies_total=sum(c.copies_total for c in per_layer),
            copies_steady=sum(c.copies_steady for c in per_layer),
            per_layer=per_layer, engine="live",
            device=str(first.pool.device), sequences=self._finished + int(self._served()),
            copy_seconds=sum(c.copy_seconds for c in per_layer), expert_bytes=first.pool.expert_bytes,
            future_mismatches=sum(c.future_mismatches for c in per_layer),
        )


def offload(model: torch.nn.Module, capacity: int, policy: "str | Policy" = "lru",
            layers: Iterable[int] | None = None, **options) -> OffloadRun:
    """Offload the experts of ``layers`` (default: every MoE layer) behind ``capacity`` slots each.

    Use as a context manager; see the module docstring. ``policy`` is a spec such as ``"lru"``,
    ``"decayed:0.9"`` or ``"belady"``, or a policy object (each layer gets its own copy). Options:
    ``future=`` (a recorded :class:`~expertcache.Trace`, required by clairvoyant policies) and
    ``reset=`` (``"sequence"``, the default, or ``"none"``).
    """
    return OffloadRun(model, capacity, policy, layers, **options)


def _top_k(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for cfg_ in (cfg, getattr(cfg, "text_config", None)):
        for key in ("num_experts_per_tok", "moe_top_k", "top_k"):
            value = getattr(cfg_, key, None)
            if isinstance(value, int):
                return value
    return 1
