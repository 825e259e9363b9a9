"""Resumable grids of replays: a TOML spec, a local process pool, results as Parquet parts
(docs/grid.md). pyarrow (the ``grid`` extra) is imported only when results are read or written."""

from .cells import Cell, Task, plan_tasks
from .spec import GridSpec, TraceSource, load_spec, parse_spec

__all__ = ["Cell", "GridSpec", "Task", "TraceSource", "load_spec", "parse_spec", "plan_tasks"]
