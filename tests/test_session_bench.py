"""The Claude-Code-shaped session benchmark's pieces (benchmarks/claude_session.py,
benchmarks/session_clients.py): the requests as Claude Code sends them, the
tools as it answers, a request translated for chat completions, and every
server's answer read the same way. No model: the benchmark itself runs on
the real one."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import claude_session as cs  # noqa: E402
from session_clients import Answer, _finish, tool_reader  # noqa: E402

from hf2q_py.server.conversation import normalize_system  # noqa: E402


@pytest.fixture(scope="module")
def shape():
    return cs.claude_code_shape()


def test_requests_carry_claude_codes_captured_shape_and_a_new_nonce_each(shape):
    messages = cs.opening(shape, cs.workspace())
    first, second = (cs.request_body(shape, messages, i, 512) for i in (0, 1))
    assert len(first["tools"]) == 12 and {"Bash", "Read", "Edit", "Write"} <= {
        t["name"] for t in first["tools"]
    }
    assert first["messages"][1]["role"] == "system" and first["messages"][1]["content"][0]["text"].startswith("# Environment")  # fmt: skip
    assert first["thinking"] and first["output_config"] and first["metadata"] and first["temperature"] == 0
    bill1, bill2 = first["system"][0]["text"], second["system"][0]["text"]
    assert bill1.startswith("x-anthropic-billing-header:") and "cch=" in bill1 and bill1 != bill2
    assert normalize_system(bill1) == normalize_system(bill2)  # what hf2q-py reads is the same
    assert first["system"][1:] == second["system"][1:]


def test_the_short_session_keeps_the_shape_with_less_text():
    short = cs.claude_code_shape(short=True)
    assert [t["name"] for t in short.tools] == ["Bash", "Edit", "Read", "Write"]
    assert len(short.system[-1]["text"]) == cs.SHORT_SYSTEM and len(short.environment) == cs.SHORT_ENVIRONMENT


def test_the_tools_answer_as_claude_code_does():
    space = cs.workspace()
    text, error = space.run("Read", {"file_path": cs.SOURCE_PATH})
    assert (
        not error
        and text.splitlines()[0] == '     1\t"""A small inventory of items with quantities and prices."""'
    )
    assert space.run("Read", {"file_path": "inventory.py", "offset": 3, "limit": 1})[0] == "     3\tfrom dataclasses import dataclass"  # fmt: skip
    assert space.run("Read", {"file_path": "nope.py"})[1]
    old = "def find_item(items, name):"
    assert space.run(
        "Edit", {"file_path": cs.SOURCE_PATH, "old_string": old, "new_string": old.replace("find", "lookup")}
    ) == (  # fmt: skip
        f"The file {cs.SOURCE_PATH} has been updated successfully.",
        False,
    )
    assert "def lookup_item(" in space.files[cs.SOURCE_PATH]
    missing = space.run("Edit", {"file_path": cs.SOURCE_PATH, "old_string": old, "new_string": "x"})
    assert missing[1] and "String to replace not found in file." in missing[0]
    twice = space.run("Edit", {"file_path": cs.SOURCE_PATH, "old_string": "item", "new_string": "thing"})
    assert twice[1] and "replace_all is false" in twice[0]
    assert space.run("Write", {"file_path": "report.py", "content": "x = 1\n"}) == (
        f"File created successfully at: {cs.WORKDIR}/report.py",
        False,
    )
    space.commands["report.py"] = "total: 4.00"
    assert space.run("Bash", {"command": "python3  report.py"}) == ("total: 4.00", False)
    assert space.run("Bash", {"command": "ls"}) == ("(Bash completed with no output)", False)
    assert space.run("Grep", {})[1]


def test_a_request_for_chat_completions_keeps_the_billing_line_and_the_calls(shape):
    messages = cs.opening(shape, cs.workspace())
    body = cs.openai_request(cs.request_body(shape, messages, 3, 256))
    system = body["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("x-anthropic-billing-header:")
    calls = [m for m in body["messages"] if m.get("tool_calls")]
    assert len(calls) == len(cs.EXAMPLE)
    args = json.loads(calls[1]["tool_calls"][0]["function"]["arguments"])
    assert args["old_string"].startswith("def mul(a, b):")
    assert [m["role"] for m in body["messages"]].count("tool") == len(cs.EXAMPLE)
    assert body["max_tokens"] == 256 and body["temperature"] == 0 and len(body["tools"]) == 12


def test_the_session_runs_each_turn_and_sends_a_late_calls_result_with_the_next_message(shape):
    edit = {"name": "Edit", "arguments": {"file_path": "inventory.py", "old_string": "def find_item", "new_string": "def lookup_item"}}  # fmt: skip
    answers = iter([("", [edit], {}), ("", [edit], {})] + [("ok", [], {})] * 20)
    bodies = []

    def ask(body):
        bodies.append(body)
        return next(answers)

    script = cs.run_session(shape, ask, 64, log=lambda line: None)
    labels = [r["label"] for r in script["requests"]]
    assert labels[:3] == [cs.TURNS[0][0], f"{cs.TURNS[0][0]} / after the result", cs.TURNS[1][0]]
    assert len(labels) == len(cs.TURNS) + 1
    late = bodies[2]["messages"][-1]["content"]  # the second call's result, then the next turn's text
    assert late[0]["type"] == "tool_result" and "String to replace not found" in late[0]["content"]
    assert late[-1] == {"type": "text", "text": cs.TURNS[1][1]}
    assert [b["system"][0]["text"] for b in bodies] == [
        cs.billing_block(i)["text"] for i in range(len(bodies))
    ]


def test_every_servers_answer_is_read_as_text_and_calls_the_same_way(shape):
    reader = tool_reader(shape.tools)
    call = {"name": "Read", "arguments": {"file_path": "/x.py"}}
    fenced = _finish(Answer(text='Reading.\n```json\n{"name": "Read", "arguments": {"file_path": "/x.py"}}\n```'), reader, [])  # fmt: skip
    parsed = _finish(Answer(text="Reading.\n"), reader, [call])
    assert fenced.calls == parsed.calls == [call]
    assert fenced.same(parsed) and parsed.called_by_server and not fenced.called_by_server
    other = _finish(Answer(text='```json\n{"name": "Nope", "arguments": {}}\n```'), reader, [])
    assert other.calls == [] and not other.same(parsed)


def test_a_recorded_conversation_is_matched_to_the_session_it_was_made_from(shape):
    assert cs.fingerprint(shape) == cs.fingerprint(cs.claude_code_shape())
    assert cs.fingerprint(shape) != cs.fingerprint(cs.claude_code_shape(short=True))
