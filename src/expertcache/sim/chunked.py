"""Replay and sweep a chunked trace (:mod:`expertcache.trace.chunked`) in bounded memory.

The work is cut into *units*, each a trace small enough to lay out, whose streams are a subset of
the whole trace's streams; a stream is never cut, so each unit's counts are exact and the whole
trace's counts are their sum:

* ``reset="sequence"`` (either pool): one unit per chunk. Every sequence lies in one chunk, and
  every stream is one sequence's (of one layer, or of the global pool). Units differ in tokens;
  their counts, tokens and iterations add.
* ``reset="none"``, per-layer pools: one unit per block of layers, every token of those layers,
  read chunk by chunk. A layer's stream is the whole trace; the block is sized so that its
  groups and next-use arrays stay under :data:`UNIT_BYTES`. Units differ in layers; their
  per-layer counts are put side by side, the tokens are the same.
* ``reset="none"``, global pool: one stream over everything. One unit, the whole trace loaded
  (for traces that fit).

Belady's and foresight's next uses are computed inside each unit, which holds its streams whole.
Results equal :func:`~expertcache.sim.replay.replay` / :func:`~expertcache.sim.curves.mrc.sweep`
on the trace loaded whole, field for field (``seconds`` aside; tested). One difference: without
explicit capacities a chunked sweep runs from ``top_k`` (the widest group a chunk can hold)
instead of the widest group the whole trace holds, which differs only on padded traces.

Units run one after another, or on ``jobs`` local processes, or as Ray tasks (``ray="auto"`` or
an address): each worker opens the chunk files itself, so only the folder's path, the options
and the counts cross between processes.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Callable, Sequence

import numpy as np

from ..policies import Policy, make_policy
from ..trace.chunked import ChunkedTrace, open_chunked
from ..trace.core import Trace, layer_columns
from ..trace.sampling import sample_trace
from .curves.mrc import DEFAULT_GRID, MissRatioCurve, _fill_gaps, sweep_layout
from .layout import build_layout
from .options import StreamOptions
from .replay import LayerCounts, ReplayResult, fill_gap, replay_layout

UNIT_BYTES = 1 << 30
"""Target size of one unit's groups and next-use arrays (12 bytes a request) in a layer block."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """One piece of work: chunk ``chunk`` (all layers), or layer columns ``cols`` (all chunks), or
    everything (both ``None``). ``by``: how its counts join the others': ``"tokens"`` or ``"layers"``."""

    chunk: int | None
    cols: tuple[int, ...] | None
    by: str


