"""Teacher-forced evaluation of offloaded policies: NLL, tokens/s, copies, and the exactness check.

Protocol (the seeds' harness, extended to batches): every sequence teacher-forced, batch b (default
1) rows of equal length per forward, each policy's pools empty at the start of every batch.

1. *Reference pass*: next-token NLL and time, and a capture of every position's router decisions
   (the trace ``--capture`` saves, and the recorded future clairvoyant policies and oracle
   prefetch read). ``reference="resident"`` runs the stock model with every expert on the device
   (the experts are moved there for this pass only); ``"offloaded"`` runs it offloaded at the same
   capacity under ``lru`` (lossless, so the same NLL), for a model whose experts do not fit the
   device; ``"auto"`` (default) is ``resident`` unless the host-held experts exceed 90% of the
   device's free memory.
2. *One pass per policy* under :func:`~expertcache.hf.offload` (a pool per layer, or one
   global pool shared by all offloaded layers): NLL, time, copies (fill and steady, per layer),
   copy time, prefetch counts, memory, and a capture of what the live run requested.

Checks, per policy: ``exact`` = ``|nll - nll_reference| <= tolerance`` (5e-3): for a lossless
policy a miss is a bug and :meth:`Evaluation.check` raises; a set-holding (lossy) policy reports
its ``dnll`` instead. ``replay_agrees`` = the live copy counts equal :func:`expertcache.replay` of the
live capture with the same policy, capacity and layers, layer by layer (``None`` with prefetching
or a set-holding policy, which the simulator does not model). ``switches`` / ``switch_rate``: token
steps whose chosen expert set differs from the previous token's at the same layer (a switch is
not a copy: a held set can switch without copying).

Modes: ``decode`` feeds one token position per forward with a KV cache (the seeds' token-by-token
decoding); ``forward`` runs one forward per batch, in which each offloaded layer still steps its
cache one position at a time (see :mod:`.layer`), so both modes make the same copies. Prefetch
and the global pool need ``decode``. Timing: CUDA events on a GPU, ``perf_counter`` on the CPU, around each forward;
one untimed warm-up forward runs before each pass.

Time per step (``ms_per_token``; a step is one token position, one token of each row) and the
cost model (docs/design.md section 2): ``c_ms`` = this run's compute per step (``ms_per_token`` minus its
copy time per step), ``rho`` = steady copies per step over all offloaded layers (the seeds' rho,
``copies_per_token``), ``dnll`` = ``nll - nll_reference``: the three fields ``expertcache choose``
reads. ``tau_ms`` = measured copy time per copy (each counted copy, so N repeats under
``slow_copies`` = N count as one, N times slower), ``rho_all`` = all copies made per step (demand,
fill and prefetch), ``c_ms_reference`` = the reference pass's ms per step, the blocking sum
``ms_blocking = c_ms_reference + rho_all * tau_ms`` and the overlapped bound
``ms_overlapped = max(c_ms_reference, rho_all * tau_ms)``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from .._text import short
from ..costmodel.runs import MAX_SAMPLES
from ..errors import ConfigError, ExpertcacheError, is_int, is_real
from ..policies.registry import check_kind
from ..sim import replay
from ..trace import Trace
from .loading import resident
from .pagecache import read_bytes_self
from .model import find_sites, model_device, model_label, select_sites
from .intervals import dnll_interval, draws
from .passes import MODES, PassResult, check_sequences, make_batches, run_pass, vocab_size
from .recorder import Capture
from .run import OffloadRun
from .stats import OffloadStats

TOLERANCE = 5e-3
WARMUP_TOKENS = 4
REFERENCES = ("auto", "resident", "offloaded")


class ExactnessError(ExpertcacheError):
    """A lossless policy's NLL left the tolerance around the all-resident reference, or its copies
    disagree with a replay of its own trace."""


@dataclass
class PolicyResult:
    """One policy's evaluation; :meth:`to_dict` is the ``expertcache eval --json`` record."""

    policy: str
    capacity: int
    mode: str
    tolerance: float
    reference: PassResult
    run: PassResult
    stats: OffloadStats
    replay_copies_total: int | None
    replay_copies_steady: int | None
    replay_agrees: bool | None
    routing_changed: float
    reference_kind: str = "resident"
    read_bytes_self: int | None = None  # /proc/self/io read_bytes during the timed pass (this process only)
    ms_runs: list = field(default_factory=list)  # ms per step of each round (--repeats), in round order
    ms_runs_reference: list = field(default_factory=list)
    counts_repeat: bool = True  # every round made the same copies
    dnll_ci: list | None = None  # --bootstrap: 95% interval of dnll over the sequences (hf.intervals)
    bootstrap: int = 0
    bootstrap_seed: int = 0

    @property
    def nll_delta(self) -> float:
        return self.run.nll - self.reference.nll

    @property
    def exact(self) -> bool:
        return abs(self.nll_delta) <= self.tolerance

    @property
    def lossless(self) -> bool:
        return self.stats.lossless

    def timing(self) -> dict:
        """Measured ms per step, its compute part, and the cost model's blocking sum and overlapped bound."""
        s = self.stats
        steps = self.run.steps or 1
        copies = s.copies_total + s.prefetch_copies
        c_ref = self.reference.ms_per_step
        copy_ms = 1000.0 * s.copy_seconds / steps
        tau = 1000.0 * s.copy_seconds / copies if copies else float("nan")
        rho_all = copies / steps
        load = rho_all * tau if copies else 0.0
        return {
            "ms_per_token": self.run.ms_per_step, "c_ms": self.run.ms_per_step - copy_ms, "rho": s.copies_per_token,
            "dnll": self.nll_delta, "tau_ms": tau, "rho_all": rho_all, "c_ms_reference": c_ref,
            "ms_blocking": c_ref + load, "ms_overlapped": max(c_ref, load), "slow_copies": s.slow_copies,
        }

    def spread(self) -> dict:
        """The rounds of ``repeats``: each round's ms per step (this policy and the reference) and the
        spread (max - min) / median; the record's timings are those of the median round."""
        def rel(xs):
            xs = [x for x in xs if x == x]
            return (max(xs) - min(xs)) / float(np.median(xs)) if len(xs) > 1 and np.median(xs) > 0 else 0.0

        return {"repeats": len(self.ms_runs) or 1, "ms_per_token_runs": list(self.ms_runs),
                "ms_per_token_spread": rel(self.ms_runs), "ms_per_token_reference_runs": list(self.ms_runs_reference),
                "ms_per_token_reference_spread": rel(self.ms_runs_reference)}

    def to_dict(self) -> dict:
        s = self.stats
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "tokens": self.run.tokens,
            "steps": self.run.steps,
            "batch": s.batch,
            "nll": self.run.nll,
            "nll_reference": self.reference.nll,
            "nll_delta": self.nll_delta,
            "dnll_ci": self.dnll_ci,
            "bootstrap": self.bootstrap,
            "bootstrap_seed": self.bootstrap_seed,
            "exact": self.exact,
            "lossless": self.lossless,
            "tolerance": self.tolerance,
            "reference": self.reference_kind,
            "pool": s.pool,
            "copies_total": s.copies_total,
            "copies_fill": s.copies_fill,
            "copies_steady": s.copies_steady,
            "copies_per_token": s.copies_per_token,
            "hit_rate": s.hit_rate,
            "tokens_per_s": self.run.tokens_per_s,
            "tokens_per_s_reference": self.reference.tokens_per_s,
            "speed_vs_reference": self.run.tokens_per_s / self.reference.tokens_per_s,
            **self.timing(),
            "copy_seconds": s.copy_seconds,
            "copy_bytes_per_s": s.copy_bandwidth,
            "expert_bytes": s.expert_bytes,
            "switches": s.switches,
            "switch_rate": s.switch_rate,
            "refreshes": s.refreshes,
            "prefetch": s.prefetch,
            "prefetch_copies": s.prefetch_copies,
            "prefetch_hits": s.prefetch_hits,
            "prefetch_wasted": s.prefetch_wasted,
            "prefetch_pending": s.prefetch_pending,
            "replay_copies_total": self.replay_copies_total,
            "replay_copies_steady": self.replay_copies_steady,
            "replay_agrees": self.replay_agrees,
            "routing_changed": self.routing_changed,
            "future_mismatches": s.future_mismatches,
            "predictions": self.run.predictions,
            "sequences": s.sequences,
            "layers": s.layers,
            "mode": self.mode,
            "device": s.device,
            "host": s.host,
            "tier_hits": s.tier_hits(),
            "read_bytes_self": self.read_bytes_self,
            **self.spread(),
            "memory": s.memory.to_dict(),
            "per_layer": [c.to_dict() for c in s.per_layer],
        }


