"""Synthetic router traces with realistic locality, and presets calibrated to published statistics.

The generator (:func:`synthesize`) draws each (layer, sequence) stream independently. Token ``t``
fills its ``k`` slots one by one; a slot

1. with probability ``reuse_prob`` *copies a recent choice*: it draws a lag ``m`` in
   ``1..max_lag`` with ``P(m) ~ m ** -lag_exponent`` and takes a uniformly chosen slot of token
   ``t - m``, or the next slot of that token whose expert this token does not hold yet (bursts:
   recently used experts come back);
2. otherwise, or when the lag reaches before the sequence start or every expert of token
   ``t - m`` is already in this token, *draws by popularity*: rank ``r`` (0-based) with
   ``P(r) ~ (r + 1) ** -zipf * exp(-(r / (zipf_cutoff * E)) ** cutoff_power)`` (no cutoff
   factor when ``zipf_cutoff`` is 0), mapped to an expert through the stream's current ranking;
   an expert already in this token passes the draw to the next rank. The cutoff gives the cold
   tail real routers show (seed 004: a domain touches only 73-81% of Qwen3's pool in 4,000
   steps); ``cutoff_power`` above 1 sharpens it into the edge of a working set.

Per-layer and per-sequence structure:

* ``zipf`` grows with depth from ``zipf_first`` (first layer) to ``zipf_last`` (last layer) as
  ``zipf_first + (zipf_last - zipf_first) * x ** depth_power`` at relative depth ``x`` in [0, 1]
  (1: linear; below 1: rises early, then levels off): deep layers are more concentrated
  (seed 004, "concentration grows with depth");
* every layer has its own random base ranking of experts; each sequence (a "domain") starts from
  it with a share ``domain_shuffle`` of ranks permuted among themselves (hot sets differ between
  domains);
* popularity drifts: at each token, ``drift_rate`` rank swaps happen on average (two uniformly
  chosen ranks exchange experts).

Invariants: the result is a validated :class:`~expertcache.trace.Trace` (no padding, no expert
twice in a (token, layer)); the same parameters and seed give the same ids on every machine,
because all randomness comes from ``np.random.default_rng(seed)`` draws handed to the compiled
sampler, which uses no random generator of its own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Iterator, Mapping

import numpy as np

from .._jit import njit
from ..errors import ConfigError, is_int, is_real
from .core import Trace
from .validate import MAX_EXPERTS, MAX_ITEMS, MAX_LAYERS

GENERATOR = "expertcache.trace.synth/1"
TIERING_PAPER = '"Who Should Own the Expert Cache? Kernel-Managed Tiering for Trillion-Parameter MoE Inference"'
EVICTION_PAPER = '"Fewer Expert Transfers Without Changing Routing: Expert Eviction for MoE Offloading" (arXiv:2611.15842)'
MAX_LAG = 1 << 20
"""Largest copy lag in tokens (the lag distribution is tabulated)."""
MAX_DRIFT = 64
"""Most rank swaps per token (each swap draws a number per token and sequence)."""
"""Recorded in provenance; bump the suffix when the same parameters would give different ids."""


@dataclass(frozen=True)
class SynthParams:
    """Everything that determines a synthetic trace apart from the seed (see the module docstring)."""

    num_experts: int
    top_k: int
    num_layers: int = 1
    tokens: int = 1024
    """Tokens per sequence; the trace holds ``tokens * sequences`` rows."""
    sequences: int = 1
    zipf_first: float = 1.0
    zipf_last: float = 1.0
    depth_power: float = 1.0
    """Shape of the rise of ``zipf`` with depth (1: linear)."""
    zipf_cutoff: float = 0.0
    """Scale of the tail cutoff as a fraction of ``num_experts``; 0 disables it."""
    cutoff_power: float = 1.0
    """Shape of the cutoff: 1 exponential, larger values a sharper edge."""
    reuse_prob: float = 0.5
    lag_exponent: float = 1.5
    max_lag: int = 64
    drift_rate: float = 0.0
    domain_shuffle: float = 0.0

    def validate(self) -> "SynthParams":
        """Raise :class:`ConfigError` naming the first bad parameter; return ``self``."""
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ConfigError(f"synthetic trace: {what}")

        for name in ("num_experts", "top_k", "num_layers", "tokens", "sequences", "max_lag"):
            value = getattr(self, name)
            need(is_int(value, 1), f"{name} must be a positive integer, got {value!r}")
        need(self.top_k <= self.num_experts, f"top_k = {self.top_k} exceeds num_experts = {self.num_experts}")
        need(self.num_experts <= MAX_EXPERTS, f"num_experts = {self.num_experts:,} is above the limit of {MAX_EXPERTS:,}")
        need(self.num_layers <= MAX_LAYERS, f"num_layers = {self.num_layers:,} is above the limit of {MAX_LAYERS:,}")
        need(self.num_layers * self.num_experts <= MAX_ITEMS,
             f"num_layers x num_experts = {self.num_layers * self.num_experts:,} is above the limit of {MAX_ITEMS:,}")
        need(self.max_lag <= MAX_LAG, f"max_lag = {self.max_lag:,} is above {MAX_LAG:,}")
        for name in ("zipf_first", "zipf_last", "depth_power", "zipf_cutoff", "cutoff_power", "lag_exponent",
                     "drift_rate"):  # each a finite real before any comparison or format meets it
            value = getattr(self, name)
            need(is_real(value) and value >= 0, f"{name} must be a finite number >= 0, got {value!r}")
        need(self.drift_rate <= MAX_DRIFT, f"drift_rate = {self.drift_rate:g} is above {MAX_DRIFT} swaps per token")
        for name in ("reuse_prob", "domain_shuffle"):
            value = getattr(self, name)
            need(is_real(value) and 0.0 <= value <= 1.0, f"{name} must lie in [0, 1], got {value!r}")
        return self

    def zipf_at(self, layer: int) -> float:
        """Popularity exponent of layer column ``layer``."""
        if self.num_layers == 1:
            return self.zipf_first
        depth = layer / (self.num_layers - 1)
        return self.zipf_first + (self.zipf_last - self.zipf_first) * depth**self.depth_power

    def popularity(self, layer: int) -> np.ndarray:
        """float ``[E]``: unnormalised popularity weight of each rank at layer column ``layer``."""
        r = np.arange(self.num_experts, dtype=np.float64)
        w = (r + 1.0) ** -self.zipf_at(layer)
        if self.zipf_cutoff > 0:
            w *= np.exp(-((r / (self.zipf_cutoff * self.num_experts)) ** self.cutoff_power))
        return w

    def with_overrides(self, **overrides: Any) -> "SynthParams":
        """A copy with the given fields replaced (``None`` values are ignored), validated."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"synthetic trace: unknown parameter(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None}).validate()