def plan_units(ct: ChunkedTrace, options: StreamOptions) -> list[Unit]:
    """The units of ``ct`` under ``options`` (see the module docstring)."""
    if options.reset == "sequence":
        return [Unit(i, None, "tokens") for i in range(ct.num_chunks)]
    if options.pool == "global":
        return [Unit(None, None, "tokens")]
    cols = selected_cols(ct, options)
    per_layer = max(1, ct.num_tokens * ct.top_k * 12)
    block = max(1, min(len(cols), UNIT_BYTES // per_layer))
    return [Unit(None, tuple(cols[i: i + block]), "layers") for i in range(0, len(cols), block)]


def selected_cols(trace: "ChunkedTrace | Trace", options: StreamOptions) -> list[int]:
    """The layer columns ``options.layers`` selects (the same checks and lines for a whole trace and
    a chunked one)."""
    if isinstance(trace, Trace):
        return [int(c) for c in trace.layer_index(options.layers)]
    return [int(c) for c in layer_columns(trace.layer_ids, options.layers, str(trace.root))]


def unit_layout(ct: ChunkedTrace, unit: Unit, options: StreamOptions, mask: np.ndarray | None = None):
    """The stream layout of one unit; with ``mask`` (bool ``[L, E]`` over the trace's layer columns)
    of its sampled items only (:func:`~expertcache.trace.sampling.sample_trace`)."""
    if unit.chunk is not None or unit.cols is None:
        trace = ct.chunk(unit.chunk) if unit.chunk is not None else ct.load()
        return build_layout(trace if mask is None else sample_trace(trace, mask), options)
    trace = ct.load_layers(np.asarray(unit.cols))
    if mask is not None:
        trace = sample_trace(trace, mask[list(unit.cols)])
    return build_layout(trace, dataclasses.replace(options, layers=None))


# ------------------------------------------------------------------------------------ API
def replay_chunked(ct: "ChunkedTrace | str", capacity: int, policies: Sequence["str | Policy"],
                   options: StreamOptions | None = None, *, jobs: int = 1, ray: str | None = None,
                   progress: Callable[[int], None] | None = None) -> list[ReplayResult]:
    """One :class:`~expertcache.sim.replay.ReplayResult` per policy at ``capacity``, equal to
    replaying the whole trace (``gap_recovered`` filled when lru and belady are both run)."""
    ct = ct if isinstance(ct, ChunkedTrace) else open_chunked(ct)
    options = options or StreamOptions()
    units = plan_units(ct, options)
    parts = _run_units(ct, units, options, ("replay", capacity), list(policies), jobs, ray, progress)
    results = [join_results([part[i] for part in parts], units) for i in range(len(policies))]
    fill_gap(results)
    return results


def sweep_chunked(ct: "ChunkedTrace | str", capacities: Sequence[int] | None, policies: Sequence["str | Policy"],
                  options: StreamOptions | None = None, *, one_pass: bool = True, jobs: int = 1,
                  ray: str | None = None, progress: Callable[[int], None] | None = None,
                  mask: np.ndarray | None = None) -> list[MissRatioCurve]:
    """One :class:`~expertcache.sim.curves.mrc.MissRatioCurve` per policy, equal to sweeping the
    whole trace (LRU by one stack pass per unit when ``one_pass``); with ``mask``, the whole trace
    sampled by it (:func:`~expertcache.trace.sampling.sample_trace`)."""
    ct = ct if isinstance(ct, ChunkedTrace) else open_chunked(ct)
    options = options or StreamOptions()
    caps = default_capacities(ct, options) if capacities is None else sorted({int(c) for c in capacities})
    units = plan_units(ct, options)
    parts = _run_units(ct, units, options, ("sweep", caps, one_pass), list(policies), jobs, ray, progress, mask)
    curves = [join_curves([part[i] for part in parts], units) for i in range(len(policies))]
    _fill_gaps(curves)
    return curves


def widest_group(ct: "ChunkedTrace | str", options: StreamOptions | None = None, *, mask: np.ndarray | None = None,
                 jobs: int = 1, ray: str | None = None) -> int:
    """The widest group of the whole trace's layout (of its sampled items with ``mask``): the largest
    of its units' (units split groups never, so the largest is the whole trace's)."""
    ct = ct if isinstance(ct, ChunkedTrace) else open_chunked(ct)
    options = options or StreamOptions()
    parts = _run_units(ct, plan_units(ct, options), options, ("widest",), [], jobs, ray, None, mask)
    return max(part[0] for part in parts)


def default_capacities(ct: ChunkedTrace, options: StreamOptions) -> list[int]:
    """Every capacity from ``top_k`` to the item count (or :data:`DEFAULT_GRID` evenly spaced)."""
    shape = pool_shape(ct, options)
    lo, hi = shape.widest, max(shape.n_items, shape.widest)
    if hi - lo + 1 <= DEFAULT_GRID:
        return list(range(lo, hi + 1))
    return sorted({int(round(x)) for x in np.linspace(lo, hi, DEFAULT_GRID)})


# ------------------------------------------------------------------------------------ joining
def join_results(parts: list[ReplayResult], units: list[Unit]) -> ReplayResult:
    """One result from the units' results of the same policy and capacity."""
    first = parts[0]
    if units[0].by == "layers":
        per_layer = [c for r in parts for c in r.per_layer]
        tokens, iterations = first.tokens, first.iterations
    else:
        per_layer = [LayerCounts(c.layer, sum(r.per_layer[j].requests for r in parts),
                                 sum(r.per_layer[j].copies_total for r in parts),
                                 sum(r.per_layer[j].copies_steady for r in parts))
                     for j, c in enumerate(first.per_layer)]
        tokens, iterations = sum(r.tokens for r in parts), sum(r.iterations for r in parts)
    return dataclasses.replace(
        first, layers=[c.layer for c in per_layer], tokens=tokens, iterations=iterations,
        requests=sum(c.requests for c in per_layer), copies_total=sum(c.copies_total for c in per_layer),
        copies_steady=sum(c.copies_steady for c in per_layer), per_layer=per_layer,
        seconds=sum(r.seconds for r in parts), gap_recovered=None)


def join_curves(parts: list[MissRatioCurve], units: list[Unit]) -> MissRatioCurve:
    """One curve from the units' curves of the same policy (same capacities)."""
    first = parts[0]
    if units[0].by == "layers":
        req = np.concatenate([c.layer_requests for c in parts])
        tot = np.concatenate([c.layer_copies_total for c in parts], axis=1)
        std = np.concatenate([c.layer_copies_steady for c in parts], axis=1)
        layers = [lid for c in parts for lid in c.layers]
        tokens, iterations = first.tokens, first.iterations
    else:
        req = sum(c.layer_requests for c in parts)
        tot = sum(c.layer_copies_total for c in parts)
        std = sum(c.layer_copies_steady for c in parts)
        layers = first.layers
        tokens, iterations = sum(c.tokens for c in parts), sum(c.iterations for c in parts)
    return dataclasses.replace(first, layer_requests=req, layer_copies_total=tot, layer_copies_steady=std,
                               layers=layers, tokens=tokens, iterations=iterations,
                               seconds=sum(c.seconds for c in parts), gap_recovered=None)


# ------------------------------------------------------------------------------------ running
def _run_units(ct, units, options, job, policies, jobs, ray, progress, mask=None) -> list[list]:
    tick = progress or (lambda n: None)
    parallel = (jobs > 1 or ray is not None) and len(units) > 1 and all(isinstance(p, str) for p in policies)
    if not parallel:
        out = []
        for unit in units:
            out.append(run_unit(ct, unit, options, job, policies, mask))
            tick(1)
        return out
    tasks = [(str(ct.root), unit, options, job, policies, mask) for unit in units]
    if ray is None:
        with ProcessPoolExecutor(max_workers=min(jobs, len(units)), mp_context=get_context("spawn")) as pool:
            out = []
            for part in pool.map(_run_task, tasks):
                out.append(part)
                tick(1)
            return out
    from .backends import ray_session

    with ray_session(ray, cpus=max(1, jobs)) as ray_mod:
        remote = ray_mod.remote(_run_task)
        refs = [remote.remote(t) for t in tasks]
        out = []
        for ref in refs:
            out.append(ray_mod.get(ref))
            tick(1)
        return out


def run_unit(ct: ChunkedTrace, unit: Unit, options: StreamOptions, job: tuple, policies: list,
             mask: np.ndarray | None = None) -> list:
    """The results of ``policies`` on one unit (its items sampled by ``mask`` when given): a
    ReplayResult each (``job = ("replay", C)``), a MissRatioCurve each (``job = ("sweep",
    capacities, one_pass)``), or ``[the layout's widest group]`` (``job = ("widest",)``)."""
    layout = unit_layout(ct, unit, options, mask)
    if job[0] == "widest":
        return [layout.widest]
    if job[0] == "replay":
        return [replay_layout(layout, job[1], make_policy(p) if isinstance(p, str) else p) for p in policies]
    return sweep_layout(layout, job[1], policies, one_pass=job[2])


def _run_task(task) -> list:
    """A worker's unit: it opens the chunked trace itself (only the path was sent)."""
    root, unit, options, job, policies, mask = task
    return run_unit(open_chunked(root), unit, options, job, policies, mask)


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """What sizing a capacity needs of a layout, without building one: the item count, the pool
    kind, the selected layer ids and the widest group (``top_k`` for a chunked trace)."""

    n_items: int
    pool: str
    layer_ids: list[int]
    widest: int


def pool_shape(ct: ChunkedTrace, options: StreamOptions) -> PoolShape:
    """The :class:`PoolShape` of ``ct`` laid out under ``options``."""
    cols = selected_cols(ct, options)
    n_items = ct.num_experts * (len(cols) if options.pool == "global" else 1)
    return PoolShape(n_items, options.pool, [ct.layer_ids[c] for c in cols], ct.top_k)
