"""Sizing: copies per token in the units a deployment is planned in (docs/sizing.md).

Inputs (each optional; every one given must be a positive finite number):

* ``expert_bytes`` ``S``: bytes of one expert's weights (``--expert-mb``, decimal: 1 MB = 1e6 bytes;
  or the trace meta key ``expert_bytes``; or a Hugging Face ``config.json`` via
  :func:`expert_bytes_from_config`);
* ``tau_ms`` ``tau``: milliseconds to copy one expert host-to-device (``--tau``);
* ``c_ms`` ``c``: milliseconds of compute per token with every expert resident (``--c``);
* ``tokens_per_s``: a decode rate to size the link for (``--tokens-per-s``).

Figures, for ``rho`` = steady copies per token over all offloaded layers (exactly
:attr:`~expertcache.sim.replay.ReplayResult.copies_per_token`); each is ``None`` when an input it
needs is missing:

* ``bytes_per_token = rho * S`` (bytes; tables show MB/token, 1 MB = 1e6 bytes);
* ``copy_ms_per_token = rho * tau``: the copy time alone;
* ``ms_per_token = c + rho * tau``: decode time when copies block compute (the eviction paper's
  Eq. (1)); needs ``c`` -- with only ``tau`` known, ``copy_ms_per_token`` is the figure;
* ``ms_per_token_overlapped = max(c, rho * tau)``: the limit when copies fully overlap compute;
* ``tokens_per_s_predicted = 1000 / ms_per_token``: the blocking decode rate;
* ``gbps_needed = bytes_per_token * rate / 1e9``: host-to-device GB/s (1 GB = 1e9 bytes) the copies
  need at ``rate`` = ``tokens_per_s`` when given, else ``tokens_per_s_predicted``;
* ``cache_bytes``: memory the cache itself holds: ``capacity * S * layers`` for per-layer pools
  (one pool of ``capacity`` per offloaded layer), ``capacity * S`` for one global pool.

Example (the paper's L40S, LRU): ``rho = 9.6``, ``S = 12.6 MB``, ``tau = 0.51 ms``,
``c = 1000/49 ms`` give 120.96 MB/token, 25.304 ms/token (20.408 overlapped), 39.52 tok/s and
4.780 GB/s at that rate.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from .._io import read_json
from ..errors import ConfigError, is_int, is_real
from ..trace.validate import MAX_EXPERT_BYTES

MB = 1e6
"""Bytes in one (decimal) megabyte."""
GB = 1e9
"""Bytes in one (decimal) gigabyte."""

OPTION = {"expert_bytes": "--expert-mb", "tau_ms": "--tau", "c_ms": "--c", "tokens_per_s": "--tokens-per-s"}
"""The command-line option that sets each input (error messages name it)."""

FIGURES = ("bytes_per_token", "gbps_needed", "copy_ms_per_token", "ms_per_token", "ms_per_token_overlapped",
           "tokens_per_s_predicted", "cache_bytes")
"""Names of the derived figures, in record order."""

INPUTS = ("expert_bytes", "tau_ms", "c_ms", "tokens_per_s")


LIMITS = {"expert_bytes": MAX_EXPERT_BYTES, "tau_ms": 3.6e6, "c_ms": 3.6e6, "tokens_per_s": 1e9}
"""Largest accepted inputs (10 TB per expert, an hour per copy or token, 1e9 tokens/s): beyond
them a figure would be noise or overflow, never a plan."""


@dataclass(frozen=True)
class SizingFigures:
    """The derived figures of one run (definitions in the module docstring); ``None`` = unknown."""

    bytes_per_token: float | None = None
    gbps_needed: float | None = None
    copy_ms_per_token: float | None = None
    ms_per_token: float | None = None
    ms_per_token_overlapped: float | None = None
    tokens_per_s_predicted: float | None = None
    cache_bytes: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Sizing:
    """What is known about the hardware and the model; validated once, here.

    ``Sizing()`` knows nothing and yields all-``None`` figures. See the module docstring for the
    inputs and :meth:`figures` for what they give.
    """

    expert_bytes: float | None = None
    tau_ms: float | None = None
    c_ms: float | None = None
    tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in INPUTS:
            value = getattr(self, name)
            if value is None:
                continue
            if not is_real(value) or value <= 0:
                raise ConfigError(f"{OPTION[name]} ({name}): expected a positive finite number, got {_short(value)}")
            if value > LIMITS[name]:
                raise ConfigError(f"{OPTION[name]} ({name}): {_short(value)} is above {LIMITS[name]:g}, "
                                  "not a plausible value")

    @property
    def empty(self) -> bool:
        """True when no input is known."""
        return all(getattr(self, n) is None for n in INPUTS)

    def inputs(self) -> dict:
        """The inputs, echoed into records (``None`` where unknown)."""
        return {n: getattr(self, n) for n in INPUTS}

    def figures(self, copies_per_token: float, *, capacity: int | None = None, num_layers: int | None = None,
                pool: str = "layer") -> SizingFigures:
        """The figures at ``rho = copies_per_token``; ``capacity`` (experts per pool), ``pool``
        (``"layer"`` or ``"global"``) and, for per-layer pools, ``num_layers`` give ``cache_bytes``."""
        S, tau, c = self.expert_bytes, self.tau_ms, self.c_ms
        cache = cache_bytes(capacity, S, pool=pool, num_layers=num_layers) if capacity is not None and S else None
        rho = float(copies_per_token)
        if not math.isfinite(rho) or rho < 0:  # no scored tokens: nothing per token is defined
            return SizingFigures(cache_bytes=cache)
        copy_ms = rho * tau if tau is not None else None
        ms = c + copy_ms if c is not None and copy_ms is not None else None
        overlapped = max(c, copy_ms) if ms is not None else None
        predicted = 1000.0 / ms if ms else None
        per_token = rho * S if S is not None else None
        rate = self.tokens_per_s if self.tokens_per_s is not None else predicted
        gbps = per_token * rate / GB if per_token is not None and rate is not None else None
        return SizingFigures(per_token, gbps, copy_ms, ms, overlapped, predicted, cache)

    def record(self, copies_per_token: float, **kwargs: Any) -> dict:
        """Inputs and figures as one flat dict (the JSON fields): see :meth:`figures`."""
        return self.inputs() | self.figures(copies_per_token, **kwargs).to_dict()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def cache_bytes(capacity: int, expert_bytes: float, *, pool: str = "layer", num_layers: int | None = None) -> float:
    """Memory the cache holds: ``capacity * expert_bytes`` per pool, times the number of layers for
    per-layer pools (``pool="layer"``), once for one global pool (``pool="global"``)."""
    if pool == "global":
        return capacity * expert_bytes
    if pool != "layer":
        raise ConfigError(f"pool: {pool!r} is not 'layer' or 'global'")
    if num_layers is None:
        raise ConfigError("cache_bytes: per-layer pools need the number of layers")
    return capacity * expert_bytes * num_layers


# ----------------------------------------------------------------------------- parsing inputs
_DURATION = re.compile(r"^\s*([0-9.eE+-]+)\s*(ms|us|\u00b5s|\u03bcs|ns|s)?\s*$", re.IGNORECASE)
_TO_MS = {"s": 1e3, "ms": 1.0, "us": 1e-3, "\u00b5s": 1e-3, "\u03bcs": 1e-3, "ns": 1e-6, None: 1.0}


def parse_duration_ms(text: str, option: str | None = None) -> float:
    """``'0.51ms'``, ``'510us'``, ``'0.00051s'`` or a bare number (milliseconds) -> milliseconds,
    a positive finite number; otherwise a one-line :class:`ConfigError` (naming ``option`` if given)."""
    where = f"{option}: " if option else ""
    m = _DURATION.match(str(text))
    try:
        value = float(m.group(1)) if m else math.nan
    except ValueError:
        value = math.nan
    if not m or not math.isfinite(value):
        raise ConfigError(f"{where}cannot read {text!r} as a duration (e.g. '0.51ms', '510us', '0.00051s'; "
                          "a bare number is milliseconds)")
    ms = value * _TO_MS[m.group(2).lower() if m.group(2) else None]
    if not ms > 0 or not math.isfinite(ms):
        raise ConfigError(f"{where}expected a positive duration, got {text!r}")
    if ms < MIN_DURATION_MS:  # 1e-300ms gave 8.7e301 tok/s; a denormal was c = 0
        raise ConfigError(f"{where}{text!r} is below 1 ns, not a plausible duration")
    if ms > MAX_DURATION_MS:  # choose --tau 1e300ms printed a 300-digit ms/token
        raise ConfigError(f"{where}{text!r} is above an hour, not a plausible copy or token time")
    return ms


MIN_DURATION_MS = 1e-6
"""Shortest duration accepted (1 ns)."""

MAX_DURATION_MS = LIMITS["tau_ms"]
"""Longest duration accepted (an hour, :data:`LIMITS`'s bound on a copy or a token)."""


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8": 1}
"""Bytes per weight of the ``torch_dtype``/``dtype`` names a config may hold."""


MAX_CONFIG_BYTES = 1 << 24
"""A model config larger than this is refused (real ones are a few kB)."""


def expert_bytes_from_config(path: str | Path) -> int:
    """Bytes of one routed expert from a Hugging Face ``config.json`` (or a folder holding one).

    Experts are gated MLPs of three ``hidden x intermediate`` matrices (w1/w2/w3, or gate/up/down),
    so ``bytes = 3 * hidden_size * intermediate * dtype_bytes`` with ``intermediate`` =
    ``moe_intermediate_size`` when present (Qwen2/3-MoE, DeepSeek), else ``intermediate_size``
    (Mixtral, OLMoE), and dtype from ``torch_dtype`` or ``dtype`` (bfloat16/float16 2 bytes,
    float32 4, float8 1). A ``quantization_config`` with ``quant_method: fp8`` (DeepSeek-V3) stores
    1 byte per weight (block scales left out). Keys are looked up at the top level, then in
    ``text_config``. Only the JSON is read. OLMoE-1B-7B: 3 * 2048 * 1024 * 2 = 12,582,912 bytes.
    """
    return expert_bytes_of(*read_model_config(path))


def read_model_config(path: str | Path, option: str = "--model-config") -> tuple[dict, str, str]:
    """``(config, where, name)``: the JSON object of a config.json (or of the config.json in the
    folder ``path``), at most :data:`MAX_CONFIG_BYTES` long; ``where`` (``OPTION PATH``: how the user
    named it) and the file's ``name`` for messages. Every refusal is one ConfigError line."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    where = f"{option} {path}"
    if not file.is_file():
        raise ConfigError(f"{where}: no such file" + (" (expected a config.json or a folder holding one)"
                                                      if not path.exists() else ": the folder holds no config.json"))
    config = read_json(file, where, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {file.name} is not a JSON object")
    return config, where, file.name


def expert_bytes_of(config: Mapping, where: str, name: str = "config.json") -> int:
    """:func:`expert_bytes_from_config` of a config already read (``where`` and ``name`` for messages)."""
    scopes = config_scopes(config, where)

    def get(*keys: str) -> tuple[str, Any]:
        for key in keys:
            for scope in scopes:
                if scope.get(key) is not None:
                    return key, scope[key]
        raise ConfigError(f"{where}: {name} has no {' or '.join(repr(k) for k in keys)}; "
                          "give the expert size with --expert-mb instead")

    def positive(key: str, value: Any) -> int:
        if not is_int(value, 1):
            raise ConfigError(f"{where}: {key} = {_short(value)} is not a positive integer")
        return value

    hidden = positive(*get("hidden_size"))
    intermediate = positive(*get("moe_intermediate_size", "intermediate_size"))
    quant = next((s["quantization_config"] for s in scopes if isinstance(s.get("quantization_config"), Mapping)), None)
    width = _weight_bytes(where, quant) if quant is not None else _dtype_bytes(where, *get("torch_dtype", "dtype"))
    size = 3 * hidden * intermediate * width
    if size > LIMITS["expert_bytes"]:
        raise ConfigError(f"{where}: experts of {size:.3g} bytes (hidden_size x intermediate) are not plausible")
    return size


def config_scopes(config: Mapping, where: str) -> list[Mapping]:
    """Where a config's keys are looked up: the top level, then ``text_config`` (multimodal configs
    nest the language model's there). A ``text_config`` or ``quantization_config`` that is not a
    table is a ConfigError (it had been passed over, exit 0)."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        raise ConfigError(f"{where}: text_config = {_short(text)} is not a table (a JSON object)")
    scopes = [config] + ([text] if text is not None else [])
    for scope in scopes:
        quant = scope.get("quantization_config")
        if quant is not None and not isinstance(quant, Mapping):
            raise ConfigError(f"{where}: quantization_config = {_short(quant)} is not a table (a JSON object)")
    return scopes


def _weight_bytes(where: str, quant: Mapping) -> int:
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return 1
    raise ConfigError(f"{where}: quantization_config quant_method {method or '?'!r} is not supported; "
                      "give the expert size with --expert-mb instead (for 'expertcache size', the quantized "
                      "model's GGUF or checkpoint folder as --model-config counts the non-expert weights too)")


def _dtype_bytes(where: str, key: str, name: Any) -> int:
    width = DTYPE_BYTES.get(str(name).lower().removeprefix("torch."))
    if width is None:
        raise ConfigError(f"{where}: {key} = {name!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    return width
