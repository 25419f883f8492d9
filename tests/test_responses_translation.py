"""OpenAI's Responses requests as the engine's conversation, without a server:
input items to template messages in order, tools (namespaces flattened,
custom tools as freeform functions, others left out), options, problems
named by their place; and a response's output items and stream events for
the engine's events, reasoning included."""

from __future__ import annotations

import json

import pytest
from test_server_responses import APPLY_PATCH, NAMESPACE, SKIPPED

from hf2q_py.errors import Hf2qError
from hf2q_py.server.call_split import CallDelta, CallEnd, CallStart
from hf2q_py.server.conversation import Thinking
from hf2q_py.server.events import Done, Ping, ReasoningDelta, TextDelta
from hf2q_py.server.responses_api import ResponseStore, _Output
from hf2q_py.server.responses_protocol import (
    ResponseShape,
    ResponsesRequest,
    conversation,
    read_items,
    read_tools,
)
from hf2q_py.server.tool_calls import ToolCall
from hf2q_py.stats import GenerationStats

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


def translate(**fields):
    req = ResponsesRequest.model_validate(fields)
    return conversation(req, read_items(req.input))


def test_items_become_template_messages_in_order():
    conv, _ = translate(
        instructions="Be brief.",
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}],
             "encrypted_content": None},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "namespace": "multi_agent_v1", "name": "spawn_agent",
             "arguments": '{"message": "hi"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "agent 7"}]},
            {"type": "custom_tool_call", "call_id": "call_3", "name": "apply_patch", "input": "*** Begin Patch\n"},
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Done."},
            {"role": "system", "content": "Mind the time."},
            {"role": "user", "content": "Thanks."},
        ],
        tools=[WEATHER, NAMESPACE, APPLY_PATCH],
    )  # fmt: skip
    assert conv.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "hi"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "multi_agent_v1__spawn_agent", "content": "agent 7"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "apply_patch", "arguments": {"input": "*** Begin Patch\n"}}}]},
        {"role": "tool", "tool_call_id": "call_3", "name": "apply_patch", "content": "Done."},
        {"role": "system", "content": "Mind the time."},  # kept in its place
        {"role": "user", "content": "Thanks."},
    ]  # fmt: skip


def test_tools_are_offered_flat_freeform_tools_as_one_string_and_others_left_out():
    tools = read_tools([*SKIPPED, WEATHER, NAMESPACE, APPLY_PATCH, {"type": "custom", "name": "note"}])
    names = [f["function"]["name"] for f in tools.functions]
    assert names == [
        "get_weather",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__close_agent",
        "apply_patch",
        "note",
    ]
    assert tools.namespaced == {"multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent"),
                                "multi_agent_v1__close_agent": ("multi_agent_v1", "close_agent")}  # fmt: skip
    patch = tools.functions[3]["function"]
    assert patch["parameters"]["required"] == ["input"] and patch["description"] == APPLY_PATCH["description"]
    assert "Lark grammar" in patch["parameters"]["properties"]["input"]["description"]
    assert tools.freeform["apply_patch"].kind == "grammar" and tools.freeform["note"] is None
    assert tools.functions[2]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_options_reach_the_conversation():
    conv, _ = translate(
        input="Hi", max_output_tokens=64, temperature=0.5, top_p=0.9, parallel_tool_calls=False,
        reasoning={"effort": "low", "summary": "auto"}, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        store=False, include=["reasoning.encrypted_content"], prompt_cache_key="k", client_metadata={"a": "b"},
    )  # fmt: skip
    assert (conv.max_tokens, conv.sampling, conv.parallel_tool_calls) == (
        64,
        {"temperature": 0.5, "top_p": 0.9},
        False,
    )
    assert conv.thinking == Thinking(enabled=True, effort="low")
    assert conv.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert conv.constraint.kind == "json_schema" and conv.messages == [{"role": "user", "content": "Hi"}]
    assert translate(input="Hi", reasoning={"effort": "none"})[0].thinking == Thinking(enabled=False)
    assert translate(input="Hi", reasoning={"summary": "auto"})[0].thinking is None


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]: a file"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": 3}]},
         "input[0].namespace"),
        ({"input": "Hi", "tools": [{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "regex",
                                                                            "definition": "(a"}}]}, "tools[0].format.definition"),
        ({"input": "Hi", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ],
)  # fmt: skip
def test_problems_are_named_by_their_place(fields, says):
    with pytest.raises(Hf2qError) as e:
        translate(**fields)
    assert says in str(e.value)


