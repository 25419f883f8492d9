"""Tool calls through the real ``hf2q-py serve`` process and the ``openai``
client, on scripted models (``scripted_model.py``): tiny llamas whose greedy
answer is a chosen text, behind chat templates that declare tools. Plus the
structured-output and logprobs fields, and hostile tool requests."""

from __future__ import annotations

import json

import openai
import pytest
from scripted_model import TOOLS_TEMPLATE, write_scripted_folder
from server_process import running_server
from test_server import assert_error_body

from hf2q_py.loaders.folder import load_folder

#: The hermes model's answers: after the generation prompt ("\n"), text then two
#: calls; after a named call's opening (which ends in a space), the arguments.
HERMES = {
    "\n": [
        "Let me check.", "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris", ',
        '"unit": "celsius"}}', "\n</tool_call>\n", "<tool_call>\n", '{"name": "get_time", "arguments": {"zone": "CET"}}',
        "\n</tool_call>",
    ],
    " ": ['{"zone": "UTC"}}', "\n</tool_call>\n\n"],
}  # fmt: skip
#: Qwen2.5-Coder's habit: the call as a fenced JSON block.
FENCED = {
    "\n": [
        "I will look that up.\n",
        "```json\n",
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        "\n```",
    ]
}
WEATHER = {"city": "Paris", "unit": "celsius"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone.",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
ASK = [{"role": "user", "content": "What's the weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def hermes_folder(tmp_path_factory):
    return write_scripted_folder(tmp_path_factory.mktemp("hermes"), HERMES)


@pytest.fixture(scope="module")
def hermes(hermes_folder):
    with running_server("--model", str(hermes_folder), "--method", "ngram") as s:
        yield s


@pytest.fixture(scope="module")
def client(hermes):
    return openai.OpenAI(base_url=hermes.base, api_key="unused", max_retries=0, timeout=60)


def ask(client, messages=ASK, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, **kw)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# -- calls -------------------------------------------------------------------------------------
def test_the_models_calls_come_back_as_tool_calls_with_the_text_before_them(client):
    r = ask(client, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(c.type == "function" for c in choice.message.tool_calls)


def streamed_calls(chunks) -> list[tuple[str, str, str, list[str]]]:
    """A stream's calls by index: (id, name, the arguments joined, each arguments delta)."""
    calls: dict[int, list] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if tc.id:  # a call's first delta: its id, type and name
                assert tc.type == "function" and tc.index not in calls
                calls[tc.index] = [tc.id, tc.function.name, "", []]
            if tc.function.arguments:
                calls[tc.index][2] += tc.function.arguments
                calls[tc.index][3].append(tc.function.arguments)
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


def test_streamed_calls_arrive_as_they_are_written_and_equal_the_whole_answer(client):
    plain = {"hf2q": {"method": "baseline"}}  # a token a round (speculation may write a call in one round)
    chunks = list(ask(client, tools=TOOLS, stream=True, extra_body=plain))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    streamed = streamed_calls(chunks)
    assert content == "Let me check."
    assert [(name, json.loads(args)) for _, name, args, _ in streamed] == [
        ("get_weather", WEATHER),
        ("get_time", {"zone": "CET"}),
    ]
    # The model writes the first call's arguments in two tokens: they come as two deltas.
    assert streamed[0][3] == ['{"city": "Paris", ', '"unit": "celsius"}']
    assert len({cid for cid, *_ in streamed}) == 2
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert not any("<tool_call>" in (d.content or "") for d in deltas)  # never leaked as text


def test_tool_choice_none_renders_no_tools_and_returns_the_text(client):
    r = ask(client, tools=TOOLS, tool_choice="none")
    with_tools = ask(client, tools=TOOLS)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<tool_call>" in r.choices[0].message.content
    assert r.usage.prompt_tokens < with_tools.usage.prompt_tokens  # the tools were not in the prompt


def test_a_named_tool_choice_makes_the_model_call_that_function(client):
    r = ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert calls_of(r.choices[0].message) == [("get_time", {"zone": "UTC"})]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_opens_the_call_for_the_model(client):
    r = ask(client, tools=TOOLS, tool_choice="required")
    # The prompt now ends in "\n<tool_call>\n" (one token of this model): the model goes on from there,
    # skipping the text it writes first otherwise.
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert calls_of(r.choices[0].message) == [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]


def test_parallel_tool_calls_false_returns_one_call(client):
    r = ask(client, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(r.choices[0].message) == [("get_weather", WEATHER)]


def test_tool_history_round_trips_through_the_template(client, hermes_folder):
    first = ask(client, tools=TOOLS).choices[0].message
    history = [
        *ASK,
        first.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": c.id, "content": f"result of {c.function.name}"}
            for c in first.tool_calls
        ),
    ]
    assert history[1]["content"] == "Let me check."
    history[1]["content"] = None  # as most agents send it
    r = ask(client, history, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    tok = load_folder(str(hermes_folder), None).tokenizer._tokenizer
    sent = json.loads(json.dumps(history))
    for m in sent:
        m["content"] = m["content"] or ""
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    want = tok.apply_chat_template(sent, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in want and "result of get_time" in want
    assert r.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))


def test_a_fenced_json_call_naming_a_tool_is_a_tool_call(tmp_path):
    folder = write_scripted_folder(tmp_path / "fenced", FENCED)
    with running_server("--model", str(folder)) as s:
        c = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=60)
        whole = ask(c, tools=TOOLS).choices[0]
        assert whole.message.content == "I will look that up."
        assert calls_of(whole.message) == [("get_weather", {"city": "Oslo"})]
        streamed = streamed_calls(ask(c, tools=TOOLS, stream=True))
        assert [(name, json.loads(args)) for _, name, args, _ in streamed] == calls_of(whole.message)
        renamed = [{**TOOLS[1]}]  # get_weather is not a tool of this request: the block stays text
        plain = ask(c, tools=renamed).choices[0]
        assert plain.message.tool_calls is None and "```json" in plain.message.content


# -- refused requests --------------------------------------------------------------------------
HOSTILE_TOOLS = [
    ({"tools": [{"type": "function", "function": {"description": "nameless"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     'tools.0.function.parameters: the type must be "object"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["x"]}}}]},
     "tools.0.function.parameters: properties must be an object of schemas"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [[]]}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 7}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "orphan"}]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "no id"}]}, "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None}]}, "content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function",
       "function": {"name": "get_time", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "get_time"}]}, "tool_calls"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}},
     "response_format.json_schema.schema: unsupported schema feature(s): not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs: needs logprobs: true"),
]  # fmt: skip