@dataclass
class Evaluation:
    """The reference pass, its trace, and one :class:`PolicyResult` per policy."""

    reference: PassResult
    trace: Trace
    results: list[PolicyResult] = field(default_factory=list)
    reference_kind: str = "resident"
    dropped: int = 0  # trailing sequences left out because they did not fill a batch
    capacity_requested: int | None = None  # the capacity asked for, before clamping to what can be held
    capacity: int | None = None
    repeats: int = 1

    def failures(self) -> list[str]:
        """One line per broken guarantee (empty when every policy is exact and agrees with replay)."""
        out = []
        for r in self.results:
            if r.lossless and not r.exact:
                out.append(
                    f"policy {r.policy} at C={r.capacity}: NLL {r.run.nll:.6f} differs from the reference "
                    f"{r.reference.nll:.6f} by {abs(r.nll_delta):.2e} > {r.tolerance:g} (a lossless policy must match)"
                )
            if r.replay_agrees is False:
                out.append(
                    f"policy {r.policy} at C={r.capacity}: live copies (total {r.stats.copies_total}, steady "
                    f"{r.stats.copies_steady}) differ from the replay of its trace (total {r.replay_copies_total}, "
                    f"steady {r.replay_copies_steady})"
                )
            if not r.counts_repeat:
                out.append(f"policy {r.policy} at C={r.capacity}: the rounds of --repeats made different copies")
        return out

    def check(self) -> None:
        """Raise :class:`ExactnessError` with the first failure, if any."""
        failures = self.failures()
        if failures:
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            raise ExactnessError(failures[0] + more)


