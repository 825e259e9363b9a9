"""Loading a checkpoint so that the device never holds the offloaded experts: ``load_offloaded``.

How (transformers' own loading, then a placement pass): ``AutoModelForCausalLM.from_pretrained``
reads the checkpoint into host memory (its weight conversions, dtypes and sharded safetensors
files all apply; no device map, so no accelerate hooks). Then, layer by layer, each offloaded
layer's packed expert tensors are copied once into page-locked host memory (a CUDA target) and
the unpinned tensor is released before the next layer, so host memory holds one copy of each
expert (at most one layer's experts twice, during its move). Finally every other parameter and
buffer moves to the device. The device therefore holds the non-expert weights, the experts of
layers that are not offloaded, and later the C slots per offloaded layer: never the full model.

On the CPU nothing is pinned or moved and no expert is copied: the loaded tensors are the host
memory the slots copy from.

``host="mmap"`` / ``"direct"`` (:mod:`.host`): after transformers' loading, each offloaded layer's
experts are located in the checkpoint's safetensors files and checked byte for byte against the
loaded tensors, then the loaded tensors are released (NaN placeholders) and the files' cached
pages dropped: the experts stay in the files, and a miss reads them from there into its slot.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import torch

from .._text import first_line
from ..errors import ConfigError
from .model import ExpertsSite, find_sites, model_label, require_transformers, select_sites
from .host import check_host, host_of, map_file_experts, use_files
from .pagecache import drop_cached, release_mappings
from .pool import host_tensor
from .run import OffloadRun

DTYPES = ("auto", "float32", "bfloat16", "float16")


class Offloaded(NamedTuple):
    """What :func:`load_offloaded` returns: the model, ready to run, and its attached :class:`OffloadRun`."""

    model: torch.nn.Module
    run: OffloadRun


def resolve_device(device: "str | torch.device | None") -> torch.device:
    """``device`` as a torch device (default: cuda when available, else cpu), refused in one line if unusable."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r}: {first_line(exc)}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device}: only cpu and cuda devices are supported")
    return dev


def load_model(
    path: "str | Path",
    *,
    device: "str | torch.device | None" = None,
    dtype: str = "auto",
    host_layers: Iterable[int] | None = None,
    host: str = "memory",
) -> torch.nn.Module:
    """The checkpoint at ``path`` with the experts of ``host_layers`` (default: every MoE layer) in
    host memory (pinned for a CUDA device), or left in its files (``host="mmap"`` / ``"direct"``),
    and everything else on ``device``; see the module docstring."""
    import transformers
    from transformers import AutoModelForCausalLM

    require_transformers()
    dev = resolve_device(device)
    check_host(host)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    folder = check_checkpoint(path)
    transformers.logging.set_verbosity_error()  # errors reach the user as one line; no loading chatter
    transformers.logging.disable_progress_bar()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ConfigError(f"model {path}: cannot load it ({first_line(exc)})") from None
    sites = select_sites(find_sites(model), host_layers, model_label(model))
    if host != "memory":
        served = [map_file_experts(site, folder, host, dev) for site in sites]  # all checked before any is released
        for site, files in zip(sites, served):
            use_files(site, files)
    place(model, sites, dev)
    paths = [str(p) for p in folder.glob("*.safetensors")]
    release_mappings(model, paths)  # weights loaded zero-copy get memory of their own: "memory" means memory
    if host != "memory":
        drop_cached(paths)  # the host tier starts cold
    return model.eval()


def check_checkpoint(path: "str | Path", what: str = "model") -> Path:
    """``path`` as a folder holding a ``config.json``, or a one-line refusal naming it as ``what``."""
    folder = Path(path)
    if not folder.exists():
        raise ConfigError(f"{what} {path}: no such folder")
    if not folder.is_dir():
        raise ConfigError(f"{what} {path}: is a file, expected a checkpoint folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{what} {path}: not a checkpoint folder (no config.json)")
    return folder


@torch.no_grad()
def place(model: torch.nn.Module, sites: list[ExpertsSite], device: torch.device) -> None:
    """Experts of ``sites`` into (pinned, for CUDA) host memory, one layer at a time; the rest to ``device``."""
    pin = device.type == "cuda"
    held = set()
    for site in sites:
        for param in (site.experts.gate_up_proj, site.experts.down_proj):
            if host_of(site.experts) is None:  # experts served from files hold no memory to move
                param.data = host_tensor(param.data, pin)  # the unpinned original is released here
            held.add(id(param))
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in held and param.device != device:
                param.data = param.data.to(device)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


@contextlib.contextmanager
def resident(sites: list[ExpertsSite], device: torch.device) -> Iterator[None]:
    """Inside the block the experts of ``sites`` are on ``device`` (the stock, all-resident model);
    afterwards they are back in the same host tensors. Nothing moves when they are already there.
    Experts served from files are read back in full for the block (uncounted), then released."""
    moved = []
    try:
        for site in sites:
            files = host_of(site.experts)
            if files is not None:
                params = (site.experts.gate_up_proj, site.experts.down_proj)
                for param, full in zip(params, files.materialize(device)):
                    moved.append((param, param.data))
                    param.data = full
                continue
            for param in (site.experts.gate_up_proj, site.experts.down_proj):
                if param.device != device:
                    host = param.data
                    param.data = host.to(device)
                    moved.append((param, host))
        yield
    finally:
        for param, host in moved:
            param.data = host


def load_offloaded(
    path: "str | Path",
    capacity: int,
    layers: Iterable[int] | None = None,
    policy="lru",
    *,
    device: "str | torch.device | None" = None,
    dtype: str = "auto",
    host: str = "memory",
    **options,
) -> Offloaded:
    """Load ``path`` with the experts of ``layers`` (default: every MoE layer) straight into host
    memory (``host="memory"``), or left in the checkpoint's safetensors files and read on a miss
    through a mapping (``"mmap"``: the page cache is the host tier) or with O_DIRECT (``"direct"``:
    every miss pays the device), and serve them from ``capacity`` device slots per layer under ``policy``.

    Returns ``(model, run)``: the model is ready to run (``model(...)``, ``model.generate(...)``),
    ``run`` is the attached :class:`OffloadRun` (``run.stats()``, ``run.memory()``). ``options`` are
    :func:`~expertcache.hf.offload`'s (``future``, ``reset``, ``prefetch``). ``run.detach()``
    leaves the experts in host memory, where they were loaded.
    """
    dev = resolve_device(device)
    layers = None if layers is None else list(layers)
    model = load_model(path, device=dev, dtype=dtype, host_layers=layers, host=host)
    run = OffloadRun(model, capacity, policy, layers, device=dev, **options)
    run.attach()
    return Offloaded(model, run)