@pytest.mark.parametrize("fields, says", HOSTILE_TOOLS, ids=range(len(HOSTILE_TOOLS)))
def test_hostile_tools_history_and_schemas_get_a_400_naming_the_field(hermes, fields, says):
    body = {"messages": ASK, "max_tokens": 4, **fields}
    status, _, raw = hermes.raw("POST", "/v1/chat/completions", json.dumps(body))
    assert status == 400, raw
    assert_error_body(status, raw, "/v1/chat/completions")
    assert says in json.loads(raw)["error"]["message"]
    assert hermes.alive()


def test_structured_output_and_logprobs_requests_are_answered_in_openais_shapes(hermes):
    body = {"messages": ASK, "max_tokens": 48, "response_format": {"type": "json_object"}}
    status, out = hermes.post("/v1/chat/completions", body)
    choice = out["choices"][0]
    assert status == 200 and choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    status, out = hermes.post(
        "/v1/chat/completions", {"messages": ASK, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    )
    content = out["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == out["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    status, out = hermes.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 2})
    lp = out["choices"][0]["logprobs"]
    assert (
        status == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == out["usage"]["completion_tokens"]
    )
    assert hermes.alive()


def test_a_model_whose_template_has_no_tools_refuses_them_by_name(tmp_path):
    from scripted_model import PLAIN_TEMPLATE

    folder = write_scripted_folder(tmp_path / "plain", {"\n": ["Hello there."]}, template=PLAIN_TEMPLATE)
    with running_server("--model", str(folder)) as s:
        status, _, raw = s.raw("POST", "/v1/chat/completions", json.dumps({"messages": ASK, "tools": TOOLS}))
        assert status == 400 and "does not render tools" in json.loads(raw)["error"]["message"]
        status, body = s.post(
            "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}
        )
        assert status == 200 and body["choices"][0]["message"]["content"] == "Hello there."


def test_tools_template_still_answers_plain_chat(client):
    assert TOOLS_TEMPLATE  # the hermes model, asked without tools, writes its text as content
    r = ask(client)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.startswith(
        "Let me check."
    )
