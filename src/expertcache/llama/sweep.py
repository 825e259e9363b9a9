"""The capacity response of llama.cpp: decode tokens/s and read bytes per token against the wall
(``expertcache llama sweep``; the tiering paper's Figure 2 in a real engine, docs/llama.md).

Walls are written as bytes (``800MB``) or as ``P%``: the dense part of the file (every tensor that
is not an expert tensor, read every step: ``Geometry.dense_bytes``) plus P% of the expert tensors, so ``100%`` holds the
whole model. The (wall, mode, run) cells are run in rounds, each round every (wall, mode) once in
its own seeded shuffled order (:func:`in_rounds`), so slow drift of a shared machine lines up with
neither a wall nor a mode, and a slow minute falls on one run of a cell, not on all of them. Per
(mode, wall) the summary holds the median
and the spread (min, max) over runs of ``decode_tokens_per_s`` and ``read_bytes_per_token``, and
whether every run's wall proof held; a run the wall killed (or that failed) is kept as that cell's
``failed_runs`` with its error, and the sweep goes on. ``smallest_wall`` per mode: the smallest wall whose median
decode rate reaches ``target_tokens_per_s``.
"""

from __future__ import annotations

import random
import statistics

from .._units import parse_bytes
from ..errors import ConfigError, ExpertcacheError
from ..formats.gguf import Geometry
from ..wall.capacity import follow_plan
from .runner import check_managed, check_wall, run_one


def parse_walls(text: str, g: Geometry, what: str = "--walls") -> list[int]:
    """``25%,50%,800MB`` -> distinct ascending byte walls (percent as in the module docstring)."""
    dense = g.dense_bytes
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        if part.endswith("%"):
            try:
                pct = float(part[:-1])
            except ValueError:
                raise ConfigError(f"{what}: cannot read {part!r} as a percentage") from None
            if not 0 < pct <= 1000:
                raise ConfigError(f"{what}: {part} is outside (0%, 1000%]")
            out.append(int(dense + g.expert_tensor_bytes * pct / 100))
        else:
            out.append(parse_bytes(part, what))
    if not out:
        raise ConfigError(f"{what}: no wall in {text!r}")
    return sorted(set(out))


def parse_wall(text: str | None, g: Geometry, what: str) -> int | None:
    """One size as :func:`parse_walls` reads it (``800MB`` or ``P%``); None for None."""
    if text is None:
        return None
    walls = parse_walls(text, g, what)
    if len(walls) != 1 or "," in str(text):
        raise ConfigError(f"{what}: one size, got {text!r}")
    return walls[0]


def _spread(values: list) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarize(records: list[dict], modes: list[str], walls: list[int], target: float | None) -> dict:
    cells = []
    for mode in modes:
        for wall in walls:
            every = [r for r in records if r["mode"] == mode and r["memory_wall"] == wall]
            rs = [r for r in every if not r.get("error")]
            if not every:
                continue
            cells.append({"mode": mode, "memory_wall": wall, "runs": len(rs), "failed_runs": len(every) - len(rs),
                          "errors": sorted({r["error"] for r in every if r.get("error")})[:3],
                          "decode_tokens_per_s": _spread([r["decode_tokens_per_s"] for r in rs]),
                          "read_bytes_per_token": _spread([r["read_bytes_per_token"] for r in rs]),
                          "demand_bytes_per_token": rs[0].get("demand_bytes_per_token") if rs else None,
                          "amplification": _spread([r.get("amplification") for r in rs]),
                          "proof_ok": bool(rs) and all(r["proof_ok"] for r in every),
                          "output_sha256": sorted({r["output_sha256"] for r in rs})})
    smallest = {}
    for mode in modes:
        ok = [c["memory_wall"] for c in cells if c["mode"] == mode and target is not None
              and (c["decode_tokens_per_s"]["median"] or 0) >= target]
        smallest[mode] = min(ok) if ok else None
    shas = {s for c in cells for s in c["output_sha256"]}
    return {"cells": cells, "smallest_wall": smallest, "target_tokens_per_s": target,
            "tokens_identical": len(shas) == 1}


