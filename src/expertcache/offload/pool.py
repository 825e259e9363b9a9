"""Expert memory of one offloaded layer: E experts packed in host memory, C slots on the device.

Layout (the seeds' harness): per projection one packed host tensor holding all E experts
(``gate_up [E, 2I, H]``, ``down [E, H, I]``), page-locked when the slots live on a CUDA device so
copies can run asynchronously, and one device tensor of C slots per projection
(``[C, 2I, H]``, ``[C, H, I]``). Which expert sits in which slot is not this module's business:
the :class:`~expertcache.cache.ExpertCache` decides, and :meth:`SlotPool.load` performs the
copies it asks for.

Invariants:

* a copy writes exactly one slot of each projection from exactly one host expert, and nothing
  else; eviction is not an operation here (a load simply overwrites the victim's slot);
* copies are issued on the current stream, the stream that then runs the expert matmuls, so a
  matmul queued after a load always reads the new weights and a load queued after a matmul never
  disturbs it; no other synchronisation is needed;
* slots start as NaN (floating dtypes), so reading a slot that was never loaded poisons the
  output instead of silently using stale weights.

On the CPU (``device = cpu``) the same path runs: host and device memory are the same kind, and
each load is a real ``memcpy`` into the slot buffers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .timing import Stopwatch


class SlotPool:
    """``capacity`` device slots over the ``E`` experts held by ``host`` (a pair of packed tensors)."""

    def __init__(self, host: Sequence[torch.Tensor], capacity: int, device: torch.device | str):
        self.host = tuple(host)
        self.device = torch.device(device)
        E = self.host[0].shape[0]
        if any(h.shape[0] != E for h in self.host):
            raise ValueError("host tensors must hold the same number of experts")
        if any(h.device.type != "cpu" for h in self.host):
            raise ValueError("host tensors must live in host memory")
        self.num_experts = int(E)
        self.capacity = int(min(capacity, E))
        fill = float("nan") if self.host[0].dtype.is_floating_point else 0
        self.slots = tuple(
            torch.full((self.capacity, *h.shape[1:]), fill, dtype=h.dtype, device=self.device) for h in self.host
        )
        self.expert_bytes = sum(h[0].numel() * h.element_size() for h in self.host)
        self.copies = 0
        self.stopwatch = Stopwatch(self.device)
        self._non_blocking = self.device.type == "cuda" and all(h.is_pinned() for h in self.host)

    @classmethod
    def from_weights(cls, weights: Sequence[torch.Tensor], capacity: int, device: torch.device | str) -> "SlotPool":
        """Pack ``weights`` (``[E, ...]`` each, on any device) into host memory, pinned for a CUDA pool."""
        device = torch.device(device)
        pin = device.type == "cuda"
        host = []
        for w in weights:
            h = w.detach().to("cpu")
            host.append(h.pin_memory() if pin and not h.is_pinned() else h)
        return cls(host, capacity, device)

    @torch.no_grad()
    def load(self, loads: Sequence[tuple[int, int]]) -> None:
        """Copy expert ``e`` into slot ``s`` for each ``(e, s)``, on the current stream, timed."""
        if not loads:
            return
        with self.stopwatch.time():
            for expert, slot in loads:
                for h, d in zip(self.host, self.slots):
                    d[slot].copy_(h[expert], non_blocking=self._non_blocking)
        self.copies += len(loads)

    @property
    def copy_seconds(self) -> float:
        return self.stopwatch.seconds

    def clear_counters(self) -> None:
        self.copies = 0
        self.stopwatch.clear()

    @property
    def nbytes(self) -> int:
        """Device bytes held by the slots."""
        return sum(s.numel() * s.element_size() for s in self.slots)
