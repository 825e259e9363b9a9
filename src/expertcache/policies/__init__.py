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
=================  ==========================================================================
"""

from .base import NEVER, Policy, StreamFuture
from .registry import available_policies, make_policy, register
from . import belady, decayed, foresight, lfu, lru, mean_interval, randomized  # noqa: F401  (register)

__all__ = ["NEVER", "Policy", "StreamFuture", "available_policies", "make_policy", "register"]
