"""Choosing a policy: the fastest admissible one under the cost model (docs/choose.md).

Each run ``i`` (:class:`~expertcache.costmodel.runs.Run`) gives compute ``c_i`` (ms/token), steady
copies per token ``rho_i`` and quality loss ``dnll_i`` (nats). At a copy time ``tau`` (ms):

* ``ms_i(tau) = c_i + rho_i * tau`` when copies block compute; ``max(c_i, rho_i * tau)`` when
  they fully overlap it (``overlapped=True``); predicted tokens/s = ``1000 / ms``;
* admissible: ``dnll_i <= tolerance`` (1e-12 nats of rounding allowed);
* the winner: the admissible run with the smallest ``ms_i(tau)``. Runs within 1e-9 (relative) of
  the smallest time tie, and a tie goes to the smaller ``dnll``, then the smaller ``rho`` (the one
  that stays ahead as copies get slower), then the policy name (string order);
* crossovers: the points ``tau > 0`` where the winner changes, ``{a: winner below, b: winner
  above, tau_ms}``; for blocking copies ``tau_ab = (c_b - c_a) / (rho_a - rho_b)``, the breakpoints
  of the lower envelope of the admissible runs' lines. Runs with the same ``c`` and ``rho`` are one
  line, represented by the tie-break's pick. At a crossover itself both predict the same time and
  the tie-break decides.

Only runs with ``slow_copies == 1`` at one host mode (the *base*: ``memory`` unless chosen,
:func:`~expertcache.costmodel.runs.base_host`) are chosen among; the other conditions -- slowed
runs (``slow_copies = N > 1``) and runs at another host mode (``mmap``, ``direct``: a real link
with its own measured copy time) -- check the prediction (:func:`validate`). :func:`replayed_runs` adds lossless rules from a replayed trace.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from .._text import short
from ..errors import ConfigError, is_int, is_real
from .runs import Run, base_host

LOSSLESS_NATS = 5e-3
"""A run with ``|dnll| <= 5e-3`` nats is lossless (the harness's exactness check)."""
FRONTIER_FACTORS = (1, 10, 50)
"""Copy-time multiples of the frontier plot and the text report (the eviction paper's Figure 1)."""
DEFAULT_REPLAY_POLICIES = ("belady", "foresight:16")
TIE_REL = 1e-9
ADMIT_SLACK = 1e-12


def checked(runs, **numbers) -> list[Run]:
    """``runs`` and the numbers of this module's public functions, checked where a Python caller
    passes them (the command parses its options first): ``runs`` a sequence of :class:`Run`
    (``read_runs``), and the numbers as :func:`checked_numbers` says. A one-line ConfigError
    otherwise (``runs="x"`` had ended as AttributeError). Returns ``runs`` as a list."""
    checked_numbers(**numbers)
    if isinstance(runs, (str, bytes)) or not isinstance(runs, Sequence):
        raise ConfigError(f"runs must be a sequence of Run (read_runs), got {type(runs).__name__}")
    bad = next((r for r in runs if not isinstance(r, Run)), None)
    if bad is not None:
        raise ConfigError(f"runs must be a sequence of Run (read_runs), got an item {short(bad, 40)}")
    return list(runs)


def checked_numbers(**numbers) -> None:
    """``tau_ms`` a finite number >= 0 (``None`` passes: the measured one), ``tolerance`` a finite
    number (below 0 it admits only runs that improve the NLL), ``factors`` a non-empty sequence of
    positive integers; a one-line ConfigError otherwise. A negative tau had predicted copies that
    save time, ``tolerance=True`` read as 1 nat, and a NaN tolerance admitted nothing, silently."""
    for name, value in numbers.items():
        if name == "factors":
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or not all(
                    is_int(n, 1, 2**31) for n in value):
                raise ConfigError(f"factors must be a non-empty sequence of integers in [1, 2**31], got "
                                  f"{short(value, 40)}")
        elif name == "tolerance" and not is_real(value):
            raise ConfigError(f"tolerance must be a finite number (nats), got {short(value, 40)}")
        elif name == "tau_ms" and value is not None and not (is_real(value) and value >= 0):
            raise ConfigError(f"tau_ms must be a finite number >= 0, got {short(value, 40)}")


def blocking_ms(run: Run, tau_ms: float) -> float:
    """``c + rho * tau``: copies block compute."""
    return run.c_ms + run.rho * tau_ms


def overlapped_ms(run: Run, tau_ms: float) -> float:
    """``max(c, rho * tau)``: copies fully overlap compute."""
    return float(max(run.c_ms, run.rho * tau_ms))


def cost_function(overlapped: bool) -> Callable[[Run, float], float]:
    return overlapped_ms if overlapped else blocking_ms


def tokens_per_s(ms: float) -> float | None:
    """``1000 / ms``; ``None`` for 0 ms."""
    return 1000.0 / ms if ms > 0 else None


@dataclass(frozen=True)
class Prediction:
    """Predicted time of one run at one ``tau`` (the overlapped pair only when asked)."""

    policy: str
    ms_per_token: float
    tokens_per_s: float | None
    ms_per_token_overlapped: float | None = None
    tokens_per_s_overlapped: float | None = None


def predict(runs: Sequence[Run], tau_ms: float, overlapped: bool = False) -> list[Prediction]:
    """Every run's predicted ms/token and tokens/s at ``tau_ms``, in the order given; with
    ``overlapped`` also ``max(c, rho * tau)`` and its rate."""
    runs = checked(runs, tau_ms=tau_ms)
    out = []
    for r in runs:
        ms = blocking_ms(r, tau_ms)
        ovl = overlapped_ms(r, tau_ms) if overlapped else None
        out.append(Prediction(r.policy, ms, tokens_per_s(ms), ovl, tokens_per_s(ovl) if overlapped else None))
    return out


def admissible(runs: Sequence[Run], tolerance: float) -> list[Run]:
    """The runs with ``dnll <= tolerance``, in the order given."""
    return [r for r in checked(runs, tolerance=tolerance) if _admits(r, tolerance)]


def _admits(run: Run, tolerance: float) -> bool:
    return run.dnll <= tolerance + ADMIT_SLACK


def _tie_key(run: Run) -> tuple:
    return (run.dnll, run.rho, run.policy)


def fastest(runs: Sequence[Run], cost: Callable[[Run], float]) -> Run | None:
    """The run of smallest ``cost``, ties (1e-9 relative) broken by dnll, rho, then name; ``None``
    when ``runs`` is empty."""
    if not runs:
        return None
    costs = [cost(r) for r in runs]
    best = min(costs)
    near = [r for r, v in zip(runs, costs) if v <= best + TIE_REL * max(1.0, abs(best))]
    return min(near, key=_tie_key)


def winner(runs: Sequence[Run], tau_ms: float, tolerance: float, overlapped: bool = False) -> Run | None:
    """The fastest admissible run at ``tau_ms`` (``None`` when no run is admissible)."""
    checked_numbers(tau_ms=tau_ms)
    cost = cost_function(overlapped)
    return fastest(admissible(runs, tolerance), lambda r: cost(r, tau_ms))


@dataclass(frozen=True)
class Crossover:
    """Below ``tau_ms`` ``a`` is the fastest, above it ``b``."""

    a: str
    b: str
    tau_ms: float


def crossovers(runs: Sequence[Run], overlapped: bool = False) -> list[Crossover]:
    """Where the fastest of ``runs`` changes over ``tau > 0`` (pass the admissible runs), in
    increasing ``tau``. Exact: every point where two cost functions can meet is a candidate, and
    the winner is evaluated between consecutive candidates."""
    runs = checked(runs)
    cuts = _candidates(runs, overlapped)
    if not cuts:
        return []
    probes = [cuts[0] / 2] + [(x + y) / 2 for x, y in zip(cuts, cuts[1:])] + [cuts[-1] * 2]
    cost = cost_function(overlapped)
    leaders = [fastest(runs, lambda r, t=t: cost(r, t)) for t in probes]
    out = []
    for cut, a, b in zip(cuts, leaders, leaders[1:]):
        if a is b:
            continue
        if not overlapped and a.rho != b.rho:  # the pair's own crossing, as written by hand
            cut = (b.c_ms - a.c_ms) / (a.rho - b.rho)
        out.append(Crossover(a.policy, b.policy, cut))
    return out


def _candidates(runs: Sequence[Run], overlapped: bool) -> list[float]:
    """Sorted distinct ``tau > 0`` where two runs' costs can meet (within 1e-9 relative: one)."""
    pts = set()
    for i in runs:
        for j in runs:
            if overlapped:  # a flat piece c_i meets a rising piece rho_j * tau
                t = i.c_ms / j.rho if j.rho > 0 else 0.0
            else:
                t = (j.c_ms - i.c_ms) / (i.rho - j.rho) if i.rho != j.rho else 0.0
            if t > 0 and math.isfinite(t):
                pts.add(t)
    merged: list[float] = []
    for t in sorted(pts):
        if not merged or t > merged[-1] * (1 + TIE_REL):
            merged.append(t)
    return merged


def measured_tau(runs: Sequence[Run], host: str = "memory") -> float | None:
    """The median of the finite ``tau_ms`` of the measured ``slow_copies == 1`` runs at ``host``
    (``None`` when none has one)."""
    return _median([r.tau_ms for r in runs if r.slow_copies == 1 and r.host == host and not r.replayed
                    and r.tau_ms is not None])


def _median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class Choice:
    """What ``choose`` reports (see the module docstring); ``winner`` and ``crossovers`` follow the
    overlapped model when ``overlapped``, and the blocking ones are kept beside them."""

    tau_ms: float
    tolerance: float
    overlapped: bool
    runs: list[Run]
    predictions: list[Prediction]
    admissible: list[str]
    winner: Run
    crossovers: list[Crossover]
    winner_blocking: Run
    crossovers_blocking: list[Crossover]
    winners_at: dict[int, Run] = field(default_factory=dict)

    def to_dict(self, *, replayed: bool = False) -> dict:
        """The JSON object of ``choose --json`` (docs/choose.md): ``tau_ms``, ``tolerance``,
        ``admissible``, ``winner``, ``predicted``, ``crossovers``; with ``overlapped`` also
        ``winner_blocking`` and ``crossovers_blocking``; ``replayed`` adds ``replayed`` and
        ``needs_future`` to each prediction."""
        predicted = []
        for p, r in zip(self.predictions, self.runs):
            item = {"policy": p.policy, "ms_per_token": p.ms_per_token, "tokens_per_s": p.tokens_per_s}
            if self.overlapped:
                item |= {"ms_per_token_overlapped": p.ms_per_token_overlapped,
                         "tokens_per_s_overlapped": p.tokens_per_s_overlapped}
            if replayed:
                item |= {"replayed": r.replayed, "needs_future": r.needs_future}
            predicted.append(item)
        out = {"tau_ms": self.tau_ms, "tolerance": self.tolerance, "admissible": self.admissible,
               "winner": self.winner.policy, "predicted": predicted,
               "crossovers": [asdict(c) for c in self.crossovers]}
        if self.overlapped:
            out |= {"winner_blocking": self.winner_blocking.policy,
                    "crossovers_blocking": [asdict(c) for c in self.crossovers_blocking]}
        return out


def frontier(choice: Choice, factors: Sequence[int] = FRONTIER_FACTORS) -> list[dict]:
    """The points of the frontier plot: per run ``policy``, ``dnll``, ``needs_future``, ``replayed``,
    ``admissible`` and ``tokens_per_s`` (a list, one per factor: the rate at ``factor x tau`` under
    the choice's model, ``None`` at 0 ms)."""
    checked_numbers(factors=factors)
    cost = cost_function(choice.overlapped)
    ok = set(choice.admissible)
    return [{"policy": r.policy, "dnll": r.dnll, "needs_future": r.needs_future, "replayed": r.replayed,
             "admissible": r.policy in ok, "tokens_per_s": [tokens_per_s(cost(r, n * choice.tau_ms)) for n in factors]}
            for r in choice.runs]


def choose(runs: Sequence[Run], tolerance: float, tau_ms: float | None = None, overlapped: bool = False,
           factors: Sequence[int] = FRONTIER_FACTORS, host: str | None = None) -> Choice:
    """Choose among the ``slow_copies == 1`` runs of the base host (:func:`base_host` of ``host``)
    at ``tau_ms`` (default :func:`measured_tau`). No such run, no tau, or no admissible run is a
    one-line ConfigError."""
    runs = checked(runs, tolerance=tolerance, tau_ms=tau_ms, factors=factors)
    host = base_host(runs, host)
    base = [r for r in runs if r.slow_copies == 1 and r.host == host]
    if not base:
        raise ConfigError("no runs with slow_copies 1 to choose among (slowed runs only check the choice)")
    if tau_ms is None:
        tau_ms = measured_tau(base, host)
        if tau_ms is None:
            raise ConfigError("no run records a measured tau_ms; give the copy time with --tau (e.g. 0.51ms)")
    ok = admissible(base, tolerance)
    if not ok:
        best = min(base, key=_tie_key)
        raise ConfigError(f"no admissible policy: every run's dnll exceeds the tolerance {tolerance:g} nats "
                          f"(smallest: {best.policy} at {best.dnll:.4g})")
    won = winner(ok, tau_ms, tolerance, overlapped)
    blocking = winner(ok, tau_ms, tolerance) if overlapped else won
    cross_blocking = crossovers(ok)
    return Choice(
        tau_ms, tolerance, overlapped, base, predict(base, tau_ms, overlapped), [r.policy for r in ok], won,
        crossovers(ok, True) if overlapped else cross_blocking, blocking, cross_blocking,
        {n: winner(ok, n * tau_ms, tolerance, overlapped) for n in factors},
    )


# ----------------------------------------------------------------------------- checking it
@dataclass
class Check:
    """The predicted against the measured winner in one condition: a copy factor ``slow_copies``
    at a host mode ``host``."""

    slow_copies: int
    tau_ms: float
    """``slow_copies x`` the host's tau: the tau the prediction uses (the paper's slowed link)."""
    tau_ms_measured: float | None
    """Median ``tau_ms`` the condition's runs record (``None`` when none does)."""
    predicted: str
    measured: str
    rows: list[dict]
    """Per policy run in this condition: ``policy``, ``admissible``, ``ms_predicted``, ``ms_measured``."""
    unmatched: list[str]
    """Policies of the condition without a base run: nothing to predict them from, left out."""

    spreads: dict = field(default_factory=dict)
    """Per policy run at this factor: its ``ms_per_token_spread`` (``None``: timed once)."""
    host: str = "memory"
    """The host mode of the condition's runs."""
    base_tau_ms: float | None = None
    """The host's own copy time the prediction scales (``tau_ms / slow_copies``)."""
    not_run: list[str] = field(default_factory=list)
    """Admissible policies with a base run but none in this condition that the model predicts at
    least as fast there as ``predicted``, fastest predicted first: while any is left, the condition
    cannot test the prediction (the verdict is ``"untested"``, never ``"agree"``)."""

    @property
    def tested(self) -> bool:
        """Whether the policy the model predicts fastest among every admissible base run was run here."""
        return not self.not_run

    @property
    def agree(self) -> bool:
        return self.tested and self.predicted == self.measured

    @property
    def lead(self) -> float | None:
        """How the measurement separates the verdict, relative to the measured winner: when the
        predicted winner won, its lead over the runner-up; otherwise how much slower it measured."""
        if self.predicted == self.measured:
            return self.margin("ms_measured")
        ms = {r["policy"]: r["ms_measured"] for r in self.rows}
        best = ms[self.measured]
        return (ms[self.predicted] - best) / best if best > 0 else None

    @property
    def noise(self) -> float | None:
        """The larger spread of the two runs the verdict compares (``None`` when neither was repeated)."""
        if self.predicted == self.measured:
            ranked = sorted((r["ms_measured"], r["policy"]) for r in self.rows if r["admissible"])
            pair = [p for _, p in ranked[:2]]
        else:
            pair = [self.predicted, self.measured]
        known = [self.spreads[p] for p in pair if self.spreads.get(p) is not None]
        return max(known) if known else None

    @property
    def verdict(self) -> str:
        """``"untested"`` when a policy predicted at least as fast as ``predicted`` has no run in
        this condition (:attr:`not_run`); else ``"tie (within noise)"`` when the measured lead is
        inside the runs' spread, else ``"agree"`` or ``"DISAGREE"`` (runs timed once have no
        spread: plain agree/DISAGREE)."""
        if not self.tested:
            return "untested"
        lead, noise = self.lead, self.noise
        if noise is not None and lead is not None and lead <= noise:
            return "tie (within noise)"
        return "agree" if self.agree else "DISAGREE"

    def margin(self, key: str) -> float | None:
        """How much slower the second fastest admissible policy is than the fastest, relative
        (``key``: ``"ms_predicted"`` or ``"ms_measured"``); None with fewer than two."""
        ms = sorted(r[key] for r in self.rows if r["admissible"])
        return (ms[1] - ms[0]) / ms[0] if len(ms) > 1 and ms[0] > 0 else None

    def to_dict(self) -> dict:
        return {"host": self.host, "slow_copies": self.slow_copies, "tau_ms": self.tau_ms, "tau_ms_measured": self.tau_ms_measured,
                "predicted": self.predicted, "measured": self.measured, "agree": self.agree,
                "verdict": self.verdict, "lead": self.lead, "noise": self.noise,
                "margin_predicted": self.margin("ms_predicted"), "margin_measured": self.margin("ms_measured"),
                "policies": self.rows, "unmatched": self.unmatched, "not_run": self.not_run}


def validate(runs: Sequence[Run], tolerance: float, tau_ms: float, overlapped: bool = False,
             host: str | None = None) -> list[Check]:
    """For each condition other than the base (``slow_copies == 1`` at :func:`base_host`): a factor
    ``N > 1`` at any host mode, or ``N = 1`` at another host mode. Among the policies run there that
    also have a base run and are admissible there (its ``dnll``), the predicted winner (smallest
    ``c + rho * N * tau_h`` from the base run's ``c`` and ``rho``; ``max(c, rho * N * tau_h)`` with
    ``overlapped``) against the measured winner (smallest measured ``ms_per_token`` in the
    condition), both with :func:`fastest`'s tie-break. ``tau_h`` is ``tau_ms`` at the base host and
    the median measured ``tau_ms`` of a host's own ``slow_copies == 1`` runs at another host."""
    runs = checked(runs, tolerance=tolerance, tau_ms=tau_ms)
    host = base_host(runs, host)
    base = {r.policy: r for r in runs if r.slow_copies == 1 and r.host == host}
    conditions = sorted({(r.host != host, r.host, r.slow_copies) for r in runs if (r.host, r.slow_copies) != (host, 1)})
    if not conditions:
        raise ConfigError("--validate: no slowed runs (slow_copies > 1) and no runs at another host mode "
                          "to compare the prediction with")
    cost = cost_function(overlapped)
    checks = []
    for _, h, n in conditions:
        where = f"slow_copies {n}" + ("" if h == host else f" on host {h}")
        tau_h = tau_ms if h == host else measured_tau(runs, h)
        if tau_h is None:
            raise ConfigError(f"--validate: the slow_copies 1 runs on host {h} record no tau_ms (their copy time)")
        slowed = [r for r in runs if r.slow_copies == n and r.host == h]
        for r in slowed:
            if r.ms_per_token is None:
                raise ConfigError(f"{r.where}: --validate needs the measured 'ms_per_token' of the runs at {where}")
        pairs = [(base[r.policy], r) for r in slowed if r.policy in base]
        ok = [(b, s) for b, s in pairs if _admits(b, tolerance)]
        if not ok:
            raise ConfigError(f"--validate: no admissible policy among the runs at {where} "
                              "that also have a base run (slow_copies 1" + ("" if host == "memory" else f" on host {host}") + ")")
        tau_slowed = _median([r.tau_ms for r in slowed if r.tau_ms is not None])
        t = n * tau_h
        measured = {s.policy: s.ms_per_token for _, s in pairs}
        predicted = fastest([b for b, _ in ok], lambda b: cost(b, t))
        won = fastest([b for b, _ in ok], lambda b: measured[b.policy])
        rows = [{"policy": b.policy, "admissible": _admits(b, tolerance), "ms_predicted": cost(b, t),
                 "ms_measured": s.ms_per_token} for b, s in pairs]
        bound = cost(predicted, t)
        not_run = [b.policy for b in sorted(base.values(), key=lambda b: (cost(b, t), b.policy))
                   if b.policy not in measured and _admits(b, tolerance) and cost(b, t) <= bound]
        checks.append(Check(n, t, tau_slowed, predicted.policy, won.policy, rows,
                            [r.policy for r in slowed if r.policy not in base],
                            {s.policy: s.ms_per_token_spread for _, s in pairs}, host=h, base_tau_ms=tau_h,
                            not_run=not_run))
    return checks


# ------------------------------------------------------------------------- replayed rules
def is_lossless(run: Run) -> bool:
    """The run's ``lossless`` field when it has one (eval writes it), else ``|dnll| <= 5e-3``."""
    return run.lossless if run.lossless is not None else abs(run.dnll) <= LOSSLESS_NATS


def replayed_runs(runs: Sequence[Run], trace, policies: Sequence[str] = DEFAULT_REPLAY_POLICIES, *,
                  layers: Sequence[int] | None = None, source: str = "") -> tuple[list[Run], list[str]]:
    """Lossless rules (``policies``) added from a replay of ``trace`` at the runs' capacity.

    ``rho`` = the replay's steady copies per token over ``layers`` (default: the runs' ``layers``
    when they all record the same, else every layer of the trace), pool = the runs' ``pool``
    (default per-layer), pools emptied at each sequence, no warm window, as the live harness counts;
    ``c`` = the median ``c_ms`` of the file's lossless runs (:func:`is_lossless`): a lossless rule
    computes exactly what they compute; ``dnll`` = 0. Returns the new runs (``replayed=True``) and
    the policies left out because the file already holds a measured run of them. A trace of another
    model is refused: one whose experts per layer differ from the runs' ``num_experts`` (where they
    record it), or that has fewer experts than the runs' capacity."""
    from ..policies import make_policy
    from ..sim.replay import replay

    where = f"--add-replay {source}".rstrip()
    host = base_host(runs)
    base = [r for r in runs if r.slow_copies == 1 and r.host == host and not r.replayed]
    caps = sorted({r.capacity for r in base if r.capacity is not None})
    if any(r.capacity is None for r in base) or len(caps) != 1:
        what = (f"{next(r for r in base if r.capacity is None).where} has no 'capacity'"
                if any(r.capacity is None for r in base) else f"the runs use capacities {', '.join(map(str, caps))}")
        raise ConfigError(f"{where}: {what}; replayed rules need the one capacity every run used")
    pools = sorted({r.pool or "layer" for r in base})
    if len(pools) != 1 or pools[0] not in ("layer", "global"):
        raise ConfigError(f"{where}: the runs use pools {', '.join(pools)}; replayed rules need one, 'layer' or 'global'")
    experts = next((r for r in runs if r.num_experts is not None), None)
    if experts is not None and experts.num_experts != trace.num_experts:
        raise ConfigError(f"{where}: the trace has {trace.num_experts} experts per layer, where the runs' model has "
                          f"{experts.num_experts} ({experts.where}); replay a trace of the model the runs measured")
    most = trace.num_experts * (1 if pools[0] == "layer" else trace.num_layers)
    if caps[0] > most:
        raise ConfigError(f"{where}: the runs' capacity {caps[0]} is above the {most} experts "
                          f"{'per layer' if pools[0] == 'layer' else 'in all'} of the trace; replay a trace of the "
                          "model the runs measured")
    if layers is None and len({r.layers for r in base}) == 1:
        layers = base[0].layers
    lossless = [r.c_ms for r in base if is_lossless(r)]
    if not lossless:
        raise ConfigError(f"{where}: no lossless run (field 'lossless' true, or |dnll| <= {LOSSLESS_NATS:g} where "
                          "the field is absent) in the file to take c from")
    c_ms = statistics.median(lossless)
    have = {r.policy for r in base}
    added, skipped = [], []
    for spec in dict.fromkeys(make_policy(p).spec for p in policies):
        if spec in have:
            skipped.append(spec)
            continue
        res = replay(trace, caps[0], spec, pool=pools[0], layers=None if layers is None else list(layers))
        rho = res.copies_per_token
        if not math.isfinite(rho):
            raise ConfigError(f"{where}: the replay of {spec} scored no tokens")
        added.append(Run(spec, c_ms, rho, 0.0, needs_future=res.needs_future, capacity=caps[0], pool=pools[0],
                         layers=tuple(res.layers), replayed=True, where=where))
    return added, skipped
