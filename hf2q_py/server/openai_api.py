"""OpenAI's chat and text completions over the engine: a request (checked by
``protocol``) becomes a :class:`Conversation`, the engine's events become
OpenAI's response body or its stream of chunks.

Every error is OpenAI's ``{"error": {...}}`` body with a 4xx or 5xx status,
never a traceback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from ..errors import Hf2qError, one_line
from .conversation import Conversation
from .engine import ApiError, Engine, Prepared
from .events import CallDelta, CallEnd, CallStart, Done, Event, Failure, Ping, ReasoningDelta, TextDelta
from .logprobs import LogprobWriter
from .protocol import (
    ERROR_TYPES,
    ChatRequest,
    CompletionRequest,
    Shape,
    error_body,
    openai_finish,
    speculation,
)
from .worker import Failed

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(f: Failed) -> JSONResponse:
    """OpenAI's error body for ``f``, its type read from the status."""
    return JSONResponse(error_body(f.message, ERROR_TYPES.get(f.status, "server_error"), f.code), f.status)


def error_event(f: Failed) -> str:
    """The same error as a server-sent event (a stream already under way)."""
    return _sse(error_body(f.message, ERROR_TYPES.get(f.status, "server_error"), f.code))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def conversation(req: ChatRequest | CompletionRequest) -> Conversation:
    """The request as the engine's conversation; Hf2qError naming the field."""
    common = dict(
        stop=req.stop_strings(), sampling=req.sampling(), max_tokens=req.token_limit,
        constraint=req.constraint(), logprobs=req.logprob_count(), stream=req.stream,
        method=req.hf2q.method if req.hf2q is not None and req.hf2q.method else None,
    )  # fmt: skip
    if isinstance(req, CompletionRequest):
        return Conversation(prompt=req.prompt_input(), **common)
    return Conversation(
        messages=req.template_messages(), tools=req.tool_dicts(), tool_choice=req.choice(),
        parallel_tool_calls=req.parallel_tool_calls is not False, thinking=req.thinking(), **common,
    )  # fmt: skip


async def complete(
    engine: Engine, model: str, req: ChatRequest | CompletionRequest, request: Request
) -> Response:
    """A chat or text completion, whole or streamed."""
    chat = isinstance(req, ChatRequest)
    problem = req.unsupported()
    if problem:
        return error_response(Failed(400, problem, "unsupported_parameter"))
    try:
        try:
            conv = conversation(req)
        except Hf2qError as e:
            raise ApiError(400, one_line(e, limit=1000)) from None
        prep = engine.prepare(conv)
        job = engine.submit(prep, asyncio.get_running_loop())
    except ApiError as e:
        return error_response(e.failure)
    shape = Shape(chat, model, f"hf2q-py-{__version__}")
    events = engine.answer(prep, job, request)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(engine, events, shape, prep, include_usage)
    return await _whole(engine, events, shape, prep, bool(req.hf2q and req.hf2q.return_tokens))


async def _whole(
    engine: Engine, events: AsyncIterator[Event], shape: Shape, prep: Prepared, tokens: bool
) -> Response:
    text, thought, calls, lps = [], [], [], []
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                text.append(event.text)
                lps.extend(event.logprobs or ())
            elif isinstance(event, ReasoningDelta):
                thought.append(event.text)
            elif isinstance(event, CallEnd):
                calls.append(event.call)
            elif isinstance(event, Failure):
                return error_response(event.failed)
            elif isinstance(event, Done):
                answer = "".join(text)
                content = (answer or None) if prep.use is not None else answer
                finish = openai_finish(event.finish)
                body = shape.response(
                    content,
                    event.stats,
                    prep.label,
                    calls or None,
                    finish,
                    "".join(thought),
                    event.reasoning_tokens,
                )
                if prep.config.logprobs is not None:
                    body["choices"][0]["logprobs"] = LogprobWriter(engine.target.tokenizer, shape.chat).body(
                        lps + event.logprobs
                    )
                if tokens:
                    body["hf2q"]["tokens"] = event.tokens
                return JSONResponse(body)
    finally:
        await events.aclose()
    return Response(status_code=499)  # the client left


async def _stream(
    engine: Engine, events: AsyncIterator[Event], shape: Shape, prep: Prepared, include_usage: bool
) -> Response:
    """The stream starts with the first news (so an early failure is an error
    status); a client that leaves before it never starts the generation."""
    first = None
    async for event in events:
        if not isinstance(event, Ping):
            first = event
            break
    if first is None:
        await events.aclose()
        return Response(status_code=499)
    if isinstance(first, Failure):
        await events.aclose()
        return error_response(first.failed)
    writer = LogprobWriter(engine.target.tokenizer, shape.chat) if prep.config.logprobs is not None else None
    chunks = _Chunks(shape, writer, prep.label, include_usage)

    async def sse() -> AsyncIterator[str]:
        try:
            if shape.chat:
                yield _sse(shape.chunk("", role=True, with_usage=include_usage))
            if out := chunks.of(first):
                yield out
            async for event in events:
                if out := chunks.of(event):
                    yield out
        finally:
            await events.aclose()

    return StreamingResponse(sse(), media_type="text/event-stream", headers=SSE_HEADERS)


class _Chunks:
    """The stream's chunks for the engine's events."""

    def __init__(self, shape: Shape, writer: LogprobWriter | None, label: str, include_usage: bool):
        self.shape, self.writer, self.label, self.include_usage = shape, writer, label, include_usage

    def of(self, event: Event) -> str:
        shape, usage = self.shape, self.include_usage
        if isinstance(event, TextDelta):
            chunk = shape.chunk(event.text, with_usage=usage)
            if self.writer is not None and event.logprobs:
                chunk["choices"][0]["logprobs"] = self.writer.body(event.logprobs)
            return _sse(chunk)
        if isinstance(event, ReasoningDelta):
            return _sse(shape.reasoning_chunk(event.text, with_usage=usage)) if event.text else ""
        if isinstance(event, CallStart):
            entry = {"index": event.index, "id": event.id, "type": "function",
                     "function": {"name": event.name, "arguments": ""}}  # fmt: skip
            return _sse(shape.call_chunk(entry, with_usage=usage))
        if isinstance(event, CallDelta):
            entry = {"index": event.index, "function": {"arguments": event.arguments}}
            return _sse(shape.call_chunk(entry, with_usage=usage))
        if isinstance(event, Failure):
            return error_event(event.failed)
        if isinstance(event, Done):
            return self._last(event)
        return ""  # a call's end, a keep-alive: nothing to send

    def _last(self, done: Done) -> str:
        last = self.shape.chunk(None, openai_finish(done.finish), with_usage=self.include_usage)
        if self.writer is not None and done.logprobs:  # tokens whose text never came out (tool calls)
            last["choices"][0]["logprobs"] = self.writer.body(done.logprobs)
        last["hf2q"] = speculation(done.stats, self.label)
        out = _sse(last)
        if self.include_usage:
            out += _sse(self.shape.usage_chunk(done.stats, done.reasoning_tokens))
        return out + "data: [DONE]\n\n"
