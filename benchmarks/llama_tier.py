#!/usr/bin/env python
"""llama.cpp decode and prefill under a memory wall, forecast then measured (issue 33; docs/llama.md
"Benchmark: the targets").

1. Builds (once, under --scratch, never in the repository) two random-weight GGUFs with the
   small-moe tokenizer: an OLMoE-geometry f16 file of 1.69 GB (hidden 1024, expert width 512, 64
   experts, top-8, 8 layers) and a Qwen3-MoE-geometry one quantized to Q4_K_M (hidden 1024, expert
   width 512, 128 experts, top-8, 12 layers, grouped-query attention, per-head q/k norms).
2. Per model and thread count (--threads, default 1 and 2):
   * the compute rates (``size``'s and this prompt's, in both page states of
     ``roofline.PAGE_STATES``; ``size``'s also as the managed and advise steps run, ``forecast.COMPUTE_TIMINGS``),
     the device's bandwidths and the modes' own reads (``roofline.hinted_bandwidth``,
     ``roofline.faulted_bandwidth``, both also at a full cgroup: ``roofline.full_bandwidth``) measured afresh,
     into the cache the forecasts and the runs' roofline read (a cached figure lives a day, and this
     shared host's speed drifts by more than the targets' 15% within one);
   * the forecast first: ``expertcache size MODEL --memory WALL --threads T --trace CAPTURED --json``
     at every wall (the trace: this prompt's own decode captured by ``expertcache capture --keep-prompt``,
     whose prompt rows are replayed first, uncounted, as the run's prefill reads before its decode), and
     once more without ``--trace`` (the matched synthetic trace a user without a capture gets);
   * then the measurement: the unwalled ``mmap`` reference (no observer, no graph split: plain
     llama.cpp) and every (wall, mode) cell, --runs runs each (``managed-python``: the ``managed`` mode
     with its Python step instead of the compiled one, the A/B), in --runs rounds of every cell, each round
     in its own seeded shuffled order (``expertcache.llama.runner.run_one``: a child in a memory
     cgroup whose limit follows it, the GGUF's page cache the tier, cold start, the proof), with
     --runs compute-rate cells per page state among them; every record's roofline is taken again with
     the median of those in its mode's page state (``roofline.pages_of``: the rates the table prints),
     so the limit and the runs see the same drift of the host;
   * per cell: median [min-max] decode tok/s, the ratio to the unwalled median, read and demand MB
     per token, the roofline's limit and efficiency, the managed step's own cost, the proof, the
     forecast and its error (forecast / measured median - 1).
3. Prefill of a --prefill-tokens prompt at the 25% wall (mmap, managed, prefetch; 1 thread): prefill
   tok/s, read bytes against the routed experts' bytes, and the prefill's limit (its compute rate,
   ``roofline.prefill_compute_rate``, and the device's bandwidth) with each mode's efficiency.
4. The targets of issue 33 checked against the medians, each printed as met or missed; everything
   written between the benchmark markers of docs/llama.md; the records to --json-out.

Run (19 minutes for both models and thread counts on the shared 2-core machine, once the GGUFs are built)::

    nice -n 5 .venv/bin/python benchmarks/llama_tier.py --scratch /work/scratch --json-out /work/scratch/llama_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from expertcache.errors import ExpertcacheError  # noqa: E402
from expertcache.llama.convert import convert_random  # noqa: E402
from expertcache.formats.gguf import read_geometry  # noqa: E402
from expertcache.llama.quantize import quantize  # noqa: E402
from expertcache.llama.forecast import measure_compute, measure_faulted, measure_full, measure_hinted  # noqa: E402
from expertcache.llama.roofline import (PAGE_STATES, STEPS, compute_rate, device_bandwidths, limits,  # noqa: E402
                                        pages_of, prefill_compute_rate, roofline)
from expertcache.llama.runner import request_bytes, run_one  # noqa: E402
from expertcache.llama.sweep import in_rounds, parse_walls  # noqa: E402
from expertcache.llama.textgen import tokenize  # noqa: E402

OLMOE = dict(model_type="olmoe", hidden_size=1024, intermediate_size=512, num_experts=64, num_experts_per_tok=8,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, vocab_size=2048,
             max_position_embeddings=4096, rms_norm_eps=1e-5, norm_topk_prob=False)
QWEN3 = dict(model_type="qwen3_moe", hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048,
             num_experts=128, num_experts_per_tok=8, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=2048, max_position_embeddings=4096, rms_norm_eps=1e-6,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
PROMPT = ("The history of the city begins with a small settlement on the river, where traders from the north "
          "met farmers from the valley and exchanged grain, salt and iron.")
START, END = "<!-- llama-bench:start -->", "<!-- llama-bench:end -->"
FORECAST_MODES = ("mmap", "advise", "managed")
MODE_ORDER = ["mmap", "advise", "prefetch", "managed", "managed-python"]
"""The table's rows: ``managed-python`` is ``managed`` with its Python step (``run_one(compiled=False)``),
measured beside the compiled one for the A/B."""


def build(scratch: Path, wanted: set[str] | None = None) -> dict[str, Path]:
    """The two GGUFs under ``scratch`` (those named in ``wanted`` built where missing; None: both)."""
    tok = REPO / "models" / "small-moe"
    olmoe = scratch / "serve-bench-olmoe-f16.gguf"  # the serve benchmark's file: the same seed and geometry
    if not olmoe.exists() and (wanted is None or "olmoe-f16" in wanted):
        print("building", olmoe, flush=True)
        convert_random(OLMOE, olmoe, "f16", seed=0, tokenizer=tok)
    qwen = scratch / "tier-qwen3moe-q4_k_m.gguf"
    if not qwen.exists() and (wanted is None or "qwen3moe-q4_k_m" in wanted):
        f16 = scratch / "tier-qwen3moe-f16.gguf"
        print("building", f16, "then", qwen, flush=True)
        convert_random(QWEN3, f16, "f16", seed=0, tokenizer=tok)
        quantize(f16, qwen, "q4_k_m")
        f16.unlink()
    return {"olmoe-f16": olmoe, "qwen3moe-q4_k_m": qwen}


def cli(*args: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"expertcache {' '.join(args[:3])}: {done.stderr.strip()[-400:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def capture(gguf: Path, prompt: list[int], tokens: int, scratch: Path) -> Path:
    """This prompt's decode captured with the prompt's forward flagged (what a user would give
    ``size --trace``: ``capture --generate N --keep-prompt``)."""
    ids = scratch / f"{gguf.stem}.prompt.npy"
    out = scratch / f"{gguf.stem}.prompt-decode{tokens}.npz"
    np.save(ids, np.asarray(prompt, dtype=np.int64))
    if not out.exists():
        cli("capture", "--model", str(gguf), "--tokens", str(ids), "--out", str(out), "--generate", str(tokens),
            "--keep-prompt")
    return out


def forecast(gguf: Path, wall: int, threads: int, trace: Path | None) -> dict[str, dict]:
    args = ["size", str(gguf), "--memory", str(wall), "--threads", str(threads), "--json"]
    if trace is not None:
        args += ["--trace", str(trace)]
    return {r["mode"]: r for r in cli(*args) if r.get("mode") in FORECAST_MODES}


def spread(values: list) -> dict:
    v = [x for x in values if x is not None]
    return {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else {"median": None, "min": None, "max": None}


def measure(g, prompt, args, walls, threads, modes) -> tuple[list, dict, dict]:
    """Every cell's runs in ``args.runs`` rounds, each round one run of every cell and one
    compute-rate cell per page state (:func:`compute_rate` afresh: the file evicted, its pages
    brought in as the state says, the median of 3 passes) in its own seeded shuffled order, so that
    a slow minute of the shared host falls on one run of a cell, not on all of them (one shuffled
    order of all runs put the three runs of OLMoE's 1-thread ``managed`` at 50% within the last
    minute of a block: 62.1-66.9 tok/s, where a block of that cell alone measured 73.3-76.9 a few
    minutes later, its unwalled reference the same). The host's speed drifts over a block (a compute rate timed
    once at its start put Qwen3's 1-thread efficiency at 1.06-1.08 and its 2-thread one at 0.72-0.78
    in one run), and the rate depends on the pages' structure (one timed in whatever state the last
    run left put an unwalled mmap run at 1.05 of it), so every record's roofline is then taken again
    with the median of the block's compute cells in its mode's state: measured and limit under the
    same drift and the same pages."""
    cells = in_rounds([(w, m) for w in walls for m in modes] + [(None, "mmap")]
                      + [(None, f"compute-{p}") for p in PAGE_STATES], args.runs, args.seed)
    recs, rates = [], {p: [] for p in PAGE_STATES}
    for i, (w, m, r) in enumerate(cells, 1):
        if m.startswith("compute-"):
            p = m.removeprefix("compute-")
            rates[p].append(compute_rate(g.path, prompt, args.new_tokens, threads, fresh=True, pages=p)["tokens_per_s"])
            print(f"  [{i}/{len(cells)}] compute rate T{threads} {p}: {rates[p][-1]:.3g} tok/s (median of 3 passes)",
                  flush=True)
            continue
        try:  # managed-python: the managed mode with its Python step (the A/B of the compiled one)
            rec = run_one(g, prompt, args.new_tokens, m.removesuffix("-python"), wall_bytes=w, threads=threads,
                          timeout=args.timeout, compiled=m != "managed-python")
            rec["mode"] = m
        except ExpertcacheError as exc:
            rec = {"mode": m, "memory_wall": w, "error": str(exc)}
        rec.pop("proof", None)
        recs.append(rec)
        what = rec.get("error") or (f"{rec['decode_tokens_per_s']:.3g} tok/s, read {rec['read_bytes_per_token'] / 1e6:.3g} "
                                    f"MB/token, proof {rec['proof_ok']}")
        print(f"  [{i}/{len(cells)}] {m:8s} wall {(w or 0) / 1e6:6.0f} MB T{threads}: {what}", flush=True)
    for rec in recs:
        if not rec.get("error"):
            p = pages_of(rec["mode"].removesuffix("-python"))
            c = statistics.median(rates[p])
            rec["compute_tokens_per_s"], rec["compute_pages"] = c, p
            rec["compute_tokens_per_s_block"] = rates[p]
            rec.update(limits(c, rec["read_bytes_per_token"], rec["device_read_bytes_per_s_1"],
                              rec["device_read_bytes_per_s_4"], rec["decode_tokens_per_s"]))
    groups: dict = {}
    for rec in recs:
        groups.setdefault((rec["memory_wall"], rec["mode"]), []).append(rec)
    return recs, groups, rates


def cell(rs: list[dict]) -> dict:
    ok = [r for r in rs if not r.get("error")]
    out = {"runs": len(ok), "failed": len(rs) - len(ok), "errors": [r["error"] for r in rs if r.get("error")]}
    for key in ("decode_tokens_per_s", "read_bytes_per_token", "demand_bytes_per_token", "limit_tokens_per_s",
                "serial_limit_tokens_per_s", "efficiency", "advice_seconds_per_token", "compute_tokens_per_s"):
        out[key] = spread([r.get(key) for r in ok])
    out["proof_ok"] = bool(ok) and all(r["proof_ok"] for r in ok)
    out["shas"] = sorted({r["output_sha256"] for r in ok})
    return out


def mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.3g}"


def rate(s: dict) -> str:
    return "-" if s["median"] is None else f"{s['median']:.3g} [{s['min']:.3g}-{s['max']:.3g}]"


def model_block(name, g, threads, groups, rates, fc, fc_syn, walls, labels) -> tuple[list[str], dict]:
    ref = cell(groups[(None, "mmap")])
    unwalled = ref["decode_tokens_per_s"]["median"]
    comp = "; ".join(f"{p} pages {rate(spread(rates[p]))}" for p in PAGE_STATES)
    lines = [f"**{name}, {g.file_bytes / 1e9:.2f} GB, {threads} thread{'s' if threads > 1 else ''}** (unwalled mmap: "
             f"{rate(ref['decode_tokens_per_s'])} tok/s; compute rate: {comp} tok/s)", "",
             "| wall | mode | decode tok/s median [min-max] | x unwalled | read MB/token | demand MB/token | read/demand | "
             "limit tok/s | efficiency | step ms/token | proof | forecast tok/s | error | synthetic forecast | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for w in walls:
        for mode in sorted({m for (ww, m) in groups if ww == w}, key=MODE_ORDER.index):
            c = cell(groups[(w, mode)])
            med = c["decode_tokens_per_s"]["median"]
            rd, dm = c["read_bytes_per_token"]["median"], c["demand_bytes_per_token"]["median"]
            f = fc.get(w, {}).get(mode, {}).get("predicted_tokens_per_s")
            fs = fc_syn.get(w, {}).get(mode, {}).get("predicted_tokens_per_s")
            err = (f / med - 1) if f and med else None
            errs = (fs / med - 1) if fs and med else None
            step = c["advice_seconds_per_token"]["median"]
            summary[(w, mode)] = {**c, "ratio": med / unwalled if med and unwalled else None, "forecast": f,
                                  "forecast_error": err, "synthetic_forecast": fs, "synthetic_error": errs}
            if not c["runs"]:
                lines.append(f"| {labels[w]} | {mode} | failed: {c['errors'][0][:60]} |" + " |" * 12)
                continue
            lines.append(
                f"| {labels[w]} {w / 1e6:.0f} MB | {mode} | {rate(c['decode_tokens_per_s'])} | "
                f"{med / unwalled:.2f} | {mb(rd)} | {mb(dm)} | {'-' if not (rd is not None and dm) else f'{rd / dm:.2f}'} | "
                f"{c['limit_tokens_per_s']['median']:.3g} | {c['efficiency']['median']:.2f} | "
                f"{'-' if step is None or not mode.startswith('managed') else f'{step * 1e3:.2f}'} | {'ok' if c['proof_ok'] else 'FAILED'} | "
                f"{'-' if f is None else f'{f:.3g}'} | {'-' if err is None else f'{err:+.0%}'} | "
                f"{'-' if fs is None else f'{fs:.3g}'} | {'-' if errs is None else f'{errs:+.0%}'} |")
    summary["unwalled"] = unwalled
    return lines, summary


def prefill(g, args, labels) -> tuple[list[str], dict]:
    rng = np.random.default_rng(7)
    ids = rng.integers(3, 2048, size=args.prefill_tokens)
    w = parse_walls("25%", g)[0]
    out: dict = {}
    for m, r in in_rounds([("mmap",), ("managed",), ("prefetch",)], args.runs, args.seed):
        rec = run_one(g, ids, 2, m, wall_bytes=w, roofline=False, timeout=args.timeout)
        out.setdefault(m, []).append(rec)
        print(f"  prefill {m:8s}: {rec['prefill_tokens_per_s']:.3g} tok/s, read {rec['prefill_read_bytes'] / 1e6:.4g} MB "
              f"of {rec['prefill_routed_bytes'] / 1e6:.4g} routed, proof {rec['proof_ok']}", flush=True)
    # the prefill's roofline: its compute with every routed expert resident (no callback), and the
    # device reading the routed experts' bytes once (each expert once per prompt)
    c = prefill_compute_rate(g.path, ids, 1, fresh=True)["tokens_per_s"]
    bw = device_bandwidths(g.path, request_bytes(g), fresh=True)
    bw1, bw4 = bw[1]["bytes_per_s"], bw[4]["bytes_per_s"]
    routed = statistics.median(r["prefill_routed_bytes"] for r in out["managed"]) / args.prefill_tokens
    lim = limits(c, routed, bw1, bw4)
    out["limit"] = {"compute_tokens_per_s": c, "limit_tokens_per_s": lim["limit_tokens_per_s"],
                    "serial_limit_tokens_per_s": lim["serial_limit_tokens_per_s"]}
    print(f"  prefill compute rate {c:.3g} tok/s (every routed expert resident, no callback); limit "
          f"{lim['limit_tokens_per_s']:.3g}, serial limit {lim['serial_limit_tokens_per_s']:.3g} tok/s", flush=True)
    lines = [f"**Prefill of {args.prefill_tokens} tokens at the 25% wall ({w / 1e6:.0f} MB), {g.file_bytes / 1e9:.2f} GB "
             f"OLMoE f16, 1 thread** (prefill compute rate {c:.3g} tok/s; limit {lim['limit_tokens_per_s']:.3g}, serial "
             f"limit {lim['serial_limit_tokens_per_s']:.3g})", "",
             "| mode | prefill tok/s median [min-max] | read MB | routed experts MB | read / routed | efficiency | proof |",
             "|---|---|---|---|---|---|---|"]
    for m in ("mmap", "managed", "prefetch"):
        rs = out[m]
        s = spread([r["prefill_tokens_per_s"] for r in rs])
        rd, rt = statistics.median(r["prefill_read_bytes"] for r in rs), statistics.median(r["prefill_routed_bytes"] for r in rs)
        eff = s["median"] / lim["limit_tokens_per_s"] if lim["limit_tokens_per_s"] else None
        lines.append(f"| {m} | {rate(s)} | {rd / 1e6:.4g} | {rt / 1e6:.4g} | {rd / rt:.2f} | "
                     f"{'-' if eff is None else f'{eff:.2f}'} | {'ok' if all(r['proof_ok'] for r in rs) else 'FAILED'} |")
    return lines, out


def targets(results: dict, pre: dict, labels: dict) -> list[str]:
    """Issue 33's targets against the medians: one line each, met or missed (the speed targets for
    the walls labelled 50% and 25% in ``labels``, wall bytes -> label, where they were run)."""
    out = []

    def line(ok, text):
        out.append(f"- {'met' if ok else '**missed**'}: {text}")

    for key, s in results.items():
        name, threads = key
        cells = {k: v for k, v in s.items() if k != "unwalled"}
        walls = sorted({w for (w, _) in cells})
        by_label = {labels[name].get(w): w for w in walls}
        for frac, want in (("50%", 0.95), ("25%", 0.85)):
            c = cells.get((by_label.get(frac), "managed"))
            if c and c["ratio"] is not None:
                line(c["ratio"] >= want, f"{name} T{threads} managed at {frac}: {c['ratio']:.2f}x unwalled (target {want})")
        for (w, mode), c in sorted(cells.items(), key=lambda kv: kv[0][0]):
            if mode != "managed" or not c["runs"]:
                continue
            rd, dm = c["read_bytes_per_token"]["median"], c["demand_bytes_per_token"]["median"]
            if rd is not None and dm:
                line(rd <= 1.1 * dm, f"{name} T{threads} managed at {w / 1e6:.0f} MB: reads {rd / dm:.2f}x demand (<= 1.1)")
            eff = c["efficiency"]["median"]
            line(eff is not None and eff >= 0.8, f"{name} T{threads} managed at {w / 1e6:.0f} MB: efficiency {eff:.2f} (>= 0.8)")
        for w in (by_label.get("25%"), by_label.get("50%")):
            m, p = cells.get((w, "managed")), cells.get((w, "prefetch"))
            if m and p and m["runs"] and p["runs"]:
                mm, pm = m["decode_tokens_per_s"], p["decode_tokens_per_s"]
                beats = mm["median"] > pm["max"]
                tie_less = mm["max"] >= pm["min"] and m["read_bytes_per_token"]["median"] < p["read_bytes_per_token"]["median"]
                line(beats or tie_less, f"{name} T{threads} at {w / 1e6:.0f} MB: managed {mm['median']:.3g} vs prefetch "
                     f"{pm['median']:.3g} tok/s, reads {mb(m['read_bytes_per_token']['median'])} vs "
                     f"{mb(p['read_bytes_per_token']['median'])} MB/token")
        for (w, mode), c in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if c.get("forecast_error") is not None:
                line(abs(c["forecast_error"]) <= 0.15, f"{name} T{threads} forecast {mode} at {w / 1e6:.0f} MB: "
                     f"{c['forecast']:.3g} vs {c['decode_tokens_per_s']['median']:.3g} measured ({c['forecast_error']:+.0%})")
    if pre:
        m = statistics.median(r["prefill_read_bytes"] / r["prefill_routed_bytes"] for r in pre["managed"])
        line(m <= 1.2, f"prefill at 25%: managed read {m:.2f}x the routed experts' bytes (<= 1.2)")
        rm = statistics.median(r["prefill_tokens_per_s"] for r in pre["managed"])
        rp = statistics.median(r["prefill_tokens_per_s"] for r in pre["mmap"])
        lim = pre["limit"]["limit_tokens_per_s"]
        line(rm >= 2 * rp, f"prefill at 25%: managed {rm:.3g} tok/s vs mmap {rp:.3g} ({rm / rp:.2f}x, >= 2)"
             + (f"; the prefill's limit is {lim:.3g} tok/s ({lim / rp:.2f}x mmap), managed at {rm / lim:.2f} of it"
                if lim else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", default="/work/scratch", help="folder for the GGUFs (outside the repository)")
    ap.add_argument("--walls", default="25%,50%,75%")
    ap.add_argument("--modes", default="mmap,advise,prefetch,managed,managed-python")
    ap.add_argument("--models", default="olmoe-f16,qwen3moe-q4_k_m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--doc", default=str(REPO / "docs" / "llama.md"))
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.time(), os.getloadavg()[0]
    wanted = set(args.models.split(",")) | (set() if args.no_prefill else {"olmoe-f16"})  # prefill runs on olmoe
    files = build(scratch, wanted)
    modes = [m for m in args.modes.split(",") if m]
    blocks, results, dump, all_labels = [], {}, {}, {}
    for name in args.models.split(","):
        g = read_geometry(str(files[name]))
        prompt = tokenize(g.path, PROMPT)
        trace = capture(files[name], prompt, args.new_tokens, scratch)
        walls = parse_walls(args.walls, g)
        labels = {parse_walls(p, g)[0]: p.strip() for p in args.walls.split(",") if p.strip()}
        all_labels[name] = labels
        for threads in [int(t) for t in args.threads.split(",")]:
            # this block's compute rates and bandwidths measured now, into the cache the forecasts and
            # the runs' roofline read: a day-old figure from a host twice as fast misled both by 60%
            for p in PAGE_STATES:  # roofline's bandwidths are size's too
                c_size, _ = measure_compute(g, threads, fresh=True, timing=p)
                c_run = roofline(g.path, request_bytes(g), prompt, args.new_tokens, threads, fresh=True,
                                 pages=p)["compute_tokens_per_s"]
                print(f"{name} T{threads}: compute rate in {p} pages {c_size:.3g} tok/s (size's prompt), {c_run:.3g} "
                      "(this prompt)", flush=True)
            for step in STEPS:
                print(f"{name} T{threads}: compute rate as the {step} step runs "
                      f"{measure_compute(g, threads, True, step)[0]:.3g} tok/s (size's prompt)", flush=True)
            full = {kind: measure_full(g, kind, fresh=True)[0] for kind in ("hinted", "faulted")}
            print(f"{name} T{threads}: hinted reads (managed) {measure_hinted(g, fresh=True)[0] / 1e9:.3g} GB/s, "
                  f"faulted reads {measure_faulted(g, fresh=True)[0] / 1e9:.3g} GB/s; at a full cgroup: hinted (advise) "
                  f"{(full['hinted'] or 0) / 1e9:.3g} GB/s, faulted (mmap) {(full['faulted'] or 0) / 1e9:.3g} GB/s",
                  flush=True)
            fc = {w: forecast(files[name], w, threads, trace) for w in walls}  # predicted before anything is measured
            fc_syn = {w: forecast(files[name], w, threads, None) for w in walls}
            print(f"{name} T{threads}: forecast " + ", ".join(
                f"{labels[w]} {m} {fc[w][m]['predicted_tokens_per_s']:.3g}" for w in walls for m in fc[w]), flush=True)
            recs, groups, rates = measure(g, prompt, args, walls, threads, modes)
            lines, summary = model_block(name, g, threads, groups, rates, fc, fc_syn, walls, labels)
            blocks += lines + [""]
            results[(name, threads)] = summary
            dump[f"{name} T{threads}"] = {"records": recs, "compute_rates": rates,
                                          "forecast": {str(w): v for w, v in fc.items()},
                                          "synthetic_forecast": {str(w): v for w, v in fc_syn.items()}}
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(dump, default=str))
    pre_lines, pre = ([], {}) if args.no_prefill else prefill(read_geometry(str(files["olmoe-f16"])), args, {})
    head = [START, f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `benchmarks/llama_tier.py` "
            f"({(time.time() - t0) / 60:.0f} min; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
            f"end; 2 cores, shared), read-ahead {Path('/sys/block/vda/queue/read_ahead_kb').read_text().strip() if Path('/sys/block/vda/queue/read_ahead_kb').exists() else '?'} KB, "
            f"prompt {len(prompt)} tokens, {args.new_tokens} new tokens ({args.new_tokens - 1} decode steps), "
            f"{args.runs} runs per cell in as many rounds (each round every cell once, in its own seeded shuffled order). A wall P% = the dense part + P% of the expert "
            "tensors; the unwalled reference has no observer (plain llama.cpp); compute rates per page state (the "
            "file evicted, then faulted in by llama.cpp's load, or dropped and read back by hints: `roofline.PAGE_STATES`; "
            "each mode's limit takes its own, `mmap` and `prefetch` faulted, the others hinted); `managed-python` is `managed` with its "
            "Python step instead of the compiled one (the A/B). Forecasts by `expertcache size MODEL --memory WALL --threads T` made before the runs: with "
            "`--trace` (this prompt's forward and decode captured: `capture --generate N --keep-prompt`, the prompt "
            "replayed first, uncounted, in every mode's replay) and without (a matched synthetic trace); error = forecast / "
            "measured median - 1.", ""]
    tgt = targets(results, pre, all_labels)
    block = "\n".join(head + blocks + pre_lines + ["", "**Targets (issue 33)**", "", *tgt, END])
    doc = Path(args.doc)
    text = doc.read_text()
    text = text[: text.index(START)] + block + text[text.index(END) + len(END):] if START in text and END in text \
        else text + "\n" + block + "\n"
    doc.write_text(text)
    if args.json_out:
        dump["prefill"] = pre
        Path(args.json_out).write_text(json.dumps(dump, default=str))
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
