"""Streaming clients for the session benchmark: one request to Anthropic's
Messages API or to chat completions, timed from the request to its first
content and to its end, its answer read into text and tool calls the same
way for every server.

A server that leaves a call as text (Qwen2.5-Coder writes its calls as
fenced ```` ```json ```` blocks; mlx_lm.server and mlx-dspark do not read
that form) has the call read from its text as hf2q-py reads it, so every
server's answer is compared as (text outside calls, calls).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from hf2q_py.server.call_split import split_answer
from hf2q_py.server.tool_calls import ToolUse

#: Seconds a request may take (a long prompt re-prefilled on a busy CPU takes many minutes).
REQUEST_TIMEOUT = 3600.0


@dataclass
class Answer:
    """One request's answer and timings."""

    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"}
    called_by_server: bool = False  # the server returned its calls as calls (not text)
    ttft: float = 0.0  # seconds to the first content
    total: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    stop: str | None = None
    hf2q: dict[str, Any] | None = None
    tokens: list[int] | None = None  # the answer's token ids, where the server gives them

    def same(self, other: Answer) -> bool:
        """The same text outside calls and the same calls."""
        return self.text.strip() == other.text.strip() and self.calls == other.calls

    def record(self) -> dict[str, Any]:
        return asdict(self)


def tool_reader(tools: list[dict[str, Any]]) -> ToolUse:
    """Reads JSON calls naming one of the (Anthropic) tools from text."""
    fns = [{"type": "function", "function": {"name": t["name"], "parameters": t.get("input_schema", {})}} for t in tools]  # fmt: skip
    return ToolUse(fns, frozenset(t["name"] for t in tools), None)


def _events(response: requests.Response):
    """Server-sent events as (name, data) pairs; ``data`` parsed as JSON. Read
    byte by byte, as they come: a server that does not chunk its stream
    (mlx_lm.server, mlx-dspark) would be read to its end by a larger read."""
    name, data = None, []
    for line in response.iter_lines(chunk_size=1, decode_unicode=True):
        if not line:
            if data:
                text = "\n".join(data)
                yield name, (None if text == "[DONE]" else json.loads(text))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        text = "\n".join(data)
        yield name, (None if text == "[DONE]" else json.loads(text))


def _finish(answer: Answer, reader: ToolUse, server_calls: list[dict[str, Any]]) -> Answer:
    """The answer's calls: the server's own, then any left in its text."""
    content, calls = split_answer(reader, answer.text)
    answer.called_by_server = bool(server_calls)
    answer.text = content or ""
    answer.calls = server_calls + [{"name": c.name, "arguments": c.input()} for c in calls]
    return answer


def messages_call(url: str, body: dict[str, Any], reader: ToolUse) -> Answer:
    """One streamed ``POST /v1/messages``."""
    answer, calls, inputs = Answer(), [], {}
    t0 = time.perf_counter()
    with requests.post(url + "/v1/messages", json=body, timeout=REQUEST_TIMEOUT, stream=True,
                       headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"}) as r:  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"{url}/v1/messages answered {r.status_code}: {r.text[:500]!r}")
        for name, data in _events(r):
            kind = (data or {}).get("type", name)
            if kind in ("content_block_start", "content_block_delta") and not answer.ttft:
                answer.ttft = time.perf_counter() - t0
            if kind == "message_start":
                u = data["message"].get("usage") or {}
                answer.prompt_tokens = u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0)
            elif kind == "content_block_start" and data["content_block"]["type"] == "tool_use":
                inputs[data["index"]] = [data["content_block"]["name"], ""]
            elif kind == "content_block_delta":
                d = data["delta"]
                if d["type"] == "text_delta":
                    answer.text += d["text"]
                elif d["type"] == "input_json_delta":
                    inputs[data["index"]][1] += d["partial_json"]
            elif kind == "message_delta":
                u = data.get("usage") or {}
                answer.output_tokens = u.get("output_tokens")
                if "cache_read_input_tokens" in u:
                    answer.cached_tokens = u["cache_read_input_tokens"]
                    answer.prompt_tokens = u.get("input_tokens", 0) + u["cache_read_input_tokens"]
                answer.stop = data["delta"].get("stop_reason")
                answer.hf2q = data.get("hf2q")
            elif kind == "error":
                raise RuntimeError(f"{url}: stream error {data}")
    answer.total = time.perf_counter() - t0
    for i in sorted(inputs):
        name, text = inputs[i]
        calls.append({"name": name, "arguments": json.loads(text) if text.strip() else {}})
    return _finish(answer, reader, calls)


def messages_whole(url: str, body: dict[str, Any], reader: ToolUse) -> Answer:
    """One whole (not streamed) ``POST /v1/messages``, with hf2q-py's token ids when it gives them."""
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/messages", json={**body, "stream": False}, timeout=REQUEST_TIMEOUT,
                   headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"})  # fmt: skip
    if r.status_code != 200:
        raise RuntimeError(f"{url}/v1/messages answered {r.status_code}: {r.text[:500]!r}")
    m = r.json()
    u = m.get("usage") or {}
    answer = Answer(total=time.perf_counter() - t0, stop=m.get("stop_reason"), hf2q=m.get("hf2q"))
    answer.prompt_tokens = u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0)
    answer.cached_tokens, answer.output_tokens = u.get("cache_read_input_tokens"), u.get("output_tokens")
    answer.tokens = (m.get("hf2q") or {}).pop("tokens", None)
    answer.text = "".join(b["text"] for b in m["content"] if b["type"] == "text")
    calls = [{"name": b["name"], "arguments": b["input"]} for b in m["content"] if b["type"] == "tool_use"]
    return _finish(answer, reader, calls)


def chat_call(url: str, body: dict[str, Any], reader: ToolUse) -> Answer:
    """One streamed ``POST /v1/chat/completions``."""
    answer, pieces = Answer(), {}
    t0 = time.perf_counter()
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(url + "/v1/chat/completions", json=payload, timeout=REQUEST_TIMEOUT, stream=True) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}/v1/chat/completions answered {r.status_code}: {r.text[:500]!r}")
        for _, data in _events(r):
            if data is None:
                break
            for choice in data.get("choices") or []:
                delta = choice.get("delta") or {}
                if (delta.get("content") or delta.get("tool_calls")) and not answer.ttft:
                    answer.ttft = time.perf_counter() - t0
                answer.text += delta.get("content") or ""
                for c in delta.get("tool_calls") or []:
                    p = pieces.setdefault(c.get("index", 0), ["", ""])
                    p[0] += (c.get("function") or {}).get("name") or ""
                    p[1] += (c.get("function") or {}).get("arguments") or ""
                answer.stop = choice.get("finish_reason") or answer.stop
            if u := data.get("usage"):
                answer.prompt_tokens, answer.output_tokens = (
                    u.get("prompt_tokens"),
                    u.get("completion_tokens"),
                )
                answer.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    answer.total = time.perf_counter() - t0
    calls = [{"name": n, "arguments": json.loads(a) if a.strip() else {}} for n, a in (pieces[i] for i in sorted(pieces))]  # fmt: skip
    return _finish(answer, reader, calls)
