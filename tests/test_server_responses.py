"""OpenAI's Responses API (``POST /v1/responses``) through the real ``hf2q-py
serve`` process and the official ``openai`` client (``client.responses``):
a scripted model for text, function, namespace and freeform (custom) tools,
a grammar-constrained freeform call under a speculating draft model,
structured output, stored responses, the probe, the WebSocket refusal,
usage and bad input; the built-in model where the answer must be a real
model's (the same tokens through three APIs, clients that leave)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from pathlib import Path

import anthropic
import jsonschema
import llguidance
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_model import TOOLS_TEMPLATE, tool_call_text, write_agent_folder, write_scripted_folder
from server_process import running_server
from test_server_tools import HERMES, TOOLS, WEATHER

from hf2q_py.constraints import ll_tokenizer
from hf2q_py.loaders.folder import load_folder

#: The scripted model's generation prompt ends in the last user message's last
#: character, which chooses the script (after a tool result: "\n").
TEMPLATE = TOOLS_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    '{% if messages[-1].role == "user" %}{{ messages[-1].content[-1:] }}{% endif %}{% endif %}',
)
CONTEXT = 2048
FIXTURES = Path(__file__).parent / "fixtures" / "agents"
PATCH_OPEN = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "'
SCRIPTS = {
    "?": HERMES["\n"],  # text, then two calls
    "\n": ["The weather", " is fine."],  # after a tool result
    "!": ['<tool_call>\n{"name": "multi_agent_v1__spawn_agent", ', '"arguments": {"message": "hi"}}\n</tool_call>'],
    # A patch whose added line lacks its "+": the grammar masks "hello\n", and the
    # model's second choice, "+hello\n", leads on to a valid patch (chain "^").
    "~": [PATCH_OPEN, "*** Begin Patch\\n", "*** Add File: a.txt\\n", "hello\\n"],
    "^": ["+hello\\n", "*** End Patch\\n", '"}}\n</tool_call>'],
    ".": ["Hello", " there", ", friend", ". Bye.", *(f" w{i:03d}" for i in range(200))],
    " ": ['{"input": "'],  # after a named call's opening; then (second choice) the patch
    "#": ["Hi", " there."],
    "{": ['{"city": ', '"Paris"}'],
}  # fmt: skip
SECOND = {"*** Add File: a.txt\\n": "+hello\\n", '{"input": "': "*** Begin Patch\\n"}
PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}  # fmt: skip
R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
NAMESPACE = {
    "type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
    "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn an agent.", "strict": False,
               "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}},
              {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}],
}  # fmt: skip
SKIPPED = [{"type": "web_search", "external_web_access": False}, {"type": "image_generation"},
           {"type": "file_search", "vector_store_ids": ["vs_1"]}, {"type": "code_interpreter", "container": {"type": "auto"}}]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_scripted_folder(tmp_path_factory.mktemp("responses"), SCRIPTS, TEMPLATE, second=SECOND)


@pytest.fixture(scope="module")
def server(folder):
    flags = ("--model", str(folder), "--max-context", str(CONTEXT), "--draft-model", str(folder))
    with running_server(*flags, "--method", "ngram") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)


def ask(client, prompt: str, **kw):
    return client.responses.create(model="gpt-x", input=prompt, **kw)


def items(response) -> list[tuple]:
    """A response's output items, ids left out."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        elif item.type == "function_call":
            out.append(("function_call", item.namespace, item.name, json.loads(item.arguments)))
        elif item.type == "custom_tool_call":
            out.append(("custom_tool_call", item.name, item.input))
        else:
            out.append((item.type,))
    return out


def chat_prompt_tokens(server, messages, tools=None) -> int:
    oa = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
    r = oa.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=1)
    return r.usage.prompt_tokens


# -- answers ------------------------------------------------------------------------------------
def test_a_response_carries_text_and_function_calls_with_ids(client):
    r = ask(client, "What's the weather in Paris, and the time?", tools=R_TOOLS)
    assert items(r) == [("message", "Let me check."), ("function_call", None, "get_weather", WEATHER),
                        ("function_call", None, "get_time", {"zone": "CET"})]  # fmt: skip
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    calls = [i for i in r.output if i.type == "function_call"]
    assert len({c.call_id for c in calls}) == 2 and all(c.call_id.startswith("call_") for c in calls)
    assert all(i.id for i in r.output) and len({i.id for i in r.output}) == 3
    assert r.usage.output_tokens == 9 and r.usage.total_tokens == r.usage.input_tokens + 9
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.output_text == "Let me check."


