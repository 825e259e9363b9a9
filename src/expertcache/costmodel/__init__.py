"""Cost model: copies per token turned into bytes, bandwidth, time and memory (docs/sizing.md).

:mod:`.sizing` holds the definitions: ``bytes_per_token = rho * S``, ``ms_per_token = c + rho *
tau`` (copies block), ``max(c, rho * tau)`` (copies overlapped), ``tokens_per_s_predicted``,
``gbps_needed`` and ``cache_bytes``, with ``rho`` = steady copies per token. :mod:`.runs` reads
measured runs and :mod:`.choose` picks the fastest admissible policy among them (docs/choose.md).
"""

from .choose import (
    DEFAULT_REPLAY_POLICIES, FRONTIER_FACTORS, LOSSLESS_NATS, Choice, admissible, crossovers, frontier, measured_tau,
    predict, replayed_runs, validate, winner,
)
from .runs import Run, parse_runs, read_runs
from .sizing import (
    FIGURES, GB, INPUTS, LIMITS, MB, Sizing, SizingFigures, cache_bytes, expert_bytes_from_config, parse_duration_ms,
)

__all__ = [
    "DEFAULT_REPLAY_POLICIES", "FIGURES", "FRONTIER_FACTORS", "GB", "INPUTS", "LIMITS", "LOSSLESS_NATS", "MB", "Choice",
    "Run", "Sizing", "SizingFigures", "admissible", "cache_bytes", "crossovers", "expert_bytes_from_config", "frontier",
    "measured_tau", "parse_duration_ms", "parse_runs", "predict", "read_runs", "replayed_runs", "validate", "winner",
]
