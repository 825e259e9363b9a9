"""``expertcache size``: does every expert fit on the device, and if not, what cache meets a target?

The logic lives in :mod:`expertcache.costmodel.plan` (definitions) and
:mod:`expertcache.costmodel.model` (reading the model); this module reads the options, picks the
trace (the one given, or a synthetic preset matched to the model, labelled as such) and prints.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .._units import format_bytes
from ..costmodel import MB, Sizing
from ..costmodel.model import ModelSpec, read_model
from ..costmodel.plan import Fit, copies_for_rate, record, recommended, search, synthetic_trace
from ..errors import ConfigError
from ..policies import make_policy
from ..trace.validate import MAX_EXPERT_BYTES
from .budget_opts import budget_bytes
from .common import (add_json, emit_json, fraction, open_trace, positive_int, positive_number, samples_int, seed_int,
                     table, threads_int)
from .sizing_opts import auto_or_rate, compute_time, duration

DEFAULT_POLICIES = ("lru", "lfu", "decayed", "mean-interval", "belady")

HELP = """Size the expert cache of one model on one device (docs/sizing.md, "expertcache size").

The model: --model-config (a Hugging Face config.json, a checkpoint folder with config.json and
*.safetensors, or a .gguf file) gives E, k, the MoE layers, the bytes of one expert and of the other
weights; or give --expert-mb with --experts, --top-k and --moe-layers (or a --trace for them).

  available          --device-memory - non-expert weights - --reserve
  fits entirely      E x MoE layers x expert bytes <= available: keep every expert resident,
                     zero copies, nothing else to decide
  otherwise          per lossless rule, the smallest capacity per layer meeting the target
                     (--target-hit-rate, --target-copies or --target-tokens-per-s), or without a
                     target the rule at the largest capacity that fits; the recommended rule is the
                     causal one needing the least capacity (then the fewest copies)

The copies come from --trace, or, without one, from a synthetic trace matched to the model's E, k
and layers (labelled SYNTHETIC: give your own trace for your workload). Hit rates count the cold
fills after each sequence reset, which cap them below 1 even with every expert resident; --warm
0.6 scores the warm (fair-window) hit rate instead; misses/tok counts them, copies/tok does not.
--host-memory with --tier-pool (or a GGUF model) adds the page-cache tier: whether the experts fit
in the host's page cache beside the GGUF's dense part.

