"""Atomic file writes, and bounded reads of users' small files (:func:`open_npz`, :func:`read_text`,
:func:`read_json`).

Writes: a killed run leaves either the old file or the new one, never a torn one.

A write goes to a temporary file beside the target, named ``.<name>.<pid>.<random>.tmp``; on
success it is flushed, fsynced and renamed over the target. An exception removes it. A run killed
outright (SIGKILL, power loss) cannot clean up, so every write first removes the temporaries of
the same target whose writing process no longer exists: after the next run nothing is orphaned.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO, Iterator

from .errors import ConfigError

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""Errors of a write that mean the output's file system is full (or the file too large for it)."""
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.(?P<suffix>tmp|partial|old)")
_PENDING: set[str] = set()
"""The temporaries this process is writing now (:func:`temporary_beside`)."""


def numpy_reason(err: BaseException) -> str:
    """Why numpy refused a user's file, in one line; never numpy's advice to unpickle it
    (``allow_pickle=``): expertcache does not load pickled data, whoever made the file."""
    text = " ".join(str(err).split()) or type(err).__name__
    if "pickle" in text.lower():
        return "it holds pickled (object) data, which expertcache never loads"
    return text


def write_npz(path: str | os.PathLike, arrays: dict, *, compressed: bool = False, option: str = "--out") -> Path:
    """``arrays`` as an ``.npz`` at ``path``, written atomically (:func:`atomic_open`); returns the path."""
    import numpy as np

    with atomic_open(path, "wb", option=option) as fh:
        (np.savez_compressed if compressed else np.savez)(fh, **arrays)
    return Path(path)


def open_npz(path: str | os.PathLike, what: str, kind: str):
    """``np.load`` of a user's ``.npz`` without pickles (``with`` it); a ConfigError line when it is
    not a file (``"{what} {path}: no such file"``) or not an archive numpy reads
    (``"{what} {path}: not {kind} ({reason})"``, e.g. ``kind="a scorer file"``)."""
    import numpy as np

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p}: no such file")
    try:
        with open(p, "rb") as fh:
            head = fh.read(6)
    except OSError as err:
        raise ConfigError(f"{what} {p}: cannot be read ({err.strerror or err})") from None
    if head.startswith(b"\x80"):  # a pickle's protocol opcode
        raise ConfigError(f"{what} {p}: not {kind} ({numpy_reason(ValueError('pickle'))})")
    if head.startswith(b"\x93NUMPY"):  # np.load would return one array, not an archive
        raise ConfigError(f"{what} {p}: not {kind} (a single .npy array, not an .npz archive)")
    if not head.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # numpy calls anything else a pickle
        raise ConfigError(f"{what} {p}: not {kind} (not a numpy .npz archive: it starts with {head!r})")
    try:
        return np.load(p, allow_pickle=False)
    except Exception as err:  # truncated, not a zip, not numpy
        raise ConfigError(f"{what} {p}: not {kind} ({numpy_reason(err)})") from None


