"""The held-out protocol of ``expertcache learn eval`` (docs/learn.md).

For one trace and capacity: the sequences are split into ``folds`` contiguous groups; each fold is
held out once while the others train. On the training sequences only: events from the causal
``states`` and ``rounds`` DAgger rounds (:func:`~.dataset.build_dataset`), scorers fitted per seed,
and ``decayed``'s beta tuned (fewest steady copies over :data:`BETA_GRID`). On the held-out
sequences: closed-loop replay of every policy. Counts are steady copies summed over the folds (every
sequence is held out exactly once); ``gap`` = ``(lru - p) / (lru - belady)`` on those sums. Learned
rows are repeated per seed (initial weights, minibatch order and the learner's own rounds change)
and reported as mean and standard deviation over seeds; the rules do not depend on the seed.

A trace of one sequence is :func:`~.signals.cut` into ``folds`` contiguous parts first (pools restart
at each cut, for every policy alike), and those parts are held out in turn.

Invariant: no held-out sequence contributes an event, a normalisation statistic or a tuning
decision to the policy it is scored with.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..sim import build_layout, replay_layout
from .dataset import build_dataset, resolve_features, rule_events
from .features import MODEL, TABLED
from .models import TrainOptions, fit
from .signals import cut, external_tables, fit_folded, halved

BETA_GRID = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
FORESIGHT = (1, 2, 4)


def folds_of(n_sequences: int, folds: int) -> list[np.ndarray]:
    """Contiguous groups of sequence positions, one per fold (at most one fold per sequence)."""
    if n_sequences < 2:
        raise ConfigError(f"learn eval: the trace has {n_sequences} sequence(s); holding sequences out needs at least 2")
    return [f for f in np.array_split(np.arange(n_sequences), min(folds, n_sequences)) if f.size]


def tune_beta(trace, capacity: int, pool: str = "layer", layers=None, grid=BETA_GRID) -> float:
    """The beta of ``decayed`` with the fewest steady copies on ``trace`` (ties: first in ``grid``)."""
    layout = build_layout(trace, pool=pool, layers=layers)
    best = min(grid, key=lambda b: (replay_layout(layout, capacity, f"decayed:{b:g}").copies_steady, grid.index(b)))
    return float(best)


def evaluate(trace, capacity: int, *, folds: int = 2, seeds=(0, 1, 2), states=("lru", "decayed"), rounds: int = 1,
             pool: str = "layer", layers=None, features: str | None = None, options: TrainOptions | None = None,
             progress=None, tables_from=None) -> dict:
    """Run the protocol; returns ``{"rows": [...], "folds": [...], ...}`` (see docs/learn.md).
    ``tables_from``: a trace (with ``token_ids``) whose rows fit the model-side tables instead of the
    training sequences (text disjoint from ``trace``'s)."""
    from ..policies.learned import Learned

    single = trace.num_sequences == 1
    trace = cut(trace, max(folds, 2)) if single else trace  # one sequence: contiguous parts held out in turn
    parts = folds_of(trace.num_sequences, folds)
    steady: dict[str, np.ndarray] = {}
    fold_info = []
    seeds = list(seeds)
    tokens = 0
    for fi, held in enumerate(parts):
        train_idx = np.setdiff1d(np.arange(trace.num_sequences), held)
        train, test = trace.select_sequences(train_idx.tolist()), trace.select_sequences(held.tolist())
        beta = tune_beta(train, capacity, pool, layers)
        layout = build_layout(test, pool=pool, layers=layers)
        tokens += layout.tokens
        rules = ["lru", f"decayed:{beta:g}", *(f"foresight:{h}" for h in FORESIGHT), "belady"]
        for name, spec in zip(["lru", "decayed (tuned)", *(f"foresight:{h}" for h in FORESIGHT), "belady"], rules):
            steady.setdefault(name, np.zeros(len(seeds), dtype=np.int64))
            steady[name] += replay_layout(layout, capacity, spec).copies_steady
        info = {"fold": fi, "held_out": held.tolist(), "train": train_idx.tolist(), "beta": beta}
        # fitted tables: on the training sequences only (two-fold for their own events)
        tables = None
        names = set(resolve_features(train, features))
        if names & set(TABLED):  # from another capture only where the model-side tables need it
            if tables_from is not None and names & set(MODEL):
                tables = external_tables(tables_from)
            else:  # out of fold for every training event, also when one sequence trains
                train = halved(train)
                tables = fit_folded(train)
        base = rule_events(train, capacity, states, pool, layers, features, tables)
        for si, seed in enumerate(seeds):
            for kind in ("linear", "mlp"):
                ev = build_dataset(train, capacity, states=states, rounds=rounds, model=kind, seed=seed, pool=pool,
                                   layers=layers, features=features, options=options, base=base, tables=tables)
                runs = [(f"learned {kind}", False)] + ([("shuffled control (mlp)", True)] if kind == "mlp" else [])
                for name, shuffled in runs:
                    sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind=kind, seed=seed, shuffled=shuffled,
                             options=options)
                    sc.tables = None if tables is None else tables.full
                    r = replay_layout(layout, capacity, Learned(sc, name))
                    steady.setdefault(name, np.zeros(len(seeds), dtype=np.int64))[si] += r.copies_steady
                if si == 0:
                    info[f"events_{kind}"] = ev.meta["events_per_state"]
                    info["states"] = ev.meta["states"]
                    info["features"] = list(ev.features)
            if progress:
                progress(f"fold {fi + 1}/{len(parts)} seed {seed} done")
        fold_info.append(info)
    lru, bel = float(steady["lru"][0]), float(steady["belady"][0])
    order = ["lru", "decayed (tuned)", "learned linear", "learned mlp", "shuffled control (mlp)",
             *(f"foresight:{h}" for h in FORESIGHT), "belady"]
    rows = []
    for name in order:
        v = steady[name].astype(np.float64)
        per_seed = name.startswith(("learned", "shuffled"))
        gaps = (lru - v) / (lru - bel) if lru != bel else np.full(v.shape, np.nan)
        rows.append({
            "policy": name, "seeds": len(seeds) if per_seed else 0,
            "copies_steady": float(v.mean()), "copies_steady_sd": float(v.std()) if per_seed else 0.0,
            "copies_per_token": float(v.mean() / tokens) if tokens else float("nan"),
            "gap_recovered": float(gaps.mean()), "gap_recovered_sd": float(gaps.std()) if per_seed else 0.0,
        })
    return {"trace": trace.name, "capacity": int(capacity), "pool": pool, "folds": fold_info, "tokens": tokens,
            "cut": len(parts) if single else 0,
            "seed_list": seeds, "rounds": int(rounds), "states": list(states), "rows": rows}
