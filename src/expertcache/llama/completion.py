"""The streamed completion loop of ``expertcache llama generate`` and ``expertcache serve``: one chunk
per sampled token, its text decoded incrementally.

llama-cpp-python's own streamed completion (``Llama.create_completion(stream=True)``) holds back
every piece from the first byte that is not valid UTF-8 on, and then tries every prefix of the
held tokens on each new one: on a byte-level vocabulary (whose single-byte tokens can form invalid
sequences) a greedy 1,000-token completion of a toy model took 174 s, 2.9 s for 250 tokens, and no
piece was yielded while it stalled, so a server could not see its client leave. This loop samples
the same tokens (``Llama.generate`` with the same arguments, the same seed rule, the same stop on an
end-of-generation token) and decodes them with an incremental UTF-8 decoder instead.

Invariants (``tests/test_serve.py``):

* **One chunk per sampled token** (its text may be empty: bytes of an unfinished character, or text
  that could begin a stop sequence, are held back), then a last chunk with ``finish_reason``:
  ``stop`` (an end-of-generation token, a stop sequence or the chat template's stopping criteria)
  or ``length`` (``max_tokens``). So a consumer can stop it between any two tokens.
* **The text is the tokens' bytes decoded as UTF-8**, bytes that are not UTF-8 replaced with
  U+FFFD (llama-cpp-python dropped them), cut before the first stop sequence; the pieces joined are
  that text. Per token the work is bounded by the stop sequences' lengths, not by the text so far.
* **Chunks have llama-cpp-python's shape** (``text_completion`` chunks), so its chat handlers (the
  model's template, or a named ``chat_format``) run on top unchanged: :func:`stream_chat` gives a
  handler a ``llama`` whose ``create_completion`` is this loop (:class:`_Completer`).
* A prompt that is empty or leaves no room in the context raises :class:`PromptError` at the first
  ``next``, before anything is evaluated.
* The stop sequence that ended a decode is ``llm.stop_sequence`` once it has ended (None: none
  did), as Anthropic's ``stop_sequence`` reports it; :func:`count_prompt` counts a chat's prompt
  without decoding it.
"""

from __future__ import annotations

import codecs
import inspect
import json
import random
import time
import uuid

import jinja2
import jinja2.meta
import jinja2.sandbox
import llama_cpp

from .._text import held_back

UNSERVED = ("suffix", "logprobs", "echo", "logit_bias")
"""``create_completion`` options this loop does not implement: a call setting any of them goes to
llama-cpp-python's own loop."""


