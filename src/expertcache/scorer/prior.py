"""Routing priors: how often each layer uses each expert, and which experts follow which.

The ``prior`` feature group needs nothing but the requests, so every trace can use it (docs/learn.md,
"Routing priors"). Both tables are fitted on training sequences only (with the model-side tables,
:func:`~.signals.fit_tables`; out of fold for the training events, :class:`~.signals.FoldedTables`),
and stored in the scorer file (``sig_prior``, ``sig_succ_prior``, ``sig_trans``). With ``l`` the
candidate's layer, ``e`` its expert, ``r`` the trace row being served:

* ``pop`` = P(e at l): the share of training rows whose group at layer ``l`` holds ``e``.
* ``trans_hH`` (H in :data:`~.signals.HORIZONS`: 1, 4, 16) = the mean, over the experts ``a`` of
  the latest group served at layer ``l``, of P(e at l within rows r'+1..r'+H | a at l in row r'),
  with add-``ALPHA`` smoothing towards P(e at l within H rows). In a per-layer pool the latest group
  is the one being served; in a global pool it is layer ``l``'s group of this token or the last one.
  Before any group at ``l`` (never, for a resident candidate) the feature is the smoothing target.

Invariant (no leakage): the features at step ``t`` read the stream's groups ``0..t`` (group ``t``
is the request being served) and the fitted tables, never a later request; ``tests/test_learn.py``
perturbs a trace's future and checks it. Both replay paths average the transition rows through
:func:`expertcache.scorer.kernels_learned.trans_at`, so the compiled loop computes the same bits.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .kernels_features import trans_column
from .online import LatestGroups
from .signals import HORIZONS, TRANS_MAX_BYTES, item_index

PRIOR = ("pop", *(f"trans_h{h}" for h in HORIZONS))


class PriorFeatures(LatestGroups):
    """The prior columns of one stream; ``context`` is its :class:`~expertcache.trace.context.StreamContext`
    (groups and the pool's item map), ``tables`` a :class:`~.signals.Tables` with ``trans``."""

    def __init__(self, tables, context):
        if tables.trans is None:
            raise ConfigError("prior features: the routing tables hold no transitions (fitted with E too large, "
                              f"over {TRANS_MAX_BYTES >> 20} MB, or read from a version-2 file)")
        li, e = item_index(tables, context.item_layer, context.item_expert, context.num_experts, "prior features")
        self.pop = np.ascontiguousarray(tables.prior, dtype=np.float64)
        self.trans = tables.trans64
        self.succp = np.ascontiguousarray(tables.succ_prior, dtype=np.float64)
        super().__init__(context.groups, li, e, self.pop.shape[0])

    def columns(self, c: np.ndarray, t: int, names) -> dict[str, np.ndarray]:
        self.advance(t)
        li, e = self.li[c], self.e[c]
        out = {"pop": self.pop[li, e]}
        for i, h in enumerate(HORIZONS):
            if f"trans_h{h}" in names:
                out[f"trans_h{h}"] = trans_column(li, e, self.trans, self.succp, i, self.lat, self.latn)
        return out