def evaluate(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    capacity: int,
    policies: Iterable[str] = ("lru",),
    layers: Iterable[int] | None = None,
    *,
    mode: str = "decode",
    tolerance: float = TOLERANCE,
    router_probs: bool = False,
    progress: bool = False,
    batch: int = 1,
    prefetch: str = "none",
    reference: str = "auto",
    pool: str = "layer",
    slow_copies: int = 1,
    repeats: int = 1,
    bootstrap: int = 0,
    bootstrap_seed: int = 0,
) -> Evaluation:
    """Run the protocol of the module docstring; ``sequences`` are token-id lists of length >= 2.
    ``bootstrap`` > 0 gives each policy a 95% interval of its dNLL over the sequences
    (:mod:`.intervals`; every policy on the same resamples)."""
    _check_options(mode, reference, tolerance, prefetch, pool, router_probs, batch, repeats)
    if not (is_int(bootstrap, 0) and is_int(bootstrap_seed, 0, 2**63 - 1)):
        raise ConfigError(f"bootstrap must be an integer >= 0 (0: no interval) and bootstrap_seed one in [0, 2**63), "
                          f"got {short(bootstrap, 40)} and {short(bootstrap_seed, 40)}")
    seqs = check_sequences(sequences, vocab_size(model))
    batches, dropped = make_batches(seqs, batch)
    idx = draws(len(seqs) - dropped, bootstrap, bootstrap_seed) if bootstrap else None
    rules = [check_kind(p, ("eviction", "set-holding")) for p in policies]  # parsed once: each file read once
    specs = [r.spec for r in rules]
    if not specs:
        raise ConfigError("policies: give at least one policy")
    layers = None if layers is None else list(layers)
    model.eval()
    device = model_device(model)
    # validate capacity, layers, prefetch and model support for every policy before the long reference pass
    options = dict(prefetch=prefetch, device=device, pool=pool, slow_copies=slow_copies)
    requested = capacity
    capacity = fitting_capacity(model, capacity, layers, pool)
    probes = [OffloadRun(model, capacity, rule, layers, **options) for rule in rules]
    sites = probes[0].sites
    kind = _reference_kind(reference, sites, device)
    warmup = [b[:, :WARMUP_TOKENS] for b in batches[:1]]
    label = kind if kind == "resident" else f"lru at C={capacity}"
    bar = _bar(progress, repeats * (1 + len(specs)) * len(seqs))
    refs, runs = [], {spec: [] for spec in specs}
    trace = None
    for round_ in range(repeats):  # interleaved: the reference, then every policy, once per round
        bar.set_description(f"reference ({label})" + (f", round {round_ + 1}/{repeats}" if repeats > 1 else ""))
        refs.append(_reference_pass(model, batches, warmup, mode, kind, sites, device, capacity, probes[0].layer_ids,
                                    router_probs and trace is None, bar))
        if trace is None:
            trace = refs[0][1]
        if not math.isfinite(refs[-1][0].nll):  # the model, not a policy: nothing could match it
            raise ConfigError(f"the reference pass (every expert resident) gives NLL {refs[-1][0].nll}: the model's "
                              "weights hold NaN or infinity")
        for spec, rule, probe in zip(specs, rules, probes):
            bar.set_description(f"{spec} at C={capacity}" + (f", round {round_ + 1}/{repeats}" if repeats > 1 else ""))
            runs[spec].append(_policy_pass(model, batches, warmup, mode, rule, capacity, probe.layer_ids, trace,
                                           options, device, bar))
    bar.close()
    ref = _median_round([r[0] for r in refs])
    evaluation = Evaluation(ref, trace, reference_kind=label, dropped=dropped, capacity_requested=requested,
                            capacity=capacity, repeats=repeats)
    for spec, rule in zip(specs, rules):
        rounds = runs[spec]
        result, stats, live, read = rounds[_median_index([r[0] for r in rounds])]
        res = _policy_result(spec, rule, capacity, mode, tolerance, ref, result, stats, live, trace, label)
        res.read_bytes_self = read
        res.ms_runs = [r[0].ms_per_step for r in rounds]
        res.ms_runs_reference = [r[0].ms_per_step for r in refs]
        res.counts_repeat = all(_counts(r[1]) == _counts(stats) for r in rounds)
        if idx is not None:
            res.dnll_ci = dnll_interval(result.seq_nll, ref.seq_nll, ref.seq_predictions, idx)
            res.bootstrap, res.bootstrap_seed = int(bootstrap), int(bootstrap_seed)
        evaluation.results.append(res)
    return evaluation


