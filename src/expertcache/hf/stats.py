"""What a live offload run reports: counts equal to a replay's, plus copy time, prefetch and memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sim.replay import LayerCounts, ReplayResult


@dataclass
class LayerStats(LayerCounts):
    """One offloaded layer's counts (as :class:`~expertcache.sim.LayerCounts`) and its copy time."""

    copy_seconds: float = 0.0
    future_mismatches: int = 0
    switches: int = 0
    refreshes: int = 0
    prefetch_copies: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    prefetch_pending: int = 0
    host_loads: int = 0
    page_cache_loads: int = 0
    device_loads: int = 0
    page_cache_bytes: int = 0
    device_bytes: int = 0

    @property
    def copies_fill(self) -> int:
        return self.copies_total - self.copies_steady

    def to_dict(self) -> dict:
        return {**super().to_dict(), "copies_fill": self.copies_fill}


@dataclass
class Memory:
    """Bytes a run holds. ``device_peak_bytes``: torch's peak allocated bytes on a CUDA device since
    the figure was last reset (``None`` on the CPU, where host and device are the same memory)."""

    host_expert_bytes: int = 0
    file_expert_bytes: int = 0
    slot_bytes: int = 0
    device_weight_bytes: int = 0
    device_peak_bytes: int | None = None
    pinned: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class OffloadStats(ReplayResult):
    """Counts of a live run: a :class:`~expertcache.sim.ReplayResult` (same fields, same definitions,
    equal to the replay of the run's captured trace) plus what only a live run measures.

    ``tokens`` is the number of cache steps of one layer (token positions; a batch step counts
    once); ``copies_steady`` counts demand loads that evicted a victim (a pool is filling until it
    first holds C experts); ``copies_per_token`` = steady copies over all offloaded layers /
    tokens; ``copy_seconds`` is the time the copy stream spent copying (device events on CUDA,
    ``perf_counter`` on the CPU). Prefetched loads are not in ``copies_*``: ``prefetch_copies`` =
    ``prefetch_hits + prefetch_wasted + prefetch_pending``.
    """

    device: str = "cpu"
    sequences: int = 0
    batch: int = 1
    expert_bytes: int = 0
    prefetch: str = "none"
    slow_copies: int = 1
    lossless: bool = True
    host: str = "memory"
    memory: Memory = field(default_factory=Memory)

    def _total(self, name: str):
        return sum(getattr(c, name) for c in self.per_layer)

    # totals over the offloaded layers, derived from ``per_layer``
    copy_seconds = property(lambda self: self._total("copy_seconds"))
    future_mismatches = property(lambda self: self._total("future_mismatches"))
    switches = property(lambda self: self._total("switches"))
    refreshes = property(lambda self: self._total("refreshes"))
    prefetch_copies = property(lambda self: self._total("prefetch_copies"))
    prefetch_hits = property(lambda self: self._total("prefetch_hits"))
    prefetch_wasted = property(lambda self: self._total("prefetch_wasted"))
    prefetch_pending = property(lambda self: self._total("prefetch_pending"))

    def tier_hits(self) -> dict:
        """Where each request was served: ``slot`` (already resident: requests minus demand copies),
        then per load (demand and prefetch) ``host_memory``, ``page_cache`` or ``device``, with the
        bytes of the resident and the missing pages (docs/offload.md, "Host tiers")."""
        return {"slot": self.requests - self.copies_total, "host_memory": self._total("host_loads"),
                "page_cache": self._total("page_cache_loads"), "device": self._total("device_loads"),
                "page_cache_bytes": self._total("page_cache_bytes"), "device_bytes": self._total("device_bytes")}

    @property
    def switch_rate(self) -> float:
        """Share of token steps (after each stream's first) whose chosen expert set differs from the
        previous token's at the same layer, over all offloaded layers."""
        pairs = (self.tokens - self.sequences) * len(self.layers)
        return self.switches / pairs if pairs > 0 else float("nan")

    @property
    def copy_bandwidth(self) -> float:
        """Bytes per second over all copies, demand and prefetch (NaN before the first copy)."""
        moved = (self.copies_total + self.prefetch_copies) * self.expert_bytes
        return moved / self.copy_seconds if self.copy_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        d = super().to_dict()
        for replay_only in ("gap_recovered", "engine", "seconds", "warm"):
            d.pop(replay_only)
        d.update(
            device=self.device, sequences=self.sequences, batch=self.batch, copy_seconds=self.copy_seconds,
            copy_bytes_per_s=self.copy_bandwidth, expert_bytes=self.expert_bytes,
            future_mismatches=self.future_mismatches, prefetch=self.prefetch, slow_copies=self.slow_copies,
            lossless=self.lossless, host=self.host, tier_hits=self.tier_hits(), switches=self.switches, switch_rate=self.switch_rate, refreshes=self.refreshes,
            prefetch_copies=self.prefetch_copies, prefetch_hits=self.prefetch_hits,
            prefetch_wasted=self.prefetch_wasted, prefetch_pending=self.prefetch_pending,
            memory=self.memory.to_dict(),
        )
        return d

    def __str__(self) -> str:
        head = (
            f"offload {self.policy} at C={self.capacity} on {self.device}, layers {','.join(map(str, self.layers))}: "
            f"{self.tokens} tokens in {self.sequences} sequence(s); copies {self.copies_total} "
            f"(fill {self.copies_fill}, steady {self.copies_steady}), {self.copies_per_token:.3f} steady copies/token, "
            f"copy time {self.copy_seconds:.4f} s"
        )
        if self.prefetch != "none":
            head += (
                f"; prefetch {self.prefetch}: {self.prefetch_copies} copies, {self.prefetch_hits} used, "
                f"{self.prefetch_wasted} wasted, {self.prefetch_pending} pending"
            )
        if self.future_mismatches:
            head += f"; {self.future_mismatches} steps differed from the recorded future"
        rows = ["layer  requests  copies  fill  steady  prefetched  copy_s"]
        for c in self.per_layer:
            rows.append(
                f"{c.layer:>5}  {c.requests:>8}  {c.copies_total:>6}  {c.copies_fill:>4}  {c.copies_steady:>6}  "
                f"{c.prefetch_copies:>10}  {c.copy_seconds:.4f}"
            )
        return "\n".join([head, *rows])