CPU and disk (docs/sizing.md, "Forecast for CPU and disk"): expertcache size MODEL.gguf --memory SIZE
forecasts decode with the experts read from disk through the page cache, for the modes mmap, advise
and managed of 'expertcache llama run': the dense bytes, the expert bytes that fit beside them in
SIZE, the bytes a decode token reads from disk (a trace replayed from where a run starts: the file
just loaded for mmap and advise, an empty pool for managed; first reads counted; per-mode models of
what the kernel reads) and the decode rate
1 / (1/c + read bytes per token / B), with B the rate of each mode's own reads (faults, hints) and
the compute rate c as each mode runs, measured on the file (--disk-bandwidth auto, --compute auto)
or given.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("size", help="does every expert fit, and if not, the capacity that meets a target; "
                                    "with --memory, a forecast of decode on CPU with the experts read from disk",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model-config takes it (a .gguf file for --memory)")
    m.add_argument("--model-config", metavar="PATH", default=None,
                   help="config.json, a checkpoint folder (config.json + *.safetensors) or a .gguf file")
    m.add_argument("--expert-mb", type=positive_number, default=None, metavar="MB",
                   help="bytes of one expert in decimal MB instead of --model-config (non-expert weights then unknown)")
    m.add_argument("--experts", type=positive_int, default=None, metavar="E", help="routed experts per layer")
    m.add_argument("--top-k", type=positive_int, default=None, metavar="K", help="experts each token uses per layer")
    m.add_argument("--moe-layers", type=positive_int, default=None, metavar="L", help="layers with routed experts")
    p.add_argument("--device-memory", type=budget_bytes, default=None, metavar="BYTES",
                   help="device memory, e.g. 24GB (decimal; GiB binary); the non-expert weights are taken off it "
                        "(a GPU expert cache; --memory for CPU and disk)")
    p.add_argument("--reserve", type=budget_bytes, default=None, metavar="BYTES",
                   help="device memory kept for the KV cache and activations (default none)")
    p.add_argument("--trace", default=None, help="router trace to count copies on (default: synthetic, matched)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the synthetic trace (default 0)")
    p.add_argument("--warm", type=fraction, default=0.0, metavar="W",
                   help="unscored warm-up fraction of each stream (default 0; 0.6 = the fair window)")
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=f"lossless rule, repeatable (default: {', '.join(DEFAULT_POLICIES)})")
    p.add_argument("--tau", type=duration, default=None, metavar="DURATION", help="time of one expert copy, e.g. 0.51ms")
    p.add_argument("--c", type=compute_time, default=None, metavar="DURATION",
                   help="compute per token with every expert resident, e.g. 20.4ms or 49tok/s")
    p.add_argument("--calibrate", type=samples_int, default=None, metavar="N",
                   help="measure --tau and --c on this machine with N samples each, as 'expertcache calibrate' "
                        "does (needs a checkpoint folder as --model-config, and the hf extra)")
    t = p.add_argument_group("target (default: the largest capacity that fits)")
    t.add_argument("--target-hit-rate", type=positive_number, default=None, metavar="X", help="hit rate >= X, in (0, 1]")
    t.add_argument("--target-copies", type=_nonnegative, default=None, metavar="Y", help="copies/token <= Y")
    t.add_argument("--target-tokens-per-s", type=positive_number, default=None, metavar="N",
                   help="blocking decode rate >= N tok/s (needs --tau and --c)")
    h = p.add_argument_group("page-cache tier")
    h.add_argument("--host-memory", type=budget_bytes, default=None, metavar="BYTES", help="host memory for the page cache")
    h.add_argument("--tier-pool", metavar="DIR", default=None, help="pool written by 'expertcache tier write'")
    f = p.add_argument_group("CPU and disk forecast (docs/sizing.md, 'Forecast for CPU and disk')")
    f.add_argument("--memory", default=None, metavar="SIZE",
                   help="memory the GGUF's pages may take (as 'llama run --memory-wall': bytes, e.g. 16GB, or P%% = "
                        "the dense part + P%% of the expert tensors): forecast "
                        "decode with the experts read from disk, for the modes mmap, advise and managed")
    f.add_argument("--disk-bandwidth", type=auto_or_rate("GB/s"), default=None, metavar="auto|GB/s",
                   help="bandwidth of the disk holding the GGUF: auto (default) measures on the file itself "
                        "O_DIRECT reads of one expert slice by 1 and by 4 readers, and the modes' own reads "
                        "(hints, faults; advise's and mmap's also in a memory cgroup kept full, where the kernel "
                        "reclaims a page for each read, as at a wall) of its experts (kept a day); a number in GB/s is "
                        "taken as given for all")
    f.add_argument("--compute", type=auto_or_rate("tok/s"), default=None, metavar="auto|tok/s",
                   help="decode rate with every expert resident: auto (default) times llama.cpp on the file "
                        "(needs the llama extra; kept a day); or give it in tok/s")
    f.add_argument("--threads", type=threads_int, default=None, metavar="T",
                   help="llama.cpp threads for --compute auto (default 1)")
    f.add_argument("--auto", action="store_true", help="measure both the disk bandwidth and the compute rate "
                                                       "(what --disk-bandwidth auto --compute auto do)")
    add_json(p)
    p.set_defaults(func=run)


def _nonnegative(text: str) -> float:
    from .common import nonnegative_float

    return nonnegative_float(text)


def run(args) -> int:
    _model_argument(args)
    if args.memory is not None:
        return forecast_cmd(args)
    _check_gpu(args)
    _check(args)
    if args.calibrate is not None:
        args.tau, args.c = _calibrated(args)
    trace = open_trace(args.trace) if args.trace else None
    model = _model(args, trace)
    sizing = Sizing(model.expert_bytes, args.tau, args.c)
    fit = Fit(model.expert_bytes, model.num_experts, model.moe_layers, args.device_memory, model.other_bytes or 0,
              args.reserve or 0, model.layer_set_bytes)
    if fit.available <= 0:
        raise ConfigError(f"--device-memory {format_bytes(args.device_memory)}: the non-expert weights "
                          f"({format_bytes(fit.other_bytes)}) and --reserve leave nothing for experts")
    if fit.fits_entirely:
        if args.json:
            emit_json([record(fit, sizing, None, None)])
            return 0
        print(_fit_line(model, fit, args))
        return 0
    return _size(args, model, fit, sizing, trace)


