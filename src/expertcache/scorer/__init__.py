"""What a learned scorer is, below the policies that run it: its causal features (``features``, with
the ``online``, ``prior`` and model-side ``signals`` groups and their fitted tables), its model
(``models``: linear or MLP, and their fitting) and its file (``file``). ``expertcache.policies.learned``
runs a scorer; ``expertcache.learn`` (above the simulator) collects events, trains and evaluates
(docs/learn.md)."""
