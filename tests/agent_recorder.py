"""A recording stand-in for a model server, and the capture of the agent CLIs' requests.

The stand-in listens on loopback, records every request (method, path with its
query, headers, body) and answers just enough for a client to go on, streamed in
the API the client speaks (chat completions, Anthropic Messages, OpenAI
Responses; streamed, as every client asks): a request with tools gets the
client's own tool call; one whose last input is a tool result, or one without
tools, a short text. Anything else (a GET, a WebSocket upgrade, an unknown path)
is a 404, recorded.

Captured here, from the repository root::

    python tests/agent_recorder.py            # all four clients
    python tests/agent_recorder.py qwen-code  # one

writes ``tests/fixtures/agents/<client fixture>.json`` (the first agent request
with tools; for Claude Code also the request after the tool result) and prints
every request each client made and, with strace installed, every address it
tried to reach.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_clients import CLIENTS, AgentClient, Call, run  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie"}
ANSWER = "The note is read."
PLAIN = "Hello."
NOTE = "The meeting moved to Thursday."
ROOT = Path(tempfile.gettempdir()) / "hf2q-agent-capture"  # fixed: the paths in the prompts stay the same
API = {"/chat/completions": "chat", "/messages": "messages", "/responses": "responses"}


class Recorder:
    """The stand-in server: ``requests`` holds what came in, in order."""

    def __init__(self, call: Call):
        self.call = call
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"recorder": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def record(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.requests.append(entry)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder: Recorder

    def log_message(self, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return body
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _record(self) -> dict[str, Any]:
        raw = self._body()
        try:
            body: Any = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        entry = {
            "time": time.time(),
            "method": self.command,
            "path": self.path,
            "headers": dict(self.headers.items()),
            "body": body,
        }
        self.recorder.record(entry)
        return entry

    def _send(self, status: int, body: bytes = b"", kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._record()
        self._send(404, json.dumps({"error": {"message": "not found"}}).encode())

    do_HEAD = do_GET
    do_DELETE = do_GET

    def do_POST(self) -> None:
        entry = self._record()
        body = entry["body"] if isinstance(entry["body"], dict) else {}
        path = self.path.split("?")[0]
        if path.endswith("/count_tokens"):
            return self._send(200, json.dumps({"input_tokens": len(json.dumps(body)) // 4}).encode())
        api = next((v for k, v in API.items() if path.endswith(k)), None)
        if api is None:
            return self._send(404, json.dumps({"error": {"message": "not found"}}).encode())
        turn = _turn(api, body)
        call = self.recorder.call if turn == "call" else None
        text = ANSWER if turn == "answer" else PLAIN
        events = {"chat": _chat_events, "messages": _messages_events, "responses": _responses_events}[api]
        stream = events(body.get("model", "model"), text, call)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for name, data in stream:
            head = f"event: {name}\n" if name and api != "chat" else ""
            payload = data if isinstance(data, str) else json.dumps(data)
            self.wfile.write(f"{head}data: {payload}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True


def _turn(api: str, body: dict[str, Any]) -> str:
    """What the request asks for: "call" (tools, no tool result yet), "answer" (a tool result last), "plain"."""
    if api == "chat":
        items = body.get("messages") or []
        last_is_result = bool(items) and items[-1].get("role") == "tool"
    elif api == "messages":
        items = [m for m in body.get("messages") or [] if m.get("role") != "system"]
        content = items[-1].get("content") if items else None
        last_is_result = isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "tool_result" for p in content
        )
    else:
        items = body.get("input") or []
        last = items[-1] if items and isinstance(items[-1], dict) else {}
        last_is_result = str(last.get("type", "")).endswith("_output")
    if last_is_result:
        return "answer"
    return "call" if body.get("tools") else "plain"


def _chat_events(model: str, text: str, call: Call | None) -> list[tuple[str | None, Any]]:
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict, finish: str | None = None) -> tuple[None, dict]:
        return None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    if call is None:
        body = [chunk({"role": "assistant", "content": ""}), chunk({"content": text}), chunk({}, "stop")]
    else:
        head = {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        args = {"index": 0, "function": {"arguments": json.dumps(call.arguments)}}
        body = [
            chunk({"role": "assistant", "content": None, "tool_calls": [head]}),
            chunk({"tool_calls": [args]}),
            chunk({}, "tool_calls"),
        ]
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    return [*body, (None, {**base, "choices": [], "usage": usage}), (None, "[DONE]")]


def _event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """A server-sent event of the Messages or Responses API: its name is its type."""
    return kind, {"type": kind, **fields}


def _messages_events(model: str, text: str, call: Call | None) -> list[tuple[str | None, Any]]:
    message = {"id": f"msg_{uuid.uuid4().hex[:12]}", "type": "message", "role": "assistant", "model": model}
    message |= {"content": [], "stop_reason": None, "stop_sequence": None}
    message["usage"] = {"input_tokens": 10, "output_tokens": 1}
    if call is None:
        block, delta, stop = {"type": "text", "text": ""}, {"type": "text_delta", "text": text}, "end_turn"
    else:
        block = {"type": "tool_use", "id": "toolu_01", "name": call.name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}
        stop = "tool_use"
    return [
        _event("message_start", message=message),
        _event("content_block_start", index=0, content_block=block),
        _event("content_block_delta", index=0, delta=delta),
        _event("content_block_stop", index=0),
        _event(
            "message_delta", delta={"stop_reason": stop, "stop_sequence": None}, usage={"output_tokens": 5}
        ),
        _event("message_stop"),
    ]


def _responses_events(model: str, text: str, call: Call | None) -> list[tuple[str | None, Any]]:
    response = {"id": f"resp_{uuid.uuid4().hex[:12]}", "object": "response", "created_at": int(time.time())}
    response |= {"status": "in_progress", "model": model, "output": []}
    if call is None:
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
        opened = {**item, "status": "in_progress", "content": []}
        where = {"item_id": "msg_1", "output_index": 0}
        middle = [_event("response.output_text.delta", **where, content_index=0, delta=text)]
    else:
        args = json.dumps(call.arguments)
        item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": call.name}
        item |= {"arguments": args, "status": "completed"}
        opened = {**item, "status": "in_progress", "arguments": ""}
        where = {"item_id": "fc_1", "output_index": 0}
        middle = [
            _event("response.function_call_arguments.delta", **where, delta=args),
            _event("response.function_call_arguments.done", **where, arguments=args),
        ]
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}
    usage |= {"input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    done = {**response, "status": "completed", "output": [item], "usage": usage}
    return [
        _event("response.created", response=response),
        _event("response.output_item.added", output_index=0, item=opened),
        *middle,
        _event("response.output_item.done", output_index=0, item=item),
        _event("response.completed", response=done),
    ]


# -- capture ------------------------------------------------------------------------------------
def capture(client: AgentClient, root: Path = ROOT, timeout: float = 180) -> dict[str, Any]:
    """Run ``client`` once against a recorder, in folders under ``root`` (removed
    afterwards): its run, its requests, the addresses it tried."""
    shutil.rmtree(root, ignore_errors=True)
    workdir = root / "work"
    with Recorder(client.tool_call(workdir)) as rec:
        setup = client.setup(root, rec.url, "hf2q-model", NOTE)
        command = [client.binary, *setup.argv[1:]]
        trace = root / "connect.strace"
        if shutil.which("strace"):
            setup.argv[:0] = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace)]
        result = run(setup, timeout)
        time.sleep(0.5)  # a request still in flight as the client exits
        requests = list(rec.requests)
    addresses = _addresses(trace)
    shutil.rmtree(root, ignore_errors=True)
    return {"run": result, "command": command, "requests": requests, "addresses": addresses}


def _addresses(trace: Path) -> list[str]:
    """The TCP/UDP destinations in an strace of connect() calls (loopback included)."""
    if not trace.exists():
        return []
    text = trace.read_text()
    found = re.findall(r'sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)', text)
    found += re.findall(r'sin6_port=htons\((\d+)\),.*?inet_pton\(AF_INET6, "([^"]+)"', text)
    return sorted({f"{host}:{port}" for port, host in found})


def fixture(client: AgentClient, entry: dict[str, Any], command: list[str]) -> dict[str, Any]:
    """A recorded request as a fixture: headers without secrets, the body as sent."""
    headers = {k: ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in entry["headers"].items()}
    return {
        "client": f"{client.package} {client.version()}",
        "command": command,
        "method": entry["method"],
        "path": entry["path"],
        "headers": headers,
        "body": entry["body"],
    }


def agent_requests(client: AgentClient, requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The client's fixtures by file name: its first request with tools, the first
    one carrying the tool result, the first without tools before them."""
    posts = [r for r in requests if r["method"] == "POST" and isinstance(r["body"], dict)]
    api = API[client.route.removeprefix("/v1")]
    found = {
        client.fixture: next(
            (r for r in posts if r["body"].get("tools") and _turn(api, r["body"]) == "call"), None
        ),
        client.follow_up: next((r for r in posts if _turn(api, r["body"]) == "answer"), None),
        client.preface: next((r for r in posts if not r["body"].get("tools")), None),
    }
    return {name: r for name, r in found.items() if name and r is not None}


def main(names: list[str]) -> int:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names or list(CLIENTS):
        client = CLIENTS[name]
        if reason := client.missing():
            print(f"{name}: skipped: {reason}")
            continue
        got = capture(client)
        result = got["run"]
        command = got["command"]
        print(
            f"== {name} {client.version()}: exit {result.returncode} in {result.seconds:.1f}s"
            f"{' (timed out)' if result.timed_out else ''}"
        )
        for r in got["requests"]:
            size = len(json.dumps(r["body"])) if r["body"] is not None else 0
            print(f"   {r['method']} {r['path']} ({size} bytes)")
        print(f"   addresses: {', '.join(got['addresses']) or '(strace not installed)'}")
        print(
            f"   answer: {client.answer(result.stdout)!r}; tool output: {client.tool_output(result.stdout)!r}"
        )
        saved = agent_requests(client, got["requests"])
        if client.fixture not in saved:
            print(
                f"   no request with tools: stdout {result.stdout[-2000:]!r} stderr {result.stderr[-2000:]!r}"
            )
            continue
        for name, entry in saved.items():
            (FIXTURES / name).write_text(json.dumps(fixture(client, entry, command), indent=1) + "\n")
            print(f"   saved tests/fixtures/agents/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
