"""Tool calls without a server: the format each chat template implies, the
answer split into content and calls (the same however the text streams
in), tool_choice, and the request shapes (tools, tool history,
response_format, logprobs fields) refused with the field named."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from scripted_model import PLAIN_TEMPLATE, TOOLS_TEMPLATE
from transformers import PreTrainedTokenizerFast

from hf2q_py.constraints import ConstraintSpec
from hf2q_py.errors import Hf2qError
from hf2q_py.server.protocol import ChatRequest, CompletionRequest, Shape, response_constraint
from hf2q_py.server.call_split import AnswerSplitter, split_answer
from hf2q_py.server.tool_calls import ToolCall, tool_format, tool_use
from hf2q_py.stats import GenerationStats


def tool(name: str, **props) -> dict:
    params = {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": params},
    }


TOOLS = [tool("get_weather", city="string"), tool("get_time", zone="string")]

LLAMA3 = """{%- if tools %}<|start_header_id|>system<|end_header_id|>
Respond with a JSON for a function call: {"name": function name, "parameters": dictionary}.
{%- for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}{%- if m.role == 'ipython' or m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>
{{ m.content }}<|eot_id|>{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>
<|python_tag|>{{ m.tool_calls[0].function | tojson }}<|eom_id|>{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>
{{ m.content }}<|eot_id|>{% endif %}{% endfor %}<|start_header_id|>assistant<|end_header_id|>
"""
MISTRAL = """{%- for m in messages %}{%- if m.role == 'user' %}{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]
{%- elif m.tool_calls %}[TOOL_CALLS]{% for c in m.tool_calls %}{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{%- else %}{{ m.content }}</s>{% endif %}{% endfor %}"""
GEMMA4 = """{%- if tools %}<|turn>system
{%- for t in tools %}<|tool>{{ t.function.name }}<tool|>{% endfor %}<turn|>{% endif %}
{%- for m in messages %}<|turn>{{ m.role }}
{{ m.content }}<turn|>{% endfor %}<|turn>model
{# calls are written <|tool_call>call:name{...}<tool_call|> #}"""
HERMES_PLAIN = """{%- if tools %}<|im_start|>system
Call a tool inside <tool_call></tool_call> tags: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
"""
KIMI = """{%- if tools %}tools: {{ tools | tojson }}{% endif %}{%- for m in messages %}{{ m.content }}{% endfor %}
{# <|tool_calls_section_begin|> #}"""


def tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A tokenizer with ``template`` as its chat template (the vocabulary does not matter here)."""
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    )
    tok.chat_template = template
    return tok


def use_for(template: str, choice="auto", parallel=True, tools=TOOLS):
    return tool_use(tokenizer(template), tools, choice, parallel)


# -- the format each template implies ---------------------------------------------------------
@pytest.mark.parametrize(
    "template, name",
    [(TOOLS_TEMPLATE, "json_tools"), (HERMES_PLAIN, "json_tools"), (LLAMA3, "llama3_json"), (MISTRAL, "mistral"),
     (GEMMA4, "gemma4"), (KIMI, "kimi_k2")],
    ids=["qwen-style", "hermes-unnamed-by-mlx-lm", "llama3", "mistral", "gemma4", "kimi"],
)  # fmt: skip
def test_the_tool_call_format_is_read_from_the_chat_template(template, name):
    assert tool_format(tokenizer(template)).name == name


def test_a_template_that_ignores_tools_is_refused_by_name():
    with pytest.raises(Hf2qError, match="tools: this model's chat template does not render tools"):
        use_for(PLAIN_TEMPLATE)


def test_tool_choice_none_or_no_tools_renders_and_reads_plain_text():
    assert use_for(TOOLS_TEMPLATE, "none") is None
    assert use_for(PLAIN_TEMPLATE, "none") is None  # even where tools could not be rendered
    assert tool_use(tokenizer(TOOLS_TEMPLATE), None, "auto") is None


@pytest.mark.parametrize(
    "template, choice, prefix",
    [
        (TOOLS_TEMPLATE, "auto", ""),
        (TOOLS_TEMPLATE, "required", "<tool_call>\n"),
        (TOOLS_TEMPLATE, {"type": "function", "function": {"name": "get_time"}}, '<tool_call>\n{"name": "get_time", "arguments": '),
        (LLAMA3, {"type": "function", "function": {"name": "get_time"}}, '{"name": "get_time", "parameters": '),
        (MISTRAL, {"type": "function", "function": {"name": "get_time"}}, "[TOOL_CALLS]get_time[ARGS]"),
        (GEMMA4, "required", "<|tool_call>call:"),
    ],
)  # fmt: skip
def test_required_and_named_tool_choice_start_the_answer_with_the_formats_opening(template, choice, prefix):
    assert use_for(template, choice).prefix == prefix


@pytest.mark.parametrize(
    "template, choice, tools, says",
    [
        (TOOLS_TEMPLATE, {"type": "function", "function": {"name": "rm_rf"}}, TOOLS, "'rm_rf' is not among the tools"),
        (TOOLS_TEMPLATE, "required", None, "tool_choice: a required or named tool call needs tools"),
        (KIMI, "required", TOOLS, "not supported for this model's tool-call format (kimi_k2)"),
    ],
)  # fmt: skip
def test_a_tool_choice_the_model_cannot_follow_is_refused_naming_it(template, choice, tools, says):
    with pytest.raises(Hf2qError, match="tool_choice") as e:
        use_for(template, choice, tools=tools)
    assert says in str(e.value)


def test_a_named_call_reads_once_the_model_writes_its_arguments():
    use = use_for(TOOLS_TEMPLATE, {"type": "function", "function": {"name": "get_time"}})
    content, calls = split_answer(use, '{"zone": "UTC"}}\n</tool_call>')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"})
    ]


# -- splitting answers --------------------------------------------------------------------------
HERMES_ANSWER = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
FENCED_ANSWER = 'I will look it up.\n```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "template, answer, content, calls",
    [
        (TOOLS_TEMPLATE, HERMES_ANSWER, "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        (TOOLS_TEMPLATE, FENCED_ANSWER, "I will look it up.", [("get_weather", {"city": "Oslo"})]),
        (TOOLS_TEMPLATE, '```json\n[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]\n```',
         None, [("get_time", {}), ("get_weather", {"city": "Rome"})]),
        (TOOLS_TEMPLATE, '```json\n{"name": "delete_all", "arguments": {}}\n```', '```json\n{"name": "delete_all", "arguments": {}}\n```', []),
        (TOOLS_TEMPLATE, '```python\nprint("hi")\n```', '```python\nprint("hi")\n```', []),
        (TOOLS_TEMPLATE, "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n</tool_call>", []),
        (TOOLS_TEMPLATE, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
        (TOOLS_TEMPLATE, '<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
        (TOOLS_TEMPLATE, '{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
        (TOOLS_TEMPLATE, '{"answer": 42}', '{"answer": 42}', []),
        (TOOLS_TEMPLATE, "Plain text, a < sign and `ticks`.", "Plain text, a < sign and `ticks`.", []),
        (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "PST"}}; {"name": "get_weather", "parameters": {"city": "Lima"}}',
         None, [("get_time", {"zone": "PST"}), ("get_weather", {"city": "Lima"})]),
        (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}', None, [("get_weather", {"city": "Bern"})]),
        (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [("get_time", {"zone": "CET"})]),
        (GEMMA4, 'Sure.<|tool_call>call:get_weather{city:<|"|>Kyiv<|"|>}<tool_call|>', "Sure.", [("get_weather", {"city": "Kyiv"})]),
    ],
    ids=["hermes-two-calls", "fenced", "fenced-list-string-args", "fenced-unknown-name", "fenced-code", "unreadable",
         "unended", "truncated", "bare-json", "bare-json-not-a-call", "plain", "llama3-two", "mistral-args",
         "mistral-json", "gemma4"],
)  # fmt: skip
def test_an_answer_splits_into_content_and_calls(template, answer, content, calls):
    got_content, got_calls = split_answer(use_for(template), answer)
    assert got_content == content and calls_of(got_calls) == calls


@settings(max_examples=60, deadline=None)
@given(
    answer=st.sampled_from([HERMES_ANSWER, FENCED_ANSWER, "Plain <tool text> with ``` inside", '  {"name": "get_time", "arguments": {}} ']),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)  # fmt: skip
def test_streaming_gives_the_same_content_and_calls_however_the_text_is_cut(answer, cuts):
    use = use_for(TOOLS_TEMPLATE)
    bounds = sorted({0, len(answer), *(c % (len(answer) + 1) for c in cuts)})
    splitter = AnswerSplitter(use)
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        pieces += splitter.feed(answer[a:b])
    pieces += splitter.finish()
    content, calls = split_answer(use, answer)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None) == content
    assert calls_of([p for p in pieces if isinstance(p, ToolCall)]) == calls_of(calls)


def test_text_streams_out_at_once_until_a_call_may_begin():
    splitter = AnswerSplitter(use_for(TOOLS_TEMPLATE))
    assert splitter.feed("Hello there") == ["Hello there"]
    assert splitter.feed(" and <tool") == [" and"]  # "<tool" may begin "<tool_call>"
    assert splitter.feed("box>") == [" <toolbox>"]
    assert splitter.feed("\n<tool_call>\n{") == []  # held: a call
    pieces = splitter.feed('"name": "get_time", "arguments": {}}\n</tool_call>')
    assert len(pieces) == 1 and pieces[0].name == "get_time"


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = split_answer(use_for(TOOLS_TEMPLATE, parallel=False), HERMES_ANSWER)
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]


def test_call_ids_are_unique_and_mistral_gets_its_nine_character_ids():
    _, calls = split_answer(use_for(TOOLS_TEMPLATE), HERMES_ANSWER)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    _, calls = split_answer(use_for(MISTRAL), '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


# -- request shapes ---------------------------------------------------------------------------
def chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]  # fmt: skip


def test_tool_history_reaches_the_template_with_arguments_as_objects():
    messages = ChatRequest.model_validate({"messages": HISTORY}).template_messages()
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }
    assert messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    text = tokenizer(TOOLS_TEMPLATE).apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert '"arguments": {"city": "Paris"}' in text and "18 C, sunny" in text


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function: this field is required"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name: this field is required"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": ["get_weather"]}, "tools.0"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id: a tool message names the call it answers"),
        ({"messages": [{"role": "user", "content": None}]}, "content: required"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls: only an assistant message"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
         "messages.0.tool_calls.0.function.name: this field is required"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
    ],
)  # fmt: skip
def test_malformed_tools_and_messages_are_refused_naming_the_field(fields, says):
    from fastapi.exceptions import RequestValidationError

    from hf2q_py.server.app import _validation_message

    with pytest.raises(ValidationError) as e:
        chat(**fields)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    assert says in _validation_message(RequestValidationError(errors))


@pytest.mark.parametrize(
    "messages, says",
    [
        ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1", "content": "y"}],
         "messages[1]: a tool message answers a call of the assistant message before it; tool_call_id 'call_1'"),
        ([*HISTORY[:2], {"role": "tool", "tool_call_id": "call_9", "content": "y"}], "tool_call_id 'call_9' matches none"),
        ([*HISTORY, {"role": "user", "content": "and?"}, {"role": "tool", "tool_call_id": "call_1", "content": "y"}],
         "messages[4]"),
        ([HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{broken"}}]}],
         "messages[1].tool_calls[0].function.arguments: not valid JSON"),
        ([HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
         "must be a JSON object"),
    ],
)  # fmt: skip
def test_malformed_tool_history_is_refused_naming_the_message(messages, says):
    with pytest.raises(Hf2qError) as e:
        ChatRequest.model_validate({"messages": messages}).template_messages()
    assert says in str(e.value)


def test_response_format_becomes_the_output_constraint():
    assert response_constraint(None) is None and response_constraint({"type": "text"}) is None
    assert response_constraint({"type": "json_object"}) == ConstraintSpec("json_object")
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": {"type": "integer"}, "strict": True},
    }
    assert response_constraint(fmt) == ConstraintSpec("json_schema", '{"type":"integer"}')


@pytest.mark.parametrize(
    "fmt, says",
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema: required"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, "response_format.json_schema.schema: must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "if": {}}}},
         "response_format.json_schema.schema: unsupported schema feature(s): if"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes", "schema": {}}}, "response_format.json_schema.strict"),
    ],
)  # fmt: skip
def test_a_bad_response_format_is_refused_naming_the_field(fmt, says):
    with pytest.raises(Hf2qError) as e:
        response_constraint(fmt)
    assert says in str(e.value)


def test_logprob_fields_ask_for_alternatives_per_token():
    assert chat().logprob_count() is None
    assert chat(logprobs=True).logprob_count() == 0
    assert chat(logprobs=True, top_logprobs=5).logprob_count() == 5
    with pytest.raises(Hf2qError, match="top_logprobs: needs logprobs: true"):
        chat(top_logprobs=2).logprob_count()
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 3}).logprob_count() == 3
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "logprobs": 6})


def test_a_response_with_calls_has_null_content_and_finish_reason_tool_calls():
    stats = GenerationStats()
    stats.finish_reason = "stop"
    call = ToolCall("get_time", '{"zone": "CET"}', "call_x")
    body = Shape(True, "m", "fp").response(None, stats, "ngram", [call])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "call_x", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    ]
    stats.finish_reason = "length"
    assert (
        Shape(True, "m", "fp").response("x", stats, "ngram", [call])["choices"][0]["finish_reason"]
        == "length"
    )
    delta = Shape(True, "m", "fp").tool_chunk(call, 1)["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 1, **call.openai()}]}


def test_long_texts_are_given_as_a_call_would_quote_them():
    from hf2q_py.server.tool_calls import MIN_QUOTED, quoted_views

    code = 'def add(a, b):\n    """Sum."""\n    return a + b\n' * 3
    plain = "x" * (MIN_QUOTED + 10)  # escaping changes nothing: no second view
    views = quoted_views([{"role": "tool", "content": code}, {"role": "user", "content": plain},
                          {"role": "user", "content": "short\n"}, {"role": "system", "content": code * 2}])  # fmt: skip
    half = code.replace("\n", "\\n")  # line breaks escaped, quotes left as they are
    assert views == [json.dumps(code)[1:-1], half]
    assert "\\n" in views[0] and '\\"' in views[0] and '\\"' not in views[1]


def test_a_file_shown_with_numbered_lines_is_given_without_the_numbers():
    """Claude Code's Read returns ``cat -n`` lines; an edit's old_string copies
    the lines without their numbers, so the views are of the lines alone."""
    from hf2q_py.server.tool_calls import quoted_views, unnumbered

    code = 'def add(a, b):\n    """Sum."""\n    return a + b\n'
    shown = "\n".join(f"{i + 1:>6}\t{line}" for i, line in enumerate(code.splitlines()))
    assert unnumbered(shown) == code
    assert unnumbered("no numbers here\nat all") is None
    assert unnumbered("     1\tone line only") is None
    views = quoted_views([{"role": "tool", "content": shown}])
    assert views == [json.dumps(code)[1:-1], code.replace("\n", "\\n")]
