"""Running a grid: skip finished cells, replay the rest on a local process pool, write one Parquet
part per finished task (docs/grid.md).

Invariants: a cell whose key is in the store is never replayed again unless ``force``; the rows
a run writes do not depend on ``jobs``, on the backend (process pool or Ray) or on the order
tasks finish in (only the ``seconds``
timing field differs between runs); a worker keeps the last trace it loaded, and tasks are
submitted trace-major, so each worker loads each trace about once.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Callable

from ..costmodel.sizing import MB
from ..errors import ConfigError, ExpertcacheError, is_int
from ..sim import StreamOptions, build_layout, fill_gap, replay_layout
from ..sim.chunked import pool_shape, replay_chunked
from ..trace import Trace
from ..sim.budget import Budget
from .cells import Task, plan_tasks
from .spec import GridSpec
from .store import Store, make_row

KILL_AFTER_ENV = "EXPERTCACHE_GRID_KILL_AFTER_PARTS"
"""Internal, for tests only: SIGKILL the run itself right after writing this many parts."""

_TRACES: dict = {}


def run_grid(spec: GridSpec, out: str | os.PathLike, *, jobs: int | None = None, force: bool = False,
             ray: str | None = None, on_start: Callable[[int], None] | None = None,
             on_cells: Callable[[int], None] | None = None) -> dict:
    """Run every unfinished cell of ``spec`` into the results folder ``out``.

    ``jobs``: worker processes (default ``os.cpu_count()``; 1 runs in this process). ``ray``:
    ``"auto"`` or a cluster address runs the tasks on Ray instead (:func:`run_on_ray`).
    ``on_start(n)`` is told the number of cells to compute, ``on_cells(n)`` each finished batch.
    Returns a summary: ``cells`` (in the grid), ``skipped`` (already finished), ``computed``,
    ``parts`` (written by this run) and ``out``.
    """
    jobs = jobs or os.cpu_count() or 1
    store = Store(out)
    tasks = plan_tasks(spec)
    keys = {c.key for t in tasks for c in t.cells}
    if force:
        store.drop(keys)
        done: set[str] = set()
    else:
        done = set(store.done_keys()) & keys
    work = [(t, tuple(p for p in t.policies if t.cell(p).key not in done)) for t in tasks]
    work = [(t, todo) for t, todo in work if todo]
    # lru or belady new to a task whose grid has both: its cells done before were stored without
    # gap_recovered (the grid lacked one of them then): the whole task again, their rows replaced
    redo = [(t, tuple(t.policies)) for t, todo in work
            if {"lru", "belady"} <= set(t.policies) and {"lru", "belady"} & set(todo) and len(todo) < len(t.policies)]
    if redo:
        again = {t.cell(p).key for t, todo in redo for p in todo} & done
        store.drop(again)
        done -= again
        work = [(t, tuple(t.policies)) if (t, tuple(t.policies)) in redo else (t, todo) for t, todo in work]
    summary = {"cells": len(keys), "skipped": len(done), "computed": 0, "parts": 0, "out": str(out)}
    if on_start:
        on_start(sum(len(todo) for _, todo in work))
    kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)

    def finished(rows):
        store.write(rows)
        summary["computed"] += len(rows)
        summary["parts"] += 1
        if on_cells:
            on_cells(len(rows))
        if kill_after and summary["parts"] >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    if ray is not None:
        run_on_ray(ray, jobs, work, finished)
    elif jobs == 1 or len(work) <= 1:
        for task, todo in work:
            finished(run_task(task, todo))
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(run_task, task, todo) for task, todo in work]
            try:
                for fut in as_completed(futures):
                    finished(fut.result())
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    return summary


def run_on_ray(address: str, jobs: int, work: list, finished: Callable[[list[dict]], None]) -> None:
    """Run ``work`` (task, policies to do) as Ray tasks, handing each finished task's rows to ``finished``.

    Each trace is loaded once, here, and put once into Ray's object store; every task of that
    trace receives the same object (workers on one node share it without a copy; another node
    fetches it once). A trace's object is released when its last task has finished. A task's
    ExpertcacheError comes back as that error, one line.
    """
    from ..sim.backends import ray_session

    with ray_session(address, cpus=jobs) as rt:
        remote = rt.remote(run_cells)
        traces: dict = {}  # trace ident -> [object ref, tasks not finished]
        pending = {}
        for task, todo in work:
            ident = task.trace.ident
            if ident not in traces:
                traces[ident] = [rt.put(_loaded(task, task.trace.load)), 0]
            traces[ident][1] += 1
            pending[remote.remote(task, todo, traces[ident][0])] = ident
        while pending:
            ready, _ = rt.wait(list(pending), num_returns=1)
            ident = pending.pop(ready[0])
            try:
                rows = rt.get(ready[0])
            except rt.exceptions.RayTaskError as err:
                if isinstance(err.cause, ExpertcacheError):
                    raise err.cause from None
                raise
            finished(rows)
            traces[ident][1] -= 1
            if not traces[ident][1]:
                del traces[ident]


def run_task(task: Task, todo: tuple[str, ...]) -> list[dict]:
    """:func:`run_cells` on the task's trace (each process keeps the last trace it loaded)."""
    return run_cells(task, todo, _loaded(task, lambda: _load(task)))


