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
from ..scorer.features import MODEL, TABLED
from ..scorer.models import TrainOptions, fit
from ..scorer.signals import cut, external_tables, fit_folded, halved

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


def fit_learners(train, capacity: int, *, seeds, states, rounds, pool, layers, features, options, tables_from,
                 progress=None) -> tuple[dict[str, list], dict]:
    """Scorers fitted on ``train`` only: ``({name: [Learned policy per seed]}, facts)`` for ``learned linear``,
    ``learned mlp`` and ``shuffled control (mlp)``; ``progress(seed)`` after each seed."""
    from ..policies.learned import Learned

    tables = None
    names = set(resolve_features(train, features))
    if names & set(TABLED):  # from another capture only where the model-side tables need it
        if tables_from is not None and names & set(MODEL):
            tables = external_tables(tables_from)
        else:  # out of fold for every training event, also when one sequence trains
            train = halved(train)
            tables = fit_folded(train)
    base = rule_events(train, capacity, states, pool, layers, features, tables)
    learners: dict[str, list] = {"learned linear": [], "learned mlp": [], "shuffled control (mlp)": []}
    meta: dict = {}
    for si, seed in enumerate(seeds):
        for kind in ("linear", "mlp"):
            ev = build_dataset(train, capacity, states=states, rounds=rounds, model=kind, seed=seed, pool=pool,
                               layers=layers, features=features, options=options, base=base, tables=tables)
            runs = [(f"learned {kind}", False)] + ([("shuffled control (mlp)", True)] if kind == "mlp" else [])
            for name, shuffled in runs:
                sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind=kind, seed=seed, shuffled=shuffled,
                         options=options)
                sc.tables = None if tables is None else tables.full
                learners[name].append(Learned(sc, name))
            if si == 0:
                meta[f"events_{kind}"] = ev.meta["events_per_state"]
                meta["states"] = ev.meta["states"]
                meta["features"] = list(ev.features)
        if progress:
            progress(seed)
    return learners, meta


def evaluate(trace, capacity: int, *, folds: int = 2, seeds=(0, 1, 2), states=("lru", "decayed"), rounds: int = 1,
             pool: str = "layer", layers=None, features: str | None = None, options: TrainOptions | None = None,
             progress=None, tables_from=None) -> dict:
    """Run the protocol; returns ``{"rows": [...], "folds": [...], ...}`` (see docs/learn.md).
    ``tables_from``: a trace (with ``token_ids``) whose rows fit the model-side tables instead of the
    training sequences (text disjoint from ``trace``'s)."""
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
        learners, meta = fit_learners(train, capacity, seeds=seeds, states=states, rounds=rounds, pool=pool,
                                      layers=layers, features=features, options=options, tables_from=tables_from,
                                      progress=progress and (lambda seed, fi=fi: progress(
                                          f"fold {fi + 1}/{len(parts)} seed {seed} done")))
        info.update(meta)
        for name, per_seed in learners.items():
            for si, policy in enumerate(per_seed):
                steady.setdefault(name, np.zeros(len(seeds), dtype=np.int64))[si] += \
                    replay_layout(layout, capacity, policy).copies_steady
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


RULE_NAMES = ("lru", "decayed (tuned)", *(f"foresight:{h}" for h in FORESIGHT), "belady")
ORDER = ("lru", "decayed (tuned)", "learned linear", "learned mlp", "learned (chosen)", "shuffled control (mlp)",
         *(f"foresight:{h}" for h in FORESIGHT), "belady")


def _rules(beta: float) -> dict[str, str]:
    return dict(zip(RULE_NAMES, ["lru", f"decayed:{beta:g}", *(f"foresight:{h}" for h in FORESIGHT), "belady"]))


