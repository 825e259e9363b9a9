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
``random[:seed]``  uniformly random, reproducible (hooked)
``router-logit``   lowest current router probability (needs router_probs; Python engine)
``learned:PATH``   highest score of a trained scorer (docs/learn.md; compiled unless model-side features)
``static``         pin set with bypass: the top C experts of a profile window, never changed;
                   other requests are streamed misses (replay only; :mod:`.static`)
``arc``            ARC: recency and frequency lists with ghosts, adaptive split (hooked)
``s3fifo``         S3-FIFO: small, main and ghost FIFOs (hooked)
``sieve``          SIEVE: a FIFO, visited bits and a hand (hooked)
=================  ==========================================================================

"Hooked" rules are state machines written once as compiled engine hooks (:mod:`.hooked`).
Policy strings have three kinds (eviction, admission, set-holding): :func:`parse_policy` parses a
string once, where it enters, into a :class:`PolicySpec` (:mod:`.kinds`).
"""

from .base import NEVER, Policy, StreamFuture
from .registry import KINDS, PolicySpec, kind_of, parse_policy
from .registry import available_policies, make_policy, register
import importlib as _importlib
import pkgutil as _pkgutil

for _module in _pkgutil.iter_modules(__path__):  # every rule's file registers itself: a new rule is one file
    _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["KINDS", "NEVER", "Policy", "PolicySpec", "StreamFuture", "available_policies", "kind_of", "make_policy",
           "parse_policy", "register"]