@dataclass(frozen=True)
class Target:
    """A published value a preset is calibrated to: ``lo <= measured <= hi`` (``tol`` is the slack
    the calibration tests allow beyond the range, in the statistic's own units)."""

    lo: float
    hi: float
    tol: float = 0.0

    def holds(self, value: float) -> bool:
        return self.lo - self.tol <= value <= self.hi + self.tol

    def __str__(self) -> str:
        return f"{self.lo:g}" if self.lo == self.hi else f"{self.lo:g}-{self.hi:g}"


@dataclass(frozen=True)
class Preset:
    """Named parameters, what they were calibrated to, and where the targets come from.

    ``targets`` keys name statistics as defined in :mod:`expertcache.analysis.calibration`
    (``zipf_alpha`` and ``reuse_w1`` per sequence, ``copies_per_token[lru]`` replayed on
    ``replay_layers`` at ``replay_capacity``, ...); that module measures them. ``meta`` holds
    facts about the modelled model that the trace meta records, such as ``expert_bytes`` (bytes of
    one expert's weights, which the sizing options of the replay commands read).
    """

    name: str
    params: SynthParams
    description: str
    source: str = ""
    targets: Mapping[str, Target] = field(default_factory=dict)
    replay_layers: tuple[int, ...] = ()
    replay_capacity: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)


