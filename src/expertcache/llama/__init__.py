"""llama.cpp as an expertcache engine (docs/llama.md): GGUF expert geometry, HF -> GGUF conversion,
routing capture through llama.cpp's eval callback, and decode under a memory wall with the kernel
page cache as the expert tier, optionally advised by the router.

Modules, one concept each: ``geometry`` (the GGUF header and each expert's byte ranges, no
third-party reader), ``convert`` (HF checkpoint -> GGUF with the ``gguf`` package), ``ggml``
(the ctypes mirror of ``struct ggml_tensor``, its layout asserted against the loaded library),
``engine`` (a llama.cpp model and context driven through the low-level bindings), ``capture``
(router trace from the eval callback), ``advice`` (the page-cache modes), ``runner`` (one measured
run, in or out of a wall), ``sweep`` (tokens/s against the wall). ``llama_cpp`` (the ``llama``
extra) is imported only by ``ggml``, ``engine`` and what uses them.
"""

MAX_SEED = 2**31 - 1
"""Largest sampling seed (``llama generate --seed``, a request's ``seed``): llama.cpp's sampler seed
is 32-bit (a larger one aliases a smaller, and ``0xFFFFFFFF`` asks it for a random seed: another
text on every run), and OpenAI's ``seed`` is a signed 32-bit integer."""

KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}
"""The KV cache's element types llama.cpp's ``--cache-type-k`` / ``--cache-type-v`` take, by name, as
ggml's type numbers (``ggml.h``'s ``enum ggml_type``): ``serve`` and ``llama generate`` pass them to
the context (f16 is llama.cpp's default)."""
