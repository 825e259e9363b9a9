"""Statistics of router traces: how skewed, how recent and how stable expert demand is."""

from .locality import (
    DEFAULT_WINDOWS,
    LayerLocality,
    LocalityReport,
    PairOverlap,
    coverage_curve,
    expert_counts,
    hot_set_overlap,
    hot_sets,
    locality_report,
    reuse_gaps,
    reuse_within,
    scored_tokens,
    token_steps,
    top_share,
    zipf_alpha,
)

__all__ = [
    "DEFAULT_WINDOWS", "LayerLocality", "LocalityReport", "PairOverlap", "coverage_curve", "expert_counts",
    "hot_set_overlap", "hot_sets", "locality_report", "reuse_gaps", "reuse_within", "scored_tokens", "token_steps", "top_share",
    "zipf_alpha",
]