# Fitted with seed 0 by benchmarks/calibrate_synth.py (random search around a hand-picked start;
# see its docstring); `benchmarks/calibrate_synth.py --report --seeds 0,1,2` shows achieved values.
# Layer counts: Qwen3 48 and DeepSeek-V3 58 MoE layers (61 minus 3 dense), Kimi-K3 92 routed layers
# as the paper states. DeepSeek's drift_rate sits at the search box's edge: its W64 of 83-85%
# with a slope near 0.9 needs fast turnover of the popular set.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="qwen3-30b-a3b",
            params=SynthParams(num_experts=128, top_k=8, num_layers=48, tokens=400, sequences=4,
                               zipf_first=0.302, zipf_last=0.992, zipf_cutoff=0.462, cutoff_power=3.871,
                               reuse_prob=0.709, lag_exponent=1.072, max_lag=31, drift_rate=0.005, domain_shuffle=0.309),
            description="Qwen3-30B-A3B decode: E=128, k=8, 48 layers; 4 domains x 400 steps",
            source=f"{TIERING_PAPER}, Table 1 and section 3",
            targets={"zipf_alpha": Target(1.10, 1.26, 0.02), "reuse_w1": Target(0.38, 0.45, 0.01),
                     "reuse_w64": Target(0.95, 0.96, 0.01), "top8_share": Target(0.34, 0.42, 0.01),
                     "hot_jaccard": Target(0.066, 0.454, 0.02)},
        ),
        Preset(
            name="deepseek-v3",
            params=SynthParams(num_experts=256, top_k=8, num_layers=58, tokens=300, sequences=4,
                               zipf_first=0.257, zipf_last=1.07, zipf_cutoff=2.051, reuse_prob=0.588, lag_exponent=1.249,
                               max_lag=123, drift_rate=2.0, domain_shuffle=0.0),
            description="DeepSeek-V3 decode: E=256, k=8, 58 MoE layers; 4 domains x 300 steps",
            source=f"{TIERING_PAPER}, Table 1 and section 3",
            targets={"zipf_alpha": Target(0.86, 0.93, 0.02), "reuse_w1": Target(0.26, 0.31, 0.01),
                     "reuse_w64": Target(0.83, 0.85, 0.01), "hot_jaccard": Target(0.032, 0.085, 0.02)},
        ),
        Preset(
            name="kimi-k3",
            params=SynthParams(num_experts=896, top_k=16, num_layers=92, tokens=300, sequences=4,
                               zipf_first=0.131, zipf_last=0.666, depth_power=0.252, zipf_cutoff=0.534,
                               cutoff_power=1.775, reuse_prob=0.394, lag_exponent=1.671, max_lag=4, drift_rate=0.009,
                               domain_shuffle=0.449),
            description="Kimi-K3 decode: E=896, k=16, 92 routed layers (the paper's count); 4 domains x 300 steps",
            source=f"{TIERING_PAPER}, Table 1 and section 3",
            targets={"zipf_alpha": Target(1.00, 1.04, 0.02), "reuse_w1": Target(0.32, 0.36, 0.01),
                     "reuse_w8": Target(0.57, 0.59, 0.01), "reuse_w64": Target(0.80, 0.82, 0.01),
                     "top8_share": Target(0.13, 0.16, 0.01), "coverage": Target(0.64, 0.69, 0.02),
                     "top8_share[first]": Target(0.039, 0.039, 0.015), "top8_share[max]": Target(0.18, 0.18, 0.03),
                     "hot_jaccard": Target(0.101, 0.188, 0.02)},
        ),
        Preset(
            name="olmoe",
            params=SynthParams(num_experts=64, top_k=8, num_layers=16, tokens=384, sequences=16,
                               zipf_first=0.376, zipf_last=0.473, depth_power=0.368, zipf_cutoff=0.489,
                               cutoff_power=1.298, reuse_prob=0.378, lag_exponent=0.755, max_lag=27, drift_rate=0.023,
                               domain_shuffle=0.5),
            description="OLMoE-1B-7B (reuse-tuned router), teacher-forced decode: E=64, k=8, 16 layers; 16 x 384 tokens",
            source=f"{EVICTION_PAPER}: 8 offloaded layers at C=32",
            targets={"copies_per_token[lru]": Target(9.6, 9.6, 0.5), "copies_per_token[belady]": Target(4.6, 4.6, 0.5),
                     "gap_recovered[decayed:0.95]": Target(0.27, 0.27, 0.08),
                     "gap_recovered[foresight:16]": Target(0.96, 0.96, 0.04),
                     "gap_recovered[foresight:1]": Target(0.17, 0.17, 0.1),
                     "gap_recovered[foresight:4]": Target(0.51, 0.51, 0.1),
                     "gap_recovered[foresight:8]": Target(0.76, 0.76, 0.1)},
            replay_layers=(0, 2, 4, 6, 8, 10, 12, 14),
            replay_capacity=32,
            meta={"expert_bytes": 3 * 2048 * 1024 * 2},  # gated experts, hidden 2048 x 1024, bf16: 12.6 MB
        ),
        Preset(
            name="bench-k1",
            params=SynthParams(num_experts=4096, top_k=1, num_layers=1, tokens=2_000_000, sequences=1,
                               zipf_first=1.0, zipf_last=1.0, reuse_prob=0.5, lag_exponent=1.2,
                               max_lag=4096, drift_rate=0.02, domain_shuffle=0.0),
            description="replay benchmark: one k=1 stream of 2,000,000 tokens over 4,096 ids, Zipf with bursts and drift",
        ),
    ]
}


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (:class:`ConfigError` naming the known ones otherwise)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


