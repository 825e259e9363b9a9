"""Router traces: the canonical format, importers, exporters and synthetic generators."""

from .core import Trace, load_trace, parse_layers
from .units import accepted_tokens, iteration_ids, iterations

__all__ = ["Trace", "accepted_tokens", "iteration_ids", "iterations", "load_trace", "parse_layers"]