def _check_options(mode, reference, tolerance, prefetch, pool, router_probs, batch, repeats) -> None:
    """:func:`evaluate`'s options that need no model, checked before anything runs."""
    if mode not in MODES:
        raise ConfigError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    if reference not in REFERENCES:
        raise ConfigError(f"reference: {reference!r} is not one of {', '.join(REFERENCES)}")
    if not (is_real(tolerance) and tolerance >= 0):  # True had read as 1 nat, infinity switched the check off
        raise ConfigError(f"tolerance must be a finite non-negative number of nats, got {short(tolerance, 40)}")
    if prefetch != "none" and mode != "decode":
        raise ConfigError(
            "prefetch needs mode decode: a teacher-forced forward runs every position of a layer before the next layer starts"
        )
    if pool == "global" and mode != "decode":
        raise ConfigError("pool global needs mode decode: it serves one token position per forward, layer by layer")
    if not is_int(batch, 1):
        raise ConfigError(f"batch must be an integer >= 1, got {short(batch, 40)}")
    if router_probs and batch > 1:
        raise ConfigError("router_probs records batch-1 passes; use batch 1 to capture them")
    if not is_int(repeats, 1, MAX_SAMPLES):
        raise ConfigError(f"repeats must be an integer in [1, {MAX_SAMPLES:,}], got {short(repeats, 40)}")