def evaluate_split(trace, capacity: int, split, *, split_seed: int | None = 0, parts: int = 8, seeds=(0, 1, 2),
                   states=("lru", "decayed"), rounds: int = 1, pool: str = "layer", layers=None,
                   features: str | None = None, options: TrainOptions | None = None, progress=None, tables_from=None,
                   bootstrap: int = 0, bootstrap_seed: int = 0) -> dict:
    """The train / validation / test protocol (docs/learn.md, :mod:`.split`): scorers fitted on train,
    decayed's beta and the reported learned kind chosen on validation, the test sequences read once at the
    end and scored per sequence; ``bootstrap`` > 0 adds intervals over test sequences (:mod:`.bootstrap`)."""
    from ..sim.gap import as_record
    from .bootstrap import REFERENCE, gap_of, intervals
    from .split import SealedTest, assign

    single = trace.num_sequences == 1
    trace = cut(trace, parts) if single else trace  # one sequence: contiguous parts are the documents
    pos = assign(trace.num_sequences, split, split_seed)
    train, val = trace.select_sequences(pos["train"]), trace.select_sequences(pos["validation"])
    sealed = SealedTest(trace, pos["test"])
    del trace
    seeds = list(seeds)
    learners, meta = fit_learners(train, capacity, seeds=seeds, states=states, rounds=rounds, pool=pool, layers=layers,
                                  features=features, options=options, tables_from=tables_from,
                                  progress=progress and (lambda seed: progress(f"seed {seed} done")))
    # every choice on validation: decayed's beta, the learned kind reported as "learned (chosen)"
    beta = tune_beta(val, capacity, pool, layers)
    val_layout = build_layout(val, pool=pool, layers=layers)
    val_copies = {n: float(replay_layout(val_layout, capacity, spec).copies_steady) for n, spec in _rules(beta).items()}
    for name, per_seed in learners.items():
        val_copies[name] = float(np.mean([replay_layout(val_layout, capacity, p).copies_steady for p in per_seed]))
    chosen = min(("learned linear", "learned mlp"), key=lambda n: (val_copies[n], n))
    val_copies["learned (chosen)"] = val_copies[chosen]
    learners["learned (chosen)"] = learners[chosen]
    # the test split, read once: per-sequence copies of every policy (pools restart at each sequence)
    test = sealed.open()
    per_seq = {n: np.zeros(test.num_sequences) for n in ORDER}
    per_seed = {n: np.zeros((len(seeds), test.num_sequences)) for n in learners}
    tokens = 0
    for j in range(test.num_sequences):
        layout = build_layout(test.select_sequences([j]), pool=pool, layers=layers)
        tokens += layout.tokens
        for n, spec in _rules(beta).items():
            per_seq[n][j] = replay_layout(layout, capacity, spec).copies_steady
        for n, policies in learners.items():
            per_seed[n][:, j] = [replay_layout(layout, capacity, p).copies_steady for p in policies]
            per_seq[n][j] = per_seed[n][:, j].mean()
    ci = intervals(per_seq, bootstrap, bootstrap_seed) if bootstrap else None
    totals = {n: v.sum() for n, v in per_seq.items()}
    lru, bel = totals["lru"], totals["belady"]
    vlru, vbel = val_copies["lru"], val_copies["belady"]
    rows = []
    for n in ORDER:
        seeded = n in per_seed
        seed_totals = per_seed[n].sum(axis=1) if seeded else np.array([totals[n]])
        gaps = gap_of(seed_totals, lru, bel)
        gap = float(gap_of(totals[n], lru, bel))
        rows.append({
            "policy": n, "seeds": len(seeds) if seeded else 0,
            "copies_steady": float(totals[n]), "copies_steady_sd": float(seed_totals.std()) if seeded else 0.0,
            "copies_per_token": float(totals[n] / tokens) if tokens else float("nan"),
            "gap_recovered": as_record(gap), "gap_recovered_sd": float(gaps.std()) if seeded else 0.0,
            "gap_recovered_ci": ci["gap"][n] if ci else None,
            "diff_vs_decayed": as_record(gap - float(gap_of(totals[REFERENCE], lru, bel))),
            "diff_vs_decayed_ci": ci["diff"][n] if ci else None,
            "validation_copies_steady": val_copies[n],
            "validation_gap_recovered": as_record(gap_of(val_copies[n], vlru, vbel)),
        })
    return {"trace": test.name, "capacity": int(capacity), "pool": pool,
            "split": {**pos, "spec": str(split), "seed": split_seed}, "beta": beta, "chosen": chosen, "tokens": tokens,
            "cut": parts if single else 0, "seed_list": seeds, "rounds": int(rounds),
            "states": list(states), "bootstrap": int(bootstrap), "bootstrap_seed": int(bootstrap_seed),
            "resamples_used": ci["resamples_used"] if ci else 0, "learner": meta, "rows": rows}
