"""Cost model: copies per token turned into bytes, bandwidth, time and memory (docs/sizing.md).

:mod:`.sizing` holds the definitions: ``bytes_per_token = rho * S``, ``ms_per_token = c + rho *
tau`` (copies block), ``max(c, rho * tau)`` (copies overlapped), ``tokens_per_s_predicted``,
``gbps_needed`` and ``cache_bytes``, with ``rho`` = steady copies per token.
"""

from .sizing import (
    FIGURES, GB, INPUTS, LIMITS, MB, Sizing, SizingFigures, cache_bytes, expert_bytes_from_config, parse_duration_ms,
)

__all__ = ["FIGURES", "GB", "INPUTS", "LIMITS", "MB", "Sizing", "SizingFigures", "cache_bytes", "expert_bytes_from_config",
           "parse_duration_ms"]
