"""Foresight curve: how much of the LRU-to-Belady gap a limited look-ahead recovers.

``foresight:h`` is farthest-future eviction that sees only the next ``h`` tokens
(docs/semantics.md). Its *gap recovered* at horizon h is ``(steady(lru) - steady(foresight:h)) /
(steady(lru) - steady(belady))`` -- 0 for LRU, 1 for Belady, undefined (``None``) when LRU and
Belady tie. The causal rules (LFU, decayed frequency, mean interval) get the same number, which
places each of them at an equivalent foresight (as in the eviction paper's Fig. 2, where the
causal rules sit near two tokens).

``foresight:0`` sees nothing (every candidate's next request lies beyond the horizon) and is LRU,
so the curve starts at 0; it usually rises towards 1 with h, but need not be monotone, and may pass
1, since farthest-future eviction is not optimal for grouped requests (docs/bounds.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ...errors import ConfigError
from ...trace import Trace
from ..layout import build_layout
from ..replay import ReplayResult, fill_gap, replay_layout
from .mrc import Progress

DEFAULT_HORIZONS = (1, 2, 4, 8, 16, 32, 64)
CAUSAL_RULES = ("lfu", "decayed", "mean-interval")


@dataclass
class ForesightCurve:
    """Results at one capacity: the two ends (``lru``, ``belady``), ``foresight:h`` for each
    horizon, and the causal ``references``. Every result's ``gap_recovered`` is filled."""

    capacity: int
    horizons: list[int]
    lru: ReplayResult
    belady: ReplayResult
    foresight: list[ReplayResult]
    references: list[ReplayResult] = field(default_factory=list)

    @property
    def gap(self) -> list[float | None]:
        """Gap recovered at each horizon (``None`` when LRU and Belady tie)."""
        return [r.gap_recovered for r in self.foresight]

    @property
    def results(self) -> list[ReplayResult]:
        """Every result: lru, the horizons in order, belady, then the references."""
        return [self.lru, *self.foresight, self.belady, *self.references]

    def records(self) -> list[dict]:
        """One flat record per result in :attr:`results` order (no per-layer detail), tagged with
        its ``role`` (``bound``, ``foresight`` or ``reference``) and, for foresight, its ``horizon``."""
        tagged = [(self.lru, "bound", None)]
        tagged += [(r, "foresight", h) for r, h in zip(self.foresight, self.horizons)]
        tagged += [(self.belady, "bound", None)] + [(r, "reference", None) for r in self.references]
        out = []
        for r, role, h in tagged:
            rec = {k: v for k, v in r.to_dict().items() if k != "per_layer"}
            out.append(rec | {"role": role, "horizon": h})
        return out


def foresight_curve(
    trace: Trace,
    capacity: int,
    horizons: Iterable[int] = DEFAULT_HORIZONS,
    references: Sequence[str] = CAUSAL_RULES,
    *,
    pool: str = "layer",
    reset: str = "sequence",
    layers: Iterable[int] | None = None,
    warm: float = 0.0,
    engine: str = "auto",
    progress: Progress | None = None,
) -> ForesightCurve:
    """Gap recovered by ``foresight:h`` for each horizon ``h`` (tokens), with the causal rules as
    references, all at one ``capacity`` on one layout. Replay options as in
    :func:`~expertcache.sim.replay.replay`; ``progress`` is called once per replay."""
    hs = sorted(set(int(h) for h in horizons))
    if not hs or hs[0] < 0:
        raise ConfigError(f"horizons: expected non-negative token counts, got {list(horizons)!r}")
    layout = build_layout(trace, pool=pool, reset=reset, layers=layers, warm=warm)
    tick = progress or (lambda n: None)

    def run(spec: str) -> ReplayResult:
        r = replay_layout(layout, capacity, spec, engine=engine)
        tick(1)
        return r

    lru, belady = run("lru"), run("belady")
    ahead = [run(f"foresight:{h}") for h in hs]
    refs = [run(spec) for spec in references]
    curve = ForesightCurve(capacity=lru.capacity, horizons=hs, lru=lru, belady=belady, foresight=ahead, references=refs)
    fill_gap(curve.results)
    return curve
