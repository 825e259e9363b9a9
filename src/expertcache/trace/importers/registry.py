"""The importer registry: formats by name (``register(Importer(...))`` once, in the format's own
module), the one table :func:`~.detect.detect_format`, :func:`~.detect.import_trace`,
``FORMATS``, ``DEFAULT_PHASE`` and :func:`~.detect.shapes` read.

Invariants: a name is registered once (another :class:`Importer` under it is a ValueError); the
formats are listed in registration order, the order in which :mod:`.detect` imports their modules
(``FORMATS``' order); ``auto`` tries the probes stage by stage (:mod:`.detect`: path probes, then
line probes, then record probes), each stage in registration order, ``loose`` record probes last.
This module imports no format module, so every format module imports it without a circle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..core import Trace


@dataclass(frozen=True)
class Options:
    """What :func:`~.detect.import_trace` was given; readers take the options that apply to them
    and refuse, with one :class:`~expertcache.errors.ConfigError` line, those that cannot. ``phase``
    is already defaulted to the format's (None where it has none)."""

    vllm_fields: Any
    token_fields: Any
    engine_fields: Any
    num_experts: int | None = None
    drop_incomplete: bool = False
    pad: bool = False
    model: str | None = None
    phase: str | None = None
    sequences: str = "auto"
    rank: int | None = None
    top_k: int | None = None
    expect_tokens: int | None = None
    num_layers: int | None = None

    def common(self) -> dict:
        """The options every table-building reader takes (vllm-jsonl, token-jsonl, sglang)."""
        return dict(num_experts=self.num_experts, drop_incomplete=self.drop_incomplete, pad=self.pad,
                    model=self.model, phase=self.phase)


@dataclass(frozen=True)
class Importer:
    """One format.

    ``shape(options)``: one line, the input it reads with the field names in force (the errors of
    ``auto`` list them); ``read(path, name, options) -> Trace``; ``phase``: the default phase (None:
    the reader takes it from the rows). Probes for ``auto``, where the format has one:
    ``claims_path(path, head)`` (``head``: the first four bytes, empty for a folder) -> bool;
    ``claims_line(line)`` -> the name of the format a server-response line shows, another true value
    for a server response that does not tell (this format, unless a later line tells), or None;
    ``claims_record(record, options)`` -> bool, ``loose`` for a shape others' records also fit.
    ``write_chunked(path, out, fmt, options, chunk_sequences) -> ChunkedTrace``, where the format
    can be written as a chunked trace while it is read (memory bounded by what is open at once, not
    by the file); formats without it are read whole, then written chunked
    (:func:`~.detect.import_chunked`).
    """

    name: str
    shape: Callable[[Options], str]
    read: Callable[[str | os.PathLike, str, Options], "Trace"]
    phase: str | None = None
    claims_path: Callable[[str | os.PathLike, bytes], bool] | None = None
    claims_line: Callable[[bytes], Any] | None = None
    claims_record: Callable[[dict, Options], bool] | None = None
    loose: bool = False
    write_chunked: Callable[[str | os.PathLike, str | os.PathLike, str, Options, int], Any] | None = None


_REGISTRY: dict[str, Importer] = {}


def register(importer: Importer) -> Importer:
    """Make ``importer`` available under ``importer.name``."""
    if importer.name in _REGISTRY and _REGISTRY[importer.name] is not importer:
        raise ValueError(f"importer name {importer.name!r} is already registered")
    _REGISTRY[importer.name] = importer
    return importer


def importers() -> list[Importer]:
    """The registered formats, in registration order."""
    return list(_REGISTRY.values())


def get(name: str) -> Importer | None:
    """The format registered as ``name``, or None (also for a name that is no string)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None