def _model_argument(args) -> None:
    """The positional MODEL is --model-config given in front; ``args.model_option`` names the one
    given, for messages."""
    args.model_option = "--model-config"
    if args.model is not None:
        if args.model_config is not None:
            raise ConfigError("MODEL and --model-config both name the model: give one")
        args.model_config, args.model_option = args.model, "MODEL"


FORECAST_ONLY = ("disk_bandwidth", "compute", "threads", "auto")


def _check_gpu(args) -> None:
    """The GPU sizing takes --device-memory and none of the forecast's options."""
    given = [o for o in FORECAST_ONLY if getattr(args, o) not in (None, False)]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} belongs to the CPU-and-disk forecast: give --memory SIZE "
                          "(with MODEL.gguf)")
    if args.device_memory is None:
        raise ConfigError("give --device-memory BYTES (a GPU expert cache) or --memory SIZE (a GGUF decoded on "
                          "CPU, its experts read from disk)")


def _check(args) -> None:
    if args.model_config is not None and args.expert_mb is not None:
        raise ConfigError("--model-config and --expert-mb both give the expert size: give one")
    if args.model_config is None and args.expert_mb is None:
        raise ConfigError("give the model: --model-config PATH, or --expert-mb MB (with --experts, --top-k and "
                          "--moe-layers, or a --trace)")
    if args.model_config is not None and any(v is not None for v in (args.experts, args.top_k, args.moe_layers)):
        raise ConfigError("--experts/--top-k/--moe-layers come from --model-config; leave them out")
    if args.target_hit_rate is not None and not 0 < args.target_hit_rate <= 1:
        raise ConfigError(f"--target-hit-rate: {args.target_hit_rate:g} is outside (0, 1]")
    if args.tier_pool is not None and args.host_memory is None:
        raise ConfigError("--tier-pool needs --host-memory (the page cache it would sit in)")
    if args.tier_pool is not None and not Path(args.tier_pool).is_dir():
        raise ConfigError(f"--tier-pool {args.tier_pool}: no such folder (write one with 'expertcache tier write')")
    if args.host_memory is not None and args.tier_pool is None and not _is_gguf(args.model_config):
        raise ConfigError("--host-memory needs --tier-pool DIR or a GGUF --model-config (the file the page cache holds)")
    for spec in args.policies or []:
        if not make_policy(spec).admits:
            raise ConfigError(f"--policy {spec}: not a lossless rule (size counts copies of lossless caches)")
    if len(set(args.policies or [])) != len(args.policies or []):
        raise ConfigError("--policy: a rule is given twice")


def _calibrated(args) -> tuple[float, float]:
    """(tau, c) in ms measured on the checkpoint folder ``--model-config`` (the median of
    ``--calibrate`` samples each, through :func:`expertcache.hf.calibrate.calibrate`); the
    measurement and its spread go to stderr so stdout stays the answer."""
    import sys

    from .._text import first_line
    if args.tau is not None or args.c is not None:
        raise ConfigError("--calibrate measures --tau and --c: give either the measurement or the values")
    folder = Path(args.model_config) if args.model_config is not None else None
    if folder is None or not folder.is_dir():
        raise ConfigError("--calibrate needs a checkpoint folder as --model-config (config.json and *.safetensors)")
    try:
        from ..hf import load_model
        from ..hf.calibrate import calibrate
    except ImportError as exc:
        raise ConfigError(f"--calibrate needs the hf extra ({first_line(exc)})") from None
    r = calibrate(load_model(str(folder)), repeats=args.calibrate)
    print(f"calibrated on this machine ({r.device}, {args.calibrate} samples): tau {r.tau_ms:.4f} ms "
          f"(p10 {r.tau_ms_p10:.4f}, p90 {r.tau_ms_p90:.4f}), c {r.c_ms:.3f} ms (p10 {r.c_ms_p10:.3f}, "
          f"p90 {r.c_ms_p90:.3f})", file=sys.stderr)
    return r.tau_ms, r.c_ms


def _is_gguf(path) -> bool:
    return path is not None and str(path).lower().endswith(".gguf")


