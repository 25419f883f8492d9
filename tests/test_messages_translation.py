"""Anthropic's Messages requests as the engine's conversation, without a
server: content blocks to template messages in order, problems named by
their place; the billing nonce; a template's refusal of system messages
past the start; the stream's content blocks for the engine's events."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from hf2q_py.errors import Hf2qError
from hf2q_py.server.anthropic_api import _Blocks
from hf2q_py.server.app import _validation_message
from hf2q_py.server.anthropic_protocol import CountRequest, MessagesRequest, conversation
from hf2q_py.server.conversation import Thinking, normalize_system, schema_problem, system_as_user
from hf2q_py.server.events import CallDelta, CallEnd, CallStart, Ping, ReasoningDelta, TextDelta
from hf2q_py.server.tool_calls import ToolCall

BILLING = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch=36ee5;"
WEATHER_TOOL = {"name": "get_weather", "description": "Weather.", "cache_control": {"type": "ephemeral"},
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 64, **fields})


def test_blocks_become_template_messages_in_order():
    conv = conversation(request(
        system=[{"type": "text", "text": BILLING}, {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
            {"role": "system", "content": "The user is in a hurry."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "no data", "is_error": True}]},
        ],
        tools=[WEATHER_TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        metadata={"user_id": "u"}, context_management={"edits": []},
    ))  # fmt: skip
    assert conv.messages == [
        {"role": "system", "content": f"{BILLING}\nYou are helpful."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "system", "content": "The user is in a hurry."},  # kept in its place
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "name": "get_weather", "content": "Error: no data"},
    ]  # fmt: skip
    assert [t["function"]["name"] for t in conv.tools] == ["get_weather"]  # Anthropic's own tools: not shown
    assert conv.tools[0]["function"]["parameters"] == WEATHER_TOOL["input_schema"]
    assert conv.prefill == "" and conv.call_id_prefix == "toolu_"


def test_generation_fields_map_to_the_engines():
    conv = conversation(request(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}],
        max_tokens=128000, stop_sequences=["END"], temperature=0, top_k=5, stream=True,
        tools=[WEATHER_TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "adaptive"}, output_config={"effort": "medium"},
    ))  # fmt: skip
    assert conv.max_tokens == 128000 and conv.stop == ("END",) and conv.stream
    assert conv.sampling == {"temperature": 0, "top_k": 5}
    assert conv.tool_choice == "required" and conv.parallel_tool_calls is False
    assert conv.thinking == Thinking(enabled=True, budget=None, effort="medium")
    assert conv.prefill == "Sure, here" and conv.messages == [{"role": "user", "content": "Hi"}]
    named = conversation(request(messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL],
                                 tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "disabled"}))  # fmt: skip
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert named.thinking.enabled is False
    counted = conversation(CountRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}]}))
    assert counted.max_tokens is None and counted.thinking is None


BAD_BLOCKS = [
    ([{"role": "user", "content": None}], "messages.0.content: must be a string or a list of content blocks, got null"),
    ([{"role": "user", "content": 5}], "messages.0.content: must be a string or a list of content blocks, got int"),
    ([{"role": "user", "content": ["hi"]}], "messages.0.content.0: a content block is an object with a type"),
    ([{"role": "user", "content": [{}]}], "messages.0.content.0: a content block is an object with a type"),
    ([{"role": "user", "content": [{"type": "video"}]}], "messages.0.content.0: unknown content block type 'video'"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "source": {"type": "base64"}}]}],
     "messages.0.content.1: an image block, but this model reads text only"),
    ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages.0.content.0: a document block"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text: a text block needs a string, got null"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}],
     "messages.0.content.0.tool_use_id: 'toolu_x' answers no tool_use block of an earlier assistant message"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}],
     "messages.0.content.0.input: a tool_use block needs an object, got str"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "", "name": "f", "input": {}}]}],
     "messages.0.content.0: a tool_use block needs an id and a name"),
    ([{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}], "messages.0.content.0: a thinking block is not allowed here"),
    ([{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
     "messages.0.content.0: a tool_use block is not allowed here"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}],
     "messages.1.content.0.content.0: an image block, but this model reads text only"),
]  # fmt: skip


@pytest.mark.parametrize("messages, says", BAD_BLOCKS, ids=range(len(BAD_BLOCKS)))
def test_malformed_content_is_refused_naming_its_place(messages, says):
    with pytest.raises(Hf2qError) as e:
        conversation(request(messages=messages))
    assert says in str(e.value)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
        ({"tools": [{"input_schema": {"type": "object"}}]}, "tools.0.name"),
        ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools.0.name"),
        ({"tools": [{"name": "f"}]}, "input_schema: required"),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
            'input_schema: the type must be "object"',
        ),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object", "required": "x"}}]},
            "required must be a list",
        ),
        ({"tool_choice": {"type": "tool"}}, 'name: required with "type": "tool"'),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_malformed_fields_are_refused_naming_them(fields, says):
    with pytest.raises(ValidationError) as e:
        request(**{"messages": [{"role": "user", "content": "Hi"}], **fields})
    assert says in _validation_message(RequestValidationError(e.value.errors()))  # the server's one line


def test_too_many_or_empty_stop_sequences_are_refused():
    with pytest.raises(Hf2qError, match="stop_sequences: at most 16"):
        conversation(request(messages=[{"role": "user", "content": "Hi"}], stop_sequences=["x"] * 17))
    with pytest.raises(Hf2qError, match="stop_sequences: a stop sequence must not be empty"):
        conversation(request(messages=[{"role": "user", "content": "Hi"}], stop_sequences=[""]))


def test_the_billing_lines_nonce_is_fixed_and_nothing_else_changes():
    other = BILLING.replace("cch=36ee5", "cch=0aaa9")
    assert normalize_system(BILLING) == normalize_system(other) == BILLING.replace("cch=36ee5", "cch=00000")
    text = f"{BILLING}\nYou are Claude Code. Keep cch=12345 here."
    assert (
        normalize_system(text)
        == f"{BILLING.replace('36ee5', '00000')}\nYou are Claude Code. Keep cch=12345 here."
    )
    assert normalize_system("A plain system prompt, cch=1;") == "A plain system prompt, cch=1;"


def test_system_messages_past_the_start_move_into_user_text_in_place():
    messages = [
        {"role": "system", "content": "A"}, {"role": "system", "content": "B"},
        {"role": "user", "content": "u1"}, {"role": "system", "content": "env"},
        {"role": "assistant", "content": "a1"}, {"role": "system", "content": "note"},
        {"role": "user", "content": "u2"}, {"role": "system", "content": "last"},
    ]  # fmt: skip
    assert system_as_user(messages) == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "u1\n\n<system-reminder>\nenv\n</system-reminder>"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "<system-reminder>\nnote\n</system-reminder>\n\nu2\n\n<system-reminder>\nlast\n</system-reminder>"},
    ]  # fmt: skip
    assert system_as_user([{"role": "system", "content": "A"}, {"role": "user", "content": "u"}]) is None


def test_tool_schemas_are_checked():
    assert schema_problem({}) is None and schema_problem({"type": "object", "properties": {"a": {}}}) is None
    assert "properties" in schema_problem({"properties": []})
    assert "JSON schema object" in schema_problem("object")


def events_of(stream: str) -> list[tuple[str, dict]]:
    out = []
    for part in stream.strip().split("\n\n"):
        name, data = part.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_the_streams_content_blocks_open_fill_and_close_in_order():
    blocks = _Blocks()
    call = ToolCall("get_weather", '{"city": "Oslo"}', "toolu_1")
    stream = "".join(blocks.of(e) for e in [
        ReasoningDelta("Think"), ReasoningDelta("ing."), TextDelta("Hello"), Ping(), TextDelta(""),
        CallStart(0, "toolu_1", "get_weather"), CallDelta(0, '{"city": '), CallDelta(0, '"Oslo"}'), CallEnd(0, call),
        TextDelta("Done."),
    ]) + blocks.close()  # fmt: skip
    got = [
        (n, b.get("index"), (b.get("delta") or b.get("content_block") or {}).get("type"))
        for n, b in events_of(stream)
    ]
    assert got == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None), ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("ping", None, None), ("content_block_stop", 1, None), ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None), ("content_block_start", 3, "text"), ("content_block_delta", 3, "text_delta"),
        ("content_block_stop", 3, None),
    ]  # fmt: skip
