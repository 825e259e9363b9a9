"""Checks of single values read from a routing record, each failing with one line that names
``file:line`` and the field.

Invariants of what passes: integers are Python ``int`` (never ``bool``, never a float); indices
(token, layer) lie in ``[0, 2**31)``; expert ids lie in ``[0, min(num_experts, MAX_EXPERTS))``
with no id twice in one list; gate weights are finite, non-negative and representable as float32.
"""

from __future__ import annotations

import math

from ..._text import short  # noqa: F401 (importers take it from here with the other value checks)
from ...errors import ConfigError, TraceError, is_int
from ..validate import MAX_EXPERTS
from .records import HugeInt
INT32_MAX = (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38
_SEQ_LIMIT = 1 << 63


def _huge(x: object, field: str, where: str) -> None:
    if isinstance(x, HugeInt):
        raise TraceError(f"{where}: field '{field}': {x!r} is out of range")


def check_num_experts(num_experts: int | None) -> int | None:
    if num_experts is not None and not (is_int(num_experts) and 0 < num_experts <= MAX_EXPERTS):
        raise ConfigError(f"--num-experts: {num_experts!r} is outside [1, {MAX_EXPERTS}] (MAX_EXPERTS)")
    return num_experts


def index_value(x: object, field: str, where: str) -> int:
    """A token index or layer id: an integer in ``[0, 2**31)``."""
    _huge(x, field, where)
    if not is_int(x):
        raise TraceError(f"{where}: field '{field}' must be an integer, got {short(x)}")
    if not 0 <= x <= INT32_MAX:
        raise TraceError(f"{where}: field '{field}': {short(x)} is outside [0, 2^31)")
    return x


def seq_value(x: object, field: str, where: str) -> int | str:
    """A sequence id: a string or an integer that fits in 64 bits."""
    if isinstance(x, str):
        return x
    _huge(x, field, where)
    if not is_int(x):
        raise TraceError(f"{where}: field '{field}' must be an integer or a string, got {short(x)}")
    if not -_SEQ_LIMIT <= x < _SEQ_LIMIT:
        raise TraceError(f"{where}: field '{field}': {short(x)} does not fit in 64 bits")
    return x


def id_list(x: object, field: str, where: str, num_experts: int | None) -> list[int]:
    """A non-empty list of distinct expert ids in ``[0, limit)``."""
    limit = num_experts if num_experts is not None else MAX_EXPERTS
    if not isinstance(x, list) or not x:
        raise TraceError(f"{where}: field '{field}' must be a non-empty list of expert ids, got {short(x)}")
    for v in x:
        if type(v) is not int or not 0 <= v < limit:  # bool and HugeInt are not int
            _huge(v, field, where)
            if not is_int(v):
                raise TraceError(f"{where}: field '{field}': expert id {short(v)} is not an integer")
            what = f"--num-experts {num_experts}" if num_experts is not None else f"MAX_EXPERTS = {MAX_EXPERTS}"
            raise TraceError(f"{where}: field '{field}': expert id {short(v)} is outside [0, {limit}) ({what})")
    if len(set(x)) != len(x):
        raise TraceError(f"{where}: field '{field}': an id appears twice in {short(x)}")
    return x


def prob_list(x: object, n: int, field: str, where: str) -> list[float]:
    """``n`` finite, non-negative gate weights that fit in float32."""
    if not isinstance(x, list) or len(x) != n:
        raise TraceError(f"{where}: field '{field}' must be a list of {n} numbers (one per expert id), got {short(x)}")
    for v in x:
        if type(v) not in (float, int) or not 0 <= v <= FLOAT32_MAX:  # NaN fails the comparison
            _huge(v, field, where)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TraceError(f"{where}: field '{field}': {short(v)} is not a number")
            if isinstance(v, float) and not math.isfinite(v):
                raise TraceError(f"{where}: field '{field}': non-finite value {v} (gate weights must be finite)")
            raise TraceError(f"{where}: field '{field}': {short(v)} is outside [0, float32 max] (gate weights are non-negative)")
    return x


def layer_key(key: str, field: str, where: str) -> int:
    """A layer id written as a JSON object key (``"0"``, ``"12"``)."""
    if not (key.isascii() and key.isdigit() and len(key) <= 10):
        raise TraceError(f"{where}: field '{field}': layer key {short(key)} is not a non-negative integer")
    return index_value(int(key), field, where)


def field(rec: dict, name: str, where: str) -> object:
    """``rec[name]``, or an error saying the field is missing."""
    if name not in rec:
        raise TraceError(f"{where}: missing field '{name}' (set the field names with the --*-field options)")
    return rec[name]


def check_phase(phase: str) -> str:
    from ..validate import PHASES

    if phase not in PHASES:
        raise ConfigError(f"--phase: {phase!r} is not one of {', '.join(PHASES)}")
    return phase