def _model(args, trace) -> ModelSpec:
    if args.model_config is not None:
        model = read_model(args.model_config, args.model_option)
    else:
        dims = [args.experts, args.top_k, args.moe_layers]
        if trace is not None:
            dims = [d if d is not None else t for d, t in zip(dims, (trace.num_experts, trace.top_k, trace.num_layers))]
        if None in dims:
            missing = [o for o, d in zip(("--experts", "--top-k", "--moe-layers"), dims) if d is None]
            raise ConfigError(f"--expert-mb: also give {', '.join(missing)} (or a --trace that has them)")
        if dims[1] > dims[0]:
            raise ConfigError(f"--top-k {dims[1]} is above --experts {dims[0]}")
        if not args.expert_mb * MB <= MAX_EXPERT_BYTES:  # 1e303 MB and up are infinite bytes
            raise ConfigError(f"--expert-mb {args.expert_mb:g}: above {MAX_EXPERT_BYTES / MB:g} MB, "
                              "not a plausible value")
        model = ModelSpec(dims[0], dims[1], dims[2], round(args.expert_mb * MB), None, "--expert-mb and dimensions")
    if trace is not None and trace.num_experts != model.num_experts:
        raise ConfigError(f"--trace {args.trace}: E={trace.num_experts}, the model has E={model.num_experts}")
    return model


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def _fit_line(model: ModelSpec, fit: Fit, args) -> str:
    other = (f" - {_gb(fit.other_bytes)} non-expert weights, {model.other_source}" if model.other_bytes is not None
             else "")
    reserve = f" - {_gb(fit.reserve_bytes)} reserve" if fit.reserve_bytes else ""
    missing = "; non-expert weights not counted: give --model-config" if model.other_bytes is None else ""
    rate = f"; {1000 / args.c:.4g} tok/s at c = {args.c:.4g} ms/token" if args.c else ""
    return (f"fits entirely: {model.num_experts} experts x {model.moe_layers} layers x {_expert_mb(model)} "
            f"= {_gb(fit.all_experts_bytes)} <= {fit.available / 1e9:.4g} GB available ({format_bytes(fit.device_bytes)}"
            f"{other}{reserve}{missing}): keep every expert resident, zero copies, no cache to size{rate}")


def _expert_mb(model: ModelSpec) -> str:
    """One expert in MB; ``0.119 MB (mean; 0.1106-0.1275 MB by layer)`` where layers differ."""
    sizes = model.layer_expert_bytes
    if sizes is None or len(set(sizes)) == 1:
        return f"{model.expert_bytes / MB:.4g} MB"
    return f"{model.expert_bytes / MB:.4g} MB (mean; {min(sizes) / MB:.4g}-{max(sizes) / MB:.4g} MB by layer)"


def _size(args, model, fit, sizing, trace) -> int:
    from ..sim import build_layout
    from ..sim.curves import FAIR_WARM
    from ..sim.curves.targets import hit_rate_ceiling

    label = f"trace {args.trace}"
    if trace is None:
        trace, label = synthetic_trace(model, args.seed)
    layout = build_layout(trace, warm=args.warm)
    scale = model.moe_layers / len(layout.layer_ids)
    target_copies = args.target_copies
    if args.target_tokens_per_s is not None:
        rate = copies_for_rate(args.target_tokens_per_s, args.tau, args.c)
        target_copies = rate if target_copies is None else min(rate, target_copies)
    targeted = args.target_hit_rate is not None or target_copies is not None
    cap = fit.memory_capacity
    if not targeted and cap < layout.widest:
        raise ConfigError(f"--device-memory: {_gb(fit.available)} for experts holds {cap} per layer, fewer than the "
                          f"{layout.widest} one token needs at a layer: a lossless cache cannot serve a token")
    policies = [make_policy(s).spec for s in (args.policies or DEFAULT_POLICIES)]
    answers = search(layout, policies, target_hit_rate=args.target_hit_rate,
                     target_copies=None if target_copies is None else target_copies / scale, at_capacity=cap)
    if scale != 1:
        from dataclasses import replace

        answers = [replace(a, copies_per_token=None if a.copies_per_token is None else a.copies_per_token * scale,
                           misses_per_token=None if a.misses_per_token is None else a.misses_per_token * scale)
                   for a in answers]
    best = recommended(answers)
    tier = host_tier(args, model, trace) if args.host_memory is not None else None
    records = [record(fit, sizing, a, best) | {"host_tier": tier} for a in answers]
    if args.json:
        emit_json(records)
        return 0
    ceiling = None
    if args.target_hit_rate is not None:
        fair = build_layout(trace, warm=FAIR_WARM) if args.warm < FAIR_WARM else None
        ceiling = hit_rate_ceiling(layout, fair_layout=fair)
    print_size(args, model, fit, sizing, label, layout, scale, target_copies, records, answers, best, ceiling, trace)
    return 0


