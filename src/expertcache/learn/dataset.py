"""Eviction events: candidate features and farthest-future labels, from chosen cache states.

An *event* is one eviction decision (one ``keys`` call of a full pool): the candidates' feature
rows (:mod:`.features`) and the victim set = the candidates whose next request on the recorded
trace lies farthest ahead (never again counts as farthest; all tied candidates are victims).
Eviction never changes routing, so the recorded requests are the ones any policy will face.

*States* say whose cache the events are collected in: a causal rule's (``lru``, ``decayed[:b]``,
any registered causal policy) and then, for ``rounds`` DAgger-style rounds, the learner's own:
round r trains a scorer on every event so far and replays it closed-loop, adding the events its
cache meets. Clairvoyant states (``belady``) are refused: in Belady's states old residents are the
ones Belady knew would return, and a scorer trained there learns to keep old experts (issue 12).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._io import numpy_reason, open_npz, write_npz
from ..cache import ExpertCache
from ..errors import ConfigError, PolicyError
from ..kernels import pool_slots
from ..policies import Policy, StreamFuture, make_policy
from ..policies.learned import Learned
from ..trace.context import stream_context
from ..sim.layout import StreamLayout, build_layout
from ..sim.replay import check_capacity
from ..scorer.features import GROUPS, PRIOR, TABLED, FeatureState, available_features
from ..scorer.signals import NEEDS, TABLE_FIELDS, FoldedTables, fit_folded, halved, tables_from_arrays, tables_to_arrays
from ..scorer.models import TrainOptions, fit

FORMAT_VERSION = 1


@dataclass
class Events:
    """Eviction events; rows of event i are ``offsets[i]:offsets[i+1]``."""

    X: np.ndarray  # float32 [N, F]
    victim: np.ndarray  # bool [N]
    offsets: np.ndarray  # int64 [n + 1]
    seq: np.ndarray  # int64 [n] sequence position (0-based, in trace order)
    step: np.ndarray  # int64 [n] step within the stream
    state: np.ndarray  # int64 [n] index into meta["states"]
    item: np.ndarray | None = None  # int64 [N] candidate item ids (not saved)
    features: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)
    tables: object = None  # model-side routing tables (.signals), when the features need them

    @property
    def num_events(self) -> int:
        return int(self.offsets.size - 1)

    def select(self, keep: np.ndarray) -> "Events":
        """The events where ``keep`` (bool ``[n]``) holds."""
        idx = np.flatnonzero(keep)
        lens = np.diff(self.offsets)[idx]
        sub = np.r_[0, np.cumsum(lens)]
        rows = np.repeat(self.offsets[idx] - sub[:-1], lens) + np.arange(sub[-1])
        return Events(self.X[rows], self.victim[rows], sub.astype(np.int64), self.seq[idx], self.step[idx],
                      self.state[idx], None if self.item is None else self.item[rows], self.features, dict(self.meta),
                      self.tables)


def concat(parts: list[Events]) -> Events:
    offs, base = [np.zeros(1, dtype=np.int64)], 0
    for p in parts:
        offs.append(p.offsets[1:] + base)
        base += p.offsets[-1]
    return Events(np.concatenate([p.X for p in parts]), np.concatenate([p.victim for p in parts]),
                  np.concatenate(offs), np.concatenate([p.seq for p in parts]), np.concatenate([p.step for p in parts]),
                  np.concatenate([p.state for p in parts]),
                  None if any(p.item is None for p in parts) else np.concatenate([p.item for p in parts]),
                  parts[0].features, dict(parts[0].meta))


class _Recorder(Policy):
    """Drives the cache with ``inner``'s keys and records each eviction's features and labels.

    The features come from the compiled feature state (:meth:`Learned.describer`) wherever it
    computes them all, else (model-side features, or ``reference``) from FeatureState; the two
    give the same bits (``tests/test_learn.py`` checks whole event sets)."""

    name = "recorder"
    wants_context = True

    def __init__(self, inner: Policy, names, future: StreamFuture, sink: list, tables=None, reference: bool = False):
        super().__init__()
        self.inner, self.names, self.fut, self.sink, self.tables = inner, tuple(names), future, sink, tables
        self.describer = None if reference else Learned.describer(self.names, tables)

    def bind(self, capacity):
        super().bind(capacity)
        self.inner.bind(capacity)

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        if self.inner.wants_context:
            self.inner.set_context(self.context)
        self.inner.reset(n_items, None, steps_per_token)
        self.live = None
        if self.describer is not None:
            self.describer.set_context(self.context)
            try:
                self.describer.reset(n_items, None, steps_per_token)
                self.live = self.describer.compiled_state
            except PolicyError:  # a feature the context lacks: FeatureState says which, at the first eviction
                pass
        self.state = self.live or FeatureState(n_items, self.context, steps_per_token, self.tables)

    def keys(self, candidates, t):
        k = np.asarray(self.inner.keys(candidates, t), dtype=np.float64)
        if self.live is not None:
            X = self.live.describe(candidates, k, t)
        else:
            X = self.state.features(candidates, t, self.names)
            self.state.note_keys(candidates, k, t)
        nu = self.fut.next_use(candidates, t)
        self.sink.append((t, X, nu == nu.max(), np.array(candidates, dtype=np.int64)))
        return k

    def on_access(self, items, t):
        self.inner.on_access(items, t)
        self.state.on_access(items, t)


def stream_sequences(layout: StreamLayout) -> np.ndarray:
    """int64 ``[S]``: the sequence (0-based position in the trace) each stream serves."""
    trace = layout.source
    T = trace.num_tokens
    a = layout.starts[:-1]
    rows = a % T if layout.pool == "layer" else a // len(layout.layer_ids)
    return np.searchsorted(trace.seq_bounds, rows, side="right") - 1


def collect(layout: StreamLayout, capacity: int, policy: Policy, names, state_index: int = 0, tables=None,
            reference: bool = False) -> Events:
    """Events met by ``policy``'s cache on every stream of ``layout`` (reset must be per sequence);
    ``reference``: features from FeatureState always (the compiled state otherwise, where it can)."""
    if layout.reset != "sequence":
        raise ConfigError("learn: events need pools that start empty at each sequence (--reset sequence)")
    if policy.needs_future:
        raise ConfigError(f"--states: {policy.spec!r} reads the future; collect states from causal rules "
                          "(lru, decayed) and the learner's own rounds (docs/learn.md)")
    capacity = pool_slots(layout, check_capacity(layout, capacity))
    seqs = stream_sequences(layout)
    X, V, offs, sq, st, it = [], [], [0], [], [], []
    for s in range(layout.num_streams):
        a, b = int(layout.starts[s]), int(layout.starts[s + 1])
        groups = layout.groups[a:b]
        sink: list = []
        rec = _Recorder(policy, names, StreamFuture(groups), sink, tables, reference)
        rec.set_context(stream_context(layout, s))
        cache = ExpertCache(capacity, rec, layout.n_items, steps_per_token=layout.steps_per_token)
        for g in range(b - a):
            cache.prepare(groups[g])
        for t, x, v, c in sink:
            X.append(x)
            it.append(c)
            V.append(v)
            offs.append(offs[-1] + v.size)
            sq.append(seqs[s])
            st.append(t)
    F = len(names)
    return Events(np.concatenate(X).astype(np.float32) if X else np.zeros((0, F), np.float32),
                  np.concatenate(V) if V else np.zeros(0, bool), np.asarray(offs, dtype=np.int64),
                  np.asarray(sq, dtype=np.int64), np.asarray(st, dtype=np.int64),
                  np.full(len(sq), state_index, dtype=np.int64),
                  np.concatenate(it) if it else np.zeros(0, np.int64), tuple(names))


def resolve_features(trace, groups: str | None = None) -> tuple[str, ...]:
    """Feature names for ``trace``: the named groups (``reuse,gate,router``; default: every group the
    trace can supply, and those that read fitted tables only when it has two sequences or more). A
    group the trace cannot supply is a ConfigError."""
    from ..scorer.online import ONLINE_MAX_BYTES, online_bytes
    from ..scorer.signals import TRANS_MAX_BYTES, trans_bytes

    L, E = trace.num_layers, trace.num_experts  # sized for a global pool, the larger
    limits = {"prior": (trans_bytes(L, E), TRANS_MAX_BYTES), "online": (online_bytes(L * E, E), ONLINE_MAX_BYTES)}

    class _C:  # what the trace offers, in the shape available_features reads (a global pool's item map)
        probs = trace.probs
        router = trace.router_probs
        signals = type("S", (), {"extras": trace.extras})
        item_layer = range(L * E)
        num_experts = E
    too_big = {n for g, (need, cap) in limits.items() if need > cap for n in GROUPS[g]}
    have = [n for n in available_features(_C) if n not in too_big]
    if groups is None:  # fitted tables need two sequences: halves of one transfer too well to be trusted
        return tuple(n for n in available_features(_C, lookahead=False)
                     if n not in too_big and (trace.num_sequences > 1 or n not in TABLED))
    names: list[str] = []
    for g in [x.strip() for x in groups.split(",") if x.strip()]:
        if g not in GROUPS:
            raise ConfigError(f"--features: unknown group {g!r} (known: {', '.join(GROUPS)})")
        if not set(GROUPS[g]) <= set(have):
            if g in limits:
                need, cap = limits[g]
                raise ConfigError(f"--features: group {g!r} needs a table of at most {cap >> 20} MB; {trace.name} "
                                  f"(L={L}, E={E}) needs {need / 1e6:.0f} MB")
            field_ = {"gate": "probs", "router": "router_probs"}.get(g) or next(
                n for n in NEEDS[g] if n not in trace.extras)
            raise ConfigError(f"--features: group {g!r} needs the trace's {field_}, which {trace.name} does not have")
        names += GROUPS[g]
    if not names:
        raise ConfigError("--features: name at least one group (reuse, gate, router)")
    return tuple(names)


def build_dataset(trace, capacity: int, *, states=("lru", "decayed"), rounds: int = 0, model: str = "linear",
                  seed: int = 0, pool: str = "layer", layers=None, features: str | None = None,
                  options: TrainOptions | None = None, base: tuple | None = None, tables=None) -> Events:
    """Events of ``trace`` from the ``states`` rules, then ``rounds`` rounds of the learner's own states.

    ``base``: ``(labels, parts)`` from :func:`rule_events` on the same arguments, to reuse the
    rules' events across seeds (they do not depend on the seed). ``tables``: the model-side routing
    tables (:mod:`.signals`); fitted here, two-fold, when the features need them and none are given
    (a single sequence is then :func:`~.signals.halved` first)."""
    names = resolve_features(trace, features)
    if tables is None and set(names) & set(TABLED):
        trace = halved(trace)
        tables = fit_folded(trace)
    layout = build_layout(trace, pool=pool, layers=layers)
    labels, parts = base if base is not None else rule_events(trace, capacity, states, pool, layers, features, tables)
    labels, parts = list(labels), list(parts)
    if not parts:
        raise ConfigError("--states: name at least one causal rule, e.g. lru,decayed")
    for r in range(1, rounds + 1):
        ev = concat(parts)
        scorer = fit(ev.X, ev.victim, ev.offsets, names, kind=model, seed=seed + r, options=options)
        scorer.tables = tables
        labels.append(f"self-round{r}:{model}")
        parts.append(collect(layout, capacity, Learned(scorer, f"<round {r}>"), names, len(labels) - 1, tables))
    ev = concat(parts)
    ev.tables = tables
    ev.meta = {
        "format_version": FORMAT_VERSION, "trace": trace.name, "capacity": int(capacity), "pool": pool,
        "layers": list(layout.layer_ids), "states": labels, "rounds": int(rounds), "round_model": model,
        "seed": int(seed), "events_per_state": [int(np.count_nonzero(ev.state == i)) for i in range(len(labels))],
        "sequences": sorted({int(x) for x in stream_sequences(layout)}),
        "label": "farthest next request on the recorded trace; all candidates tied at the farthest are victims",
    }
    return ev


def rule_events(trace, capacity: int, states=("lru", "decayed"), pool: str = "layer", layers=None,
                features: str | None = None, tables=None) -> tuple[list[str], list[Events]]:
    """``(state labels, events per state)`` collected in the causal rules' caches."""
    names = resolve_features(trace, features)
    if tables is None and set(names) & set(TABLED):
        trace = halved(trace)
        tables = fit_folded(trace)
    layout = build_layout(trace, pool=pool, layers=layers)
    labels, parts = [], []
    for i, spec in enumerate(states):
        try:
            pol = make_policy(spec)
        except PolicyError as err:
            raise ConfigError(f"--states: {err}") from None
        labels.append(pol.spec)
        parts.append(collect(layout, capacity, pol, names, i, tables))
    return labels, parts


