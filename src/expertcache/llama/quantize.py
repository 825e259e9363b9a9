"""GGUF -> GGUF quantization with llama.cpp's own ``llama_model_quantize`` (the library behind
``llama-quantize``, so its per-tensor recipes: Q4_K_M stores some layers' ``ffn_down`` as Q6_K).

``TYPE`` is a llama.cpp file type by its ``llama-quantize`` name (``q4_k_m``, ``q6_k``, ``iq4_nl``,
``mxfp4_moe``, ...): :func:`ftypes` reads them from the bindings' ``LLAMA_FTYPE_MOSTLY_*``
constants, nothing is listed here by hand. Types that need an importance matrix (IQ1, IQ2 and
Q2_K_S, which llama.cpp refuses without one) are refused in one line, as is a file llama.cpp cannot
read. The output is written to a temporary file beside it and renamed on success.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .._io import clean_stale_temporaries, pending, temporary_name
from ..errors import ConfigError
from .engine import _llama, _silence

NEEDS_IMATRIX = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "q2_k_s")
"""File types llama.cpp quantizes only with an importance matrix (llama-quantize refuses them
without one)."""


def ftypes() -> dict[str, int]:
    """llama.cpp file types by lower-case name (``q4_k_m`` -> 15), from the bindings."""
    ll = _llama()
    prefix = "LLAMA_FTYPE_MOSTLY_"
    return {name[len(prefix):].lower(): int(getattr(ll, name)) for name in dir(ll) if name.startswith(prefix)}


def check_type(qtype: str) -> int:
    """The llama.cpp file type id of ``qtype``, or a one-line refusal (unknown; needs an importance matrix)."""
    known = ftypes()
    name = qtype.lower()
    if name not in known:
        raise ConfigError(f"--quantize: {qtype!r} is not a llama.cpp file type (known: {', '.join(sorted(known))})")
    if name in NEEDS_IMATRIX:
        raise ConfigError(f"--quantize {qtype}: llama.cpp needs an importance matrix for this type; pick one that "
                          "does not (q4_k_m, q6_k, iq4_nl, iq4_xs, ...)")
    return known[name]


def quantize(src: str | os.PathLike, out: str | os.PathLike, qtype: str, *, threads: int = 0) -> dict:
    """Quantize the GGUF ``src`` to ``out`` as ``qtype``; returns ``{"out", "qtype", "bytes"}``."""
    ftype = check_type(qtype)
    name = qtype.lower()
    ll = _llama()
    _silence(ll, src)
    out = Path(out)
    clean_stale_temporaries(out)
    tmp = temporary_name(out)
    params = ll.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(threads)
    try:
        with pending(tmp):  # an abort inside llama.cpp removes it too (abort_in_one_line)
            rc = ll.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0 or not tmp.exists():
            raise ConfigError(f"--quantize {qtype}: llama.cpp could not quantize {src} (status {rc})")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"out": os.fspath(out), "qtype": name, "bytes": out.stat().st_size}