def print_size(args, model, fit, sizing, label, layout, scale, target_copies, records, answers, best, ceiling,
               trace) -> None:
    """The text report of a model that does not fit entirely."""
    other = (f"{_gb(model.other_bytes)} non-expert weights ({model.other_source})" if model.other_bytes is not None
             else "non-expert weights not counted (give --model-config)")
    print(f"model: {model.source}: E={model.num_experts}, k={model.top_k}, {model.moe_layers} MoE layers, "
          f"expert {_expert_mb(model)}; {other}")
    print(f"does not fit entirely: all {model.num_experts * model.moe_layers:,} experts need "
          f"{_gb(fit.all_experts_bytes)}, {format_bytes(fit.device_bytes)} leaves {_gb(fit.available)} for experts: "
          f"at most {fit.memory_capacity} per layer ({_gb(fit.cache_bytes(fit.memory_capacity))})")
    print(f"copies from {label}: {trace.num_tokens} tokens in {trace.num_sequences} sequence(s), "
          f"{len(layout.layer_ids)} layer(s) replayed"
          + (f", copies/token scaled by {model.moe_layers}/{len(layout.layer_ids)} to the model's layers" if scale != 1 else "")
          + (f", warm fraction {args.warm:g}" if args.warm else ", pools emptied at each sequence"))
    want = []
    if args.target_hit_rate is not None:
        want.append(f"hit rate >= {args.target_hit_rate:g}")
    if target_copies is not None:
        src = f" (= {args.target_tokens_per_s:g} tok/s)" if args.target_tokens_per_s is not None else ""
        want.append(f"copies/token <= {target_copies:.4g}{src}")
    print("target: " + (" and ".join(want) + ": the smallest capacity per layer meeting it" if want
                        else f"none: each rule at the largest capacity that fits ({fit.memory_capacity} per layer)"))
    rows = []
    for a, r in zip(answers, records):
        gbps = None if r["copy_bytes_per_s"] is None else r["copy_bytes_per_s"] / 1e9
        fits = None if r["fits"] is None else ("yes" if r["fits"] else "no")
        rows.append([a.policy, "yes" if a.needs_future else "", r["capacity_per_layer"], r["hit_rate"],
                     r["copies_per_token"], r["misses_per_token"], r["ms_per_token"], r["ms_per_token_overlapped"],
                     r["tokens_per_s"], gbps, None if r["cache_bytes"] is None else r["cache_bytes"] / 1e9, fits])
    table(rows, ["policy", "future", "C/layer", "hit rate", "copies/tok", "misses/tok", "ms/tok", "ms/tok ovl", "tok/s",
                 "GB/s", "cache GB", "fits"])
    print("  copies/tok: the steady copies that evict; misses/tok: every miss, the cold fills of empty pools "
          "(pools emptied at each sequence) included, as the hit rate counts them")
    if sizing.tau_ms is None or sizing.c_ms is None:
        print("  (add --tau and --c for ms/token, tok/s and GB/s)")
    else:
        print("  ms/tok = c + copies/token x tau (copies block), ovl = max(c, copies/token x tau), "
              "GB/s = copies/token x expert bytes x tok/s")
    for a in answers:
        if a.capacity is None and ceiling is not None and ceiling.note(args.target_hit_rate):
            print("  " + ceiling.note(args.target_hit_rate))
            break
    if any(a.capacity is None for a in answers):
        print(f"  '-': no capacity up to E={model.num_experts} meets the target")
    if best is None:
        print("recommended: none (no causal rule meets the target)")
    else:
        where = "fits" if best.capacity <= fit.memory_capacity else \
            f"needs {_gb(fit.cache_bytes(best.capacity))}, more than the {_gb(fit.available)} available"
        print(f"recommended: {best.policy} at {best.capacity} experts per layer ({where}); rules marked 'future' "
              "read the recorded future: an offline reference, not a rule a cache can run")
    if args.host_memory is not None:
        print(tier_line(records[0]["host_tier"]))


