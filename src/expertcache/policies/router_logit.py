"""``router-logit``: evict the candidate with the lowest current router probability.

The seeds' hand-built router rule (001, "Learned eviction": 46% more copies than LRU in the harness,
because it evicts experts that were just used). "Current" = the router row of the step being served
for the candidate's layer; in a global pool a layer the current token has not routed yet shows its
previous token's row (:class:`~.context.RouterView`). Needs the trace's ``router_probs`` (softmax is
monotone in the logit, so the order is the logit order); on a trace without them the stream's
first reset is one PolicyError line. Python engine only (it reads the stream context).
"""

from __future__ import annotations

from ..errors import PolicyError
from .base import Policy
from ..trace.context import RouterView
from .registry import register


@register
class RouterLogit(Policy):
    name = "router-logit"
    wants_context = True

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        if self.context is None or self.context.router is None:
            raise PolicyError("policy 'router-logit' needs the trace's router_probs (the full router softmax); "
                              "this trace has none")
        self.view = RouterView(self.context, self.n_items)

    def keys(self, candidates, t):
        self.view.advance(t)
        return self.view.latest[candidates].copy()
