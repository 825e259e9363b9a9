"""Eviction policies behind one interface (:class:`Policy`), by name via :func:`make_policy`.

=================  ==========================================================================
name               rule (ties: least recently used, then smallest id)
=================  ==========================================================================
``lru``            oldest last use
``lfu``            fewest uses so far in the stream
``decayed[:b]``    lowest sum of ``b ** (t - u)`` over past uses u (b = 0.95 per token)
``belady``         farthest next request (clairvoyant); never again = farthest
``foresight:h``    belady seeing only h tokens ahead; beyond the horizon = farthest
``mean-interval``  farthest predicted next request (last use + mean interval)
``random[:seed]``  uniformly random, reproducible
``router-logit``   lowest current router probability (needs router_probs; Python engine)
``learned:PATH``   highest score of a trained scorer (docs/learn.md; compiled unless model-side features)
``static``         pin set with bypass: the top C experts of a profile window, never changed;
                   other requests are streamed misses (replay only; :mod:`.static`)
=================  ==========================================================================
"""

from .base import NEVER, Policy, StreamFuture
from .registry import available_policies, make_policy, register
from . import belady, decayed, foresight, learned, lfu, lru, mean_interval, randomized, router_logit, static  # noqa: F401  (register)

__all__ = ["NEVER", "Policy", "StreamFuture", "available_policies", "make_policy", "register"]
