"""Tool calls streamed as they are written (``call_split.CallSplitter``): a
JSON call's name as soon as its arguments open, the arguments text in
deltas that join to the call's arguments exactly, whole calls at their end
for formats that cannot stream, the same calls however the text is cut."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_calls import GEMMA4, LLAMA3, MISTRAL, TOOLS_TEMPLATE, use_for

from hf2q_py.server.call_split import CallDelta, CallEnd, CallSplitter, CallStart

STREAMED = [
    (TOOLS_TEMPLATE, 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     '{"city": "Paris"}'),
    (TOOLS_TEMPLATE, 'Sure:\n```json\n{"name": "get_weather", "arguments": {"city": "a \\"quoted\\" {brace}"}}\n```',
     '{"city": "a \\"quoted\\" {brace}"}'),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "PST", "deep": [{"x": 1}]}}',
     '{"zone": "PST", "deep": [{"x": 1}]}'),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}', '{"city": "Bern"}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', '{"zone": "CET"}'),
]  # fmt: skip


def events(template: str, text: str, cuts=None, **kw) -> list[tuple[int, object]]:
    """The splitter's output, each item with how much of ``text`` was fed when it came."""
    splitter = CallSplitter(use_for(template, **kw))
    bounds = cuts if cuts is not None else range(len(text) + 1)
    bounds = sorted({0, len(text), *bounds})
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out += [(b, e) for e in splitter.feed(text[a:b])]
    return out + [(len(text) + 1, e) for e in splitter.finish()]


def calls(items) -> list[tuple[str, str, str, bool]]:
    """(name, the deltas joined, the ended call's arguments, complete) per call."""
    out = {}
    for _, e in items:
        if isinstance(e, CallStart):
            out[e.index] = [e.name, "", None, None]
        elif isinstance(e, CallDelta):
            out[e.index][1] += e.arguments
        elif isinstance(e, CallEnd):
            out[e.index][2:] = [e.call.arguments, e.call.complete]
    return [tuple(v) for _, v in sorted(out.items())]


@pytest.mark.parametrize(
    "template, answer, arguments",
    STREAMED,
    ids=["hermes", "fenced", "llama3", "mistral-args", "mistral-json"],
)
def test_a_json_call_starts_once_its_arguments_open_and_streams_them_as_written(template, answer, arguments):
    got = events(template, answer)
    start = next(fed for fed, e in got if isinstance(e, CallStart))
    assert start == answer.index(arguments) + 1  # the name went out with the arguments' first character
    deltas = [fed for fed, e in got if isinstance(e, CallDelta)]
    assert len(deltas) == len(arguments)  # fed one character at a time: one delta per character
    assert calls(got) == [(calls(got)[0][0], arguments, arguments, True)]
    ended = next(fed for fed, e in got if isinstance(e, CallEnd))
    assert ended <= answer.index(arguments) + len(arguments) + 2  # before the wrapper's closing text


@settings(max_examples=80, deadline=None)
@given(which=st.integers(0, len(STREAMED) - 1), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_the_same_calls_come_out_however_the_text_is_cut(which, cuts):
    template, answer, arguments = STREAMED[which]
    got = events(template, answer, [c % (len(answer) + 1) for c in cuts])
    assert [c[1:] for c in calls(got)] == [(arguments, arguments, True)]
    content = "".join(e for _, e in got if isinstance(e, str))
    assert "tool_call" not in content and "```" not in content and arguments not in content


def test_a_fence_inside_the_arguments_does_not_end_the_call():
    answer = '```json\n{"name": "get_weather", "arguments": {"city": "```python\\nx = 1\\n```"}}\n```\nDone.'
    got = events(TOOLS_TEMPLATE, answer, cuts=range(0, len(answer), 5))
    assert json.loads(calls(got)[0][2]) == {"city": "```python\nx = 1\n```"}
    assert "".join(e for _, e in got if isinstance(e, str)) == "\nDone."


def test_a_call_cut_short_ends_with_the_arguments_written_so_far():
    got = events(TOOLS_TEMPLATE, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    (name, joined, arguments, complete), = calls(got)  # fmt: skip
    assert (name, joined, arguments, complete) == ("get_weather", '{"city": "Par', '{"city": "Par', False)
    call = next(e.call for _, e in got if isinstance(e, CallEnd))
    assert call.input() == {"city": "Par"}


def test_formats_that_cannot_stream_give_each_call_whole_at_its_end():
    answer = 'Sure.<|tool_call>call:get_weather{city:<|"|>Kyiv<|"|>}<tool_call|>'
    got = events(GEMMA4, answer)
    starts = [fed for fed, e in got if isinstance(e, CallStart)]
    assert starts == [len(answer)] and json.loads(calls(got)[0][2]) == {"city": "Kyiv"}
    assert len([e for _, e in got if isinstance(e, CallDelta)]) == 1


@pytest.mark.parametrize(
    "answer, args",
    [
        ('<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>', {"zone": "UTC"}),
        (
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>',
            {"zone": "UTC"},
        ),
        ('<tool_call>\n{"name": "get_time"}\n</tool_call>', {}),
    ],
    ids=["arguments-first", "arguments-as-a-string", "no-arguments"],
)
def test_calls_that_do_not_stream_are_read_whole(answer, args):
    got = events(TOOLS_TEMPLATE, answer)
    ((name, joined, arguments, complete),) = calls(got)
    assert name == "get_time" and joined == arguments and json.loads(arguments) == args and complete


def test_a_second_call_is_dropped_without_parallel_calls_and_ids_differ():
    answer = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    assert [c[0] for c in calls(events(TOOLS_TEMPLATE, answer))] == ["get_time", "get_weather"]
    assert [c[0] for c in calls(events(TOOLS_TEMPLATE, answer, parallel=False))] == ["get_time"]
    ids = [e.id for _, e in events(TOOLS_TEMPLATE, answer) if isinstance(e, CallStart)]
    assert len(set(ids)) == 2


def test_arguments_that_stop_being_json_end_the_call_with_what_was_json_closed():
    # Qwen2.5-Coder writes a docstring's quotes unescaped into a call's string
    answer = (
        '```json\n{"name": "get_weather", "arguments": {"city": "def f():\\n    """Doc."""\\n", '
        '"unit": "C"}}\n```\nDone.'
    )
    for cuts in (None, [7, 40, 61, 62, 63, 90]):
        got = calls(events(TOOLS_TEMPLATE, answer, cuts))
        assert got == [("get_weather", '{"city": "def f():\\n    "}', '{"city": "def f():\\n    "}', True)]
    assert json.loads(got[0][1]) == {"city": "def f():\n    "}
