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
import re
import warnings
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import torch

from .._text import first_line
from ..errors import ConfigError, one_line, is_int
from ..formats.safetensors import check_checkpoint, checkpoint_files, read_headers
from .model import (ExpertsSite, find_sites, model_label, require_transformers, resolve_device, select_sites,
                    text_config)
from .host import check_host, host_of, map_file_experts, use_files
from .pagecache import drop_cached, release_mappings
from .pool import host_tensor
from .run import OffloadRun

DTYPES = ("auto", "float32", "bfloat16", "float16")


class Offloaded(NamedTuple):
    """What :func:`load_offloaded` returns: the model, ready to run, and its attached :class:`OffloadRun`."""

    model: torch.nn.Module
    run: OffloadRun


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
        config = transformers.AutoConfig.from_pretrained(folder)
    except CONFIG_ERRORS as exc:
        raise ConfigError(f"model {path}: cannot load it ({one_line(exc)[:300]})") from None
    check_weights_cover_config(folder, config)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype if dtype == "auto" else getattr(torch, dtype), output_loading_info=True,
            ignore_mismatched_sizes=True)  # reported below by name, rather than as "look at the report above"
    except LOAD_ERRORS as exc:
        raise ConfigError(f"model {path}: cannot load it ({one_line(exc)[:300]})") from None
    check_loading_info(path, info)
    sites = select_sites(find_sites(model), host_layers, model_label(model))
    check_top_k(path, config, sites)
    if host != "memory":
        served = [map_file_experts(site, folder, host, dev) for site in sites]  # all checked before any is released
        for site, files in zip(sites, served):
            use_files(site, files)
    place(model, sites, dev)
    paths = [str(p) for p in checkpoint_files(folder)]
    release_mappings(model, paths)  # weights loaded zero-copy get memory of their own: "memory" means memory
    if host != "memory":
        drop_cached(paths)  # the host tier starts cold
    return model.eval()


def _load_errors() -> tuple:
    """What transformers' loading raises on a damaged checkpoint: a truncated or lying safetensors
    file (``SafetensorError``), a config value of the wrong type (huggingface_hub's strict
    dataclass errors, ``TypeError``), arithmetic on a config value (a size divided by 0 heads, a
    power of 0: ``ArithmeticError``), besides the usual OSError, ValueError, KeyError, RuntimeError."""
    kinds = [OSError, ValueError, KeyError, RuntimeError, TypeError, ArithmeticError]
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        kinds.append(SafetensorError)
    with contextlib.suppress(ImportError):
        from huggingface_hub.errors import StrictDataclassError

        kinds.append(StrictDataclassError)
    return tuple(kinds)


LOAD_ERRORS = _load_errors()
CONFIG_ERRORS = LOAD_ERRORS + (AttributeError, IndexError)
"""What reading a config.json raises besides: transformers looks its ``dtype`` up on the torch module
(``"dtype": "x"``, AttributeError) and takes the first of a list (``[]``, IndexError); each had been
exit 70. Only around the config's read, where no expertcache code runs."""