def in_rounds(cells: list[tuple], runs: int, seed: int) -> list[tuple]:
    """``(*cell, run)`` for every cell and run ``0 .. runs-1``: round ``r`` holds each cell's run ``r``,
    the rounds in order, each shuffled by one ``random.Random(seed)`` (the same seed, the same order).
    One shuffled order of all runs had put a cell's three runs within one slow minute of a shared
    host (docs/llama.md, "Benchmark")."""
    rng, out = random.Random(seed), []
    for r in range(runs):
        block = [(*c, r) for c in cells]
        rng.shuffle(block)
        out += block
    return out


def sweep(g: Geometry, prompt, max_new_tokens: int, modes: list[str], walls: list[int], *, runs: int = 3,
          seed: int = 0, wall: str = "auto", headroom_bytes: int | None = None, threads: int = 1,
          target: float | None = None, timeout: float | None = None, progress=None, policy: str = "lru",
          readers: int | None = None, roofline: bool = True, predict: str | None = None) -> dict:
    """Every (wall, mode, run) once, in rounds (:func:`in_rounds`); the records and :func:`summarize`.
    ``policy`` decides the ``managed`` mode's residency (checked first; a wall too small for its pool
    is a failed cell, as a run the wall killed is)."""
    if "managed" in modes:
        check_managed(g, None, policy)
    for w in walls:
        check_wall(g, w, "--walls")
    cells = in_rounds([(w, m) for w in walls for m in modes], runs, seed)
    records = []
    for i, (w, m, r) in enumerate(cells):
        try:
            rec = run_one(g, prompt, max_new_tokens, m, wall_bytes=w, wall=wall, headroom_bytes=headroom_bytes,
                          threads=threads, timeout=timeout, policy=policy, readers=readers, roofline=roofline,
                          predict=predict if m == "managed" else None)
        except ExpertcacheError as exc:  # a run the wall killed is a result of that cell, not the end of the sweep
            rec = {"mode": m, "memory_wall": w, "error": str(exc), "decode_tokens_per_s": None,
                   "read_bytes_per_token": None, "proof_ok": False, "output_sha256": None}
        rec.pop("proof", None)
        rec["run"] = r
        records.append(rec)
        if progress is not None:
            progress(i + 1, len(cells), rec)
    out = summarize(records, modes, walls, target)
    out.update(records=records, headroom_note=follow_plan(max(walls), headroom_bytes)[2], order_seed=seed,
               geometry=g.summary())
    return out


def plot_sweep(result: dict, path: str, title: str) -> None:
    """Two panels against the wall (MB): median decode tokens/s (log) and read MB per token, min-max bars."""
    from ..report.plots import _figure, _save, plot_format

    fmt = plot_format(path)
    fig = _figure(2)
    ax_t, ax_r = fig.axes
    modes = sorted({c["mode"] for c in result["cells"]}, key=[c["mode"] for c in result["cells"]].index)
    for i, mode in enumerate(modes):
        cs = [c for c in result["cells"] if c["mode"] == mode]
        x = [c["memory_wall"] / 1e6 for c in cs]
        for ax, key, scale in ((ax_t, "decode_tokens_per_s", 1.0), (ax_r, "read_bytes_per_token", 1e-6)):
            med = [(c[key]["median"] or 0) * scale for c in cs]
            lo = [m - (c[key]["min"] or 0) * scale for m, c in zip(med, cs)]
            hi = [(c[key]["max"] or 0) * scale - m for m, c in zip(med, cs)]
            ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=mode, color=f"C{i % 10}")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("decode tokens/s (median, min-max)")
    ax_r.set_ylabel("MB read per decode token (process's own)")
    for ax in (ax_t, ax_r):
        ax.set_xlabel("memory wall (MB)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    _save(fig, path, fmt)