def _loaded(task: Task, load: Callable[[], object]):
    """``load()``, a trace error naming the grid's trace (the same line on every backend)."""
    try:
        return load()
    except ExpertcacheError as err:
        raise ConfigError(f"grid trace {task.trace.label}: {err}") from None


def run_cells(task: Task, todo: tuple[str, ...], trace) -> list[dict]:
    """Replay the cells of ``task`` whose policies are in ``todo`` on ``trace``; their rows. The
    task's lru and belady are replayed too when the grid has them, so ``gap_recovered`` is always
    filled alike."""
    try:
        options = StreamOptions.of(pool=task.pool, reset=task.reset, warm=task.warm,
                                   layers=list(task.layers) if task.layers is not None else None)
        chunked = not isinstance(trace, Trace)  # a chunked trace: replayed unit by unit (sim.chunked)
        layout = pool_shape(trace, options) if chunked else build_layout(trace, options)
        capacity, budget = task.capacity, None
        if task.budget is not None:
            budget = Budget(task.budget[1], _expert_bytes(task, trace))
            capacity = budget.capacity(task.pool, len(layout.layer_ids))
        run = [p for p in task.policies if p in todo or p in ("lru", "belady")]
        if chunked:
            results = dict(zip(run, replay_chunked(trace, capacity, run, options)))
        else:
            results = {p: replay_layout(layout, capacity, p) for p in run}
        fill_gap(list(results.values()))
    except ExpertcacheError as err:
        size = f"budget {task.budget[0]}" if task.budget else f"capacity {task.capacity}"
        raise ConfigError(f"grid cell {task.trace.label} pool={task.pool} reset={task.reset} warm={task.warm:g} "
                          f"{size}: {err}") from None
    rows = []
    for p in todo:
        r = results[p]
        if budget is not None:
            r.budget = budget.record(task.pool, len(layout.layer_ids))
        rows.append(make_row(task.cell(p), r, trace.name))
    return rows


def _load(task: Task):
    """The task's trace; each process keeps only the last one it loaded (bounded memory)."""
    ident = task.trace.ident
    if ident not in _TRACES:
        _TRACES.clear()
        _TRACES[ident] = task.trace.load()
    return _TRACES[ident]


def _expert_bytes(task: Task, trace) -> int:
    if task.expert_mb is not None:
        return max(1, round(task.expert_mb * MB))
    S = trace.meta.get("expert_bytes")
    if not is_int(S, 1):
        raise ConfigError("budgets: the trace meta has no expert_bytes; set expert_mb in the spec")
    return S


def default_jobs() -> int:
    return os.cpu_count() or 1

