"""Lossless replay of traces through eviction policies."""

from .layout import StreamLayout, build_layout
from .options import StreamOptions
from .replay import LayerCounts, ReplayResult, fill_gap, replay, replay_layout, replay_many

__all__ = ["LayerCounts", "ReplayResult", "StreamLayout", "StreamOptions", "build_layout", "fill_gap", "replay", "replay_layout", "replay_many"]