def save_events(ev: Events, path, option: str = "--out") -> Path:
    full = ev.tables.full if isinstance(ev.tables, FoldedTables) else ev.tables
    arrays = dict(X=ev.X, victim=ev.victim, offsets=ev.offsets, seq=ev.seq, step=ev.step, state=ev.state,
                  features=np.array(list(ev.features), dtype=str), meta=np.array(json.dumps(ev.meta)),
                  **(tables_to_arrays(full) if full is not None else {}))
    return write_npz(path, arrays, compressed=True, option=option)


def load_events(path) -> Events:
    """Read an events file; ConfigError naming the file and field on any problem."""
    p = Path(path)
    with open_npz(p, "events", "an events file") as npz:
        got = {}
        tables = (tables_from_arrays(lambda n: _npz_field(npz, n, p), f"events {p}", npz.files)
                  if "sig_tok" in npz.files else None)
        for name in ("X", "victim", "offsets", "seq", "step", "state", "features", "meta"):
            got[name] = _npz_field(npz, name, p)
    try:
        meta = json.loads(str(got["meta"]))
    except (json.JSONDecodeError, RecursionError):
        raise ConfigError(f"events {p}: field 'meta' is not JSON (or nests deeper than a reader follows)") from None
    if got["features"].ndim != 1 or got["features"].dtype.kind != "U":
        raise ConfigError(f"events {p}: field 'features' must be a 1-d list of feature names")
    for name in ("offsets", "seq", "step", "state"):
        if got[name].ndim != 1 or got[name].dtype.kind not in "iu":
            raise ConfigError(f"events {p}: field {name!r} must be a 1-d array of integers, not "
                              f"{got[name].ndim}-d {got[name].dtype}")
    if got["X"].dtype.kind not in "fiu" or got["victim"].dtype.kind not in "biu":
        raise ConfigError(f"events {p}: fields 'X' and 'victim' must be numeric")
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"events {p}: field 'meta' has format_version {meta.get('format_version') if isinstance(meta, dict) else None}; "
                          f"this expertcache reads {FORMAT_VERSION}")
    X, off, feats = got["X"], got["offsets"].astype(np.int64), tuple(str(f) for f in got["features"])
    n = off.size - 1
    if X.ndim != 2 or X.shape[1] != len(feats):
        raise ConfigError(f"events {p}: field 'X' has shape {X.shape}, expected (rows, {len(feats)})")
    if n < 0 or off[0] != 0 or off[-1] != X.shape[0] or np.any(np.diff(off) < 1):
        raise ConfigError(f"events {p}: field 'offsets' does not partition the {X.shape[0]} rows")
    for name in ("seq", "step", "state"):
        if got[name].shape != (n,):
            raise ConfigError(f"events {p}: field {name!r} has shape {got[name].shape}, expected ({n},)")
    if got["victim"].shape != (X.shape[0],):
        raise ConfigError(f"events {p}: field 'victim' has shape {got['victim'].shape}, expected ({X.shape[0]},)")
    if not np.all(np.isfinite(X)):
        raise ConfigError(f"events {p}: field 'X' holds a non-finite value")
    for name in ("seq", "step", "state"):
        if n and got[name].min() < 0:
            raise ConfigError(f"events {p}: field {name!r} holds a negative value")
    if tables is None and set(feats) & set(TABLED):
        raise ConfigError(f"events {p}: field {TABLE_FIELDS[0]!r} is missing (its features need the fitted tables)")
    if set(feats) & set(PRIOR) and tables.trans is None:
        raise ConfigError(f"events {p}: field 'sig_trans' is missing (its prior features need the transitions)")
    return Events(X.astype(np.float32), got["victim"].astype(bool), off, got["seq"].astype(np.int64),
                  got["step"].astype(np.int64), got["state"].astype(np.int64), None, feats, meta, tables)


def _npz_field(npz, name: str, p: Path) -> np.ndarray:
    if name not in npz.files:
        raise ConfigError(f"events {p}: field {name!r} is missing")
    try:
        return npz[name]
    except Exception as err:
        raise ConfigError(f"events {p}: field {name!r} cannot be read ({numpy_reason(err)})") from None