# -- output items and stream events --------------------------------------------------------------------
def stats(prompt=10, generated=7, cached=4) -> GenerationStats:
    s = GenerationStats()
    s.prompt_tokens, s.generated_tokens, s.cached_tokens = prompt, generated, cached
    return s


class _Prep:
    label = "ngram"


def output(tools) -> _Output:
    return _Output(ResponseShape("m", ResponsesRequest.model_validate({"input": "x"})), tools, _Prep())


def test_reasoning_text_and_calls_become_output_items_and_their_events():
    out = output(read_tools([NAMESPACE, APPLY_PATCH]))
    args = json.dumps({"input": '*** Begin Patch\n"x"\n'})
    engine = [
        ReasoningDelta("Think"), ReasoningDelta(" more."), Ping(), TextDelta("Sure."),
        CallStart(0, "call_a", "multi_agent_v1__spawn_agent"), CallDelta(0, '{"message": '), CallDelta(0, '"hi"}'),
        CallEnd(0, ToolCall("multi_agent_v1__spawn_agent", '{"message": "hi"}', "call_a")),
        CallStart(1, "call_b", "apply_patch"), CallDelta(1, args[:20]), CallDelta(1, args[20:]),
        CallEnd(1, ToolCall("apply_patch", args, "call_b")),
    ]  # fmt: skip
    events = [e for ev in engine for e in out.of(ev)]
    done = Done(stats(), "tool_calls", reasoning_tokens=3)
    events += out.finish(done)
    body = out.final(done)
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                         "response.reasoning_text.delta", "response.in_progress"]  # fmt: skip
    assert [i["type"] for i in body["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "custom_tool_call",
    ]
    reasoning, message, fn, custom = body["output"]
    assert (
        reasoning["content"] == [{"type": "reasoning_text", "text": "Think more."}]
        and reasoning["summary"] == []
    )
    assert message["content"][0]["text"] == "Sure."
    assert (fn["namespace"], fn["name"], fn["arguments"], fn["call_id"]) == (
        "multi_agent_v1",
        "spawn_agent",
        '{"message": "hi"}',
        "call_a",
    )
    assert custom["input"] == '*** Begin Patch\n"x"\n' and custom["call_id"] == "call_b"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    assert deltas == custom["input"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["item_id"] in {i["id"] for i in body["output"]} for e in events if "item_id" in e)
    assert body["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 7,
                             "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 17}  # fmt: skip
    assert body["status"] == "completed" and all(i["status"] == "completed" for i in body["output"])


def test_an_answer_cut_short_is_incomplete():
    out = output(read_tools([]))
    out.of(TextDelta("Once upon"))
    done = Done(stats(), "length")
    events = out.finish(done)
    body = out.final(done)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and events[-1]["item"]["status"] == "incomplete"


def test_the_store_keeps_recent_responses_within_its_bounds():
    store = ResponseStore(entries=2, chars=10_000)
    for n in range(3):
        store.put(
            [{"role": "user", "content": f"q{n}"}],
            {"id": f"resp_{n}", "output": [{"type": "message", "n": n}]},
        )
    assert store.get("resp_0") is None and store.history("resp_2") == [
        {"role": "user", "content": "q2"},
        {"type": "message", "n": 2},
    ]
    store.put([], {"id": "resp_big", "output": ["x" * 20_000]})  # larger than the bound: not kept
    assert store.get("resp_big") is None and store.get("resp_1") is not None
