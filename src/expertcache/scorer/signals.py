"""Model-side features: routing tables fitted on training sequences, applied to a captured trace's signals.

A capture with ``--record`` gives each trace row its input token id, the model's top-M next-token
distribution and a hidden-state summary (:mod:`expertcache.trace.model_signals`). This module turns
them into eviction features (docs/learn.md, "Model-side signals"; ``l`` = the candidate's layer,
``e`` = its expert, ``v`` = a token id, ``r`` = the trace row being served):

* ``token`` group: ``tok_now`` = P(e at l | token v_r) (the row's own token; the row's router has run
  for the current layer only, so in a global pool this forecasts the token's later layers);
  ``tok_hH`` = P(e at l within rows r+1..r+H | v_r), H in :data:`HORIZONS` (1, 4, 16).
* ``next`` group: the model's own forecast, ``sum_j p_j T(e | v_j, l)`` over the top-M ids ``v_j``
  and renormalised probabilities ``p_j`` of row ``r - 1``: ``next_now`` with T = ``tok_now``'s table,
  ``next_h4`` with ``tok_h4``'s. Row ``r - 1``'s distribution is the latest one that exists while row
  ``r`` is served (a row's logits come after its last layer); it forecasts token ``v_r``, which
  is already known then, so this group is measured, not expected, to add information.
* ``hidden`` group: ``hid_hH`` = a ridge regression from row ``r - 1``'s hidden summary (and a
  constant) to the use of ``e`` at ``l`` within rows ``r+1..r+H``.
* ``ahead`` group (input lookahead, *not* causal for generation): ``ahead_h`` = ``1 - prod_{j=1..h}
  (1 - P(e at l | v_{r+j}))`` for h = 1, 2, 4, 8: reads the input ids of later rows, known only when
  the text is given up front (teacher-forced scoring, prefill). Never chosen by default.
* ``late`` group (a diagnostic, *not* causal: one row late): the ``next`` features on row ``r``'s own
  distribution, which forecasts the row after: ``late_1`` = ``sum_j p_j P(e at l | v_j)`` (demand at
  row r+1), ``late_4`` = ``sum_j p_j P(e within 4 rows | v_j)`` (rows r+2..r+5). It says what the
  model's forecast would be worth if it existed while row ``r`` is served. Never chosen by default.

Tables (:class:`Tables`) are conditional frequencies on the training rows with add-``ALPHA`` smoothing
towards the layer's marginal, over the token ids seen in training (others get the marginal).
Invariant (no leakage): the features of a step at row ``r`` read token ids of rows ``<= r`` and
next-token / hidden rows ``< r`` of the same stream (``ahead``: token ids of rows ``<= r + 8``), and
never a request; ``tests/test_learn.py`` perturbs a trace's future and checks it. Events collected
on the training sequences use tables fitted on the *other* training sequences (:class:`FoldedTables`,
two folds), so the scorer does not learn to trust tables that have seen the very rows it is scored on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError

HORIZONS = (1, 4, 16)
TOKEN = ("tok_now", *(f"tok_h{h}" for h in HORIZONS))
NEXT = ("next_now", "next_h4")
HIDDEN = tuple(f"hid_h{h}" for h in HORIZONS)
AHEAD_H = (1, 2, 4, 8)
AHEAD = tuple(f"ahead_{h}" for h in AHEAD_H)
LATE = ("late_1", "late_4")
SIGNAL_GROUPS = {"token": TOKEN, "next": NEXT, "hidden": HIDDEN, "ahead": AHEAD, "late": LATE}
NEEDS = {"token": ("token_ids",), "next": ("token_ids", "next_top_ids"), "hidden": ("token_ids", "hidden_summary"),
         "ahead": ("token_ids",), "late": ("token_ids", "next_top_ids")}
"""The trace extras each group reads (token ids always: the tables are fitted from them)."""
DEFAULT_OFF = ("ahead", "late")
"""Groups that read beyond what exists while a row is served: chosen only when named."""
H4 = HORIZONS.index(4)  # the successor table the next-token features use
ALPHA = 1.0
RIDGE = 1.0


# the routing priors' transition table (fitted here with the other tables; read by :mod:`.prior`)
TRANS_MAX_BYTES = 16 << 20
"""Largest transition table (float32 ``[H, L, E, E]``) fitted and stored: the scorer file's field limit.
At 3 horizons that is E = 64 up to 341 layers, E = 128 up to 85, E = 256 up to 21."""


def trans_bytes(num_layers: int, num_experts: int, horizons: int = 3) -> int:
    return 4 * horizons * int(num_layers) * int(num_experts) ** 2


def fit_transitions(used: np.ndarray, target: np.ndarray, ok: np.ndarray, succ_prior: np.ndarray,
                    alpha: float) -> np.ndarray:
    """float32 ``[L, E, E]``: P(e in ``target`` row r | a in ``used`` row r) per layer over rows ``ok``,
    smoothed towards ``succ_prior [L, E]``. ``used``/``target``: bool ``[T, L, E]``."""
    rows = np.flatnonzero(ok)
    U = used[rows].astype(np.float32).transpose(1, 2, 0)  # [L, E, n]
    Y = target[rows].astype(np.float32).transpose(1, 0, 2)  # [L, n, E]
    counts = np.matmul(U, Y).astype(np.float64)  # [L, a, e]
    n = U.sum(axis=2, dtype=np.float64)  # [L, a]
    p = (counts + alpha * succ_prior[:, None, :]) / (n[:, :, None] + alpha)
    return p.astype(np.float32)


@dataclass
class Tables:
    """Routing tables of one training set. ``tok [L, V, E]`` P(e at layer | token); ``succ [H, L, V, E]``
    P(e within the next h rows | token), h in :data:`HORIZONS`; ``prior*`` the marginals ``[.., L, E]``
    used for unseen tokens; ``hid [H, L, D+1, E]`` ridge weights (D = 0: no hidden summary)."""

    layer_ids: np.ndarray  # int64 [L]
    vocab: np.ndarray  # int64 [V] sorted token ids seen in training
    prior: np.ndarray  # float64 [L, E]
    tok: np.ndarray  # float32 [L, V, E]
    succ_prior: np.ndarray  # float64 [H, L, E]
    succ: np.ndarray  # float32 [H, L, V, E]
    hid: np.ndarray  # float64 [H, L, D+1, E]
    meta: dict = field(default_factory=dict)
    trans: np.ndarray | None = None  # float32 [H, L, E, E] (.prior), None when too large or not stored
    _trans64: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def trans64(self) -> np.ndarray | None:
        """:attr:`trans` as contiguous float64 (what both replay paths add up), converted once."""
        if self._trans64 is None and self.trans is not None:
            self._trans64 = np.ascontiguousarray(self.trans, dtype=np.float64)
        return self._trans64

    @property
    def num_experts(self) -> int:
        return int(self.prior.shape[1])

    def vocab_index(self, ids: np.ndarray) -> np.ndarray:
        """Index of each id in :attr:`vocab`, -1 where unseen."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.vocab.size == 0:
            return np.full(ids.shape, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.vocab, ids), self.vocab.size - 1)
        return np.where(self.vocab[pos] == ids, pos, -1)


