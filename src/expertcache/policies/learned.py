"""``learned:PATH``: evict the candidate a trained scorer ranks highest (``expertcache learn train``).

The scorer file (:mod:`expertcache.learn.scorer_io`) names its features; the policy follows the
stream with a :class:`~expertcache.learn.features.FeatureState` and, at each eviction, scores the
candidates in one vectorised call. Key = minus the score, so the cache's usual order applies
(highest score first, ties: least recently used, then smallest id). Features of the ``gate`` and
``router`` groups need the trace's ``probs`` / ``router_probs``: they reach the policy through the
stream context (:mod:`.context`), which the simulator's Python path provides; a cache without it
(or a trace without the field) gets one PolicyError line at the start of the stream.
There is no compiled plan: replay runs the Python engine (benchmarks/bench_learned.py).
"""

from __future__ import annotations

from .base import Policy
from .registry import register
from ..errors import PolicyError


@register
class Learned(Policy):
    name = "learned"
    wants_context = True
    stream_local = False  # reads a scorer file by path: kept in the parent process

    def __init__(self, scorer, path: str):
        super().__init__()
        self.scorer = scorer
        self.path = str(path)

    @classmethod
    def from_arg(cls, arg):
        if not arg:
            raise PolicyError("policy 'learned' needs a scorer file: learned:PATH (made by 'expertcache learn train')")
        from ..learn.scorer_io import load_scorer

        return cls(load_scorer(arg), arg)

    @property
    def spec(self):
        return f"learned:{self.path}"

    def reset(self, n_items, future=None, steps_per_token=1):
        from ..learn.features import FeatureState, available_features, feature_group

        super().reset(n_items, future, steps_per_token)
        have = available_features(self.context)
        lacking = [f for f in self.scorer.features if f not in have]
        if lacking:
            field = "probs" if feature_group(lacking[0]) == "gate" else "router_probs"
            raise PolicyError(f"policy learned:{self.path}: its feature {lacking[0]!r} needs the trace's {field}, "
                              "which this trace (or this cache) does not provide")
        self.state = FeatureState(self.n_items, self.context, self.steps_per_token)

    def keys(self, candidates, t):
        k = -self.scorer.score(self.state.features(candidates, t, self.scorer.features))
        self.state.note_keys(candidates, k, t)
        return k

    def on_access(self, items, t):
        self.state.on_access(items, t)