def synthesize(params: SynthParams, seed: int = 0, *, preset: str | None = None) -> Trace:
    """Generate a trace from ``params`` with ``np.random.default_rng(seed)``.

    The meta records ``model = "synthetic:<preset>"`` (``"synthetic:custom"`` without a preset),
    phase ``decode``, the preset's own ``meta`` (e.g. ``expert_bytes``) and, under ``provenance``,
    the generator, its parameters and the seed.
    """
    params.validate()
    if not is_int(seed, 0):
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    E, L, T, S = params.num_experts, params.num_layers, params.tokens, params.sequences
    rng = np.random.default_rng(seed)
    dtype = np.int16 if E <= np.iinfo(np.int16).max else np.int32
    experts = np.empty((S * T, L, params.top_k), dtype=dtype)
    for col in range(L):
        base = rng.permutation(E).astype(np.int32)
        experts[:, col, :] = _layer(params, col, base, rng, S)
    seq = np.repeat(np.arange(S, dtype=np.int32), T)
    return Trace.from_arrays(experts, seq, num_experts=E, meta=_meta(params, seed, preset),
                             source=f"<synthetic:{preset or 'custom'}>")


def _meta(params: SynthParams, seed: int, preset: str | None) -> dict:
    name = preset or "custom"
    return {
        "name": f"synthetic-{name}",
        "model": f"synthetic:{name}",
        "phase": "decode",
        **(PRESETS[preset].meta if preset in PRESETS else {}),
        "provenance": {"generator": GENERATOR, "preset": preset, "seed": int(seed), "params": asdict(params)},
    }


def synthesize_chunks(params: SynthParams, seed: int = 0, *, chunk_sequences: int,
                      preset: str | None = None) -> Iterator[Trace]:
    """The trace of ``params`` as pieces of ``chunk_sequences`` whole sequences each (the last may
    hold fewer), generated one piece at a time, for :class:`~expertcache.trace.chunked.ChunkWriter`.

    One model for all pieces: each layer's base popularity order is drawn from ``seed`` alone; each
    piece's sequences from its own stream ``default_rng([seed, piece])``. Sequence ids run on from
    piece to piece (0 .. S-1 over the whole). The pieces are therefore the same for every run with
    the same seed and ``chunk_sequences``, but not the same draws as :func:`synthesize` (which
    interleaves one stream over all sequences): equal in distribution, not token for token.
    """
    params.validate()
    if not is_int(seed, 0):
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    if not is_int(chunk_sequences, 1):
        raise ConfigError(f"chunk_sequences must be a positive integer, got {chunk_sequences!r}")
    E, L, T, S = params.num_experts, params.num_layers, params.tokens, params.sequences
    model = np.random.default_rng(seed)
    bases = [model.permutation(E).astype(np.int32) for _ in range(L)]
    dtype = np.int16 if E <= np.iinfo(np.int16).max else np.int32
    name = preset or "custom"
    meta = _meta(params, seed, preset)
    meta["provenance"]["chunk_sequences"] = int(chunk_sequences)
    for piece, s0 in enumerate(range(0, S, chunk_sequences)):
        n = min(chunk_sequences, S - s0)
        rng = np.random.default_rng([seed, piece])
        experts = np.empty((n * T, L, params.top_k), dtype=dtype)
        for col in range(L):
            experts[:, col, :] = _layer(params, col, bases[col], rng, n)
        seq = np.repeat(np.arange(s0, s0 + n, dtype=np.int64), T)
        yield Trace.from_arrays(experts, seq, num_experts=E, meta=meta, source=f"<synthetic:{name}:{piece}>")


