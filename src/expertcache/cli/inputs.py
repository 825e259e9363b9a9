"""Inputs several commands read (``eval``, ``capture``, ``llama``, ``router-tune``, ``controller``):
token ids from a ``.npy``, text through a checkpoint's tokenizer, and the Hugging Face side of the
package. Each is one line on a bad input (exit 2). transformers and torch are imported inside the
functions that need them: the commands that never touch a checkpoint run without them."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .._text import first_line
from ..errors import ConfigError
from ..formats.safetensors import check_checkpoint
from ..trace.npz import read_npy

__all__ = ["check_checkpoint", "import_hf", "read_tokens", "read_text"]


def import_hf():
    """The :mod:`expertcache.hf` functions eval needs; a missing or unsupported torch / transformers is a one-line user error."""
    try:
        from .. import hf
        from ..hf.passes import positions, split_tokens
    except ImportError as exc:
        raise ConfigError(first_line(exc)) from None
    from ..hf.evaluation import fitting_capacity

    return SimpleNamespace(load_model=hf.load_model,
                           evaluate=hf.evaluate, split_tokens=split_tokens, fitting_capacity=fitting_capacity,
                           positions=positions)


def read_tokens(path: str) -> np.ndarray:
    """Integer token ids from the ``.npy`` at ``path`` (``--tokens``), any shape, as int64 (a uint64
    id above int64's range is refused here: cast, it had been printed as a negative id)."""
    ids = read_npy(path, "--tokens")  # sizes checked before reading, no pickle; errors are one line
    if ids.dtype.kind not in "iu":
        raise ConfigError(f"--tokens {path}: expected integer token ids, got {ids.dtype}")
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise ConfigError(f"--tokens {path}: token id {int(ids.max())} is above any vocabulary")
    return ids.astype(np.int64, copy=False)


MAX_TEXT_BYTES = 8 << 20
"""Largest ``--text`` file: tokenizing holds about 170 bytes of memory per byte of text (20 MB of
text took 3.4 GB), so a corpus larger than this is tokenized ahead into ``--tokens ids.npy``."""


def read_text(model_dir: str, path: str) -> np.ndarray:
    """The UTF-8 text file ``path`` (``--text``; a leading byte-order mark is not text) as token ids,
    by the tokenizer saved in ``model_dir``; at most :data:`MAX_TEXT_BYTES`."""
    from ..hf.loading import tokenizer_or_reason  # torch and transformers: only for --text

    try:
        st = os.stat(path)
    except (OSError, ValueError):
        raise ConfigError(f"--text {path}: no such file") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--text {path}: not a regular file")
    if st.st_size > MAX_TEXT_BYTES:
        raise ConfigError(f"--text {path}: {st.st_size:,} bytes, more than {MAX_TEXT_BYTES:,} (tokenizing holds about "
                          "170 bytes per byte of text): tokenize it into --tokens ids.npy instead")
    tokenizer, why = tokenizer_or_reason(model_dir)
    if tokenizer is None:
        raise ConfigError(f"--text needs a tokenizer saved in {model_dir} ({why}); without one, pass --tokens ids.npy")
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--text {path}: not UTF-8 text (byte {exc.start})") from None
    return np.asarray(tokenizer(text, return_attention_mask=False)["input_ids"], dtype=np.int64)
