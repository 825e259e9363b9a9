"""What shapes the streams a replay serves, as one checked value (docs/semantics.md).

:class:`StreamOptions` holds the pool kind, the reset rule, the layer selection, the warm fraction
and the admission rule. It is checked once, when it is made (one ConfigError line naming the
option), so every command and API that lays a trace out (:func:`~expertcache.sim.layout.build_layout`)
accepts and refuses the same combinations. The capacity is not part of it: whether a capacity
fits depends on the trace (the widest group), and is checked against the layout
(:func:`~expertcache.sim.replay.check_capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..errors import ConfigError, is_int, is_real

POOLS = ("layer", "global")
RESETS = ("sequence", "none")
ADMISSIONS = ("all", "second")


@dataclass(frozen=True)
class StreamOptions:
    """``pool``: ``"layer"`` (one pool per layer) or ``"global"`` (one pool of ``(layer, expert)``
    items); ``reset``: ``"sequence"`` (pools start empty at each sequence) or ``"none"``;
    ``layers``: layer ids to keep (``None``: all); ``warm``: unscored warm-up
    fraction of each stream in [0, 1); ``admission``: ``"all"`` or ``"second"`` (an expert's first
    request in a stream is streamed, not inserted)."""

    pool: str = "layer"
    reset: str = "sequence"
    layers: tuple[int, ...] | None = None
    warm: float = 0.0
    admission: str = "all"

    def __post_init__(self):
        if self.pool not in POOLS:
            raise ConfigError(f"--pool: {self.pool!r} is not one of {', '.join(POOLS)}")
        if self.reset not in RESETS:
            raise ConfigError(f"--reset: {self.reset!r} is not one of {', '.join(RESETS)}")
        if not is_real(self.warm) or not 0.0 <= self.warm < 1.0:
            raise ConfigError(f"--warm: {self.warm!r} is outside [0, 1)")
        if self.admission not in ADMISSIONS:
            raise ConfigError(f"--admission: {self.admission!r} is not one of {', '.join(ADMISSIONS)}")
        object.__setattr__(self, "warm", float(self.warm))
        if self.layers is not None:
            layers = tuple(self.layers)
            if any(not is_int(x) for x in layers):
                raise ConfigError(f"--layers: expected layer ids (integers), got {list(layers)!r}")
            object.__setattr__(self, "layers", tuple(int(x) for x in layers))  # a layer the trace lacks, or
            # one named twice, is refused against the trace (Trace.layer_index), naming the file

    @classmethod
    def of(cls, layers: Iterable[int] | None = None, **kwargs) -> "StreamOptions":
        """Options from keywords (``layers`` any iterable)."""
        return cls(layers=None if layers is None else tuple(layers), **kwargs)

    @classmethod
    def from_args(cls, args) -> "StreamOptions":
        """Options from parsed CLI arguments (options a command lacks take their defaults)."""
        return cls.of(pool=getattr(args, "pool", "layer"), reset=getattr(args, "reset", "sequence"),
                      layers=getattr(args, "layers", None), warm=getattr(args, "warm", 0.0) or 0.0,
                      admission=getattr(args, "admission", "all"))
