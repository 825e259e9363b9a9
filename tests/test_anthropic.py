"""Anthropic's Messages API translation (:mod:`expertcache.llama.anthropic`) without a model: a
request becomes the chat request that asks the same, its messages traced back to the Anthropic
fields they come from; a stream's events, read back as Anthropic's client reads them, give the
message the non-streamed answer gives, block for block (a property test over the ways a decode's
pieces can fall). The server's answers through Anthropic's own client: ``tests/test_serve.py``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic", reason="pydantic (the serve extra's) is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from expertcache.llama import anthropic  # noqa: E402
from expertcache.llama.anthropic import EventStream, MessagesRequest, answer, asked_fields, to_chat  # noqa: E402


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})


def test_blocks_become_the_chat_messages_a_template_takes():
    """Text blocks are paragraphs; a tool's results are tool messages in block order, before the
    user's text; an assistant's thinking and calls are its ``reasoning_content`` and ``tool_calls``;
    every chat message knows the Anthropic field it comes from."""
    req = request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Ask the tool.", "signature": "s"},
                                          {"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                                          {"type": "tool_use", "id": "t2", "name": "w", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Both?"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "t2",
                                      "content": [{"type": "text", "text": "cold"}, {"type": "text", "text": "dry"}]}]}],
        tools=[{"name": "w", "description": "Weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"], top_k=5)
    chat, origins = to_chat(req)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "Ask the tool.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"id": "t2", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "cold\n\ndry"},
        {"role": "user", "content": "Both?"}]
    assert origins == ["system", "messages.0", "messages.1", "messages.2.content.1", "messages.2.content.2", "messages.2"]
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"},
                                                               "description": "Weather"}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["stop"], chat["top_k"]) == ("required", False, ["END"], 5)
    assert to_chat(request(messages=[{"role": "user", "content": "x"}], tools=req.model_dump()["tools"],
                           tool_choice={"type": "tool", "name": "w"}))[0]["tool_choice"] == \
        {"type": "function", "function": {"name": "w"}}
    assert asked_fields("messages[4].role: dropped", origins) == "messages.2.content.2.role: dropped"
    assert asked_fields("stop: at most 4", origins) == "stop_sequences: at most 4"
    assert asked_fields("tool_choice.function.name: none", origins) == "tool_choice.name: none"
    assert asked_fields("the context is 512 tokens", origins) == "the context is 512 tokens"


def test_the_thinking_switch_sets_only_what_the_template_reads():
    """``thinking`` enabled or disabled sets the switches among the template's variables, the
    request's own ``chat_template_kwargs`` over them; ``adaptive`` sets none; ``effort`` is gpt-oss's
    ``reasoning_effort`` where read."""
    msgs = [{"role": "user", "content": "x"}]
    reads = frozenset({"messages", "enable_thinking"})
    assert to_chat(request(messages=msgs, thinking={"type": "disabled"}), reads)[0]["chat_template_kwargs"] == \
        {"enable_thinking": False}
    assert "chat_template_kwargs" not in to_chat(request(messages=msgs, thinking={"type": "enabled",
                                                                                  "budget_tokens": 2048}))[0]
    assert to_chat(request(messages=msgs, thinking={"type": "enabled", "budget_tokens": 2048},
                           chat_template_kwargs={"enable_thinking": False, "x": 1}), reads)[0]["chat_template_kwargs"] \
        == {"enable_thinking": False, "x": 1}
    assert "chat_template_kwargs" not in to_chat(request(messages=msgs, thinking={"type": "adaptive"}), reads)[0]
    assert to_chat(request(messages=msgs, output_config={"effort": "max"}),
                   frozenset({"reasoning_effort"}))[0]["chat_template_kwargs"] == {"reasoning_effort": "high"}


@pytest.mark.parametrize("messages, says", [
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], "messages.0.content.0"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}], "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}], "messages.0.content.0"),
])
def test_a_block_in_the_wrong_message_is_refused_by_its_place(messages, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        to_chat(request(messages=messages))


def test_fields_that_would_change_the_answer_are_refused():
    for field in anthropic.UNSERVED:
        with pytest.raises(ValueError, match=f"^{field}: not served"):
            to_chat(request(messages=[{"role": "user", "content": "x"}], **{field: {"a": 1}}))


def read_events(text: str) -> list[tuple[str, dict]]:
    """Server-sent events ``(event, data)``, each data's ``type`` its event's name."""
    out = []
    for frame in text.split("\n\n"):
        if frame:
            event, data = frame.split("\n")
            name, body = event.removeprefix("event: "), json.loads(data.removeprefix("data: "))
            assert body["type"] == name
            out.append((name, body))
    return out


def accumulate(events: list[tuple[str, dict]]) -> dict:
    """The message Anthropic's client builds of ``events``, checking their order on the way: one
    block open at a time, indices in order, each delta to the open block and of its kind."""
    (first, start), *rest = events
    assert first == "message_start" and start["message"]["content"] == []
    msg = dict(start["message"])
    blocks, open_ = [], None
    for name, e in rest:
        if name == "content_block_start":
            assert open_ is None and e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
            open_ = e["index"]
        elif name == "content_block_delta":
            assert e["index"] == open_
            b, d = blocks[open_], e["delta"]
            kind = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "thinking",
                    "input_json_delta": "tool_use"}[d["type"]]
            assert b["type"] == kind, (b, d)
            if d["type"] == "input_json_delta":
                b["json"] = b.get("json", "") + d["partial_json"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            else:
                b[kind] += d[kind]
        elif name == "content_block_stop":
            assert e["index"] == open_
            open_ = None
        elif name == "message_delta":
            assert open_ is None
            msg.update(e["delta"])
            msg["usage"] = {**msg["usage"], **e["usage"]}
        else:
            assert name == "message_stop" and (name, e) == events[-1]
    for b in blocks:
        if "json" in b:
            b["input"] = json.loads(b.pop("json"))
    msg["content"] = blocks
    return msg


def pieces(text: str, cuts: list[int]) -> list[str]:
    at = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(at, at[1:]) if b > a]


@settings(max_examples=150, deadline=None)
@given(thinking=st.text(max_size=12), text=st.text(max_size=12),
       calls=st.lists(st.dictionaries(st.sampled_from("abc"), st.integers(-5, 5), max_size=3), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=6), finish=st.sampled_from(["stop", "length", "context"]),
       stop=st.sampled_from([None, "END"]), omit=st.booleans(), whole_calls=st.booleans())
def test_a_stream_accumulates_to_the_whole_message(thinking, text, calls, cuts, finish, stop, omit, whole_calls):
    """Whatever pieces a decode's thinking, text and calls come in (a call whole, as a tagged
    format's reader gives it, or its arguments piece by piece, as a forced call's grammar writes
    them), the events are in Anthropic's order and read back to :func:`~.anthropic.answer`'s
    answer for the same whole, stop reason and usage included."""
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "cached_tokens": 3}
    deltas = [{"reasoning_content": p} for p in pieces(thinking, cuts)] + [{"content": p} for p in pieces(text, cuts)]
    chat_calls = []
    for i, args in enumerate(calls):
        arguments = json.dumps(args)
        call = {"id": f"call_{i}", "type": "function", "function": {"name": f"f{i}", "arguments": arguments}}
        chat_calls.append(call)
        if whole_calls:
            deltas.append({"tool_calls": [{"index": i, **call}]})
        else:
            first, *more = pieces(arguments, cuts)
            deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"], "arguments": first}}]})
            deltas += [{"tool_calls": [{"index": i, "function": {"arguments": p}}]} for p in more]
    asked = request(messages=[{"role": "user", "content": "x"}],
                    thinking={"type": "adaptive", "display": "omitted" if omit else "summarized"})
    stream = EventStream("msg_1", "m", usage, asked)
    sent = stream.start() + "".join(stream.feed(d) for d in deltas) + stream.finish(finish, stop, usage)
    streamed = accumulate(read_events(sent))
    whole = {"role": "assistant", "content": text or None, "reasoning_content": thinking or None}
    if chat_calls:
        whole["tool_calls"] = chat_calls
    assert streamed == answer("msg_1", "m", whole, finish, stop, usage, asked)
    assert streamed["stop_reason"] == ("model_context_window_exceeded" if finish == "context" else "max_tokens"
                                       if finish == "length" else "tool_use" if calls else
                                       "stop_sequence" if stop else "end_turn")