def host_tier(args, model, trace) -> dict:
    """The page-cache tier (``--host-memory``) as the ``host_tier`` field of ``size --json``: do the
    experts of the pool (or GGUF) fit in host memory? For a GGUF the page cache holds its dense part
    too (read on every token): the experts get what it leaves. Otherwise how many it holds, and the
    experts per token a global LRU of that size over the trace reads from disk (``None`` when it
    holds fewer than one token's k: nearly every miss reads the disk)."""
    if args.tier_pool is not None:
        from ..tier.pool import open_pool

        pool = open_pool(args.tier_pool)
        total, S, what, dense = pool.total_bytes, pool.expert_bytes, f"pool {args.tier_pool}", 0
    else:
        total, S, what = model.all_experts_bytes, model.expert_bytes, f"GGUF {args.model_config}"
        dense = model.other_bytes or 0
    H = args.host_memory
    out = {"of": what, "host_memory_bytes": H, "dense_bytes": dense, "experts_bytes": total,
           "experts_total": total // S, "fits": total <= H - dense, "experts_held": total // S,
           "experts_per_token_from_disk": 0.0}
    if not out["fits"]:
        n = max(0, H - dense) // S
        out.update(experts_held=n, experts_per_token_from_disk=None)
        if n >= trace.top_k:
            from ..sim import replay

            r = replay(trace, int(n), "lru", pool="global", reset="none")
            out["experts_per_token_from_disk"] = r.copies_total / r.tokens
    return out


def tier_line(tier: dict) -> str:
    """:func:`host_tier` as the text report's line."""
    H, what, total, n = format_bytes(tier["host_memory_bytes"]), tier["of"], tier["experts_bytes"], tier["experts_held"]
    beside = f" beside its {format_bytes(tier['dense_bytes'])} dense part" if tier["dense_bytes"] else ""
    if tier["fits"]:
        return (f"page-cache tier: the {_gb(total)} of experts in {what} fit in {H} of host memory"
                f"{beside}: after the first read every miss is a host-to-device copy from the page cache, no disk read")
    if tier["experts_per_token_from_disk"] is None:
        return f"page-cache tier: {H} holds {n} experts of {what}{beside}: nearly every miss reads the disk"
    return (f"page-cache tier: {H} holds {n:,} of the {tier['experts_total']:,} experts of {what}{beside} "
            f"({n / tier['experts_total']:.0%}); a global LRU of that size over the trace (page cache "
            f"kept across sequences, started empty) reads {tier['experts_per_token_from_disk']:.4g} experts/token from "
            "disk, first reads counted: an estimate, the kernel's page cache is not exactly LRU; measure with "
            "'expertcache tier replay' (or forecast a GGUF with --memory)")


# ------------------------------------------------------------------------ --memory: CPU and disk
GPU_ONLY = (("expert_mb", "--expert-mb"), ("experts", "--experts"), ("top_k", "--top-k"),
            ("moe_layers", "--moe-layers"), ("device_memory", "--device-memory"), ("reserve", "--reserve"),
            ("tau", "--tau"), ("c", "--c"), ("calibrate", "--calibrate"), ("target_hit_rate", "--target-hit-rate"),
            ("target_copies", "--target-copies"), ("target_tokens_per_s", "--target-tokens-per-s"),
            ("host_memory", "--host-memory"), ("tier_pool", "--tier-pool"), ("policies", "--policy"))


