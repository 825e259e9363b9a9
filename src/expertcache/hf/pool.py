"""Expert memory of one offloaded layer: E experts packed in host memory, C slots on the device.

Layout (the seeds' harness): per projection one packed host tensor holding all E experts
(``gate_up [E, 2I, H]``, ``down [E, H, I]``), page-locked when the slots live on a CUDA device so
copies run asynchronously, and one device tensor of C slots per projection (``[C, 2I, H]``,
``[C, H, I]``). Which expert sits in which slot is not this module's business: the
:class:`~expertcache.cache.ExpertCache` decides, and :meth:`SlotPool.load` performs the copies.

Invariants:

* a copy writes exactly one slot of each projection from exactly one host expert, and nothing
  else; eviction is not an operation here (a load simply overwrites the victim's slot);
* copies run on the pool's copy stream (:mod:`.streams`) and a matmul reads a slot only after
  :meth:`SlotPool.before_read` (it waits for the copies into the slots it reads) and is declared
  with :meth:`SlotPool.after_read` (a later copy into those slots waits for it);
* each expert exists once in host memory: :meth:`SlotPool.from_weights` pins layer weights by
  copying them into a page-locked buffer and the caller drops the unpinned original, and host
  tensors that are already where they belong are used as they are (no copy);
* slots start as NaN (floating dtypes), so reading a slot that was never loaded poisons the
  output instead of silently using stale weights.

On the CPU (``device = cpu``) the same path runs: host and device memory are the same kind, each
load is a real ``memcpy`` into the slot buffers, and the stream calls are no-ops.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .streams import SlotSync
from .timing import Stopwatch


class SlotPool:
    """``capacity`` device slots over the experts held in host memory by one or more *sources*.

    A source is one layer's pair of packed host tensors (``gate_up [E, 2I, H]``, ``down [E, H, I]``).
    A per-layer pool has one source and item ``e`` is expert ``e``; a global pool (every offloaded
    layer sharing C slots) has one source per layer and item ``s * E + e`` is expert ``e`` of source
    ``s``, the numbering of the simulator's global pool.
    """

    def __init__(self, host: Sequence[torch.Tensor], capacity: int, device: torch.device | str,
                 *more_sources: Sequence[torch.Tensor], files: Sequence | None = None):
        self.sources = [tuple(host), *(tuple(m) for m in more_sources)]
        # per source: a FileExperts (.host) serving its experts from the checkpoint's files, or None (host memory)
        self.files = list(files) if files is not None else [None] * len(self.sources)
        self.host = self.sources[0]
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        E = self.host[0].shape[0]
        shapes = [tuple(h.shape) for h in self.host]
        for src in self.sources:
            if [tuple(h.shape) for h in src] != shapes or any(h.dtype != self.host[0].dtype for h in src):
                raise ValueError("every source must hold experts of the same shapes and dtype")
            if any(h.device.type != "cpu" for h in src):
                raise ValueError("host tensors must live in host memory")
        self.num_experts = int(E)
        self.num_items = int(E) * len(self.sources)
        self.capacity = int(min(capacity, self.num_items))
        fill = float("nan") if self.host[0].dtype.is_floating_point else 0
        self.slots = tuple(
            torch.full((self.capacity, *h.shape[1:]), fill, dtype=h.dtype, device=self.device) for h in self.host
        )
        self.expert_bytes = sum(h[0].numel() * h.element_size() for h in self.host)
        self.copies = 0
        self.repeat = 1  # each copy made this many times and counted once (``slow_copies``: a slower link)
        self.sync = SlotSync(self.device, self.capacity)
        self.stopwatch = Stopwatch(self.device, stream=self.sync.copy_stream)
        self._non_blocking = self.device.type == "cuda" and all(
            h.is_pinned() for src, f in zip(self.sources, self.files) if f is None for h in src)

    @classmethod
    def from_weights(cls, weights: Sequence[torch.Tensor], capacity: int, device: torch.device | str,
                     *more: Sequence[torch.Tensor], files: Sequence | None = None) -> "SlotPool":
        """Host tensors for ``weights`` (``[E, ...]`` each, on any device), page-locked for a CUDA pool;
        ``more``: the weights of further sources (a global pool); ``files``: per source, the
        :class:`~.host.FileExperts` serving it from the checkpoint's files (its weights are then
        placeholders, used as they are), or ``None``.

        A weight already in host memory (and pinned, for a CUDA pool) is used as it is; otherwise
        it is copied once, straight into its final (pinned) host buffer.
        """
        device = torch.device(device)
        pin = device.type == "cuda"
        files = list(files) if files is not None else [None] * (1 + len(more))
        sources = [[w.detach() if f is not None else host_tensor(w, pin) for w in ws]
                   for ws, f in zip((weights, *more), files)]
        return cls(sources[0], capacity, device, *sources[1:], files=files)

    def stopwatch_for_copies(self) -> Stopwatch:
        """A new stopwatch timing on this pool's copy stream (one per layer of a shared pool)."""
        return Stopwatch(self.device, stream=self.sync.copy_stream)

    @torch.no_grad()
    def load(self, loads: Sequence[tuple[int, int]], watch: Stopwatch | None = None) -> None:
        """Copy item ``i`` into slot ``s`` for each ``(i, s)`` on the copy stream, timed there (by
        ``watch`` when given, else the pool's own stopwatch)."""
        if not loads:
            return
        sync, E = self.sync, self.num_experts
        with sync.copying():
            for _, slot in loads:  # waits for the matmuls still reading these slots, outside the timed span
                sync.before_overwrite(slot)
            with (watch or self.stopwatch).time():
                for item, slot in loads:
                    source, expert = divmod(item, E)
                    files = self.files[source]
                    for r in range(self.repeat):
                        if files is not None:  # read from the checkpoint's files (mmap or O_DIRECT)
                            files.copy_into(expert, [d[slot] for d in self.slots], count=r == 0)
                            continue
                        for h, d in zip(self.sources[source], self.slots):
                            d[slot].copy_(h[expert], non_blocking=self._non_blocking)
                    sync.copied(slot)
        self.copies += len(loads)

    def before_read(self, slots: Iterable[int]) -> None:
        self.sync.before_read(slots)

    def after_read(self, slots: Iterable[int]) -> None:
        self.sync.after_read(slots)

    @property
    def copy_seconds(self) -> float:
        """Time the copies took on the copy stream (events on CUDA, ``perf_counter`` on the CPU)."""
        return self.stopwatch.seconds

    def clear_counters(self) -> None:
        self.copies = 0
        self.stopwatch.clear()
        for f in self.files:
            if f is not None:
                f.clear_counters()

    @property
    def nbytes(self) -> int:
        """Device bytes held by the slots."""
        return sum(s.numel() * s.element_size() for s in self.slots)

    @property
    def host_bytes(self) -> int:
        """Host bytes held by the packed experts of every source (sources served from files hold none)."""
        return sum(h.numel() * h.element_size() for src, f in zip(self.sources, self.files) if f is None for h in src)

    @property
    def file_bytes(self) -> int:
        """Bytes of the experts left in the checkpoint's files (host ``mmap`` / ``direct``)."""
        return sum(f.file_bytes for f in self.files if f is not None)


def host_tensor(weight: torch.Tensor, pin: bool) -> torch.Tensor:
    """``weight`` in host memory (page-locked when ``pin``), copied only when it is not already so."""
    w = weight.detach()
    if w.device.type == "cpu" and (not pin or w.is_pinned()):
        return w
    out = torch.empty(w.shape, dtype=w.dtype, device="cpu", pin_memory=pin)
    out.copy_(w)
    return out