def fitting_capacity(model: torch.nn.Module, capacity: int, layers, pool: str) -> int:
    """``capacity`` clamped to what can be held at all: E per layer (``pool="layer"``), E times the
    offloaded layers (``"global"``). At or above it every expert fits and no steady copy is made."""
    if not is_int(capacity):
        raise ConfigError(f"capacity must be an integer, got {capacity!r}")
    sites = select_sites(find_sites(model), layers, model_label(model))
    most = sites[0].num_experts * (len(sites) if pool == "global" else 1)
    return int(min(capacity, most))


def _reference_pass(model, batches, warmup, mode, kind, sites, device, capacity, layer_ids, router_probs, bar):
    """One timed reference pass (all resident, or lru offloaded) with a capture: (PassResult, Trace)."""
    ctx = resident(sites, device) if kind == "resident" else OffloadRun(model, capacity, "lru", layer_ids, device=device)
    with ctx:
        run_pass(model, warmup, mode)
        with Capture(model, phase="all", router_probs=router_probs, label="teacher-forced") as cap:
            ref = run_pass(model, batches, mode, progress=bar)
    return ref, cap.trace


def _policy_pass(model, batches, warmup, mode, rule, capacity, layer_ids, trace, options, device, bar):
    """One timed pass of ``rule`` (a parsed policy; each run copies it per layer): (PassResult,
    OffloadStats, live Trace, this process's read bytes)."""
    run = OffloadRun(model, capacity, rule, layer_ids, future=trace, **options)
    with run:
        run_pass(model, warmup, mode)
        run.rewind()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = read_bytes_self()
        with Capture(model, phase="all", layers=run.layer_ids, label="teacher-forced") as live:
            result = run_pass(model, batches, mode, progress=bar)
        after = read_bytes_self()
    read = after - before if before is not None and after is not None else None
    return result, run.stats(), live.trace, read


def _median_index(passes) -> int:
    """Index of the round whose time is the median (the lower one for an even count)."""
    order = sorted(range(len(passes)), key=lambda i: passes[i].seconds)
    return order[(len(order) - 1) // 2]


def _median_round(passes):
    return passes[_median_index(passes)]


def _counts(stats) -> list:
    return [(c.copies_total, c.copies_steady) for c in stats.per_layer]


def _reference_kind(reference: str, sites, device: torch.device) -> str:
    if reference != "auto":
        return reference
    if device.type != "cuda":
        return "resident"
    away = sum(
        p.numel() * p.element_size()
        for s in sites for p in (s.experts.gate_up_proj, s.experts.down_proj) if p.device != device
    )
    free, _ = torch.cuda.mem_get_info(device)
    return "resident" if away <= 0.9 * free else "offloaded"


def _policy_result(spec, rule, capacity, mode, tolerance, reference, result, stats, live: Trace, ref_trace: Trace,
                   reference_kind: str) -> PolicyResult:
    if stats.prefetch == "none" and stats.lossless:  # a lossless rule: a Policy, replayed from a copy (never re-parsed)
        replayed = replay(live, capacity, copy.deepcopy(rule), layers=stats.layers, pool=stats.pool)
        agrees = (
            replayed.copies_total == stats.copies_total
            and replayed.copies_steady == stats.copies_steady
            and [(c.copies_total, c.copies_steady) for c in replayed.per_layer]
            == [(c.copies_total, c.copies_steady) for c in stats.per_layer]
        )
        totals = (replayed.copies_total, replayed.copies_steady)
    else:  # the simulator has no prefetch and no set-holding rule: nothing to compare the counts with
        agrees, totals = None, (None, None)
    ref = np.sort(ref_trace.select_layers(stats.layers).experts, axis=2)
    changed = float(np.mean(np.any(np.sort(live.experts, axis=2) != ref, axis=2))) if ref.shape == live.experts.shape else 1.0
    return PolicyResult(
        policy=spec, capacity=capacity, mode=mode, tolerance=tolerance, reference=reference, run=result,
        stats=stats, replay_copies_total=totals[0], replay_copies_steady=totals[1],
        replay_agrees=agrees, routing_changed=changed, reference_kind=reference_kind,
    )


def _bar(enabled: bool, total: int):
    """A progress bar over every sequence of every pass (stderr; silent unless ``enabled`` and a TTY)."""
    from .._progress import progress

    return progress(total=total, desc="eval", disable=not enabled)