def forecast_cmd(args) -> int:
    """``size MODEL.gguf --memory SIZE``: the CPU-and-disk forecast (:mod:`expertcache.llama.forecast`)."""
    from ..llama import forecast as dk
    from ..formats.gguf import read_geometry, type_sizes
    from ..llama.sweep import parse_wall
    from ..llama.runner import smallest_wall

    for dest, option in GPU_ONLY:
        if getattr(args, dest) is not None:
            raise ConfigError(f"{option} sizes a GPU expert cache (--device-memory); the --memory forecast takes "
                              "MODEL.gguf, --disk-bandwidth, --compute, --threads, --trace and --seed")
    if args.warm:
        raise ConfigError("--warm scores part of each stream; the --memory forecast counts every read, first reads "
                          "included")
    if not _is_gguf(args.model_config):
        raise ConfigError("--memory forecasts a GGUF decoded by llama.cpp: give MODEL.gguf (or --model-config "
                          "MODEL.gguf)")
    if args.auto and any(isinstance(v, float) for v in (args.disk_bandwidth, args.compute)):
        raise ConfigError("--auto measures both the disk bandwidth and the compute rate: leave out the number given "
                          "to --disk-bandwidth or --compute (or --auto)")
    bandwidth = args.disk_bandwidth if args.disk_bandwidth is not None else "auto"
    compute = args.compute if args.compute is not None else "auto"
    threads = args.threads if args.threads is not None else 1
    type_sizes(f"{args.model_option} {args.model_config}")  # without the gguf package: one line
    g = read_geometry(str(args.model_config), args.model_option)
    args.memory = parse_wall(args.memory, g, "--memory")
    if args.memory < smallest_wall(g):
        raise ConfigError(f"--memory {format_bytes(args.memory)}: below the smallest memory this model decodes in, "
                          f"{format_bytes(smallest_wall(g))} ({smallest_wall(g):,} bytes: the dense part "
                          f"{g.dense_bytes:,} plus one layer's {g.top_k} routed experts)")
    E, k, L = g.num_experts, g.top_k, len(g.moe_layers)
    if args.trace:
        trace, label = open_trace(args.trace), f"trace {args.trace}"
    else:
        spec = ModelSpec(E, k, L, max(g.layer_expert_bytes), g.dense_bytes, f"GGUF {g.path}")
        trace, label = synthetic_trace(spec, args.seed, tokens=dk.synthetic_tokens(E, k))
    experts = dk.routing(trace, g)
    prompt = dk.prompt_rows(trace) if args.trace else None
    if isinstance(bandwidth, float):
        bw1 = bw4 = hinted = faulted = bandwidth * 1e9
        req, bw_source = dk.request_bytes(g), "--disk-bandwidth"
        hinted_source = faulted_source = "--disk-bandwidth"
        full = {kind: (None, "") for kind in ("hinted", "faulted")}
    else:
        bw1, bw4, req, bw_source = dk.measure_bandwidth(g)
        hinted, hinted_source = dk.measure_hinted(g)
        faulted, faulted_source = dk.measure_faulted(g)
        full = {kind: dk.measure_full(g, kind) for kind in ("hinted", "faulted")}
    if isinstance(compute, float):
        rates, c_sources = dk.Disk.given_compute(compute, "--compute")
    else:  # in each page state, and as the managed and advise modes run (forecast.COMPUTE_TIMINGS)
        measured = {t: dk.measure_compute(g, threads, timing=t) for t in dk.COMPUTE_TIMINGS}
        rates, c_sources = {t: m[0] for t, m in measured.items()}, {t: m[1] for t, m in measured.items()}
    window, window_source = dk.readahead_bytes(g.path)
    disk = dk.Disk(bw1, bw4, req, bw_source, rates, c_sources, threads, hinted, hinted_source, faulted,
                   faulted_source, *full["hinted"], *full["faulted"])
    records = dk.forecast(g, experts, args.memory, disk, window=window, window_source=window_source,
                          trace_label=label, prompt=prompt, seq=np.asarray(trace.seq))
    if args.json:
        emit_json(records)
        return 0
    print_forecast(g, trace, label, records, prompt)
    return 0


def _num(x, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x / scale:.4g}"


