"""Lossless replay of traces through eviction policies."""

from .layout import StreamLayout, build_layout
from .replay import LayerCounts, ReplayResult, fill_gap, replay, replay_layout, replay_many

__all__ = ["LayerCounts", "ReplayResult", "StreamLayout", "build_layout", "fill_gap", "replay", "replay_layout", "replay_many"]
