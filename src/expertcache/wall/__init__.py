"""The memory wall: a capacity enforced on a worker process and the proof that it held (docs/tier.md,
docs/llama.md, docs/robustness.md). Used alike by the file tier (``tier/``), the Hugging Face
harness (``hf/``), the llama.cpp engine (``llama/``) and the server.

Modules, bottom up: ``procfs`` (bounded reads of /proc and /sys), ``pagecache`` (a file's resident
pages: mincore, cachestat, drops), ``cgroupfs`` (cgroup v1/v2 files, the sampler whose limit
follows the worker), ``cgroupwall`` (the cgroup walls and their proof), ``capacity`` (choosing and
running a wall: ``run_walled``, ``follow_plan``, the balloon), ``accounting`` (block-device,
reclaim, pressure and memory snapshots around an interval). Only the standard library: no numpy.
"""