def tokenizer_or_reason(model_dir: str | Path):
    """``(tokenizer, None)``: transformers' ``AutoTokenizer`` of the checkpoint folder; or ``(None,
    why)`` in one line when it has none or its files are damaged. Every exception is caught here:
    transformers raises AttributeError, KeyError or RecursionError on a tokenizer_config.json or
    tokenizer.json of the wrong shape, and the Rust tokenizers a plain ``Exception`` ("data did not
    match any variant ..."); each had been exit 70. Only transformers' code runs inside."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir)), None
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return None, first_line(exc)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_weights_cover_config(folder: Path, config) -> None:
    """Before transformers builds the model: the config's layers and vocabulary must be the weights'.
    transformers allocates what the config declares and fills what the files lack with random values,
    so a ``num_hidden_layers`` of 10^7 or a ``vocab_size`` of 10^8 beside small weights took gigabytes
    before any check. From the safetensors headers (bounded reads): every layer ``model.layers.i``
    below ``num_hidden_layers`` has a weight, and ``model.embed_tokens.weight`` is ``[vocab_size,
    hidden_size]``; the attention and KV heads are 1..hidden_size (0 had been a ZeroDivisionError as
    transformers built the model, exit 70), the layers at least 1 and ``pad_token_id`` a token id
    (torch's assertion, exit 70). Checkpoints of other layouts (``.bin`` weights, other
    tensor names) are left to :func:`check_loading_info`."""
    files = checkpoint_files(folder)
    shapes: dict[str, list] = {}
    for _, header, _ in read_headers(files):
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})  # entries checked
    if files and not shapes:
        raise ConfigError(f"model {folder}: its safetensors files hold no weights")
    if not any(_LAYER.match(k) for k in shapes):
        return
    text = text_config(config)
    L = getattr(text, "num_hidden_layers", None)
    if is_int(L):
        if L < 1:  # had been "not supported: it has no experts module"
            raise ConfigError(f"model {folder}: config.json has num_hidden_layers {L}; a model has at least 1")
        present = sorted({int(m.group(1)) for k in shapes if (m := _LAYER.match(k))})
        missing = next((i for i, v in enumerate(present) if v != i), len(present))
        if missing < L:
            raise ConfigError(f"model {folder}: config.json has num_hidden_layers {L}, but the weights hold no "
                              f"model.layers.{missing}.* (they hold layers {present[0]}..{present[-1]})")
    H = getattr(text, "hidden_size", None)
    for key in ("num_attention_heads", "num_key_value_heads"):  # transformers divides by them as it builds
        n = getattr(text, key, None)
        if is_int(H) and is_int(n) and not 1 <= n <= H:
            raise ConfigError(f"model {folder}: config.json has {key} {n}, not 1..hidden_size ({H})")
    V, pad = getattr(text, "vocab_size", None), getattr(text, "pad_token_id", None)
    if is_int(V) and is_int(pad) and not -V <= pad < V:  # torch's Embedding asserts it (exit 70)
        raise ConfigError(f"model {folder}: config.json has pad_token_id {pad}, outside its vocab_size {V}")
    embed = shapes.get("model.embed_tokens.weight")
    want = [V, H]
    if isinstance(embed, list) and all(is_int(x) for x in want) and embed != want:
        raise ConfigError(f"model {folder}: config.json has vocab_size {want[0]} and hidden_size {want[1]}, but "
                          f"model.embed_tokens.weight is {embed}")


def check_top_k(path, config, sites: list[ExpertsSite]) -> None:
    """The config's experts per token (``num_experts_per_tok``) must be 1..E of the loaded experts:
    torch's ``topk`` fails in the forward otherwise."""
    text = text_config(config)
    k = getattr(text, "num_experts_per_tok", None)
    if sites and is_int(k) and not 1 <= k <= sites[0].num_experts:
        raise ConfigError(f"model {path}: config.json has num_experts_per_tok {k}, not 1..{sites[0].num_experts} "
                          "(the experts its weights hold)")


def check_loading_info(path, info: dict) -> None:
    """Refuse a model transformers built with weights the checkpoint lacks (filled with random values:
    every figure of a run on it would be noise, and differ run to run) or holds in another shape,
    naming the first; weights the checkpoint holds that the config does not use are one warning."""
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, ckpt, model = mismatched[0]
        raise ConfigError(f"model {path}: {name} is {list(ckpt)} in the checkpoint but {list(model)} for its "
                          f"config ({len(mismatched)} weight(s) of another shape)")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(f"model {path}: the checkpoint lacks {len(missing)} weight(s) its config needs, e.g. "
                          f"{missing[0]} (transformers would fill them with random values)")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        warnings.warn(f"model {path}: {len(unexpected)} weight(s) in the checkpoint are not used by its config, e.g. "
                      f"{unexpected[0]}")


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
