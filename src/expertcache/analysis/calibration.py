"""How a synthetic preset's published targets are measured on a trace (the calibration contract).

Target names (keys of :attr:`expertcache.trace.synth.Preset.targets`):

* ``<stat>``: an overall locality statistic of :meth:`LocalityReport.summary` (``zipf_alpha``,
  ``reuse_w1``, ``top8_share``, ``coverage``, ...), measured on **each sequence separately**:
  one sequence stands for one of the paper's domains, whose Table 1 gives the range over domains;
* ``<stat>[first]`` / ``<stat>[max]``: the first layer's value / the largest per-layer value of a
  per-layer statistic, again per sequence;
* ``hot_jaccard``: mean over layers of the Jaccard overlap of two sequences' hot sets (top 8 per
  layer), one value per pair of sequences (the paper's "domain Jaccard");
* ``copies_per_token[<policy>]`` / ``gap_recovered[<policy>]``: a lossless replay of the whole
  trace on the preset's ``replay_layers`` at ``replay_capacity`` experts per layer.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..trace import Trace
from .locality import DEFAULT_TOP, hot_set_overlap, locality_report

if TYPE_CHECKING:  # pragma: no cover
    from ..trace.synth import Preset, Target

_NAME = re.compile(r"^(?P<stat>[a-z0-9_]+)(?:\[(?P<arg>[^\]]+)\])?$")
REPLAY_STATS = ("copies_per_token", "gap_recovered")
LAYER_PICKS = ("first", "max")


@dataclass
class TargetCheck:
    """One target's measured values (one per sequence, pair or trace) and whether all hold."""

    name: str
    target: "Target"
    values: list[float]

    @property
    def ok(self) -> bool:
        return bool(self.values) and all(v is not None and self.target.holds(v) for v in self.values)


def measure_targets(preset: "Preset", trace: Trace) -> dict[str, list[float]]:
    """Every target of ``preset`` measured on ``trace`` (normally one the preset generated)."""
    parsed = {name: _parse(name) for name in preset.targets}
    out: dict[str, list[float]] = {}
    local = {n: p for n, p in parsed.items() if p[0] not in REPLAY_STATS and p[0] != "hot_jaccard"}
    needs_pairs = any(p[0] == "hot_jaccard" for p in parsed.values())
    if local or needs_pairs:
        windows = sorted({int(p[0][len("reuse_w"):]) for p in local.values() if p[0].startswith("reuse_w")} | {1})
        reports = [locality_report(trace.select_sequences([i]), windows=windows, top=DEFAULT_TOP)
                   for i in range(trace.num_sequences)]
        for name, (stat, pick) in local.items():
            out[name] = [_locality_value(r, stat, pick) for r in reports]
        if needs_pairs:
            out["hot_jaccard"] = [hot_set_overlap(a, b).mean for a, b in itertools.combinations(reports, 2)]
    replayed = {n: p for n, p in parsed.items() if p[0] in REPLAY_STATS}
    if replayed:
        from ..sim import replay_many

        policies = ["lru", "belady"] + sorted({p[1] for p in replayed.values()} - {"lru", "belady"})
        results = {r.policy: r for r in replay_many(trace, preset.replay_capacity, policies,
                                                      layers=list(preset.replay_layers))}
        for name, (stat, policy) in replayed.items():
            r = results[policy]
            out[name] = [r.copies_per_token if stat == "copies_per_token" else r.gap_recovered]
    return out


def check_targets(preset: "Preset", trace: Trace) -> list[TargetCheck]:
    """:func:`measure_targets` paired with the targets, in the preset's order."""
    measured = measure_targets(preset, trace)
    return [TargetCheck(name, target, measured[name]) for name, target in preset.targets.items()]


def _parse(name: str) -> tuple[str, str | None]:
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"target name {name!r} is not '<stat>' or '<stat>[<arg>]'")
    stat, arg = m.group("stat"), m.group("arg")
    if stat in REPLAY_STATS and not arg:
        raise ValueError(f"target {name!r}: a replay statistic needs a policy, e.g. '{stat}[lru]'")
    if stat not in REPLAY_STATS and arg not in (None, *LAYER_PICKS):
        raise ValueError(f"target {name!r}: the layer pick must be one of {', '.join(LAYER_PICKS)}")
    return stat, arg


def _locality_value(report, stat: str, pick: str | None) -> float:
    if pick is None:
        return report.summary()[stat]
    per_layer = [layer.to_dict(report.top)[stat] for layer in report.layers]
    return per_layer[0] if pick == "first" else max(per_layer)