def print_forecast(g, trace, label: str, records: list[dict], prompt=None) -> None:
    """The text report of ``size --memory``."""
    r0 = records[0]
    sizes = g.layer_expert_bytes
    per = (f"{sizes[0] / MB:.4g} MB per expert" if len(set(sizes)) == 1
           else f"{min(sizes) / MB:.4g}-{max(sizes) / MB:.4g} MB per expert by layer")
    print(f"model: GGUF {g.path}: E={g.num_experts}, k={g.top_k}, {len(g.moe_layers)} MoE layers; dense part "
          f"{format_bytes(g.dense_bytes)} (read every token), expert tensors {format_bytes(g.expert_tensor_bytes)} "
          f"({per})")
    room = r0["memory_wall"] - g.dense_bytes
    if room >= g.expert_tensor_bytes:
        from ..llama.advice import managed_budget, managed_item_bytes

        spare = room - g.expert_tensor_bytes
        pages = int(managed_item_bytes(g).sum())
        managed = ("" if managed_budget(g, r0["memory_wall"]) >= pages else
                   f"; managed counts each expert's whole pages, {format_bytes(pages)} in all, which do not fit: "
                   "its row re-reads")
        print(f"memory {format_bytes(r0['memory_wall'])}: the dense part and every expert "
              f"({format_bytes(g.expert_tensor_bytes)}), {format_bytes(spare)} to spare (every expert fits: mmap and "
              f"advise keep what the load read, managed reads each once{managed})")
    else:
        print(f"memory {format_bytes(r0['memory_wall'])}: the dense part and {format_bytes(room)} of experts beside "
              f"it ({room / g.expert_tensor_bytes:.0%} of the expert tensors)")
    decode = trace.num_tokens - (0 if prompt is None else int(prompt.sum()))
    warm = "" if prompt is None else (f" ({int(prompt.sum())} prompt rows besides: replayed first, uncounted, as "
                                      "a run's prefill reads before its decode)")
    print(f"reads from {label}: {decode} {'decode ' if prompt is not None else ''}tokens in {trace.num_sequences} "
          f"sequence(s){warm}, replayed from where a run starts (mmap, advise: the file just loaded; managed: an "
          "empty pool), the page cache kept across sequences, first reads counted")
    same = r0["device_read_bytes_per_s_1"] == r0["device_read_bytes_per_s_4"] and r0["disk_bandwidth_source"] == \
        "--disk-bandwidth"
    bws = (f"B1 = B4 = {r0['device_read_bytes_per_s_1'] / 1e9:.4g} GB/s" if same else
           f"B1 {r0['device_read_bytes_per_s_1'] / 1e9:.4g} GB/s (one reader), B4 "
           f"{r0['device_read_bytes_per_s_4'] / 1e9:.4g} GB/s (four readers)")
    by_pages: dict = {}
    for r in records:
        by_pages.setdefault((r["compute_tokens_per_s"], r["compute_source"]), []).append(r["mode"])
    if len(by_pages) == 1:
        comp = f"c = {r0['compute_tokens_per_s']:.4g} tok/s with every expert resident ({r0['compute_source']})"
    else:
        comp = "c with every expert resident = " + ", ".join(
            f"{c:.4g} tok/s for {' and '.join(modes)} ({source})" for (c, source), modes in by_pages.items())
    paths = {r["mode"]: r for r in records}
    own = "" if paths["managed"]["read_source"] == "--disk-bandwidth" else "".join(
        f"; {what} {paths[m]['read_bytes_per_s'] / 1e9:.4g} GB/s ({paths[m]['read_source']})"
        for m, what in (("managed", "managed's hinted reads"), ("advise", "advise's hinted reads"),
                        ("mmap", "mmap's faulted reads")))
    print(f"disk: {bws} ({r0['disk_bandwidth_source']}){own}; compute: {comp}")
    head = ["mode", "dense MB", "experts MB", "demand MB/tok", "ampl", "read MB/tok", "first reads", "tok/s",
            "ovl tok/s", "bound by"]
    rows = []
    for r in records:
        D = r["missed_bytes_per_token"]
        share = None if not D else f"{r['fill_bytes_per_token'] / D:.0%}"
        rows.append([r["mode"], _num(r["dense_bytes"], MB), _num(r["cache_bytes"], MB),
                     _num(r["demand_bytes_per_token"], MB), _num(r["amplification"]), _num(D, MB), share or "-",
                     _num(r["predicted_tokens_per_s"]), _num(r["limit_tokens_per_s"]), r["bound_by"] or "-"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i in (0, len(head) - 1) else c.rjust(w) for i, (c, w) in
                        enumerate(zip(row, widths))).rstrip())
    print("  tok/s = 1 / (1/c + read/B): the forecast (reads block compute in these modes), B = the rate of each "
          "mode's own reads (mmap: faults; advise, managed: hints; mmap's and advise's at a full cgroup, whose "
          "kernel reclaims a page for each it reads, as at a wall); ovl tok/s = min(c, max(B1, B4, B) / read): "
          "reads overlapped with compute, for reference; bound by: the larger of 1/c and read/B")
    print("  demand: an LRU of the mode's expert bytes (experts MB) over the trace; first reads: their share of "
          "read MB/tok")
    for r in records:
        print(f"  {r['mode']}: {r['note']}")
    print("  the read models are models (docs/sizing.md, 'Forecast for CPU and disk'): measure with "
          "'expertcache llama run MODEL.gguf --memory-wall SIZE --mode MODE'")
