"""``hf2q-py serve``: the real server process on a free loopback port, talked
to with the official ``openai`` client (and raw HTTP where the client cannot
misbehave enough)."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import openai
import pytest
from helpers import assert_same_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from server_process import running_server, server_command, stop

import hf2q_py
from hf2q_py.generation import encode_messages

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
EDIT = "Rename x to y in this function:\n\ndef scale(x, factor):\n    return x * factor + x\n"
TOKENS = {"hf2q": {"return_tokens": True}}


@pytest.fixture(scope="module")
def smol():
    return hf2q_py.load()


@pytest.fixture(scope="module")
def server():
    with running_server("--max-body-bytes", "256KiB", "--max-context", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, max_tokens=32, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def tokens_of(response) -> list[int]:
    return response.model_extra["hf2q"]["tokens"]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- answers ---------------------------------------------------------------------
def test_a_chat_completion_equals_generate_for_the_same_message(client, smol):
    r = chat(client, user(EDIT), extra_body=TOKENS)
    ids = hf2q_py.encode_prompt(smol, EDIT)
    want = hf2q_py.generate(smol, ids, max_tokens=32, method="baseline")
    assert_same_greedy(smol.model, ids, tokens_of(r), want.tokens)
    if tokens_of(r) == want.tokens:
        assert r.choices[0].message.content == want.text
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tokens_of(r))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["hf2q"]["method"] == "ngram"


def test_text_parts_and_a_system_message_go_through_the_chat_template(client, smol):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}],
        },
    ]
    r = chat(client, messages, max_tokens=8, extra_body=TOKENS)
    ids = encode_messages(
        smol,
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
        ],
    )
    assert r.usage.prompt_tokens == len(ids)
    assert_same_greedy(
        smol.model, ids, tokens_of(r), hf2q_py.generate(smol, ids, max_tokens=8, method="baseline").tokens
    )


def test_a_text_completion_equals_generate_without_the_chat_template(client, smol):
    prompt = "def fibonacci(n):\n"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=TOKENS)
    ids = hf2q_py.encode_prompt(smol, prompt, chat_template=False)
    want = hf2q_py.generate(smol, ids, max_tokens=24, method="baseline")
    assert r.object == "text_completion"
    assert_same_greedy(smol.model, ids, tokens_of(r), want.tokens)
    assert r.usage.prompt_tokens == len(ids)


def test_stop_strings_end_the_text_before_them(client):
    whole = chat(client, user("Count from 1 to 10, separated by commas."), max_tokens=40)
    text = whole.choices[0].message.content
    assert "5" in text, text
    cut = chat(client, user("Count from 1 to 10, separated by commas."), max_tokens=40, stop=["5"])
    kept = cut.choices[0].message.content
    assert text.startswith(kept) and "5" not in kept and cut.choices[0].finish_reason == "stop"
    assert text[len(kept) : text.index("5")].strip() == ""  # at most the text of the token holding "5"


def test_streaming_gives_the_whole_responses_text_and_ends_with_usage(client):
    messages = user("Write a short poem about rivers.")
    whole = chat(client, messages, max_tokens=40)
    chunks = list(chat(client, messages, max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finish[0].model_extra["hf2q"]["method"] == "ngram"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_the_event_stream_is_openais_chunk_format_ending_with_done(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "stream": True}
    status, headers, raw = server.raw("POST", "/v1/completions", json.dumps(body))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_text_never_splits_a_character(client):
    chunks = chat(client, user("Reply with three emoji and the word café."), max_tokens=24, stream=True)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert pieces and all("\ufffd" not in p for p in pieces)


# -- across requests -------------------------------------------------------------
def test_a_follow_up_turn_reuses_the_conversation_and_matches_a_fresh_generation(client, smol):
    first = chat(client, user(EDIT), max_tokens=40)
    answer = first.choices[0].message.content
    conversation = [
        *user(EDIT),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now add a docstring to it."},
    ]
    second = chat(client, conversation, max_tokens=40, extra_body=TOKENS)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert second.model_extra["hf2q"]["cached_tokens"] == cached
    ids = encode_messages(smol, conversation)
    want = hf2q_py.generate(smol, ids, max_tokens=40, method="baseline").tokens
    assert_same_greedy(smol.model, ids, tokens_of(second), want)


def test_a_retried_request_is_drafted_from_its_first_answer(client):
    messages = user(
        "Rename total to acc in: def f(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n"
    )
    first = chat(client, messages, max_tokens=48)
    again = chat(client, messages, max_tokens=48)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    spec = again.model_extra["hf2q"]
    assert spec["accepted"] >= again.usage.completion_tokens - 2
    assert spec["rounds"] <= 4


def test_eight_concurrent_clients_share_forwards_and_each_gets_the_answer_it_gets_alone(server, smol):
    prompts = ["Name three colors.", "What is 2 + 2?", "Say hello in French.", EDIT]
    want = {}
    for p in prompts:
        ids = hf2q_py.encode_prompt(smol, p)
        want[p] = (ids, hf2q_py.generate(smol, ids, max_tokens=16, method="baseline").tokens)
    before = batch_rounds(server)
    got: dict[int, tuple[str, list[int]]] = {}

    def ask(i: int, p: str) -> None:
        c = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
        got[i] = (p, tokens_of(chat(c, user(p), max_tokens=16, extra_body=TOKENS)))

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 8
    for p, tokens in got.values():
        ids, solo = want[p]
        assert_same_greedy(smol.model, ids, tokens, solo)
    after = batch_rounds(server)
    shared = sum(n - before.get(size, 0) for size, n in after.items() if size > 1)
    assert shared > 0, "concurrent requests should have shared forwards"


def batch_rounds(server) -> dict[int, float]:
    """The server's batched forwards by batch size (from /metrics)."""
    raw = server.raw("GET", "/metrics")[2].decode()
    return {
        int(s.labels["size"]): s.value
        for f in text_string_to_metric_families(raw)
        for s in f.samples
        if s.name == "hf2q_batch_rounds_total"
    }


