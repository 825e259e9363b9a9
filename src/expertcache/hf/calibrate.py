"""Measure this machine's cost-model constants for a model: tau (one expert copy) and c (compute per token).

* ``tau``: one expert copied into a slot through the offload harness's own copy path
  (:meth:`~.pool.SlotPool.load`: page-locked host memory to the device on a GPU, timed by events
  on the copy stream; host memory to the slot buffers on the CPU, ``perf_counter``), one copy per
  sample, cycling through the experts of the first offloaded layer so no sample re-reads a cache
  line the previous one left warm more than the machine's caches would;
* with the experts left in the checkpoint's files (``load_model(host=...)``, :mod:`.host`), the
  copy is the harness's file read: ``mmap`` copies from the mapping after one untimed read of
  every expert, so each sample is a page-cache hit (the host tier holding the expert; on a
  machine whose page cache holds the experts, every miss of an ``eval --host mmap`` run); ``direct``
  reads with O_DIRECT, so each sample pays the device. ``tau_tiers`` counts where the samples
  were served (page cache, device);
* ``c``: one decode step (one token, KV cache) of the stock model with every expert resident,
  per sample, after a warm-up; the median over the steps of a sequence of ``tokens`` tokens,
  repeated until ``repeats`` samples are taken.

Both are reported as the median with the 10th and 90th percentiles (the spread), in
milliseconds; ``copy_gbps`` = expert bytes / median tau. The copies and steps run exactly as
``eval`` runs them, so tau and c plug straight into ``c + rho * tau`` (docs/design.md section 2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .._text import short
from ..costmodel.runs import MAX_SAMPLES, check_slow_copies
from ..errors import ConfigError, is_int
from .host import host_of
from .loading import resident
from .model import cache_argument, find_sites, model_device, select_sites
from .passes import positions, vocab_size
from .pool import SlotPool
from .timing import Stopwatch


@dataclass
class Calibration:
    """Measured tau and c (ms: median, 10th and 90th percentiles, samples)."""

    device: str
    dtype: str
    expert_bytes: int
    tau_ms: float
    tau_ms_p10: float
    tau_ms_p90: float
    tau_samples: int
    c_ms: float
    c_ms_p10: float
    c_ms_p90: float
    c_samples: int
    copy_gbps: float
    slow_copies: int = 1
    host: str = "memory"
    tau_tiers: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _spread(samples: list[float]) -> tuple[float, float, float]:
    a = np.asarray(samples, dtype=np.float64) * 1000.0
    return float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90))


@torch.no_grad()
def calibrate(model: torch.nn.Module, *, repeats: int = 30, tokens: int = 16, layers=None, seed: int = 0,
              slow_copies: int = 1) -> Calibration:
    """Measure tau and c for ``model`` (experts may be on the device or in host memory)."""
    if not (is_int(repeats, 3, MAX_SAMPLES) and is_int(tokens, 2)):  # 2.5 had passed, 10**30 run for ever
        raise ConfigError(f"calibrate needs 3 to {MAX_SAMPLES:,} repeats and at least 2 tokens (integers), got "
                          f"{short(repeats, 40)} and {short(tokens, 40)}")
    context = positions(model)
    if context is not None and tokens > context:  # positions past the trained ones; the KV cache grows each step
        raise ConfigError(f"--tokens {tokens}: more than the model's {context} positions (max_position_embeddings)")
    device = model_device(model)
    sites = select_sites(find_sites(model), layers)
    site = sites[0]
    files = host_of(site.experts)
    pool = SlotPool.from_weights((site.experts.gate_up_proj, site.experts.down_proj), 2, device, files=[files])
    pool.repeat = check_slow_copies(slow_copies)
    E = pool.num_experts
    if files is not None and files.mode == "mmap":  # every sampled expert in the page cache: the host tier's hit
        for e in range(min(E, repeats + 2)):
            files.copy_into(e, [d[0] for d in pool.slots], count=False)
    taus = []
    for i in range(repeats + 2):  # the first two copies warm the path up and are not kept
        watch = pool.stopwatch_for_copies()
        pool.load([(i % E, i % 2)], watch)
        if i >= 2:
            taus.append(watch.seconds)
        if i == 1:
            pool.clear_counters()
    tiers = None if files is None else {"page_cache": files.page_cache, "device": files.device_loads}
    del pool
    steps = []
    vocab = vocab_size(model) or 2
    rng = np.random.default_rng(seed)
    key = cache_argument(model)
    model.eval()
    with resident(sites, device), torch.inference_mode():
        while len(steps) < repeats:
            ids = torch.as_tensor(rng.integers(0, vocab, (1, tokens)), device=device)
            cache = None
            for j in range(tokens):
                watch = Stopwatch(device)
                with watch.time():
                    out = model(input_ids=ids[:, j : j + 1], use_cache=True, **{key: cache})
                cache = out["cache"] if "cache" in out else out.get("past_key_values")
                if j:  # the first step of a sequence (an empty cache) is not a decode step
                    steps.append(watch.seconds)
    tau, tau10, tau90 = _spread(taus)
    c, c10, c90 = _spread(steps[:repeats])
    expert_bytes = sum(t[0].numel() * t.element_size() for t in (site.experts.gate_up_proj, site.experts.down_proj))
    return Calibration(
        device=str(device), dtype=str(site.experts.gate_up_proj.dtype).replace("torch.", ""), expert_bytes=expert_bytes,
        tau_ms=tau, tau_ms_p10=tau10, tau_ms_p90=tau90, tau_samples=len(taus),
        c_ms=c, c_ms_p10=c10, c_ms_p90=c90, c_samples=min(len(steps), repeats),
        copy_gbps=expert_bytes / (tau / 1000.0) / 1e9 if tau > 0 else float("nan"), slow_copies=int(slow_copies),
        host=files.mode if files is not None else "memory", tau_tiers=tiers,
    )
