"""The real agent CLIs (qwen-code, opencode, Claude Code, Codex; installed from npm by
``scripts/setup.sh``, ``agent_clients.py``), unchanged but for their base URL, complete
sessions against the real ``hf2q-py serve`` process: a plain turn, and a tool round trip
in which the client runs its own tool on ``note.txt`` and sends the result back.

The model is scripted (``scripted_model.write_agent_folder``): SmolLM2's real BPE
tokenizer, so each client's 7,000-15,000-token prompt keeps its size, and greedy
answers that follow the conversation: the client's tool call when asked about the
note, a short answer once the tool result is in, a plain answer otherwise; each ends
with EOS. The note holds a fresh random word: only the client's tool can have read it.
A client that is not installed (no npm here) is skipped.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import pytest
from agent_clients import CLIENTS, CODEX, PROMPT, AgentClient, Run, codex_catalog, codex_file_changes, run
from scripted_model import tool_call_text, write_agent_folder
from server_process import Server, running_server

pytestmark = pytest.mark.slow

MODEL = "hf2q-agent-test"
ANSWER = ["I read note.txt.", " It holds one line."]
PLAIN = ["Hello! How can I help?"]
TIMEOUT = 150  # seconds for one CLI run; each takes 3-15 s here


def _param(client: AgentClient):
    missing = client.missing()
    return pytest.param(
        client, id=client.name, marks=pytest.mark.skipif(missing is not None, reason=missing or "")
    )


@pytest.fixture(scope="module", params=[_param(c) for c in CLIENTS.values()])
def served(request, tmp_path_factory) -> tuple[AgentClient, Server, Path]:
    """A client, the server on its model (the client's own tool call), the client's folder."""
    client: AgentClient = request.param
    root = tmp_path_factory.mktemp(client.name)
    call = client.tool_call(root / "tool" / "work")
    folder = write_agent_folder(
        root / "model", [tool_call_text(call.name, call.arguments)], ANSWER, PLAIN, trigger=PROMPT
    )
    with running_server("--model", str(folder), "--served-model-name", MODEL) as server:
        yield client, server, root


def _generations(server: Server) -> int:
    """Generations the server finished (its ``hf2q_request_seconds`` histogram's count)."""
    status, _, body = server.raw("GET", "/metrics")
    assert status == 200
    found = re.search(r"^hf2q_request_seconds_count (\S+)$", body.decode(), re.M)
    return int(float(found.group(1))) if found else 0


def _session(served, name: str, prompt: str, note: str) -> tuple[Run, int]:
    """One CLI run in its own folder; the run and how many generations the server made for it."""
    client, server, root = served
    before = _generations(server)
    result = run(client.setup(root / name, server.url, MODEL, note, prompt), TIMEOUT)
    said = f"{client.name} exited {result.returncode}: stdout {result.stdout[-3000:]!r} stderr {result.stderr[-3000:]!r}"
    assert not result.timed_out, said
    assert result.returncode == 0, said
    return result, _generations(server) - before


def test_a_plain_turn_prints_the_models_answer(served):
    client = served[0]
    result, generations = _session(served, "plain", "Say hello.", "unused")
    assert client.answer(result.stdout) == "".join(PLAIN), result.stdout[-3000:]
    assert generations >= 1


def test_the_client_runs_the_tool_the_model_calls_and_the_answer_follows_its_result(served):
    client = served[0]
    note = f"The meeting moved to room {secrets.token_hex(4)}."
    result, generations = _session(served, "tool", PROMPT, note)
    assert note in client.tool_output(result.stdout), result.stdout[-3000:]
    # The answer is the model's only after a tool result (the template's ending says so).
    assert client.answer(result.stdout) == "".join(ANSWER), result.stdout[-3000:]
    assert generations >= 2  # the call, then the answer


# -- Codex's freeform apply_patch, and its WebSocket ---------------------------------------------------
PATCH_PROMPT = "Add hello.txt saying hi there."
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi there\n*** End Patch\n"
CODEX_HERE = pytest.mark.skipif(CODEX.missing() is not None, reason=CODEX.missing() or "")


@pytest.fixture(scope="module")
def patching(tmp_path_factory) -> tuple[Server, Path]:
    """The server on a model whose call is Codex's freeform apply_patch with ``PATCH``
    (the call in two pieces: a token written like ``<...>`` is special to the grammar engine)."""
    root = tmp_path_factory.mktemp("codex-patch")
    call = [
        '<tool_call>\n{"name": "apply_patch", "arguments": {"input": ' + json.dumps(PATCH) + "}}",
        "\n</tool_call>",
    ]
    folder = write_agent_folder(
        root / "model", call, ["I wrote", " the file."], ["Hello there!"], trigger=PATCH_PROMPT
    )
    with running_server("--model", str(folder), "--served-model-name", MODEL) as server:
        yield server, root


def _codex(patching, name: str, prompt: str, websocket: bool = False) -> tuple[Run, Path]:
    server, root = patching
    setup = CODEX.setup(root / name, server.url, MODEL, "unused", prompt)
    codex_catalog(setup, MODEL)
    config = setup.home / ".codex" / "config.toml"
    if websocket:  # Codex's own switches for the Responses API over a WebSocket
        text = config.read_text().replace(
            'wire_api = "responses"', 'wire_api = "responses"\nsupports_websockets = true'
        )
        config.write_text(text + "responses_websockets = true\nresponses_websockets_v2 = true\n")
    setup.argv[-1:-1] = ["--sandbox", "workspace-write"]
    result = run(setup, TIMEOUT)
    said = (
        f"codex exited {result.returncode}: stdout {result.stdout[-3000:]!r} stderr {result.stderr[-3000:]!r}"
    )
    assert not result.timed_out and result.returncode == 0, said
    return result, setup.workdir


@CODEX_HERE
def test_codex_applies_the_patch_of_a_freeform_apply_patch_call_its_grammar_constrained(patching):
    result, workdir = _codex(patching, "patch", PATCH_PROMPT)
    (change,) = codex_file_changes(result.stdout)
    assert change["status"] == "completed" and change["changes"][0]["kind"] == "add"
    assert (workdir / "hello.txt").read_text() == "hi there\n"
    assert CODEX.answer(result.stdout) == "I wrote the file."


def _refused_upgrades(server: Server) -> float:
    status, _, body = server.raw("GET", "/metrics")
    found = re.search(
        r'^hf2q_requests_total\{endpoint="/v1/responses",status="426"\} (\S+)$', body.decode(), re.M
    )
    return float(found.group(1)) if found else 0.0


@CODEX_HERE
def test_codex_falls_back_to_http_at_once_when_its_websocket_is_refused(patching):
    before = _refused_upgrades(patching[0])
    result, _ = _codex(patching, "websocket", "Say hello.", websocket=True)
    assert CODEX.answer(result.stdout) == "Hello there!"
    assert _refused_upgrades(patching[0]) == before + 1  # one try, no retries
    assert result.seconds < 30