def test_a_stream_gives_the_same_response_event_by_event(client):
    plain = {"hf2q": {"method": "baseline"}}  # a token a round: the arguments arrive in pieces
    with client.responses.stream(model="x", input="What's the weather in Paris, and the time?",
                                 tools=R_TOOLS, extra_body=plain) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    whole = ask(client, "What's the weather in Paris, and the time?", tools=R_TOOLS)
    assert items(final) == items(whole) and final.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas[:2] == ['{"city": "Paris", ', '"unit": "celsius"}']  # as the model wrote them
    ids = {i.id for i in final.output}
    assert all(e.item_id in ids for e in events if hasattr(e, "item_id"))
    assert [e.text for e in events if e.type == "response.output_text.done"] == ["Let me check."]


def test_a_tool_round_trip_renders_the_history_as_the_chat_template_does(client, server):
    question = "What's the weather in Paris, and the time?"
    first = ask(client, question, tools=R_TOOLS)
    calls = [i for i in first.output if i.type == "function_call"]
    history = [{"role": "user", "content": question}, *[i.model_dump(exclude_none=True) for i in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"},
               {"type": "function_call_output", "call_id": calls[1].call_id, "output": [{"type": "input_text", "text": "14:00"}]}]  # fmt: skip
    second = client.responses.create(model="x", input=history, tools=R_TOOLS)
    assert items(second) == [("message", "The weather is fine.")]
    chat = [{"role": "user", "content": question},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 C"},
            {"role": "tool", "tool_call_id": calls[1].call_id, "content": "14:00"}]  # fmt: skip
    assert second.usage.input_tokens == chat_prompt_tokens(server, chat, TOOLS)


def test_namespace_tools_are_called_by_their_flat_name_and_come_back_in_their_namespace(client, server):
    r = ask(client, "Start a helper!", tools=[NAMESPACE])
    (call,) = r.output
    assert (call.type, call.namespace, call.name, json.loads(call.arguments)) == (
        "function_call", "multi_agent_v1", "spawn_agent", {"message": "hi"})  # fmt: skip
    back = [{"role": "user", "content": "Start a helper!"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "agent 7"}]  # fmt: skip
    second = client.responses.create(model="x", input=back, tools=[NAMESPACE])
    assert items(second) == [("message", "The weather is fine.")]
    flat = [{"type": "function", "function": {"name": f"multi_agent_v1__{t['name']}", "parameters": t["parameters"],
             **({"description": t["description"]} if "description" in t else {})}} for t in NAMESPACE["tools"]]  # fmt: skip
    chat = [{"role": "user", "content": "Start a helper!"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
             "function": {"name": "multi_agent_v1__spawn_agent", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "agent 7"}]  # fmt: skip
    assert second.usage.input_tokens == chat_prompt_tokens(server, chat, flat)


def _grammar_accepts(folder, grammar: str, text: str) -> bool:
    """Whether the Lark ``grammar`` accepts ``text`` (read by llguidance over the model's own tokens)."""
    tok = load_folder(str(folder), None).tokenizer._tokenizer
    matcher = llguidance.LLMatcher(
        ll_tokenizer(tok, [tok.eos_token_id]), llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
    )
    return (
        all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
        and matcher.is_accepting()
    )


def test_a_freeform_tools_grammar_constrains_its_calls_input_while_a_draft_model_speculates(client, folder):
    draft = {"hf2q": {"method": "draft:k=4,fixed"}}
    r = ask(client, "Write the file~", tools=[*R_TOOLS, APPLY_PATCH], extra_body=draft)
    (call,) = r.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.status == "completed"
    assert call.input == "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch\n"
    assert _grammar_accepts(folder, PATCH_GRAMMAR, call.input)
    assert r.model_extra["hf2q"]["accepted"] > 0  # the draft model's tokens, verified under the grammar
    # The same tool without its grammar: the model's own patch, which the grammar refuses.
    free = {**APPLY_PATCH, "format": {"type": "text"}}
    (loose,) = ask(client, "Write the file~", tools=[free], extra_body=draft).output
    assert loose.type == "custom_tool_call" and loose.input == "*** Begin Patch\n*** Add File: a.txt\nhello\n"
    assert not _grammar_accepts(folder, PATCH_GRAMMAR, loose.input)


def test_a_streamed_freeform_call_gives_its_input_as_it_is_written(client):
    with client.responses.stream(model="x", input="Write the file~", tools=[APPLY_PATCH],
                                 extra_body={"hf2q": {"method": "baseline"}}) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done.input == final.output[0].input
    assert deltas[:2] == ["*** Begin Patch\n", "*** Add File: a.txt\n"]


def test_a_named_freeform_tool_choice_starts_the_call_inside_the_grammar(client):
    r = ask(
        client, "Write the file~", tools=[APPLY_PATCH], tool_choice={"type": "custom", "name": "apply_patch"}
    )
    assert items(r) == [
        ("custom_tool_call", "apply_patch", "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch\n")
    ]


def test_reasoning_given_back_stays_out_of_a_prompt_whose_template_renders_none(client):
    turn = [{"role": "user", "content": "Say hi#"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Greet."}],
             "content": [{"type": "reasoning_text", "text": "The user wants a greeting."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there."}]},
            {"role": "user", "content": "Again#"}]  # fmt: skip
    with_reasoning = client.responses.create(model="x", input=turn, max_output_tokens=1)
    without = client.responses.create(model="x", input=[turn[0], *turn[2:]], max_output_tokens=1)
    assert with_reasoning.usage.input_tokens == without.usage.input_tokens


def test_tools_the_server_cannot_run_are_left_out(client):
    with_them = ask(client, "What's the weather in Paris, and the time?", tools=[*SKIPPED, *R_TOOLS])
    without = ask(client, "What's the weather in Paris, and the time?", tools=R_TOOLS)
    assert items(with_them) == items(without) and with_them.usage.input_tokens == without.usage.input_tokens
    assert [t.type for t in with_them.tools][:4] == [t["type"] for t in SKIPPED]  # echoed as given


def test_text_format_json_schema_is_enforced_and_parses(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}
    r = ask(client, "Where? Answer in JSON {", text=fmt)
    jsonschema.validate(json.loads(r.output_text), schema)
    assert json.loads(r.output_text) == {"city": "Paris"}
    # With tools beside it, the answer is calls or the JSON.
    call = ask(client, "Start a helper!", tools=[NAMESPACE], text=fmt)
    assert items(call) == [("function_call", "multi_agent_v1", "spawn_agent", {"message": "hi"})]


def test_a_stored_response_is_continued_by_its_id_and_a_gone_one_is_a_400(client, server):
    first = ask(client, "What's the weather in Paris, and the time?", tools=R_TOOLS)
    calls = [i for i in first.output if i.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls]
    second = client.responses.create(model="x", previous_response_id=first.id, input=outputs, tools=R_TOOLS)
    assert items(second) == [("message", "The weather is fine.")]
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output[0].content[0].text == "The weather is fine."
    with pytest.raises(openai.BadRequestError) as e:  # named by its place in this request's input
        client.responses.create(
            model="x", previous_response_id=first.id, input=[{**outputs[0], "call_id": "call_x"}]
        )
    assert e.value.body["message"].startswith("input[0].call_id: 'call_x' answers no function_call")
    unstored = ask(client, "Hi?", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for gone in (unstored.id, "resp_never"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="x", previous_response_id=gone, input="More.")
        assert e.value.body["param"] is None and gone in e.value.body["message"]
        assert e.value.body["message"].startswith("previous_response_id")


def test_an_empty_probe_is_answered_at_once(client, server):
    r = client.responses.create(model="x", input=[], max_output_tokens=1)
    assert (r.status, r.output, r.usage.total_tokens) == ("completed", [], 0)
    with client.responses.stream(model="x", input=[], max_output_tokens=1) as stream:
        assert [e.type for e in stream] == ["response.created", "response.in_progress", "response.completed"]


def test_a_websocket_upgrade_is_refused_at_once(server):
    request = (b"GET /v1/responses HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert time.monotonic() - t0 < 2
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 426") and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert "HTTP" in json.loads(body)["error"]["message"]
    assert server.alive()


def test_a_second_turn_reads_the_first_from_the_prompt_cache(client):
    first = ask(client, "Say hi#")
    turn = [{"role": "user", "content": "Say hi#"}, *[i.model_dump(exclude_none=True) for i in first.output],
            {"role": "user", "content": "Again."}]  # fmt: skip
    second = client.responses.create(model="x", input=turn)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens


def test_max_output_tokens_past_the_context_is_cut_to_what_it_leaves(client):
    r = ask(client, "x" * (CONTEXT - 80) + ".", max_output_tokens=128000)  # one token a character
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.total_tokens == CONTEXT and r.output[-1].status == "incomplete"
    short = ask(client, "Say hello.", max_output_tokens=2)
    assert short.output_text == "Hello there" and short.status == "incomplete"
    with client.responses.stream(model="x", input="Say hello.", max_output_tokens=2) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"


# -- a Codex request, as it sends it ----------------------------------------------------------------
@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """A scripted model on SmolLM2's tokenizer (an agent's prompt keeps its size) that
    calls Codex's namespaced spawn_agent when asked to start a helper."""
    call = tool_call_text("multi_agent_v1__spawn_agent", {"message": "hi"})
    folder = write_agent_folder(
        tmp_path_factory.mktemp("agent"), [call], ["Done."], ["Hi."], trigger="Start a helper"
    )
    with running_server("--model", str(folder)) as s:
        yield s


def test_codexs_captured_request_streams_a_completed_response(agent):
    """Codex 0.169.0's first request (tests/fixtures/agents), asking for a namespaced call."""
    body = json.loads((FIXTURES / "codex_responses.json").read_text())["body"]
    body["input"][-1]["content"][0]["text"] = "Start a helper!"
    server = agent
    status, headers, raw = server.raw(
        "POST", "/v1/responses", json.dumps(body), headers={"Accept": "text/event-stream"}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw[:500]
    events = [json.loads(part.split("data: ", 1)[1]) for part in raw.decode().strip().split("\n\n")]
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last["type"] == "response.completed" and last["response"]["usage"]["input_tokens"] > 5000
    (call,) = last["response"]["output"]
    assert (call["type"], call["namespace"], call["name"]) == (
        "function_call",
        "multi_agent_v1",
        "spawn_agent",
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# -- bad input ---------------------------------------------------------------------------------------
def body(**fields) -> bytes:
    return json.dumps({"model": "gpt-x", "input": "Hi#", **fields}).encode()


def msg(**fields) -> dict:
    return {"type": "message", "role": "user", "content": "Hi#", **fields}


HOSTILE = [
    (b"", "the request body"), (b"{", "not valid JSON"), (b"null", "the request body"), (b"[]", "the request body"),
    (body(input=7), "input"), (body(input={"role": "user"}), "input"),
    (body(input=[None]), "input[0]: an input item is an object, got null"),
    (body(input=["hi"]), "input[0]: an input item is an object, got str"),
    (body(input=[3]), "input[0]: an input item is an object, got int"),
    (body(input=[{}]), "input[0]: an input item needs a type"),
    (body(input=[msg(role="wizard")]), "input[0].role"),
    (body(input=[msg(content=None)]), "input[0].content"),
    (body(input=[msg(content=[{}])]), "input[0].content[0]"),
    (body(input=[msg(content=[{"type": "hologram", "text": "x"}])]), "input[0].content[0].type"),
    (body(input=[{"type": "hologram"}]), "input[0].type: unknown or unsupported input item type 'hologram'"),
    (body(input=[msg(content=[{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}])]),
     "input[0].content[0]: an image (input_image), but this model reads text only"),
    (body(input=[msg(), {"type": "function_call_output", "call_id": "call_none", "output": "x"}]),
     "input[1].call_id: 'call_none' answers no function_call"),
    (body(input=[{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"}]), "input[0].arguments"),
    (body(input=[{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
    (body(input=[{"type": "custom_tool_call", "call_id": "c1", "name": "f"}]), "input[0].input"),
    (body(input=[{"type": "function_call_output", "call_id": "c1"}]), "input[0].output"),
    (body(tools=[{"type": "function", "description": "nameless", "parameters": {"type": "object"}}]), "tools[0].name"),
    (body(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": []}}]), "tools[0].parameters"),
    (body(tools=[{"type": "function", "name": "f", "parameters": "object"}]), "tools[0].parameters"),
    (body(tools=[None]), "tools[0]"), (body(tools=[{"name": "f"}]), "tools[0]"),
    (body(tools=[{"type": "namespace", "name": "ns", "tools": []}]), "tools[0].tools"),
    (body(tools=[{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]), "tools[0].tools[0].name"),
    (body(tools=[R_TOOLS[0], R_TOOLS[0]]), "tools[1].name"),
    (body(tools=[{**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}]),
     "tools[0].format.definition"),
    (body(tools=[{**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: A\nA: /a/\n%ignore /b/"}}]),
     "tools[0].format.definition: the %ignore directive"),
    (body(tools=[{**APPLY_PATCH, "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}]), "tools[0].format.syntax"),
    (body(tool_choice={"type": "function", "name": "missing"}), "tool_choice.name"),
    (body(tool_choice="sometimes"), "tool_choice"), (body(tool_choice={"type": "web_search"}), "tool_choice"),
    (body(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}}),
     "text.format.schema: unsupported schema feature(s): not"),
    (body(text={"format": {"type": "yaml"}}), "text.format.type"),
    (body(reasoning={"effort": "extreme"}), "reasoning.effort"),
    (body(max_output_tokens=0), "max_output_tokens"), (body(max_output_tokens="8"), "max_output_tokens"),
    (body(temperature="hot"), "temperature"), (body(stream="yes"), "stream"),
    (body(background=True), "background"), (body(hf2q={"method": "nonsense:k=2"}), "nonsense"),
    (body(previous_response_id="resp_gone"), "previous_response_id"),
    (body(input="x" * (CONTEXT + 10)), "prompt is too long"),
    (body(input="\ud800"), "not valid Unicode"),
]  # fmt: skip


def assert_openai_error(status: int, raw: bytes, says: str) -> None:
    assert status == 400, (status, raw[:300])
    err = json.loads(raw)
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["type"] == "invalid_request_error" and says in err["error"]["message"], err
    text = raw.decode()
    assert "Traceback" not in text and "site-packages" not in text and "hf2q_py/" not in text


@pytest.mark.parametrize("raw, says", HOSTILE, ids=range(len(HOSTILE)))
def test_bad_requests_get_openais_error_naming_the_problem(server, raw, says):
    status, _, answer = server.raw("POST", "/v1/responses", raw)
    assert_openai_error(status, answer, says)
    assert server.alive()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
           "temperature", "top_p", "text", "reasoning", "store", "include", "previous_response_id", "metadata"]  # fmt: skip
_ITEM = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            [
                "message",
                "function_call",
                "function_call_output",
                "custom_tool_call",
                "custom_tool_call_output",
                "reasoning",
            ]
        )
    },  # fmt: skip
    optional={
        "role": _JSON,
        "content": _JSON,
        "call_id": _JSON,
        "name": _JSON,
        "arguments": _JSON,
        "output": _JSON,
        "input": _JSON,
        "namespace": _JSON,
        "summary": _JSON,
    },  # fmt: skip
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=4), items=st.lists(_ITEM, max_size=3))
def test_fuzzed_requests_never_crash_the_server(server, fields, items):
    fields = {"max_output_tokens": 2, "input": [*items, msg()], **fields}
    status, _, raw = server.raw("POST", "/v1/responses", json.dumps(fields))
    assert status == 200 or (400 <= status < 500 and set(json.loads(raw)) == {"error"}), (status, raw[:300])


# -- the built-in model --------------------------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct.Q4_1"
SYSTEM = "You are a helpful coding assistant."
GREEDY_CONVERSATION = [
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "An apple."},
    {"role": "user", "content": "Rename x to y in: def f(x): return x + 1"},
]


@pytest.fixture(scope="module")
def builtin():
    with running_server("--max-batch", "2", "--max-context", "4096") as s:
        yield s


@pytest.mark.slow
def test_one_conversation_gets_the_same_tokens_through_three_apis(builtin):
    tokens = {"hf2q": {"return_tokens": True}}
    oa = openai.OpenAI(base_url=builtin.base, api_key="unused", max_retries=0, timeout=120)
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *GREEDY_CONVERSATION],
                                      max_tokens=24, temperature=0, extra_body=tokens)  # fmt: skip
    claude = anthropic.Anthropic(base_url=builtin.url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(model="claude-x", system=SYSTEM, messages=GREEDY_CONVERSATION, max_tokens=24,
                                     extra_body={"temperature": 0, **tokens})  # fmt: skip
    history = [
        {"role": "user", "content": GREEDY_CONVERSATION[0]["content"]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "An apple."}]},
        {"role": "user", "content": [{"type": "input_text", "text": GREEDY_CONVERSATION[2]["content"]}]},
    ]
    response = oa.responses.create(model=MODEL, instructions=SYSTEM, input=history, max_output_tokens=24,
                                   temperature=0, extra_body=tokens)  # fmt: skip
    want = chat.model_extra["hf2q"]["tokens"]
    assert response.model_extra["hf2q"]["tokens"] == message.model_extra["hf2q"]["tokens"] == want
    assert response.output_text == message.content[0].text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == len(
        want
    )


def open_stream(server, text: str, max_tokens: int) -> http.client.HTTPConnection:
    """A streaming /v1/responses request whose first output text has been read; plain
    decoding, a token a row each round (so a round fits in a second on a loaded CPU)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    req = {"model": "x", "input": text, "max_output_tokens": max_tokens, "stream": True,
           "hf2q": {"method": "baseline"}}  # fmt: skip
    conn.request("POST", "/v1/responses", json.dumps(req), {"Content-Type": "application/json"})
    conn.resp = conn.getresponse()
    seen = b""
    while b"response.output_text.delta" not in seen:
        seen += conn.resp.read1(4096)
    return conn


def queue_depth(server) -> float:
    raw = server.raw("GET", "/metrics")[2].decode()
    return float(re.search(r"^hf2q_queue_depth (\S+)$", raw, re.M).group(1))


def first_text_after(server, text: str, start: threading.Event, out: dict) -> None:
    """Stream ``text`` once ``start`` is set; note when its first text arrived and its whole answer."""
    oa = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
    start.wait()
    with oa.responses.stream(model="x", input=text, max_output_tokens=8) as stream:
        for event in stream:
            if event.type == "response.output_text.delta" and "first" not in out:
                out["first"] = time.monotonic()
        out["text"] = stream.get_final_response().output_text


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_frees_its_row_within_a_second_while_the_other_goes_on(builtin):
    oa = openai.OpenAI(base_url=builtin.base, api_key="unused", max_retries=0, timeout=120)
    poem = "Write a long poem about the sea."
    alone = oa.responses.create(model="x", input=poem, max_output_tokens=64).output_text
    leaving = open_stream(builtin, "Write a very long story about a dragon.", 1500)
    staying = open_stream(builtin, poem, 64)  # --max-batch 2: the batch is full
    waiting, go = {}, threading.Event()
    thread = threading.Thread(
        target=first_text_after, args=(builtin, "What is the capital of France?", go, waiting)
    )
    thread.start()
    go.set()
    while queue_depth(builtin) < 1:
        time.sleep(0.05)  # the question waits for a row
    time.sleep(0.5)
    assert "first" not in waiting
    left = time.monotonic()
    leaving.sock.close()
    leaving.close()
    while queue_depth(builtin) > 0:  # the question takes the row the story left
        time.sleep(0.02)
    freed = time.monotonic() - left
    rest = b""
    while chunk := staying.resp.read1(65536):
        rest += chunk
    thread.join(120)
    assert freed < 1.0, freed
    assert "Paris" in waiting["text"]
    done = [json.loads(p.split("data: ", 1)[1]) for p in rest.decode().strip().split("\n\n")][-1]
    assert done["type"] in ("response.completed", "response.incomplete")
    assert done["response"]["output"][0]["content"][0]["text"] == alone  # the same answer as alone
