"""What the server's dialects share (:data:`~.server.DIALECTS`: :mod:`.anthropic`, :mod:`.responses`):
the template variables their thinking options set, the chat endpoint's fields they pass on, and
the naming of a chat request's error in the terms of the request as it was asked."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

THINKING_VARIABLES = ("enable_thinking", "thinking")
"""Template variables that switch a model's thinking on or off (Qwen3's, GLM's and Gemma's
``enable_thinking``; DeepSeek-V3.1's and Kimi's ``thinking``): a dialect's thinking option sets
those the chat template reads."""
EFFORT_VARIABLE = "reasoning_effort"
"""The template variable of a model's reasoning effort (gpt-oss's ``low``, ``medium``, ``high``)."""
EXTENSIONS = ("seed", "presence_penalty", "frequency_penalty", "logit_bias", "reasoning_format", "chat_template_kwargs")
"""The chat endpoint's own fields a dialect's request may carry too (llama.cpp's server takes
``chat_template_kwargs`` so): passed on as they are and checked there."""
CallId = Annotated[str, Field(min_length=1, max_length=256)]
"""A tool call's id, as a request sends it back."""
FunctionName = Annotated[str, Field(min_length=1, max_length=64)]
"""A called function's name, as a request sends it back (a name no tool has is the template's to show)."""
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
"""A tool's name, as every API declares one (OpenAI's rule: letters, digits, ``_`` and ``-``, up to 64)."""
_MESSAGE = re.compile(r"^messages(?:\.|\[)(\d+)\]?")


class Part(BaseModel):
    """A dialect request's part: unknown fields ignored (``cache_control``, ``citations``, new
    options of the dialect's clients), known ones typed strictly, as the chat endpoint's are."""

    model_config = ConfigDict(extra="ignore", strict=True)


class Passed(Part):
    """A dialect's request with the chat endpoint's fields it passes on (:data:`EXTENSIONS`, checked
    there: :func:`pass_on`); other fields it does not name are kept (:meth:`asked`) for the dialect
    to refuse those that would change the answer."""

    model_config = ConfigDict(extra="allow", strict=True)

    def asked(self, name: str):
        """The request's field ``name`` that no field of the model names (None: not given)."""
        return (self.model_extra or {}).get(name)

    seed: object = None
    presence_penalty: object = None
    frequency_penalty: object = None
    logit_bias: object = None
    reasoning_format: object = None
    chat_template_kwargs: object = None


def pass_on(req, body: dict, variables: dict, names: tuple = EXTENSIONS) -> dict:
    """``body`` (the chat request made of ``req``) given ``req``'s ``names`` that are set, and the
    template ``variables`` its options set, under the request's own ``chat_template_kwargs``."""
    for name in names:
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if variables:
        own = req.chat_template_kwargs
        body["chat_template_kwargs"] = {**variables, **own} if isinstance(own, dict) else own or variables
    return body


def asked_fields(text: str, origins: list[str], renamed: tuple) -> str:
    """An error message about the chat request a dialect made, its leading field named as the
    request was asked: ``messages[I]`` as ``origins[I]`` (where the I-th chat message came from),
    else the first of ``renamed`` (``(pattern, replacement)`` over the message's start) that
    matches."""
    m = _MESSAGE.match(text)
    if m is not None:
        i = int(m.group(1))
        return (origins[i] if i < len(origins) else m.group(0)) + text[m.end():]
    for pattern, theirs in renamed:
        new, n = re.subn(pattern, theirs, text, count=1)
        if n:
            return new
    return text