def _layer(params: SynthParams, col: int, base: np.ndarray, rng: np.random.Generator, S: int) -> np.ndarray:
    """Layer ``col`` of ``S`` sequences: ``[S * T, k]`` expert ids, drawn from ``rng`` in a fixed order."""
    E, k, T = params.num_experts, params.top_k, params.tokens
    lag_cdf = _cdf(np.arange(1, params.max_lag + 1, dtype=np.float64) ** -params.lag_exponent)
    n_shuffled = int(round(params.domain_shuffle * E))
    swaps_per_token = max(1, math.ceil(params.drift_rate)) if params.drift_rate > 0 else 0
    swap_prob = params.drift_rate / swaps_per_token if swaps_per_token else 0.0
    rank_cdf = _cdf(params.popularity(col))
    start_rank = np.empty((S, E), dtype=np.int32)
    for s in range(S):
        start_rank[s] = base
        if n_shuffled > 1:
            ranks = rng.choice(E, n_shuffled, replace=False)
            start_rank[s, ranks] = base[rng.permutation(ranks)]
    u_pick = rng.random((S, T, k))
    u_slot = rng.random((S, T, k))
    u_drift = rng.random((S, T, swaps_per_token))
    out = np.empty((S, T, k), dtype=np.int32)
    _sample_layer(out, start_rank, rank_cdf, lag_cdf, params.reuse_prob, u_pick, u_slot, u_drift, swap_prob)
    return out.reshape(S * T, k)


def synthesize_preset(name: str, seed: int = 0, **overrides: Any) -> Trace:
    """Generate preset ``name`` with some parameters replaced (``tokens=...``, ``num_layers=...``)."""
    preset = get_preset(name)
    return synthesize(preset.params.with_overrides(**overrides), seed, preset=name)


def _cdf(weights: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    return cdf


@njit(cache=True)
def _draw(cdf, u):
    """Index of the first ``cdf`` entry above ``u`` (inverse-CDF draw; binary search)."""
    lo, hi = 0, cdf.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cdf[mid] > u:
            hi = mid
        else:
            lo = mid + 1
    return lo


@njit(cache=True)
def _sample_layer(out, start_rank, rank_cdf, lag_cdf, reuse_prob, u_pick, u_slot, u_drift, swap_prob):
    """Fill ``out[S, T, k]`` for one layer from pre-drawn uniforms (see the module docstring).

    ``u_pick`` picks the source (copy if below ``reuse_prob``) and, rescaled, the lag or rank;
    ``u_slot`` picks the copied slot and, from its remainder, the fallback rank; each column of
    ``u_drift`` swaps two ranks with probability ``swap_prob``, its rescaled value naming both.
    """
    S, T, k = out.shape
    E = start_rank.shape[1]
    rank = np.empty(E, dtype=np.int32)
    for s in range(S):
        rank[:] = start_rank[s]
        for t in range(T):
            for d in range(u_drift.shape[2]):
                u = u_drift[s, t, d]
                if u < swap_prob:
                    x = u / swap_prob * E
                    r1 = min(int(x), E - 1)
                    r2 = min(int((x - r1) * E), E - 1)
                    rank[r1], rank[r2] = rank[r2], rank[r1]
            for j in range(k):
                u = u_pick[s, t, j]
                e = -1
                if u < reuse_prob:
                    m = _draw(lag_cdf, u / reuse_prob) + 1
                    x = u_slot[s, t, j] * k
                    slot = min(int(x), k - 1)
                    v = x - slot
                    if m <= t:
                        for step in range(k):
                            e = out[s, t - m, (slot + step) % k]
                            for i in range(j):
                                if out[s, t, i] == e:
                                    e = -1
                                    break
                            if e >= 0:
                                break
                else:
                    v = (u - reuse_prob) / (1.0 - reuse_prob)
                if e < 0:
                    r = _draw(rank_cdf, v)
                    while True:
                        e = rank[r]
                        taken = False
                        for i in range(j):
                            if out[s, t, i] == e:
                                taken = True
                                break
                        if not taken:
                            break
                        r = r + 1 if r + 1 < E else 0
                out[s, t, j] = e
