"""Learned eviction: causal features, farthest-future labels, scorers and the held-out protocol
(docs/learn.md)."""
