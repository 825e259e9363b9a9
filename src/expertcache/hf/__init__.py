"""Hugging Face integration: real MoE models with their experts offloaded to host memory.

``expertcache.hf`` is this package; ``expertcache.offload(model, ...)`` and
``expertcache.load_offloaded(...)`` are its :func:`offload` and :func:`load_offloaded`, loaded from
here on first use (``expertcache.capture`` dispatches to :func:`capture` for a torch model).

==============  ===============================================================================
module          concept
==============  ===============================================================================
``model``       finding a model's MoE layers, checking their experts layout, reading a forward's
                place in its sequence
``loading``     :func:`load_offloaded`: a checkpoint whose offloaded experts never reach the device
``host``        the host tier under the slots: host memory, or the checkpoint's files (mmap, O_DIRECT)
``pagecache``   mincore residency, dropping a file's cached pages, /proc/self/io read bytes
``wall``        ``eval --memory-wall``: the harness as a child behind the tier's memory wall
``pool``        host-packed experts and device slots; the copies
``streams``     the copy stream and per-slot events that order copies against matmuls
``experts``     the ``"expertcache"`` experts implementation registered in transformers' seam
``layer``       one offloaded layer: a cache step per token (batch union), segments, prefetch;
                the model's own experts function run on slot weights
``run``         :func:`offload`: attach / detach, streams, devices
``stats``       :class:`OffloadStats`, :class:`Memory`
``recorder``    :func:`capture`: router decisions into a canonical :class:`~expertcache.Trace`
``passes``      teacher-forced passes over sequences and batches: NLL and time
``evaluation``  the reference and per-policy passes, the exactness and replay checks
``timing``      device-aware stopwatch (CUDA events or ``perf_counter``)
``toy``         small random-weight checkpoints of real families (tests, benchmarks)
==============  ===============================================================================

Needs torch and transformers (``pip install 'expertcache[hf]'``); ``import expertcache`` does not.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"expertcache.hf needs torch and transformers ({exc.name} is missing): pip install 'expertcache[hf]'"
    ) from exc

from ..errors import ConfigError
from .model import TRANSFORMERS_RANGE, find_sites, require_transformers

try:
    require_transformers()
except ConfigError as exc:  # pragma: no cover - exercised only with another transformers release
    raise ImportError(str(exc)) from None

from .evaluation import Evaluation, ExactnessError, PolicyResult, evaluate  # noqa: E402
from .experts import IMPLEMENTATION  # noqa: E402
from .recorder import Capture, capture  # noqa: E402
from .loading import Offloaded, check_checkpoint, load_model, load_offloaded  # noqa: E402
from .run import OffloadRun, offload  # noqa: E402
from .stats import Memory, OffloadStats  # noqa: E402

__all__ = [
    "IMPLEMENTATION", "TRANSFORMERS_RANGE", "Capture", "Evaluation", "ExactnessError", "Memory", "Offloaded",
    "check_checkpoint",
    "OffloadRun", "OffloadStats", "PolicyResult", "capture", "evaluate", "find_sites", "load_model",
    "load_offloaded", "offload",
]
