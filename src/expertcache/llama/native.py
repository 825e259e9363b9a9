"""llama.cpp's own completion API, ``POST /completion`` (docs/serve.md, "llama.cpp's /completion"),
as llama-server answers it: the request becomes the ``/v1/completions`` request that asks the same
(:func:`to_completion`), decoded by that endpoint's code, and the answer takes llama-server's shape
(:func:`answer`, :func:`chunk`).

* **llama.cpp's defaults**, not OpenAI's: ``n_predict`` -1 (until the end of generation or of the
  context), ``temperature`` 0.8, ``top_k`` 40, ``top_p`` 0.95, ``min_p`` 0.05, ``seed`` -1 (a
  seed drawn per request).
* **Fields passed on as they are** (:data:`PASSED`): the sampling fields both APIs share under one
  name, and llama.cpp's the server serves or refuses (``min_p``, ..., ``dry_multiplier``; the
  chat endpoint's checks name them); ``json_schema`` becomes ``response_format``.
* **Refused, never ignored**: ``n_predict`` 0 (llama.cpp evaluates the prompt only), several
  prompts or a prompt of mixed texts and ids, a ``logit_bias`` entry by a token's text or
  ``false``, ``return_tokens``, ``n_probs``; ``cache_prompt`` is taken (the KV cache keeps the
  previous prompt's prefix either way but where a seed is given: :mod:`.completion`).
* **The answer**: ``content``, ``stop`` (true), ``stop_type`` (``eos``, ``word`` with its
  ``stopping_word``, or ``limit``: ``n_predict`` or the context reached), ``tokens_predicted``,
  ``tokens_evaluated`` (the prompt's tokens), ``tokens_cached`` (those the KV cache kept),
  ``truncated`` (false: a prompt the context cannot hold is refused), ``generation_settings``,
  ``prompt`` and ``timings`` (``prompt_n`` and ``prompt_ms``: the tokens evaluated and their
  forwards' time; ``predicted_n`` and ``predicted_ms``: the tokens sampled and the decode steps'
  forwards). Streamed: a ``data:`` event per piece of text (``stop`` false), then the answer with
  ``content`` empty and ``stop`` true; no ``[DONE]``, as llama-server streams it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from . import MAX_SEED, dialect

LLAMA_UNSERVED = {"repeat_last_n": (64,), "dynatemp_range": (0,), "xtc_probability": (0,), "dry_multiplier": (0,),
                  "top_n_sigma": (-1,), "grammar": ("",), "n_probs": (0,), "ignore_eos": (False,), "samplers": ()}
"""llama.cpp's sampling fields this server does not implement, and the values of each that change
nothing (its defaults; ``repeat_last_n`` 64 is llama-cpp-python's fixed window): any other is a 400
naming the field, never ignored (on every completion and chat endpoint)."""
PASSED = ("model", "presence_penalty", "frequency_penalty", "stop", "min_p", "typical_p", "repeat_penalty", "mirostat",
          "mirostat_tau", "mirostat_eta", *LLAMA_UNSERVED)
"""Fields of a ``/completion`` request passed on to the ``/v1/completions`` request as they are."""
RENAMED = ((r"^max_tokens\b", "n_predict"), (r"^response_format", "json_schema"))
"""The ``/v1/completions`` request's fields a ``/completion`` request names otherwise (:func:`asked_fields`)."""


class Request(BaseModel):
    """The fields :func:`to_completion` reads itself (the others: :data:`PASSED`); unknown fields
    ignored, known ones typed strictly, as the OpenAI endpoints'."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str | list[int]
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    seed: int = Field(-1, ge=-1, le=MAX_SEED)
    stream: bool = False
    logit_bias: list[list[int | float]] | dict[str, float] | None = None
    json_schema: dict | None = None
    cache_prompt: bool = True
    return_tokens: bool = False
    id_slot: int = Field(-1, ge=-1, le=0)


def to_completion(req: Request, n_ctx: int) -> dict:
    """The ``/v1/completions`` request that asks what ``req`` asks (module docstring); a ValueError
    ``"FIELD: why"`` for what is refused."""
    if req.n_predict == 0:
        raise ValueError("n_predict: 0 (the prompt evaluated, nothing generated) is not served; ask 1 or more, "
                         "or -1 for the rest of the context")
    if req.return_tokens:
        raise ValueError("return_tokens: the generated token ids are not served; ask /tokenize with the content")
    body = {name: (req.model_extra or {})[name] for name in PASSED if name in (req.model_extra or {})}
    bias = req.logit_bias
    if isinstance(bias, list):
        if any(len(pair) != 2 or not isinstance(pair[0], int) or isinstance(pair[1], bool) for pair in bias):
            raise ValueError("logit_bias: each entry is [token id, bias] (a token by its text, or false, is not "
                             "served)")
        bias = {str(token): value for token, value in bias}
    body.update(prompt=req.prompt, max_tokens=n_ctx if req.n_predict == -1 else req.n_predict,
                temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, stream=req.stream,
                seed=None if req.seed == -1 else req.seed)
    if bias is not None:
        body["logit_bias"] = bias
    if req.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                          "schema": req.json_schema}}
    return body


def asked_fields(text: str) -> str:
    """An error message (or its ``param``) about the ``/v1/completions`` request, its leading field
    named as the ``/completion`` request names it (the dialects' rule: :func:`~.dialect.asked_fields`)."""
    return dialect.asked_fields(text, [], RENAMED)


def settings(req: Request, body) -> dict:
    """``generation_settings``: what the decode was asked, in llama.cpp's names."""
    return {"n_predict": req.n_predict, "temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p,
            "min_p": body.min_p, "typical_p": body.typical_p, "repeat_penalty": body.repeat_penalty,
            "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "mirostat": body.mirostat, "mirostat_tau": body.mirostat_tau, "mirostat_eta": body.mirostat_eta,
            "seed": req.seed, "stop": [body.stop] if isinstance(body.stop, str) else body.stop or [],
            "stream": req.stream, "cache_prompt": req.cache_prompt}


def chunk(piece: str) -> dict:
    """A streamed piece of text, as llama-server sends it before the end."""
    return {"index": 0, "content": piece, "tokens": [], "stop": False, "id_slot": 0}


def answer(model_id: str, text: str, ended: str | None, stopping_word: str | None, usage: dict, figures: dict,
           cached: int, prompt_text: str, generation_settings: dict, streamed: bool = False) -> dict:
    """The answer (module docstring): ``text`` the whole text, ``ended`` the decode's end (``stop``,
    ``length``, ``context``), ``usage`` the OpenAI usage, ``figures`` the request's forwards
    (:func:`~.textgen.request_figures`); ``streamed``: the stream's last event (its ``content`` empty:
    the events before it carried the text)."""
    stop_type = ("word" if stopping_word else "eos") if ended == "stop" else "limit"
    prompt_n, prompt_s = figures.get("prefill_tokens") or 0, figures.get("prefill_seconds") or 0.0
    predicted_n, predicted_s = usage["completion_tokens"], figures.get("decode_seconds") or 0.0
    return {"index": 0, "content": "" if streamed else text, "tokens": [], "id_slot": 0, "stop": True, "model": model_id,
            "tokens_predicted": predicted_n, "tokens_evaluated": usage["prompt_tokens"], "tokens_cached": cached,
            "generation_settings": generation_settings, "prompt": prompt_text, "has_new_line": "\n" in text,
            "truncated": False, "stop_type": stop_type, "stopping_word": stopping_word or "",
            "timings": {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_s * 1000,
                        "prompt_per_token_ms": prompt_s * 1000 / prompt_n if prompt_n else None,
                        "prompt_per_second": prompt_n / prompt_s if prompt_s else None,
                        "predicted_n": predicted_n, "predicted_ms": predicted_s * 1000,
                        "predicted_per_token_ms": predicted_s * 1000 / predicted_n if predicted_n else None,
                        "predicted_per_second": predicted_n / predicted_s if predicted_s else None}}
