"""Progress bars for work longer than a few seconds: tqdm on stderr, off when nobody watches.

One entry point, :func:`progress`, so that every command shows progress the same way. The bar
goes to stderr (stdout stays a clean table or JSON stream) and is disabled when ``disable`` is
true (commands pass ``disable=args.json``) or when stderr is not a terminal (pipes, CI, tests):
then the returned object still iterates, accepts ``update`` calls and works as a context manager,
but prints nothing (a disabled tqdm does not count: read no numbers back from it).
"""

from __future__ import annotations

import sys
from typing import Iterable

from tqdm import tqdm


def progress(iterable: Iterable | None = None, *, total: int | float | None = None, desc: str | None = None,
             disable: bool = False) -> tqdm:
    """A tqdm bar over ``iterable`` (or a manual one, advanced by ``.update(n)``, of ``total`` steps).

    Usable as an iterator, as a context manager, and through ``.update()``/``.close()``. Writes
    to stderr; silent when ``disable`` is true or stderr is not a TTY.
    """
    stream = sys.stderr
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        tty = False
    return tqdm(iterable, total=total, desc=desc, file=stream, disable=bool(disable) or not tty,
                leave=False, dynamic_ncols=True, mininterval=0.5)
