"""The file-backed expert tier: real reads of an expert pool under an enforced capacity (docs/tier.md).

Modules, one concept each: ``pool`` (pool folders, manifest, checks) and ``checkpoint`` (real expert
bytes from safetensors); ``readers`` (pagecache / nocache / direct reads), ``arena`` (the mlocked
arena, fail-stop), ``loop`` (one pass: iterations, thread pool, reused buffers), ``advice`` (the
one-slot advice worker); ``worker`` (the measured process), ``harness`` (cells and runs, the
record), ``demand`` (LRU demand model, advice headroom), ``sweep`` (T(C)) and ``plan``
(the ownership calculus). The wall it runs behind, and its accounting, are :mod:`expertcache.wall`. Only the standard library and numpy: no torch.
"""
