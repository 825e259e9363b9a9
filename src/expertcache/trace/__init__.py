"""Router traces: the canonical format, importers, exporters and synthetic generators."""

from .core import Trace, load_trace, parse_layers

__all__ = ["Trace", "load_trace", "parse_layers"]
