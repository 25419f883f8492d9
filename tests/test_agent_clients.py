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

import re
import secrets
from pathlib import Path

import pytest
from agent_clients import CLIENTS, PROMPT, AgentClient, Run, run
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