def regular_size(path: str | os.PathLike, where: str) -> int:
    """The size of ``path``, which must be a regular file; else one ConfigError line starting
    ``"{where}: "`` (``where`` names the file): missing or unreadable, or not a regular file. A FIFO
    is refused without being opened: opening one waits for a writer, and a FIFO given as a GGUF or
    a safetensors shard had hung ``llama info``, ``size``, ``tier write`` and ``convert``."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or type(exc).__name__}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where}: not a regular file (a FIFO, a device or a folder)")
    return st.st_size


def read_text(path: str | os.PathLike, where: str, *, max_bytes: int, error: type[Exception] = ConfigError) -> str:
    """The UTF-8 text of the file ``path``, read only when it is at most ``max_bytes`` long (a
    hostile file cannot fill memory). Every failure is one ``error`` line that starts ``"{where}: "``
    and names the file: missing or not a regular file (a FIFO is not opened, so nothing blocks), too
    large, or not UTF-8."""
    p = Path(path)
    name = p.name
    try:
        if not stat.S_ISREG(p.stat().st_mode):
            raise error(f"{where}: {name} is not a regular file")
        with open(p, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{where}: cannot read {name} ({exc.strerror or type(exc).__name__})") from None
    if len(data) > max_bytes:
        raise error(f"{where}: {name} is larger than {max_bytes:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: {name} is not UTF-8 text (byte {exc.start})") from None


def read_json(path: str | os.PathLike, where: str, *, max_bytes: int, error: type[Exception] = ConfigError):
    """The JSON value of the file ``path`` (:func:`read_text`'s bounds and refusals), or one
    ``error`` line naming the file when it is not valid JSON (with the line), nests deeper than
    Python parses, or holds an integer too long to convert. The value's type is the caller's to
    check."""
    name = Path(path).name
    text = read_text(path, where, max_bytes=max_bytes, error=error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: {name} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise error(f"{where}: {name} is nested too deeply to read as JSON") from None
    except ValueError as exc:  # Python's limit on an integer's digits
        raise error(f"{where}: {name} cannot be read as JSON ({str(exc).split(':')[0][:80]})") from None


def check_writable(path: str | os.PathLike, option: str = "--out") -> Path:
    """``path`` as a Path whose folder exists and which is not itself a folder, else a ConfigError.
    An existing path that is not a regular file (a device such as ``/dev/null``, a FIFO, a socket,
    or a link to one) is refused: the atomic write's rename would replace it with a file."""
    if os.fspath(path) == "-" or os.fspath(path).endswith(os.sep):  # not stdout; Path() would drop the slash
        raise ConfigError(f"{option} {os.fspath(path)}: expected a file name" + (
            " (writing to stdout is not supported)" if os.fspath(path) == "-" else ", not a folder"))
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{option} {path}: {parent} is a file, not a folder")
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: folder {parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a folder, expected a file name")
    if not os.access(parent, os.W_OK | os.X_OK):  # a read-only mount refuses root too: said before any work
        raise ConfigError(f"{option} {path}: folder {parent} is not writable")
    check_special(path, option)
    return path


def check_special(path: str | os.PathLike, option: str = "--out") -> None:
    """Refuse an output ``path`` that exists and is neither a regular file nor a folder (a device
    such as ``/dev/null``, a FIFO, a socket, or a link to one): an atomic write's rename would
    replace it with a file."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{option} {path}: cannot write ({getattr(exc, 'strerror', None) or exc})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ConfigError(f"{option} {path}: exists and is not a regular file (a device, FIFO or socket); "
                          "refusing to replace it, choose a file name")


_FOLDER_INPUT_NAMES = ("routing.npz", "config.json", "manifest.json", "chunks.json", "generation_config.json",
                       "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                       "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_FOLDER_INPUT_SUFFIXES = (".safetensors", ".bin", ".index.json")
"""Files of an input folder that an output may not replace: a trace folder's routing.npz, a
checkpoint's config, weights, shard index, tokenizer and generation files, an expert pool's manifest,
a chunked trace's index (other files of an input folder, e.g. earlier outputs, may be)."""


def overwritten_input(path: str | os.PathLike, inputs) -> str | None:
    """Which input writing the file ``path`` would replace ('the input X', 'a file of the input
    folder X'), else None.

    An existing ``path`` that is one of ``inputs`` (the same file: equal, a hard link or a
    symbolic link), or the routing.npz, config.json or weights file of an input folder. A path
    that does not exist yet replaces nothing; so does a folder (the commands that write folders
    check them themselves).
    """
    try:
        out = os.stat(path)
    except (OSError, ValueError):  # missing, or not a valid path (a NUL byte): nothing to destroy
        return None
    if stat.S_ISDIR(out.st_mode):
        return None
    target = Path(path)
    for inp in inputs:
        try:
            st = os.stat(inp)
        except (OSError, ValueError, TypeError):
            continue
        if (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino):
            return f"the input {os.fspath(inp)}" + ("" if os.fspath(inp) == os.fspath(path) else " (the same file)")
        if stat.S_ISDIR(st.st_mode) and (target.name in _FOLDER_INPUT_NAMES
                                         or target.name.endswith(_FOLDER_INPUT_SUFFIXES)):
            with contextlib.suppress(OSError):
                if os.path.samefile(target.parent if str(target.parent) else ".", inp):
                    return f"a file of the input folder {os.fspath(inp)}"
    return None


def check_not_input(path: str | os.PathLike, inputs, option: str = "--out") -> None:
    """Refuse (a ConfigError) to write ``path`` when that would replace one of ``inputs``."""
    hit = overwritten_input(path, inputs)
    if hit is not None:
        raise ConfigError(f"{option} {path}: is {hit}; refusing to overwrite an input, choose another path")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, option: str = "--out", **kwargs) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success fsync it and rename it over ``path``.

    The folder must exist (a ConfigError naming it otherwise; ``option`` names the option that
    gave the path). Stale temporaries of the same target left by dead processes are removed first.
    A ``path`` that is a symbolic link is written through: the file it points to is replaced and the
    link stays (renaming over the link itself had turned ``/dev/stdout``, run as root with stdout
    sent to a file, into a regular file for every later process).
    """
    if os.path.islink(path):
        path = os.path.realpath(path)
    path = check_writable(path, option)
    clean_stale_temporaries(path)
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for any file
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write ({exc.strerror or exc})") from None
    try:
        with pending(tmp), os.fdopen(fd, mode, **kwargs) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if exc.errno in _FULL:  # the write itself failed: say which output (zipfile's close named no file)
            raise ConfigError(f"{option} {path}: cannot write it ({exc.strerror or exc})") from None
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def temporary_name(path: Path, suffix: str = "tmp") -> Path:
    """A fresh temporary's name beside ``path``: ``.<name>.<pid>.<8 hex>.<suffix>``; ``suffix`` is
    ``tmp`` (a file or folder being written), ``partial`` (a chunked trace being written) or ``old``
    (a folder moved aside before it is removed)."""
    parent = path.parent if str(path.parent) else Path(".")
    return parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}"


@contextlib.contextmanager
def pending(tmp: str | os.PathLike) -> Iterator[None]:
    """While the block runs, ``tmp`` is one of this process's temporaries being written:
    :func:`remove_pending` removes it where the process ends without unwinding its stack."""
    _PENDING.add(os.fspath(tmp))
    try:
        yield
    finally:
        _PENDING.discard(os.fspath(tmp))


def remove_pending() -> None:
    """Remove every temporary this process is writing now. For an end that runs no ``finally``
    (``os._exit`` from ggml's abort callback, :func:`expertcache.llama.ggml.abort_in_one_line`):
    an abort inside llama.cpp's quantizer had left its ``.tmp`` until the next write to the target."""
    for tmp in list(_PENDING):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _PENDING.clear()


def clean_stale_temporaries(path: Path, *suffixes: str) -> list[Path]:
    """Remove the temporaries of ``path`` (:func:`temporary_name`'s, with one of ``suffixes``,
    default ``tmp``: files, or folders and what they hold) whose process is gone, in one pass over
    the folder; returns them."""
    suffixes = suffixes or ("tmp",)
    parent = path.parent if str(path.parent) else Path(".")
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            m = _TEMP.fullmatch(entry.name)
            if (m is None or m.group("name") != path.name or m.group("suffix") not in suffixes
                    or _alive(int(m.group("pid")))):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # our own: another write of this process may be under way
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