def _windows(used: np.ndarray, bounds: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
    """(``any(used[r+1..r+h])`` per row, rows whose window lies inside their sequence)."""
    T = used.shape[0]
    out = np.zeros_like(used)
    ok = np.zeros(T, dtype=bool)
    for a, b in zip(bounds[:-1], bounds[1:]):
        for j in range(1, min(h, b - a - 1) + 1):
            out[a : b - j] |= used[a + j : b]
        ok[a : max(b - h, a)] = True
    return out, ok


def fit_tables(trace, alpha: float = ALPHA, ridge: float = RIDGE) -> Tables:
    """Tables from every row of ``trace`` (its training sequences). Without ``token_ids`` the token
    tables are empty (V = 0) and only the routing priors (:mod:`.prior`) and the hidden ridge are fitted;
    ``trans`` is None when it would exceed :data:`TRANS_MAX_BYTES`."""
    T, L, E = trace.num_tokens, trace.num_layers, trace.num_experts
    used = np.zeros((T, L, E), dtype=bool)
    t_idx, l_idx, j_idx = np.nonzero(trace.experts >= 0)
    used[t_idx, l_idx, trace.experts[t_idx, l_idx, j_idx].astype(np.int64)] = True
    if "token_ids" in trace.extras:
        vocab, inv = np.unique(np.asarray(trace.extras["token_ids"], dtype=np.int64), return_inverse=True)
    else:
        vocab, inv = np.zeros(0, dtype=np.int64), np.zeros(T, dtype=np.int64)
    V = vocab.size
    bounds = trace.seq_bounds

    def table(target: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        y = target[rows].astype(np.float64)  # [n, L, E]
        prior = y.mean(axis=0) if rows.size else np.zeros((L, E))
        if V == 0:
            return prior, np.zeros((L, 0, E), dtype=np.float32)
        counts = np.zeros((V, L, E))
        np.add.at(counts, inv[rows], y)
        n = np.bincount(inv[rows], minlength=V).astype(np.float64)
        p = (counts + alpha * prior[None]) / (n[:, None, None] + alpha)
        return prior, p.transpose(1, 0, 2).astype(np.float32)

    prior, ptok = table(used, np.arange(T))
    succ_prior, succ, hid, trans = [], [], [], []
    hs = trace.extras.get("hidden_summary")
    with_trans = trans_bytes(L, E, len(HORIZONS)) <= TRANS_MAX_BYTES
    for h in HORIZONS:
        target, ok = _windows(used, bounds, h)
        sp, s = table(target, np.flatnonzero(ok))
        succ_prior.append(sp)
        succ.append(s)
        if with_trans:
            trans.append(fit_transitions(used, target, ok, sp, alpha))
        if hs is not None:
            hid.append(_ridge(np.asarray(hs, dtype=np.float64), target, ok, bounds, ridge))
    D = 0 if hs is None else int(hs.shape[1])
    hid_arr = np.stack(hid) if hid else np.zeros((len(HORIZONS), L, 1, E))
    return Tables(np.asarray(trace.layer_ids, dtype=np.int64), vocab.astype(np.int64), prior, ptok,
                  np.stack(succ_prior), np.stack(succ), hid_arr,
                  {"rows": int(T), "sequences": int(trace.num_sequences), "alpha": alpha, "ridge": ridge,
                   "hidden_dims": D, "horizons": list(HORIZONS)}, np.stack(trans) if with_trans else None)


def _ridge(hs: np.ndarray, target: np.ndarray, ok: np.ndarray, bounds: np.ndarray, lam: float) -> np.ndarray:
    """``[L, D+1, E]``: least squares (ridge ``lam`` on the weights, not the constant) from row r-1's
    summary and a constant to row r's window target, over rows with both inside one sequence."""
    first = np.zeros(ok.size, dtype=bool)
    first[bounds[:-1]] = True
    rows = np.flatnonzero(ok & ~first)
    T, L, E = target.shape
    X = np.concatenate([hs[rows - 1], np.ones((rows.size, 1))], axis=1)
    Y = target[rows].reshape(rows.size, L * E).astype(np.float64)
    D1 = X.shape[1]
    reg = lam * np.eye(D1)
    reg[-1, -1] = 0.0
    A = np.einsum("nd,nf->df", X, X) + reg + 1e-9 * np.eye(D1)
    W = np.linalg.solve(A, np.einsum("nd,nf->df", X, Y))  # [D+1, L*E]
    return W.reshape(D1, L, E).transpose(1, 0, 2)


@dataclass
class FoldedTables:
    """Tables fitted on all rows (:attr:`full`) and, per sequence id, on the other fold's rows only."""

    full: Tables
    by_seq: dict[int, Tables]

    def for_stream(self, seq_id: int) -> Tables:
        return self.by_seq.get(int(seq_id), self.full)


def external_tables(trace) -> FoldedTables:
    """Tables fitted on every row of ``trace``, a capture of text none of the evaluated sequences is
    drawn from (e.g. the model's training text): used as they are for every stream; needs ``token_ids``."""
    if "token_ids" not in trace.extras:
        raise ConfigError(f"{trace.name}: model-side features need the trace's token_ids (expertcache capture --record token-ids)")
    return FoldedTables(fit_tables(trace), {})


def cut(trace, parts: int = 2):
    """``trace`` with a single sequence cut into ``parts`` contiguous pieces (ids ``seq, seq + 1, ..``),
    pools restarting at each cut; any other trace, or one shorter than ``2 * parts`` rows, as it is."""
    T = trace.num_tokens
    if trace.num_sequences != 1 or parts < 2 or T < 2 * parts:
        return trace
    seq = trace.seq.astype(np.int64)
    for i, part in enumerate(np.array_split(np.arange(T), parts)):
        seq[part] = seq[0] + i if i else seq[0]
    return trace._with(seq=seq, meta={**trace.meta, "sequences": parts})


def halved(trace):
    """:func:`cut` in two, so that :func:`fit_folded` can give each half's events tables fitted on the
    other half. Pools restart at the cut: use it for training events only, never for a held-out replay."""
    return cut(trace, 2)


def fit_folded(trace, folds: int = 2) -> FoldedTables:
    """:func:`fit_tables` on the whole trace, and on each of ``folds`` contiguous sequence groups' complement."""
    full = fit_tables(trace)
    n = trace.num_sequences
    by_seq: dict[int, Tables] = {}
    if n >= 2:
        ids = trace.seq[trace.seq_bounds[:-1]]
        for part in np.array_split(np.arange(n), min(folds, n)):
            other = np.setdiff1d(np.arange(n), part)
            t = fit_tables(trace.select_sequences(other.tolist()))
            by_seq.update({int(ids[i]): t for i in part})
    return FoldedTables(full, by_seq)


def item_index(tables: Tables, item_layer, item_expert, num_experts: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(layer index into tables, expert)`` of each item of a pool whose items have layer ids
    ``item_layer``; a trace with another E, or a layer the tables lack, is one ConfigError."""
    if tables.num_experts != num_experts:
        raise ConfigError(f"{what}: the tables are for E={tables.num_experts} experts, the trace has E={num_experts}")
    lids = {int(x): i for i, x in enumerate(tables.layer_ids)}
    missing = [int(x) for x in np.unique(item_layer) if int(x) not in lids]
    if missing:
        raise ConfigError(f"{what}: the tables have no layer {missing[0]} (fitted on layers {tables.layer_ids.tolist()})")
    return np.array([lids[int(x)] for x in item_layer], dtype=np.int64), np.asarray(item_expert, dtype=np.int64)


class SignalFeatures:
    """The model-side feature columns of one stream (context ``signals``: :class:`~expertcache.trace.
    model_signals.SignalRows`)."""

    def __init__(self, tables, rows, n_items: int):
        tables = tables.for_stream(rows.seq_id) if isinstance(tables, FoldedTables) else tables
        self.t, self.rows = tables, rows
        self.li, self.e = item_index(tables, rows.item_layer, rows.item_expert, rows.num_experts, "model-side features")
        ex = rows.extras
        a, b = rows.first_row, rows.last_row + 1
        self.a, self.b = a, b
        self.vi = tables.vocab_index(ex["token_ids"][a:b])  # vocab index of each row of the stream

    def _lookup(self, table: np.ndarray, prior: np.ndarray, vi, c: np.ndarray) -> np.ndarray:
        """``table[layer, vi, expert]`` of candidates ``c`` (``[C]`` for one vocab index, ``[J, C]`` for
        ``J``); the prior where the token was not seen in training."""
        li, e = self.li[c], self.e[c]
        vi = np.asarray(vi, dtype=np.int64)
        v = np.maximum(vi, 0)
        if vi.ndim == 0:
            return table[li, v, e].astype(np.float64) if vi >= 0 else prior[li, e].astype(np.float64)
        val = table[li[None, :], v[:, None], e[None, :]].astype(np.float64)
        return np.where(vi[:, None] >= 0, val, prior[li, e][None, :])

    def columns(self, c: np.ndarray, r: int, want: set) -> dict[str, np.ndarray]:
        t, ex, out = self.t, self.rows.extras, {}
        vr = self.vi[r - self.a]
        if want & set(TOKEN):
            out["tok_now"] = self._lookup(t.tok, t.prior, vr, c)
            for i, h in enumerate(HORIZONS):
                out[f"tok_h{h}"] = self._lookup(t.succ[i], t.succ_prior[i], vr, c)
        prev = r - 1 >= self.a
        if want & set(NEXT):
            out["next_now"], out["next_h4"] = self._expected(r - 1, c) if prev else self._priors(c)
        if want & set(LATE):
            out["late_1"], out["late_4"] = self._expected(r, c)
        if want & set(HIDDEN):
            if prev and t.hid.shape[2] > 1:
                x = np.r_[np.asarray(ex["hidden_summary"][r - 1], dtype=np.float64), 1.0]
                if x.size != t.hid.shape[2]:
                    raise ConfigError(f"model-side features: the tables expect a hidden summary of {t.hid.shape[2] - 1} "
                                      f"dims, the trace has {x.size - 1}")
                for i, h in enumerate(HORIZONS):
                    out[f"hid_h{h}"] = np.einsum("d,cd->c", x, t.hid[i][self.li[c], :, self.e[c]])
            else:
                for i, h in enumerate(HORIZONS):
                    out[f"hid_h{h}"] = t.succ_prior[i][self.li[c], self.e[c]]
        if want & set(AHEAD):
            keep = np.ones(c.size)
            j = 0
            for h in AHEAD_H:
                while j < h:
                    j += 1
                    if r + j < self.b:
                        keep = keep * (1.0 - self._lookup(t.tok, t.prior, self.vi[r + j - self.a], c))
                out[f"ahead_{h}"] = 1.0 - keep
        return out

    def _expected(self, row: int, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Expected ``tok`` and ``tok_h4`` table values under row ``row``'s top-M distribution (renormalised)."""
        t, ex = self.t, self.rows.extras
        ids, p = ex["next_top_ids"][row], ex["next_top_probs"][row].astype(np.float64)
        p = p / p.sum() if p.sum() > 0 else np.full(p.size, 1.0 / p.size)
        vi = t.vocab_index(ids)
        return (np.einsum("j,jc->c", p, self._lookup(t.tok, t.prior, vi, c)),
                np.einsum("j,jc->c", p, self._lookup(t.succ[H4], t.succ_prior[H4], vi, c)))

    def _priors(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        li, e = self.li[c], self.e[c]
        return self.t.prior[li, e].astype(np.float64), self.t.succ_prior[H4][li, e].astype(np.float64)


# ------------------------------------------------------------------------------------ file fields
def tables_to_arrays(t: Tables) -> dict[str, np.ndarray]:
    import json

    return {"sig_layer_ids": t.layer_ids, "sig_vocab": t.vocab, "sig_prior": t.prior, "sig_tok": t.tok,
            "sig_succ_prior": t.succ_prior, "sig_succ": t.succ, "sig_hid": t.hid,
            "sig_meta": np.array(json.dumps(t.meta, sort_keys=True)),
            **({} if t.trans is None else {"sig_trans": t.trans})}


TABLE_FIELDS = ("sig_layer_ids", "sig_vocab", "sig_prior", "sig_tok", "sig_succ_prior", "sig_succ", "sig_hid")


def tables_from_arrays(get, where: str, present=()) -> Tables:
    """Read and check the table fields; ``get(name)`` returns an array or raises; errors name ``where`` and the field.
    ``present``: the file's field names (``sig_trans``, the prior group's transitions, is read when there)."""
    a = {n: get(n) for n in TABLE_FIELDS + (("sig_trans",) if "sig_trans" in present else ())}

    def bad(name, why):
        raise ConfigError(f"{where}: field {name!r} {why}")

    for n, arr in a.items():
        if arr.dtype.kind not in "fiu":
            bad(n, "is not numeric")
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            bad(n, "holds a non-finite value")
    lids, vocab = a["sig_layer_ids"], a["sig_vocab"]
    if lids.ndim != 1 or lids.size == 0 or lids.dtype.kind not in "iu":
        bad("sig_layer_ids", "must be a non-empty list of layer ids")
    if vocab.ndim != 1 or vocab.dtype.kind not in "iu" or (vocab.size > 1 and np.any(np.diff(vocab) <= 0)):
        bad("sig_vocab", "must be sorted distinct token ids")
    L, V = lids.size, vocab.size
    prior = a["sig_prior"]
    if prior.ndim != 2 or prior.shape[0] != L:
        bad("sig_prior", f"has shape {prior.shape}, expected ({L}, E)")
    E = prior.shape[1]
    H = len(HORIZONS)
    for n, shape in (("sig_tok", (L, V, E)), ("sig_succ_prior", (H, L, E)), ("sig_succ", (H, L, V, E))):
        if a[n].shape != shape:
            bad(n, f"has shape {a[n].shape}, expected {shape}")
    hid = a["sig_hid"]
    if hid.ndim != 4 or hid.shape[:2] != (H, L) or hid.shape[3] != E or hid.shape[2] < 1:
        bad("sig_hid", f"has shape {hid.shape}, expected ({H}, {L}, D+1, {E})")
    trans = a.get("sig_trans")
    if trans is not None and trans.shape != (H, L, E, E):
        bad("sig_trans", f"has shape {trans.shape}, expected {(H, L, E, E)}")
    for n in ("sig_prior", "sig_tok", "sig_succ_prior", "sig_succ", "sig_trans"):
        if n in a and a[n].size and (a[n].min() < 0 or a[n].max() > 1):
            bad(n, "holds a probability outside [0, 1]")
    return Tables(lids.astype(np.int64), vocab.astype(np.int64), prior.astype(np.float64), a["sig_tok"].astype(np.float32),
                  a["sig_succ_prior"].astype(np.float64), a["sig_succ"].astype(np.float32), hid.astype(np.float64),
                  trans=None if trans is None else trans.astype(np.float32))