class PromptError(ValueError):
    """A prompt the model cannot take; ``code`` is OpenAI's error code for it, or None."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def stream_completion(llm: llama_cpp.Llama, prompt, *, max_tokens: int | None = 16, temperature: float = 0.8,
                      top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0, stop=None,
                      frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                      top_k: int = 40, seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                      mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                      stopping_criteria=None, stream: bool = True, logits_processor=None, grammar=None,
                      preserved: frozenset = frozenset()):
    """Yield ``text_completion`` chunks of ``prompt`` (a string, or token ids as a chat handler gives
    them) continued by ``llm`` (module docstring). The arguments are ``Llama.create_completion``'s,
    with its defaults; ``preserved``: special tokens written into the text all the same
    (:func:`preserved_tokens`)."""
    if isinstance(prompt, str):
        tokens = llm.tokenize(prompt.encode("utf-8"), special=True) if prompt else []
    else:
        tokens = [int(t) for t in prompt]
    if not tokens:
        raise PromptError("the prompt is empty")
    n_ctx = min(llm.n_ctx(), len(llm.input_ids))  # the Llama's own context: llama.cpp pads its to 256
    if len(tokens) >= n_ctx:
        raise PromptError(f"Requested tokens ({len(tokens)}) exceed context window of {n_ctx}",
                          "context_length_exceeded")
    if max_tokens is None or max_tokens <= 0 or max_tokens + len(tokens) >= n_ctx:
        max_tokens = n_ctx - len(tokens)
    stops = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]
    # llama-cpp-python's seed rule: a given seed, else one drawn from the model's own seed
    llm.set_seed(seed if seed is not None else random.Random(llm._seed).randint(0, 2**32))
    if seed is not None:  # the whole prompt evaluated, as by a fresh process: a prefix kept from the
        llm.reset()  # request before is evaluated in another batch shape, which moves the logits slightly,
        # and a seeded sample then depended on what was served before (1 of 40 prompts at temperature 2)
    cid, created, name = f"cmpl-{uuid.uuid4()}", int(time.time()), model or llm.model_path

    def chunk(text: str, finish: str | None) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    llm.stop_sequence = None  # the stop sequence that ends this decode, once one does
    completion: list[int] = []
    pending = ""  # decoded, not yet yielded (it could begin a stop sequence)
    finish, cut = "length", -1
    vocab = llm._model.vocab
    for token in llm.generate(tokens, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temperature,
                              tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                              mirostat_eta=mirostat_eta, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, repeat_penalty=repeat_penalty,
                              stopping_criteria=stopping_criteria, logits_processor=logits_processor,
                              grammar=grammar):
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            finish = "stop"
            break
        piece = llm.detokenize([token], prev_tokens=tokens + completion, special=token in preserved)
        completion.append(token)
        pending += decoder.decode(piece)
        cut = _first_stop(pending, stops)
        if cut >= 0:
            break
        keep = held_back(pending, stops)
        out, pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        yield chunk(out, None)
        if len(completion) >= max_tokens:
            break
    if cut < 0:  # the end: an unfinished character's bytes, then the stop sequences once more
        pending += decoder.decode(b"", final=True)
        cut = _first_stop(pending, stops)
    if cut >= 0:
        llm.stop_sequence = next(s for s in stops if pending.find(s) == cut)
        pending, finish = pending[:cut], "stop"
    elif stopping_criteria is not None and stopping_criteria(llm._input_ids, llm._scores[-1, :]):
        finish = "stop"  # as llama-cpp-python ends: the template's stop token was the last
    if pending:
        yield chunk(pending, None)
    yield chunk("", finish)


def preserved_tokens(llm: llama_cpp.Llama, markers) -> frozenset[int]:
    """The ids of ``markers`` (the tags a chat's text is read by: ``<think>``, ``<tool_call>``, ...)
    that the vocabulary holds as one special token, which llama.cpp leaves out of the text it
    writes (a control token). llama.cpp's server writes such tokens all the same for the chat
    formats it reads (its ``preserved_tokens``); so does :func:`stream_completion` given these."""
    out = set()
    for marker in markers:
        ids = llm.tokenize(marker.encode("utf-8"), add_bos=False, special=True)
        if len(ids) == 1 and llama_cpp.llama_vocab_is_control(llm._model.vocab, ids[0]):
            out.add(ids[0])
    return frozenset(out)


def _first_stop(text: str, stops: list[str]) -> int:
    """Where the first of ``stops`` begins in ``text`` (-1: none does)."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


class _Completer:
    """The ``llama`` a llama-cpp-python chat handler is given by :func:`stream_chat`: ``llm`` in all but
    ``create_completion``, which streams through :func:`stream_completion` (a call with an option of
    :data:`UNSERVED`, or not streamed, goes to ``llm``'s own)."""

    def __init__(self, llm: llama_cpp.Llama, preserved: frozenset = frozenset(),
                 reopen: tuple[str, str] | None = None):
        self._llm, self._preserved, self._reopen = llm, preserved, reopen

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def reopened(self, prompt):
        """``prompt`` (token ids) given ``reopen``'s text where it ends in its ``ended`` text."""
        if self._reopen is not None and isinstance(prompt, list) and prompt:
            ended, more = self._reopen  # a prompt ending in `ended` (the template left no turn open) gets `more`
            tail = self._llm.detokenize(prompt[-8:], special=True).decode("utf-8", errors="replace")
            if tail.endswith(ended):
                prompt = prompt + self._llm.tokenize(more.encode("utf-8"), add_bos=False, special=True)
        return prompt

    def create_completion(self, prompt, **kw):
        prompt = self.reopened(prompt)
        if not kw.get("stream") or any(kw.get(k) not in (None, False) for k in UNSERVED):
            return self._llm.create_completion(prompt, **kw)
        return stream_completion(self._llm, prompt, preserved=self._preserved,
                                 **{k: v for k, v in kw.items() if k not in UNSERVED})


def _chat_handler(llm: llama_cpp.Llama):
    """The chat handler ``Llama.create_chat_completion`` would pick: a given ``chat_format``'s, else
    the GGUF's template's."""
    return (llm.chat_handler or llm._chat_handlers.get(llm.chat_format)
            or llama_cpp.llama_chat_format.get_chat_completion_handler(llm.chat_format))


def stream_chat(llm: llama_cpp.Llama, messages: list[dict], preserved: frozenset = frozenset(),
                reopen: tuple[str, str] | None = None, **kw):
    """Yield ``chat.completion.chunk`` chunks of ``messages`` answered by ``llm``: the chat handler
    :func:`_chat_handler` picks formats the prompt and converts the chunks; the tokens stream
    through :func:`stream_completion` (``preserved``: its). ``reopen``: ``(ended, more)``, a prompt
    whose text ends in ``ended`` is given ``more`` (Gemma 4's template ends a turn holding tool
    results and content without opening the next: :data:`~.toolcalls.GEMMA4_REOPEN`). Nothing runs
    before the first chunk is asked for; a template that refuses the messages (its ``raise_exception``: "System role not
    supported") is a :class:`PromptError` then, as a prompt too long for the context is."""
    try:
        chunks = _chat_handler(llm)(llama=_Completer(llm, preserved, reopen), messages=messages, stream=True, **kw)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:  # the formatting: the messages' fault
        raise PromptError(f"the chat template refused the messages: {str(exc)[:300]}") from None
    yield from chunks


class _Formatted(Exception):
    """Raised with the prompt a chat handler formatted, before anything is decoded."""


class _Formatter(_Completer):
    def create_completion(self, prompt, **kw):
        raise _Formatted(self.reopened(prompt))


def chat_prompt(llm: llama_cpp.Llama, messages: list[dict], reopen: tuple[str, str] | None = None,
                **kw) -> str | list[int]:
    """The prompt :func:`stream_chat` would evaluate for ``messages`` with the same arguments
    (``tools``, template variables): the text the chat handler formatted (or its token ids), nothing
    decoded; a :class:`PromptError` where the template refuses them."""
    try:
        _chat_handler(llm)(llama=_Formatter(llm, reopen=reopen), messages=messages, stream=True, **kw)
    except _Formatted as done:
        return done.args[0]
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise PromptError(f"the chat template refused the messages: {str(exc)[:300]}") from None
    raise PromptError("the chat handler asked for no completion")  # pragma: no cover - every handler asks


def prompt_tokens(llm: llama_cpp.Llama, prompt: str | list[int]) -> int:
    """The tokens of a prompt :func:`chat_prompt` gave, as :func:`stream_chat` evaluates it."""
    if isinstance(prompt, str):  # as stream_completion tokenizes it
        return len(llm.tokenize(prompt.encode("utf-8"), special=True)) if prompt else 0
    return len(prompt)


def count_prompt(llm: llama_cpp.Llama, messages: list[dict], reopen: tuple[str, str] | None = None, **kw) -> int:
    """The number of tokens :func:`stream_chat` would evaluate as the prompt of ``messages``
    (:func:`chat_prompt`)."""
    return prompt_tokens(llm, chat_prompt(llm, messages, reopen, **kw))


def template_reads(template: str | None) -> frozenset[str]:
    """The variables a chat template's source reads from its context (``enable_thinking``,
    ``messages``, ...: Jinja's undeclared variables); none for no template or one that does not parse."""
    if not template:
        return frozenset()
    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except (jinja2.TemplateError, RecursionError):
        return frozenset()


def _reserved_variables() -> frozenset[str]:
    """Names a chat template's extra variables may not take: the chat handler's own arguments
    (``temperature``, ``stop``, ``grammar``, ...: a variable of that name would set them) and what the
    template is rendered with (``messages``, ``eos_token``, ...)."""
    handler = llama_cpp.llama_chat_format.chat_formatter_to_chat_completion_handler(None)
    own = set(inspect.signature(handler).parameters) - {"kwargs"}
    return frozenset(own | {"eos_token", "bos_token", "raise_exception", "add_generation_prompt", "strftime_now"})


RESERVED_VARIABLES = _reserved_variables()


def template_variables(obj, where: str) -> dict:
    """``obj`` (a request's ``chat_template_kwargs``, the server's ``--chat-template-kwargs``) checked
    as variables the chat template is rendered with (``enable_thinking``: Qwen3's switch), as
    llama.cpp's server and vLLM take them; a ``ValueError`` naming ``where`` otherwise."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object of template variables, got {type(obj).__name__}")
    for key in obj:
        if not key.isidentifier() or key.startswith("_"):
            raise ValueError(f"{where}: {key[:64]!r} is not a template variable's name")
        if key in RESERVED_VARIABLES:
            raise ValueError(f"{where}: {key!r} is set by the server (the request's own field, or the template's "
                             "fixed input), not a template variable")
    return dict(obj)


ROLE_PROBE = "expertcache7role7probe"
"""The text of the probe messages of :func:`rendered_roles` (no space or markup a template would change)."""
PROBED_ROLES = {"system": [], "developer": [], "tool": [{"role": "user", "content": "x"}]}
"""The roles :func:`rendered_roles` asks about, each with the messages before its probe."""
PROBE_CALL = {"id": "call00000", "type": "function", "function": {"name": "probe", "arguments": "{}"}}
"""The call a ``tool`` probe answers where a template renders tool results only after their call
(Gemma 4's); its id 9 letters and digits, as Mistral's templates insist."""


def _formatted(handler, llm: llama_cpp.Llama, messages: list[dict]) -> str | None:
    """The prompt's text the chat handler makes of ``messages`` (nothing decoded), or None where the
    template refuses them."""
    try:
        handler(llama=_Formatter(llm), messages=messages, stream=True, max_tokens=1)
    except _Formatted as done:
        prompt = done.args[0]
        return prompt if isinstance(prompt, str) else llm.detokenize(list(prompt), special=True).decode(
            "utf-8", "replace")
    except Exception:  # the template's own refusal (jinja2 errors, ValueError, ...)
        return None
    return None  # pragma: no cover - every handler asks for a completion


def arguments_as_objects(llm: llama_cpp.Llama) -> bool:
    """Whether the chat template needs an assistant message's ``tool_calls[].function.arguments`` as
    an object where OpenAI's clients send its JSON text (GLM-4.5's iterates ``arguments.items()``;
    Qwen3's takes either): a probe call with text arguments does not reach the prompt, and with an
    object it does. llama.cpp's server asks templates the same question."""
    handler = _chat_handler(llm)

    def reaches(arguments) -> bool:
        call = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": arguments}}
        text = _formatted(handler, llm, [{"role": "user", "content": "x"},
                                         {"role": "assistant", "content": "", "tool_calls": [call]},
                                         {"role": "user", "content": "y"}])
        return text is not None and ROLE_PROBE in text
    return not reaches(json.dumps({ROLE_PROBE: 1})) and reaches({ROLE_PROBE: 1})


def rendered_roles(llm: llama_cpp.Llama) -> dict[str, bool | None]:
    """Per role of :data:`PROBED_ROLES`: whether the chat handler puts such a message's text into
    the prompt (a message of the role holding :data:`ROLE_PROBE`, then a user message, formatted
    and tokenized as a request would be, nothing decoded, the probe looked for in the prompt's
    text). llama-cpp-python's named formats (``chatml``, ...) map system, user and assistant and
    drop every other role without a word, as a template without a branch for a role does. ``None``:
    the handler refused the probe itself (a template that raises on that order), so it is not known.
    A ``tool`` message left out is asked again after an assistant message calling :data:`PROBE_CALL`,
    which it answers."""
    handler, out = _chat_handler(llm), {}
    for role, before in PROBED_ROLES.items():
        text = _formatted(handler, llm, before + [{"role": role, "content": ROLE_PROBE}, {"role": "user", "content": "y"}])
        out[role] = None if text is None else ROLE_PROBE in text
        if role == "tool" and out[role] is False:
            text = _formatted(handler, llm, before + [
                {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
                {"role": role, "content": ROLE_PROBE, "tool_call_id": PROBE_CALL["id"]},
                {"role": "user", "content": "y"}])
            out[role] = False if text is None else ROLE_PROBE in text
    return out
