"""Anthropic's Messages API over the engine (``POST /v1/messages``,
``POST /v1/messages/count_tokens``): the request (``anthropic_protocol``)
becomes a :class:`Conversation`, the engine's events a ``message`` or its
event stream.

A stream is ``message_start`` (the prompt's tokens), a ``ping``, then per
content block ``content_block_start``, its deltas (``text_delta``;
``input_json_delta`` as a call's arguments are written; ``thinking_delta``
and a closing ``signature_delta``) and ``content_block_stop``, then
``message_delta`` (``stop_reason``, ``stop_sequence``, the usage with the
tokens read from the prompt cache) and ``message_stop``; a ``ping`` every
few seconds while nothing else comes (a long prompt prefilling). A failure
after the stream began is an ``error`` event. Errors are Anthropic's
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import Hf2qError, one_line
from .anthropic_protocol import (
    STOP_REASONS,
    CountRequest,
    MessageShape,
    MessagesRequest,
    conversation,
    error_body,
    usage,
)
from .engine import ApiError, Engine, Prepared
from .events import CallDelta, CallEnd, CallStart, Done, Event, Failure, Ping, ReasoningDelta, TextDelta
from .protocol import speculation
from .worker import Failed

#: Seconds without news after which a stream sends a ``ping``.
PING_SECONDS = 5.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(f: Failed) -> JSONResponse:
    return JSONResponse(error_body(f.message, f.status), f.status)


def _event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def _conversation(req: CountRequest):
    try:
        return conversation(req)
    except Hf2qError as e:
        raise ApiError(400, one_line(e, limit=1000)) from None


async def count_tokens(engine: Engine, req: CountRequest) -> Response:
    """``{"input_tokens": N}``: the prompt the same request would generate from."""
    try:
        return JSONResponse({"input_tokens": engine.count(_conversation(req))})
    except ApiError as e:
        return error_response(e.failure)


async def messages(engine: Engine, model: str, req: MessagesRequest, request: Request) -> Response:
    """A message, whole or streamed."""
    try:
        prep = engine.prepare(_conversation(req))
        job = engine.submit(prep, asyncio.get_running_loop())
    except ApiError as e:
        return error_response(e.failure)
    shape = MessageShape(model)
    if req.stream:
        events = engine.answer(prep, job, request, ping=PING_SECONDS)
        return StreamingResponse(
            _stream(events, shape, prep), media_type="text/event-stream", headers=SSE_HEADERS
        )
    tokens = bool(req.hf2q is not None and req.hf2q.return_tokens)
    return await _whole(engine.answer(prep, job, request), shape, prep, tokens)


async def _whole(events: AsyncIterator[Event], shape: MessageShape, prep: Prepared, tokens: bool) -> Response:
    content: list[dict[str, Any]] = []
    try:
        async for event in events:
            if isinstance(event, TextDelta) and event.text:
                if not content or content[-1]["type"] != "text":
                    content.append({"type": "text", "text": ""})
                content[-1]["text"] += event.text
            elif isinstance(event, ReasoningDelta):
                if not content or content[-1]["type"] != "thinking":
                    content.append({"type": "thinking", "thinking": "", "signature": ""})
                content[-1]["thinking"] += event.text
            elif isinstance(event, CallEnd):
                c = event.call
                content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input()})
            elif isinstance(event, Failure):
                return error_response(event.failed)
            elif isinstance(event, Done):
                body = shape.message(
                    content, STOP_REASONS[event.finish], event.stop_sequence, usage(event.stats)
                )
                body["hf2q"] = speculation(event.stats, prep.label)
                if tokens:
                    body["hf2q"]["tokens"] = event.tokens
                return JSONResponse(body)
    finally:
        await events.aclose()
    return Response(status_code=499)  # the client left


async def _stream(events: AsyncIterator[Event], shape: MessageShape, prep: Prepared) -> AsyncIterator[str]:
    blocks = _Blocks()
    start = shape.message([], None, None, usage(None, len(prep.ids)))
    try:
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("ping", {"type": "ping"})
        async for event in events:
            if isinstance(event, Done):
                yield blocks.close() + _last(event, prep)
                return
            if isinstance(event, Failure):
                yield _event("error", error_body(event.failed.message, event.failed.status))
                return
            if out := blocks.of(event):
                yield out
    finally:
        await events.aclose()


def _last(done: Done, prep: Prepared) -> str:
    delta = {"stop_reason": STOP_REASONS[done.finish], "stop_sequence": done.stop_sequence}
    body = {"type": "message_delta", "delta": delta, "usage": usage(done.stats)}
    body["hf2q"] = speculation(done.stats, prep.label)
    return _event("message_delta", body) + _event("message_stop", {"type": "message_stop"})


class _Blocks:
    """A stream's content blocks: which is open, and the events that open,
    fill and close them."""

    def __init__(self):
        self.count = 0  # blocks opened
        self.open: str | None = None  # the open block's type
        self.calls: dict[int, int] = {}  # a call's index -> its block's index

    def of(self, event: Event) -> str:
        if isinstance(event, TextDelta) and event.text:
            return self._into(
                "text", {"type": "text", "text": ""}, {"type": "text_delta", "text": event.text}
            )
        if isinstance(event, ReasoningDelta) and event.text:
            start = {"type": "thinking", "thinking": "", "signature": ""}
            return self._into("thinking", start, {"type": "thinking_delta", "thinking": event.text})
        if isinstance(event, CallStart):
            out = self.close()
            self.calls[event.index] = self.count
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            return out + self._start("tool_use", block)
        if isinstance(event, CallDelta):
            delta = {"type": "input_json_delta", "partial_json": event.arguments}
            return _event("content_block_delta", {"type": "content_block_delta", "index": self.calls[event.index], "delta": delta})  # fmt: skip
        if isinstance(event, CallEnd):
            return self.close()
        if isinstance(event, Ping):
            return _event("ping", {"type": "ping"})
        return ""

    def _into(self, kind: str, start: dict[str, Any], delta: dict[str, Any]) -> str:
        out = "" if self.open == kind else self.close() + self._start(kind, start)
        return out + _event("content_block_delta", {"type": "content_block_delta", "index": self.count - 1, "delta": delta})  # fmt: skip

    def _start(self, kind: str, block: dict[str, Any]) -> str:
        self.open = kind
        self.count += 1
        return _event("content_block_start", {"type": "content_block_start", "index": self.count - 1, "content_block": block})  # fmt: skip

    def close(self) -> str:
        """Close the open block (a thinking block gets its signature first)."""
        if self.open is None:
            return ""
        out = ""
        index = self.count - 1
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            out = _event(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
            )
        self.open = None
        return out + _event("content_block_stop", {"type": "content_block_stop", "index": index})
