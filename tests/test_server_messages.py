"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
through the real ``hf2q-py serve`` process and the official ``anthropic``
client: scripted models (``scripted_model.py``) for tools, stop sequences,
the token budget, the prompt cache and bad input; the built-in model where
the answer must be a real model's (the same tokens through both APIs, clients
that leave)."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from scripted_model import write_scripted_folder
from server_process import running_server, stop
from test_server_tools import HERMES, TOOLS, WEATHER

from hf2q_py.loaders.folder import load_folder
from hf2q_py.server.conversation import system_as_user

KEY = "sk-test-key"
TOOLS_A = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"], "cache_control": {"type": "ephemeral"}} for t in TOOLS]  # fmt: skip
ASK = [{"role": "user", "content": "What's the weather in Paris, and the time?"}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={};"
#: A ChatML template that refuses a system message past the start, and whose thinking switch
#: (mlx-lm passes ``enable_thinking``, False for a model without thinking tokens) opens a think block.
STRICT_TEMPLATE = """{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}{{ raise_exception('a system message must come first') }}{%- endif %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking %}<think>
{% endif %}{% endif %}"""
#: The plain model's answer: a greeting, then more words than its context holds.
PLAIN = {"\n": ["Hello", " there", ", friend", ". Bye.", *(f" w{i:03d}" for i in range(450))]}
CONTEXT = 400


@pytest.fixture(scope="module")
def hermes_folder(tmp_path_factory):
    return write_scripted_folder(tmp_path_factory.mktemp("hermes"), HERMES)


@pytest.fixture(scope="module")
def hermes(hermes_folder):
    with running_server("--model", str(hermes_folder)) as s:
        yield s


@pytest.fixture(scope="module")
def claude(hermes):
    return anthropic.Anthropic(base_url=hermes.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    return write_scripted_folder(tmp_path_factory.mktemp("plain"), PLAIN, template=STRICT_TEMPLATE)


@pytest.fixture(scope="module")
def plain(plain_folder):
    with running_server("--model", str(plain_folder), "--max-context", str(CONTEXT), "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(plain):
    return anthropic.Anthropic(base_url=plain.url, api_key=KEY, max_retries=0, timeout=60)


def say(client, messages=ASK, max_tokens=256, **kw):
    return client.messages.create(model="claude-sonnet-4-5", max_tokens=max_tokens, messages=messages, **kw)


def blocks(message) -> list[tuple]:
    """A message's content, ids left out: (type, text) or (type, name, input)."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]


WANT = [
    ("text", "Let me check."),
    ("tool_use", "get_weather", WEATHER),
    ("tool_use", "get_time", {"zone": "CET"}),
]


# -- answers ------------------------------------------------------------------------------------
def test_a_message_carries_text_and_tool_use_blocks(claude):
    m = say(claude, tools=TOOLS_A)
    assert blocks(m) == WANT and m.stop_reason == "tool_use" and m.stop_sequence is None
    assert m.role == "assistant" and m.type == "message" and m.id.startswith("msg_")
    ids = [b.id for b in m.content if b.type == "tool_use"]
    assert len(set(ids)) == 2 and all(i.startswith("toolu_") for i in ids)
    counted = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=ASK, tools=TOOLS_A)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert m.usage.output_tokens == 9  # the script's tokens after the generation prompt


def test_a_stream_gives_the_same_message_and_writes_calls_as_they_come(claude):
    plain = {"hf2q": {"method": "baseline"}}  # a token a round (speculation may write a call in one round)
    with claude.messages.stream(
        model="claude-x", max_tokens=256, messages=ASK, tools=TOOLS_A, extra_body=plain
    ) as s:
        events = list(s)
        final = s.get_final_message()
    assert blocks(final) == WANT and final.stop_reason == "tool_use"
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1]
    assert partial == ['{"city": "Paris", ', '"unit": "celsius"}']  # as the model wrote them
    kinds = [e.type for e in events if e.type.startswith(("message", "content_block"))]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    counted = claude.messages.count_tokens(model="claude-x", messages=ASK, tools=TOOLS_A).input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted
    assert final.usage.output_tokens == 9


def test_tool_results_round_trip_as_the_templates_tool_messages(claude, hermes, hermes_folder):
    first = say(claude, tools=TOOLS_A)
    calls = [b for b in first.content if b.type == "tool_use"]
    history = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id, "content": "18 C"},
            {"type": "tool_result", "tool_use_id": calls[1].id, "content": [{"type": "text", "text": "14:00"}], "is_error": False},
        ]},
    ]  # fmt: skip
    second = say(claude, history, tools=TOOLS_A)
    assert second.stop_reason == "tool_use"
    oa = openai.OpenAI(base_url=hermes.base, api_key="unused", max_retries=0, timeout=60)
    same = [
        *ASK,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.input)}} for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "14:00"},
    ]  # fmt: skip
    r = oa.chat.completions.create(model="m", messages=same, tools=TOOLS, max_tokens=4)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == r.usage.prompt_tokens
    tok = load_folder(str(hermes_folder), None).tokenizer._tokenizer
    sent = [dict(m) for m in same]
    sent[1]["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                             for c in sent[1]["tool_calls"]]  # fmt: skip
    text = tok.apply_chat_template(sent, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert (
        "18 C" in text
        and "14:00" in text
        and r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    )


@pytest.mark.parametrize(
    "choice, want",
    [
        ({"type": "any"}, WANT[1:]),
        ({"type": "tool", "name": "get_time"}, [("tool_use", "get_time", {"zone": "UTC"})]),
        ({"type": "auto", "disable_parallel_tool_use": True}, WANT[:2]),
    ],
    ids=["any", "named", "one-call"],
)
def test_tool_choice_forces_or_limits_calls(claude, choice, want):
    m = say(claude, tools=TOOLS_A, tool_choice=choice)
    assert blocks(m) == want and m.stop_reason == "tool_use"
    counted = claude.messages.count_tokens(model="x", messages=ASK, tools=TOOLS_A, tool_choice=choice)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_tool_choice_none_answers_in_text(claude):
    m = say(claude, tools=TOOLS_A, tool_choice={"type": "none"})
    assert [b.type for b in m.content] == ["text"] and "<tool_call>" in m.content[0].text
    assert m.stop_reason == "end_turn"


def test_a_stop_sequence_ends_the_answer_and_is_named(keyed, plain):
    hi = [{"role": "user", "content": "Hi"}]
    m = say(keyed, hi, 64, stop_sequences=["friend", "never"])
    assert (
        blocks(m) == [("text", "Hello there")]
        and m.stop_reason == "stop_sequence"
        and m.stop_sequence == "friend"
    )
    with keyed.messages.stream(model="x", max_tokens=64, messages=hi, stop_sequences=["friend"]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, blocks(final)) == ("stop_sequence", "friend", blocks(m))
    oa = openai.OpenAI(base_url=plain.base, api_key=KEY, max_retries=0, timeout=60)
    r = oa.chat.completions.create(model="m", messages=hi, max_tokens=64, stop=["friend"])
    assert r.choices[0].message.content == "Hello there" and r.choices[0].finish_reason == "stop"


def test_a_last_assistant_message_is_the_start_the_answer_continues(keyed):
    m = say(keyed, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], 2)
    assert blocks(m) == [("text", " there, friend")]  # the model's words after "Hello"


def test_a_max_tokens_past_the_context_is_cut_to_what_it_leaves_on_both_apis(keyed, plain):
    hi = [{"role": "user", "content": "Hi"}]
    m = say(keyed, hi, 128000)
    assert m.stop_reason == "max_tokens" and m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens == CONTEXT  # fmt: skip
    oa = openai.OpenAI(base_url=plain.base, api_key=KEY, max_retries=0, timeout=60)
    r = oa.chat.completions.create(model="m", messages=hi, max_tokens=32768)
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == CONTEXT
    with pytest.raises(anthropic.BadRequestError) as e:
        say(keyed, [{"role": "user", "content": "x" * CONTEXT}], 8)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("prompt is too long")


def test_the_billing_nonce_does_not_stop_the_next_turn_reusing_the_conversation(keyed, plain):
    def system(nonce: str) -> list[dict]:
        return [{"type": "text", "text": BILLING.format(nonce)}, {"type": "text", "text": "Be brief."}]

    first = say(keyed, [{"role": "user", "content": "Hi"}], 4, system=system("36ee5"))
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.content},
            {"role": "user", "content": "More."}]  # fmt: skip
    second = say(keyed, turn, 4, system=system("0aaa9"))
    before = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= before  # the whole first turn, billing line and all
    assert (
        second.usage.input_tokens <= 30
    )  # only the new turn (26 tokens, one a character) and the last answer token
    oa = openai.OpenAI(base_url=plain.base, api_key=KEY, max_retries=0, timeout=60)
    chat = [
        {"role": "system", "content": BILLING.format("11111") + "\nBe terse."},
        {"role": "user", "content": "Yo"},
    ]
    r1 = oa.chat.completions.create(model="m", messages=chat, max_tokens=4)
    chat[0]["content"] = BILLING.format("22222") + "\nBe terse."
    r2 = oa.chat.completions.create(model="m", messages=[*chat, {"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "And?"}], max_tokens=4)  # fmt: skip
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens


def test_a_system_message_inside_messages_stays_in_its_place(claude, hermes, keyed, plain_folder):
    convo = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Reply in French."},
             {"role": "user", "content": "Weather?"}]  # fmt: skip
    oa = openai.OpenAI(base_url=hermes.base, api_key="unused", max_retries=0, timeout=60)
    r = oa.chat.completions.create(model="m", messages=convo, max_tokens=2)
    assert claude.messages.count_tokens(model="x", messages=convo).input_tokens == r.usage.prompt_tokens
    # A template that refuses it there: its text in the user turn after it.
    m = say(keyed, convo, 4)
    assert m.stop_reason == "max_tokens"
    tok = load_folder(str(plain_folder), None).tokenizer._tokenizer
    moved = tok.apply_chat_template(system_as_user(convo), add_generation_prompt=True, tokenize=False)
    assert "<system-reminder>\nReply in French.\n</system-reminder>\n\nWeather?" in moved
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(
        tok.encode(moved, add_special_tokens=False)
    )


def test_thinking_reaches_a_templates_switch_and_nothing_else(claude, keyed):
    hi = [{"role": "user", "content": "Hi"}]

    def count(client, **kw) -> int:
        return client.messages.count_tokens(model="x", messages=hi, **kw).input_tokens

    off, on = count(keyed, thinking={"type": "disabled"}), count(keyed, thinking={"type": "adaptive"})
    assert (
        on == off + len("<think>\n") and count(keyed) == off
    )  # one token a character; mlx-lm's default: off
    assert count(claude, thinking={"type": "disabled"}) == count(claude) == count(claude, thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip


def test_the_api_key_is_read_from_x_api_key_or_bearer(plain):
    hi = [{"role": "user", "content": "Hi"}]
    assert say(
        anthropic.Anthropic(base_url=plain.url, auth_token=KEY, max_retries=0, timeout=60), hi, 2
    ).content
    with pytest.raises(anthropic.AuthenticationError) as e:
        say(anthropic.Anthropic(base_url=plain.url, api_key="wrong", max_retries=0, timeout=60), hi, 2)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]}}  # fmt: skip
    listed = anthropic.Anthropic(base_url=plain.url, api_key=KEY, max_retries=0, timeout=60).models.list()
    assert [(m.id, m.type) for m in listed.data] == [
        (json.loads(plain.raw("GET", "/v1/models", headers={"x-api-key": KEY})[2])["data"][0]["id"], "model")
    ]
    status, _, raw = plain.raw("GET", "/v1/models")
    assert status == 401 and set(json.loads(raw)) == {"error"}  # OpenAI's envelope off the Messages paths


# -- a Claude Code request, as it sends it ---------------------------------------------------------
CLAUDE_CODE = {
    "model": "claude-sonnet-4-5-20250929", "max_tokens": 128000, "stream": True,
    "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": "user_abc_account__session_123"},
    "system": [
        {"type": "text", "text": BILLING.format("fa690")},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "system", "content": "<env>Working directory: /repo\nPlatform: linux</env>"},
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be concise.</system-reminder>"},
            {"type": "text", "text": "What's the weather in Paris, and the time?", "cache_control": {"type": "ephemeral"}}]},
    ],
    "tools": [*TOOLS_A, {"name": "Bash", "description": "Run a command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}],
    "tool_choice": {"type": "auto"},
}  # fmt: skip


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for part in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in part.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_a_claude_code_request_streams_its_answer(hermes):
    status, headers, raw = hermes.raw("POST", "/v1/messages?beta=true", json.dumps(CLAUDE_CODE),
                                      headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"})  # fmt: skip
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert [b["content_block"]["type"] for n, b in events if n == "content_block_start"] == [
        "text",
        "tool_use",
        "tool_use",
    ]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] == 9
    start = events[0][1]["message"]
    status, _, counted = hermes.raw("POST", "/v1/messages/count_tokens?beta=true", json.dumps(CLAUDE_CODE))
    assert status == 200 and json.loads(counted)["input_tokens"] == start["usage"]["input_tokens"]
    assert (
        delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
        == start["usage"]["input_tokens"]
    )


# -- bad input ---------------------------------------------------------------------------------------
def body(**fields) -> bytes:
    return json.dumps(
        {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **fields}
    ).encode()


HOSTILE = [
    (b"", "the request body"), (b"{", "not valid JSON"), (b"null", "the request body"), (b"[]", "the request body"),
    (b'"text"', "the request body"), (body(messages=None), "messages"), (body(messages="hi"), "messages"),
    (body(messages=[5]), "messages.0"), (body(messages=[{}]), "messages.0.role"),
    (body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
    (body(messages=[{"role": "user", "content": None}]), "messages.0.content"),
    (body(messages=[{"role": "user", "content": 7}]), "messages.0.content"),
    (body(messages=[{"role": "user", "content": [{}]}]), "messages.0.content.0"),
    (body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), "unknown content block type 'hologram'"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
     "messages.0.content.0: an image block, but this model reads text only"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none", "content": "x"}]}]),
     "messages.0.content.0.tool_use_id"),
    (body(tools=[{"description": "nameless", "input_schema": {"type": "object"}}]), "tools.0.name"),
    (body(tools=[{"name": "f", "input_schema": {"type": "object", "properties": []}}]), "tools.0.input_schema"),
    (body(tools=[{"name": "f", "input_schema": "object"}]), "tools.0.input_schema"),
    (body(tool_choice={"type": "tool", "name": "missing"}), "tool_choice"),
    (body(max_tokens=None), "max_tokens"), (body(max_tokens="8"), "max_tokens"), (body(max_tokens=0), "max_tokens"),
    (body(temperature="hot"), "temperature"), (body(stop_sequences=[""]), "stop_sequences"),
    (body(stream="yes"), "stream"), (body(thinking={"type": "sometimes"}), "thinking.type"),
    (body(hf2q={"method": "nonsense:k=2"}), "nonsense"),
    (body(messages=[{"role": "user", "content": "x" * (CONTEXT + 10)}]), "prompt is too long"),
    (body(messages=[{"role": "user", "content": "\ud800"}]), "not valid Unicode"),
]  # fmt: skip


def assert_anthropic_error(status: int, raw: bytes, says: str) -> None:
    assert 400 <= status < 500, (status, raw[:300])
    err = json.loads(raw)
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert says in err["error"]["message"], err
    text = raw.decode()
    assert "Traceback" not in text and "site-packages" not in text and "hf2q_py/" not in text


@pytest.mark.parametrize("raw, says", HOSTILE, ids=range(len(HOSTILE)))
def test_bad_requests_get_anthropics_error_naming_the_problem(plain, raw, says):
    for path in ("/v1/messages", "/v1/messages?beta=true"):
        status, _, answer = plain.raw("POST", path, raw, headers={"x-api-key": KEY})
        assert status == 400
        assert_anthropic_error(status, answer, says)
    assert plain.alive()


def test_count_tokens_and_unknown_paths_answer_in_the_same_envelope(plain):
    status, _, raw = plain.raw("POST", "/v1/messages/count_tokens", b'{"messages": [{"role": "user", "content": 3}]}',
                               headers={"x-api-key": KEY})  # fmt: skip
    assert_anthropic_error(status, raw, "messages.0.content")
    status, _, raw = plain.raw("POST", "/v1/messages/batches", body(), headers={"x-api-key": KEY})
    assert_anthropic_error(status, raw, "no such endpoint")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_FIELDS = ["model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences", "temperature",
           "top_p", "top_k", "stream", "thinking", "output_config", "metadata"]  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=5))
def test_fuzzed_requests_never_crash_the_server(plain, fields):
    fields = {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **fields}
    status, _, raw = plain.raw("POST", "/v1/messages", json.dumps(fields), headers={"x-api-key": KEY})
    assert status == 200 or (400 <= status < 500 and json.loads(raw)["type"] == "error"), (status, raw[:300])


def test_metrics_count_messages_by_endpoint_and_their_tokens(claude, hermes):
    def sample(name: str, **labels) -> float:
        raw = hermes.raw("GET", "/metrics")[2].decode()
        return sum(s.value for f in text_string_to_metric_families(raw) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip

    before = (
        sample("hf2q_generation_tokens_total"),
        sample("hf2q_requests_total", endpoint="/v1/messages", status="200"),
    )
    counted = sample("hf2q_requests_total", endpoint="/v1/messages/count_tokens", status="200")
    m = say(claude, tools=TOOLS_A)
    claude.messages.count_tokens(model="x", messages=ASK)
    assert sample("hf2q_generation_tokens_total") == before[0] + m.usage.output_tokens
    assert sample("hf2q_requests_total", endpoint="/v1/messages", status="200") == before[1] + 1
    assert sample("hf2q_requests_total", endpoint="/v1/messages/count_tokens", status="200") == counted + 1


# -- the built-in model --------------------------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY_CONVERSATION = [
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "An apple."},
    {"role": "user", "content": "Rename x to y in: def f(x): return x + 1"},
]


@pytest.fixture(scope="module")
def builtin():
    with running_server("--max-batch", "1", "--max-context", "4096") as s:
        yield s


@pytest.mark.slow
def test_one_conversation_gets_the_same_tokens_through_both_apis(builtin):
    tokens = {"hf2q": {"return_tokens": True}}
    oa = openai.OpenAI(base_url=builtin.base, api_key="unused", max_retries=0, timeout=120)
    system = "You are a helpful coding assistant."
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system}, *GREEDY_CONVERSATION],
                                   max_tokens=24, temperature=0, extra_body=tokens)  # fmt: skip
    claude = anthropic.Anthropic(base_url=builtin.url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model="claude-x", system=system, messages=GREEDY_CONVERSATION, max_tokens=24,
                               extra_body={"temperature": 0, **tokens})  # fmt: skip
    assert m.model_extra["hf2q"]["tokens"] == r.model_extra["hf2q"]["tokens"]
    assert m.content[0].text == r.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == r.usage.prompt_tokens
    assert m.usage.output_tokens == r.usage.completion_tokens


def open_stream(server, text: str, max_tokens: int) -> http.client.HTTPConnection:
    """A streaming /v1/messages request whose message_start has been read."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    req = {
        "model": "claude-x",
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": text}],
    }
    conn.request("POST", "/v1/messages", json.dumps(req), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and b"message_start" in resp.read1(4096)
    conn.resp = resp
    return conn


def leave(conn: http.client.HTTPConnection) -> None:
    conn.sock.close()
    conn.close()


def capital(server) -> tuple[str, float]:
    """The answer to a short question, and how long it took."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    t0 = time.perf_counter()
    m = claude.messages.create(
        model="x", max_tokens=8, messages=[{"role": "user", "content": "What is the capital of France?"}]
    )
    return m.content[0].text, time.perf_counter() - t0


def lookups(server) -> float:
    raw = server.raw("GET", "/metrics")[2].decode()
    return sum(s.value for f in text_string_to_metric_families(raw) for s in f.samples
               if s.name == "hf2q_prompt_cache_lookups_total")  # fmt: skip


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_frees_its_row_for_the_request_waiting(builtin):
    conn = open_stream(builtin, "Write a very long story about a dragon.", 1500)
    while b"text_delta" not in conn.resp.read1(4096):
        pass  # generating
    got = {}
    waiting = threading.Thread(target=lambda: got.update(answer=capital(builtin)))
    waiting.start()  # --max-batch 1: it waits for the story's row
    time.sleep(1.0)
    left = time.perf_counter()
    leave(conn)
    waiting.join(120)
    text, _ = got["answer"]
    assert "Paris" in text
    assert time.perf_counter() - left < 20  # 1500 story tokens would take minutes on this CPU


@pytest.mark.slow
def test_a_client_that_leaves_while_prefilling_or_waiting_frees_the_model_and_the_waiting_never_starts(
    builtin,
):
    before = lookups(builtin)
    long = open_stream(
        builtin, "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 160, 200
    )
    time.sleep(1.0)  # prefilling its ~1,600 tokens, 256 a round
    queued = open_stream(builtin, "Write a poem.", 200)  # --max-batch 1: waits
    time.sleep(0.5)
    leave(queued)
    leave(long)
    text, seconds = capital(builtin)
    assert "Paris" in text and seconds < 15  # the long prompt's prefill alone takes longer here
    assert lookups(builtin) == before + 2  # the long prompt and the question started; the poem never did


@pytest.mark.slow
def test_a_failure_after_the_stream_began_is_an_error_event():
    with running_server() as server:
        conn = open_stream(server, "Write a very long story about a knight.", 1500)
        seen = b""
        while b"text_delta" not in seen:
            seen += conn.resp.read1(4096)
        server.process.send_signal(signal.SIGTERM)  # stopping: the running generation ends with an error
        rest = conn.resp.read()
        assert stop(server.process) == 0
    events = sse_events(seen + rest)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    assert "shutting down" in events[-1][1]["error"]["message"]
