"""OpenAI's Responses API translation (:mod:`expertcache.llama.responses`) without a model: input
items become the chat request that asks the same, each chat message traced back to its item; a
stream's events are numbered, each item added, filled and done before the next, and the response
they end with is :func:`~expertcache.llama.responses.answer`'s for the same whole (a property test
over the ways a decode's pieces can fall). The server through the openai client:
``tests/test_serve.py``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic", reason="pydantic (the serve extra's) is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from expertcache.llama.responses import EventStream, ResponsesRequest, answer, asked_fields, to_chat  # noqa: E402


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def test_items_become_the_chat_messages_a_template_takes():
    """Messages keep their roles and text parts; a reasoning item's text goes to the assistant turn
    after it; calls join the assistant message before them; outputs are tool messages; every chat
    message knows its item."""
    req = request(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}],
         "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "cold"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Both known."}]},
        {"type": "function_call", "call_id": "c3", "name": "w", "arguments": "{}"}],
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "w"}, parallel_tool_calls=False, max_output_tokens=9,
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        reasoning={"effort": "none"}, include=["reasoning.encrypted_content"], store=False, top_k=3)
    chat, origins = to_chat(req, frozenset({"enable_thinking", "reasoning_effort"}))
    call = lambda i, city: {"id": f"c{i}", "type": "function",  # noqa: E731
                            "function": {"name": "w", "arguments": json.dumps({"city": city}) if city else "{}"}}
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "reasoning_content": "Ask the tool.",
         "tool_calls": [call(1, "Paris"), call(2, "Oslo")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "cold"}]},
        {"role": "assistant", "content": "", "tool_calls": [call(3, None)], "reasoning_content": "Both known."}]
    assert origins == ["instructions", "input.0", "input.1", "input.3", "input.6", "input.7", "input.9"]
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"},
                                                               "strict": True}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["max_tokens"], chat["top_k"]) == \
        ({"type": "function", "function": {"name": "w"}}, False, 9, 3)
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": False}
    assert asked_fields("messages[6].role: dropped", origins) == "input.9.role: dropped"
    assert asked_fields("max_tokens: too many", origins) == "max_output_tokens: too many"
    assert asked_fields("tools.0.function.name: bad", origins) == "tools.0.name: bad"
    assert to_chat(request(input="Hi"))[0]["messages"] == [{"role": "user", "content": "Hi"}]
    cut = to_chat(request(input=[{"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hm."}]},
                                 {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Done."}]))
    assert cut[0]["messages"] == [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Done."}]


@pytest.mark.parametrize("fields, says", [
    ({"previous_response_id": "resp_1"}, "previous_response_id: not served"),
    ({"conversation": "c"}, "conversation: not served"),
    ({"background": True}, "background: not served"),
    ({"truncation": "auto"}, "truncation: auto"),
    ({"include": ["file_search_call.results"]}, "include.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type: 'item_reference'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
])
def test_what_is_not_served_is_refused_by_its_field(fields, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        to_chat(request(**{"input": "Hi", **fields}))


def read_events(text: str) -> list[dict]:
    out = []
    for frame in text.split("\n\n"):
        if frame:
            event, data = frame.split("\n")
            body = json.loads(data.removeprefix("data: "))
            assert body["type"] == event.removeprefix("event: ")
            out.append(body)
    return out


def without_ids(response: dict) -> dict:
    return {**response, "id": None, "created_at": None, "completed_at": None,
            "output": [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]}


@settings(max_examples=150, deadline=None)
@given(thinking=st.text(max_size=12), text=st.text(max_size=12),
       calls=st.lists(st.dictionaries(st.sampled_from("abc"), st.integers(-5, 5), max_size=3), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=6), finish=st.sampled_from(["stop", "length", "context"]),
       whole_calls=st.booleans())
def test_a_stream_ends_with_the_whole_response(thinking, text, calls, cuts, finish, whole_calls):
    """Whatever pieces the thinking, text and calls come in, the events are numbered in order, each
    item is added, filled by its deltas and done before the next opens, and the response the stream
    ends with holds those items and is :func:`answer`'s for the same whole (ids aside)."""
    def pieces(s: str) -> list[str]:
        at = sorted({c % (len(s) + 1) for c in cuts} | {0, len(s)})
        return [s[a:b] for a, b in zip(at, at[1:]) if b > a]

    usage = {"prompt_tokens": 7, "completion_tokens": 5, "cached_tokens": 3, "reasoning_tokens": 2}
    deltas = [{"reasoning_content": p} for p in pieces(thinking)] + [{"content": p} for p in pieces(text)]
    chat_calls = []
    for i, args in enumerate(calls):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": f"f{i}", "arguments": json.dumps(args)}}
        chat_calls.append(call)
        if whole_calls:
            deltas.append({"tool_calls": [{"index": i, **call}]})
        else:
            first, *more = pieces(call["function"]["arguments"])
            deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"], "arguments": first}}]})
            deltas += [{"tool_calls": [{"index": i, "function": {"arguments": p}}]} for p in more]
    asked = request(input="x", max_output_tokens=5)
    stream = EventStream("resp_1", "m", usage, asked)
    events = read_events(stream.start() + "".join(stream.feed(d) for d in deltas) + stream.finish(finish, None, usage))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    built, open_ = [], None
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert open_ is None and e["output_index"] == len(built)
            open_ = e["item"]["id"]
            built.append([open_, ""])
        elif e["type"].endswith(".delta"):
            assert e["item_id"] == open_ == built[e["output_index"]][0]
            built[-1][1] += e["delta"]
        elif e["type"] == "response.output_item.done":
            assert e["item"]["id"] == open_
            open_ = None
    assert open_ is None
    final = events[-1]["response"]
    assert events[-1]["type"] == ("response.completed" if finish == "stop" else "response.incomplete")
    assert [[i["id"], i["arguments"] if i["type"] == "function_call" else i["content"][0]["text"]]
            for i in final["output"]] == built
    whole = {"role": "assistant", "content": text or None, "reasoning_content": thinking or None}
    if chat_calls:
        whole["tool_calls"] = chat_calls
    assert without_ids(final) == without_ids(answer("resp_1", "m", whole, finish, None, usage, asked))
