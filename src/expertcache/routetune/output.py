"""Writing the tuned checkpoint folder atomically.

The folder is built beside the target as ``.<name>.<pid>.<hex>.tmp`` (``save_pretrained`` of the
model in its original dtype, the tokenizer when the source has one, and ``routetune.json``), every
file fsynced, then renamed to the target in one step: a reader sees no folder or the whole folder.
A failure removes the temporary folder; temporaries left by processes that no longer exist (a
killed run) are removed by the next write. An existing target is refused (one line), never merged
into or replaced.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .._io import check_writable, clean_stale_temporaries, temporary_name
from ..errors import ConfigError
from .config import CONFIG_FILE


def check_out_folder(out: str | os.PathLike) -> Path:
    """``out`` as a Path whose parent exists and which does not exist yet, else a one-line error."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"--out {out}: already exists (give a new folder name, or remove it first)")
    return check_writable(out, "--out")  # its parent folder exists


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.iterdir()):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def save_folder(model, tokenizer, out: str | os.PathLike, record: dict) -> Path:
    """Write ``model`` (+ ``tokenizer``, + ``record`` as ``routetune.json``) to ``out`` atomically."""
    out = check_out_folder(out)
    clean_stale_temporaries(out)
    tmp = temporary_name(out)
    try:
        tmp.mkdir()
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / CONFIG_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        os.rename(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"--out {out}: cannot write the checkpoint ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
