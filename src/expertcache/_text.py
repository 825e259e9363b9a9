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


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could begin one of ``stops``: a stop sequence, a tag (the
    longest proper prefix of one that ``text`` ends with; 0 if none)."""
    best = 0
    if not text:
        return 0
    last = text[-1]
    for s in stops:
        for i in range(min(len(s) - 1, len(text)), best, -1):
            if s[i - 1] == last and text.endswith(s[:i]):
                best = i
                break
    return best


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """An exception's message as one line (its first, cut to ``limit`` characters), else its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def short(x: object, limit: int = 60) -> str:
    """A bounded repr for messages. A value Python cannot print is named by its type: a structure
    nested too deeply (``RecursionError``), or an integer of more digits than Python converts
    (``ValueError``, ``sys.get_int_max_str_digits``), alone or inside a list."""
    try:
        text = repr(x)
    except RecursionError:
        return f"<deeply nested {type(x).__name__}>"
    except ValueError:
        return f"<{type(x).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