def long_stream(server) -> http.client.HTTPConnection:
    """A connection streaming a long story, its first chunks read: it is generating."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "messages": user("Write a very long story about a dragon."), "max_tokens": 1500,
            "stream": True}  # fmt: skip
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read1(200)
    return conn


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_one_beside_it(server, smol):
    conn = long_stream(server)
    got = {}

    def ask() -> None:
        c = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
        got["tokens"] = tokens_of(chat(c, user(EDIT), max_tokens=24, extra_body=TOKENS))

    beside = threading.Thread(target=ask)
    beside.start()
    time.sleep(1.0)
    conn.sock.close()  # leaves while the other request runs beside it
    conn.close()
    beside.join(120)
    ids = hf2q_py.encode_prompt(smol, EDIT)
    assert_same_greedy(smol.model, ids, got["tokens"], hf2q_py.generate(smol, ids, max_tokens=24).tokens)


def test_a_client_that_leaves_mid_stream_frees_the_worker_for_the_next_request(server, client):
    conn = long_stream(server)
    conn.sock.close()
    conn.close()
    t0 = time.perf_counter()
    r = chat(client, user("What is the capital of France?"), max_tokens=8)
    assert "Paris" in r.choices[0].message.content
    assert time.perf_counter() - t0 < 30  # 1500 tokens would take minutes on this CPU


# -- structured output and logprobs -----------------------------------------------
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
#: A prompt whose context holds JSON to copy drafts from.
AS_JSON = 'Reply with JSON like {"name": "Bo", "age": 7}.\nDescribe Ada, who is 36.'


def test_json_schema_and_json_object_answers_validate_and_speculation_still_drafts(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, user(AS_JSON), max_tokens=64, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.model_extra["hf2q"]["drafted"] > 0
    r = chat(client, user("Give me a JSON object describing a cat."), max_tokens=64,
             response_format={"type": "json_object"})  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_logprobs_equal_the_in_process_generations_and_stream_alike(client, smol):
    r = chat(client, user(EDIT), max_tokens=16, logprobs=True, top_logprobs=3, extra_body=TOKENS)
    ids = hf2q_py.encode_prompt(smol, EDIT)
    want = hf2q_py.generate(smol, ids, max_tokens=16, logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(tokens_of(r))
    if tokens_of(r) == want.tokens:
        for got, e in zip(content, want.logprobs):
            assert got.logprob == pytest.approx(e.logprob, abs=1e-3)
            assert len(got.top_logprobs) == 3 and got.top_logprobs[0].logprob >= got.top_logprobs[-1].logprob
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user(EDIT),
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == text.usage.completion_tokens
    assert "".join(lp.tokens).lstrip() == text.choices[0].text  # mlx-lm's detokenizer drops a leading space


# -- choosing the method ---------------------------------------------------------
def test_a_request_chooses_its_method_in_the_hf2q_field(client):
    plain = chat(client, user(EDIT), extra_body={"hf2q": {"method": "baseline"}})
    assert plain.model_extra["hf2q"]["method"] == "baseline" and plain.model_extra["hf2q"]["drafted"] == 0
    fixed = chat(client, user(EDIT), extra_body={"hf2q": {"method": "ngram:k=4,fixed"}})
    assert fixed.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("method", "says"),
    [
        ("bogus", "unknown method"),
        ("ngram:k=0", "k"),
        ("draft:k=8", "--draft-model"),
        ("draft:draft=/etc/passwd", "chosen when the server starts"),
        ("layerskip:skip_layers=[99]", "layer"),
    ],
)
def test_a_bad_method_spec_is_a_400_naming_the_problem(server, method, says):
    body = {"model": MODEL, "messages": user("Hi"), "max_tokens": 4, "hf2q": {"method": method}}
    status, err = server.post("/v1/chat/completions", body)
    assert status == 400 and says in err["error"]["message"]


# -- limits and bad input --------------------------------------------------------
def test_a_prompt_past_the_context_is_refused_and_a_large_max_tokens_is_cut_to_the_room_left(server):
    status, err = server.post("/v1/completions", {"model": MODEL, "prompt": "word " * 2100, "max_tokens": 4})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert err["error"]["message"].startswith("prompt is too long")
    body = {"model": MODEL, "messages": user("What is the capital of France?"), "max_tokens": 32768}
    status, out = server.post("/v1/chat/completions", body)  # the context holds 2048: cut, not refused
    assert status == 200 and "Paris" in out["choices"][0]["message"]["content"]


def test_max_tokens_past_the_context_is_cut_to_what_the_context_leaves(server):
    prompt = "word " * 2030  # 2031 tokens: 17 left of the 2048-token context
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 32000}
    status, body = server.post("/v1/completions", request, timeout=300)  # a 2031-token prefill
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 2048
    assert body["choices"][0]["finish_reason"] == "length"


def test_an_oversized_body_gets_a_413_the_client_can_read(server):
    body = json.dumps({"model": MODEL, "prompt": "x" * (300 << 10)})
    status, _, raw = server.raw("POST", "/v1/completions", body)
    assert status == 413 and "limit" in json.loads(raw)["error"]["message"]
    assert server.alive()


HOSTILE = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'"text"',
    b"\xff\xfe\x00garbage",
    b'{"messages": "hi"}',
    b'{"messages": []}',
    b'{"messages": [{"role": "user"}]}',
    b'{"messages": [{"role": "wizard", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": 5}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
    b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": [""]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
    b'{"messages": [{"role": "user", "content": "hi"}], "hf2q": {"methd": "ngram"}}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}',
    b'{"prompt": [99999999]}',
    b'{"prompt": []}',
    b'{"prompt": ["a", "b"]}',
    b"[" * 10000 + b"]" * 10000,
]


def assert_error_body(status: int, raw: bytes, path: str) -> None:
    assert 400 <= status < 500, (status, raw[:300], path)
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    text = raw.decode()
    assert "Traceback" not in text and "site-packages" not in text and "hf2q_py/" not in text


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_get_an_openai_error_and_the_server_keeps_answering(server, body):
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    started = time.perf_counter()
    status, _, raw = server.raw("POST", path, body)
    assert_error_body(status, raw, path)
    assert time.perf_counter() - started < 5
    assert server.alive()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
           "stream_options", "top_k", "min_p", "repetition_penalty", "hf2q", "prompt", "logprobs"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6), chat_path=st.booleans())
def test_fuzzed_requests_never_crash_the_server(server, fields, chat_path):
    body = {**fields, "max_tokens": 1} if "max_tokens" not in fields else fields
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 2)
    path = "/v1/chat/completions" if chat_path else "/v1/completions"
    status, _, raw = server.raw("POST", path, json.dumps(body))
    if status != 200:
        assert_error_body(status, raw, path)
    assert server.raw("GET", "/health")[0] == 200


def test_unknown_endpoints_and_methods_answer_in_the_same_error_shape(server):
    for method, path, want in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        status, _, raw = server.raw(method, path)
        assert status == want
        assert_error_body(status, raw, path)


def test_models_health_and_metrics(server, client):
    assert [(m.id, m.model_extra["max_model_len"]) for m in client.models.list().data] == [(MODEL, 2048)]
    assert json.loads(server.raw("GET", "/health")[2]) == {"status": "ok"}
    chat(client, user("Hi there"), max_tokens=4)
    chat(client, user("Hi there"), max_tokens=4)
    status, headers, raw = server.raw("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(raw.decode())
        for s in family.samples
    }
    ok = (("endpoint", "/v1/chat/completions"), ("status", "200"))
    assert samples[("hf2q_requests_total", ok)] >= 2
    assert samples[("hf2q_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))] >= 1
    assert samples[("hf2q_generation_tokens_total", ())] >= 8
    assert samples[("hf2q_spec_drafted_tokens_total", (("method", "ngram"),))] > 0
    assert samples[("hf2q_spec_accepted_tokens_total", (("method", "ngram"),))] > 0
    assert samples[("hf2q_time_to_first_token_seconds_count", ())] >= 2
    assert samples[("hf2q_prompt_cache_hits_total", ())] >= 1
    assert samples[("hf2q_prompt_cache_reused_tokens_total", ())] > 0
    assert samples[("hf2q_prompt_cache_bytes", ())] > 0
    assert samples[("hf2q_queue_depth", ())] == 0


def test_a_request_naming_any_model_is_answered_by_the_served_one(client):
    r = client.chat.completions.create(
        model="gpt-4o", messages=user("Hi"), max_tokens=2, temperature=0
    )  # as mlx_lm.server and llama-server answer
    assert r.model == MODEL and r.usage.completion_tokens >= 1


# -- a guarded server: API key, queue limit ---------------------------------------
@pytest.fixture(scope="module")
def guarded():
    from hf2q_py.loaders.builtin import builtin_model_path

    with running_server(
        "--api-key",
        "s3cret",
        "--max-queue",
        "1",
        "--max-batch",
        "1",
        "--draft-model",
        str(builtin_model_path()),
    ) as s:
        yield s


def test_a_request_chooses_the_draft_model_the_server_was_started_with(guarded):
    good = openai.OpenAI(base_url=guarded.base, api_key="s3cret", max_retries=0, timeout=120)
    plain = chat(good, user(EDIT), max_tokens=24, extra_body={"hf2q": {"method": "baseline"}})
    drafted = chat(good, user(EDIT), max_tokens=24, extra_body={"hf2q": {"method": "draft:k=4,fixed"}})
    assert drafted.model_extra["hf2q"]["method"] == "draft:k=4,fixed"
    assert drafted.model_extra["hf2q"]["drafted"] > 0
    assert drafted.choices[0].message.content == plain.choices[0].message.content


def test_the_api_key_is_needed_everywhere_but_health(guarded):
    for path in ("/v1/models", "/metrics"):
        status, headers, raw = guarded.raw("GET", path)
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        assert_error_body(status, raw, path)
        assert guarded.raw("GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert guarded.raw("GET", "/health")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.base, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=guarded.base, api_key="s3cret", max_retries=0, timeout=120)
    assert chat(good, user("Hi"), max_tokens=2).usage.completion_tokens >= 1


def test_requests_past_the_queue_limit_are_refused_at_once(guarded):
    auth = {"Content-Type": "application/json", "Authorization": "Bearer s3cret"}
    body = json.dumps(
        {"model": MODEL, "messages": user("Tell a long story."), "max_tokens": 1500, "stream": True}
    )
    running = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=60)
    running.request("POST", "/v1/chat/completions", body, auth)
    resp = running.getresponse()
    resp.read1(100)  # generating
    waiting = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=60)
    waiting.request("POST", "/v1/chat/completions", body, auth)
    deadline = time.monotonic() + 10  # the second request waits for the model (--max-batch 1)
    while queue_depth(guarded, auth) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    status, _, raw = guarded.raw("POST", "/v1/chat/completions", body, headers=auth)
    assert status == 503 and time.perf_counter() - t0 < 3
    assert "busy" in json.loads(raw)["error"]["message"]
    for conn in (waiting, running):
        conn.sock.close()
        conn.close()
    deadline = time.monotonic() + 10  # the server sees the waiting client leave: its place is free
    while queue_depth(guarded, auth) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queue_depth(guarded, auth) == 0
    good = openai.OpenAI(base_url=guarded.base, api_key="s3cret", max_retries=0, timeout=120)
    assert (
        "Paris" in chat(good, user("What is the capital of France?"), max_tokens=8).choices[0].message.content
    )


def queue_depth(server, headers) -> float:
    raw = server.raw("GET", "/metrics", headers=headers)[2].decode()
    return next(
        s.value
        for f in text_string_to_metric_families(raw)
        for s in f.samples
        if s.name == "hf2q_queue_depth"
    )


# -- the process ------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_server_cleanly_even_mid_stream(sig):
    with running_server() as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        body = {"model": MODEL, "messages": user("Tell a long story."), "max_tokens": 1500, "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read1(100)
        t0 = time.perf_counter()
        assert stop(s.process, sig) == 0
        assert time.perf_counter() - t0 < 15
        rest = resp.read().decode()
        assert "shutting down" in rest or rest == ""
        conn.close()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--port", "70000"], "port"),
        (["--max-body-bytes", "lots"], "size"),
        (["--method", "bogus"], "unknown method"),
        (["--api-key", ""], "API key"),
        (["--model", "/nonexistent/model.gguf"], "nonexistent"),
        (["--draft-model", "/nonexistent/draft.gguf"], "nonexistent"),
        (["--method", "ngram;baseline"], "one method spec"),
        (["--k", "8", "--method", "baseline"], "--k"),
    ],
)
def test_bad_server_flags_are_one_line_errors(flags, says):
    import subprocess

    out = subprocess.run(server_command(*flags), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and says in out.stderr


def test_a_port_in_use_is_refused_before_the_model_loads(server):
    import subprocess

    t0 = time.perf_counter()
    out = subprocess.run(
        server_command("--port", str(server.port)), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "cannot listen" in out.stderr
    assert time.perf_counter() - t0 < 10


def test_a_client_that_leaves_before_a_whole_response_frees_the_worker(server, client):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "messages": user("Write a very long story about a whale."), "max_tokens": 1500}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(1.0)  # generating
    conn.sock.close()
    conn.close()
    t0 = time.perf_counter()
    r = chat(client, user("What is the capital of France?"), max_tokens=8)
    assert "Paris" in r.choices[0].message.content
    assert time.perf_counter() - t0 < 30
