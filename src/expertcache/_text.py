"""Small text helpers shared by messages and tables."""

from __future__ import annotations

from typing import Sequence


def id_ranges(ids: Sequence[int]) -> str:
    """Integers as compact runs: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (input order kept)."""
    parts, i = [], 0
    ids = list(ids)
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """An exception's message as one line (its first, cut to ``limit`` characters), else its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
