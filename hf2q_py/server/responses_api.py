"""OpenAI's Responses API over the engine (``POST /v1/responses``,
``GET /v1/responses/{id}``): the request (``responses_protocol``) becomes a
:class:`Conversation`, the engine's events a ``response`` object or its event
stream.

Output items: ``reasoning`` (a reasoning splitter's text, as
``reasoning_text`` content), ``message`` (``output_text``),
``function_call`` (a namespaced tool's call with its ``namespace``) and
``custom_tool_call`` (a freeform tool's call, its ``input`` the call's
text), each with an id. A stream is ``response.created`` and
``response.in_progress`` at once, then per item ``response.output_item.added``,
its parts and deltas (``response.content_part.added``/``.done``,
``response.output_text.delta``/``.done``,
``response.reasoning_text.delta``/``.done``,
``response.function_call_arguments.delta``/``.done``,
``response.custom_tool_call_input.delta``/``.done``) and
``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` ended the answer, or
``response.failed``); every event with its ``type`` and an increasing
``sequence_number``. While nothing else comes (a long prompt prefilling)
``response.in_progress`` is sent again every few seconds, so clients with an
idle timeout keep waiting.

Responses stored (``store``, the default) are kept in a bounded
:class:`ResponseStore`: ``previous_response_id`` continues one (a response
no longer held is a 400 naming it). A request without input items (a
client's probe) is answered at once, without a generation. Errors are
OpenAI's ``{"error": {...}}`` envelope.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import Hf2qError, one_line
from .engine import ApiError, Engine, Prepared
from .events import CallDelta, CallEnd, CallStart, Done, Event, Failure, Ping, ReasoningDelta, TextDelta
from .freeform import InputDeltas, call_input
from .openai_api import SSE_HEADERS, error_response
from .protocol import speculation
from .responses_protocol import (
    ResponseShape,
    ResponsesRequest,
    Tools,
    conversation,
    new_id,
    read_items,
    usage,
)
from .worker import Failed

#: Seconds without news after which a stream sends ``response.in_progress`` again.
PING_SECONDS = 5.0


class ResponseStore:
    """Recent stored responses by id (their input items and the response),
    least recently used out past ``entries`` or ``chars`` of JSON."""

    def __init__(self, entries: int = 256, chars: int = 64 << 20):
        self.entries, self.chars = entries, chars
        self.held: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any], int]] = OrderedDict()
        self.size = 0

    def put(self, items: list[dict[str, Any]], body: dict[str, Any]) -> None:
        size = len(json.dumps(items, ensure_ascii=False)) + len(json.dumps(body, ensure_ascii=False))
        if size > self.chars:
            return
        self.held[body["id"]] = (items, body, size)
        self.size += size
        while len(self.held) > self.entries or self.size > self.chars:
            _, (_, _, dropped) = self.held.popitem(last=False)
            self.size -= dropped

    def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self.held.get(response_id)
        if entry is None:
            return None
        self.held.move_to_end(response_id)
        return entry[1]

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The items a response continued from, then its output; ApiError 400 when it is not held."""
        if self.get(response_id) is None:
            raise ApiError(
                400, f"previous_response_id: {response_id!r} is not a response this server holds (it keeps "
                f"the last {self.entries} responses made with store true; this one is unknown or was dropped)",
                code="previous_response_not_found",
            )  # fmt: skip
        items, body, _ = self.held[response_id]
        return [*items, *body["output"]]


async def responses(
    engine: Engine, store: ResponseStore, model: str, req: ResponsesRequest, request: Request
) -> Response:
    """A response, whole or streamed."""
    problem = req.unsupported()
    if problem:
        return error_response(Failed(400, problem, "unsupported_parameter"))
    shape = ResponseShape(model, req)
    try:
        try:
            history = store.history(req.previous_response_id) if req.previous_response_id else []
            items = [*history, *read_items(req.input)]
            conv, tools = conversation(req, items, len(history))
        except Hf2qError as e:
            raise ApiError(400, one_line(e, limit=1000)) from None
        if not items:
            return _probe(shape, req.stream)
        prep = engine.prepare(conv)
        job = engine.submit(prep, asyncio.get_running_loop())
    except ApiError as e:
        return error_response(e.failure)
    output = _Output(shape, tools, prep)
    keep = (lambda body: store.put(items, body)) if req.store is not False else (lambda body: None)
    if req.stream:
        events = engine.answer(prep, job, request, ping=PING_SECONDS)
        return StreamingResponse(
            _stream(events, output, keep), media_type="text/event-stream", headers=SSE_HEADERS
        )
    tokens = bool(req.hf2q is not None and req.hf2q.return_tokens)
    return await _whole(engine.answer(prep, job, request), output, keep, tokens)


def _probe(shape: ResponseShape, stream: bool) -> Response:
    """The answer to a request with nothing to answer: complete and empty."""
    body = shape.body("completed", [], usage(None))
    if not stream:
        return JSONResponse(body)
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {**body, "status": "in_progress", "usage": None}},
        {"type": "response.in_progress", "sequence_number": 1, "response": {**body, "status": "in_progress", "usage": None}},
        {"type": "response.completed", "sequence_number": 2, "response": body},
    ]  # fmt: skip

    async def sse() -> AsyncIterator[str]:
        for e in events:
            yield _sse(e)

    return StreamingResponse(sse(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _whole(events: AsyncIterator[Event], output: _Output, keep, tokens: bool) -> Response:
    try:
        async for event in events:
            if isinstance(event, Failure):
                return error_response(event.failed)
            if isinstance(event, Done):
                output.finish(event)
                body = output.final(event)
                keep(body)
                if tokens:
                    body["hf2q"]["tokens"] = event.tokens
                return JSONResponse(body)
            output.of(event)
    finally:
        await events.aclose()
    return Response(status_code=499)  # the client left


async def _stream(events: AsyncIterator[Event], output: _Output, keep) -> AsyncIterator[str]:
    try:
        yield _sse(output.lifecycle("response.created"))
        yield _sse(output.lifecycle("response.in_progress"))
        async for event in events:
            if isinstance(event, Done):
                out = output.finish(event)
                body = output.final(event)
                keep(body)
                kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                yield "".join(_sse(e) for e in [*out, output.event(kind, response=body)])
                return
            if isinstance(event, Failure):
                yield "".join(_sse(e) for e in [*output.close(), output.failed(event.failed)])
                return
            if out := output.of(event):
                yield "".join(_sse(e) for e in out)
    finally:
        await events.aclose()


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _Output:
    """A response's output items as the engine's events build them, and the
    stream events that add, fill and finish each one."""

    def __init__(self, shape: ResponseShape, tools: Tools, prep: Prepared):
        self.shape, self.tools, self.prep = shape, tools, prep
        self.items: list[dict[str, Any]] = []
        self.index: dict[str, int] = {}  # an item's id -> its place in the output
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the message or reasoning item being written
        self.calls: dict[
            int, tuple[dict[str, Any], InputDeltas | None]
        ] = {}  # call index -> item, input reader

    def event(self, kind: str, **body: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return out

    def lifecycle(self, kind: str) -> dict[str, Any]:
        return self.event(kind, response=self.shape.body("in_progress", []))

    def of(self, event: Event) -> list[dict[str, Any]]:
        """The stream events of one engine event (the item is kept either way)."""
        if isinstance(event, TextDelta) and event.text:
            return self._text("message", event.text)
        if isinstance(event, ReasoningDelta) and event.text:
            return self._text("reasoning", event.text)
        if isinstance(event, CallStart):
            return self._call_start(event)
        if isinstance(event, CallDelta):
            return self._call_delta(event)
        if isinstance(event, CallEnd):
            return self._call_end(event)
        if isinstance(event, Ping):
            return [self.lifecycle("response.in_progress")]
        return []

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        return self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item)
        )

    def _done(self, item: dict[str, Any]) -> dict[str, Any]:
        return self.event(
            "response.output_item.done", output_index=self.index[item["id"]], item=copy.deepcopy(item)
        )

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            if kind == "message":
                self.open = {
                    "type": "message",
                    "id": new_id("msg"),
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                self.open = {"type": "reasoning", "id": new_id("rs"), "status": "in_progress", "summary": [],
                             "content": [], "encrypted_content": None}  # fmt: skip
                part = {"type": "reasoning_text", "text": ""}
            out.append(self._added(self.open))
            self.open["content"].append(part)
            out.append(
                self.event(
                    "response.content_part.added", **self._where(self.open), content_index=0, part=dict(part)
                )
            )
        self.open["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(delta, **self._where(self.open), content_index=0, delta=text, **extra))
        return out

    def finish(self, done: Done) -> list[dict[str, Any]]:
        """Finish the item being written once the answer is over (cut short by
        ``max_output_tokens``: incomplete)."""
        return self.close("incomplete" if done.finish == "length" else "completed")

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Finish the message or reasoning item being written."""
        item, self.open = self.open, None
        if item is None:
            return []
        part = item["content"][0]
        where = {**self._where(item), "content_index": 0}
        if item["type"] == "message":
            done = self.event("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", **where, text=part["text"])
        item["status"] = status
        return [done, self.event("response.content_part.done", **where, part=dict(part)), self._done(item)]

    def _call_start(self, start: CallStart) -> list[dict[str, Any]]:
        out = self.close()
        name = start.name
        if name in self.tools.freeform:
            item = {"type": "custom_tool_call", "id": new_id("ctc"), "status": "in_progress",
                    "call_id": start.id, "name": name, "input": ""}  # fmt: skip
            reader = InputDeltas()
        else:
            item = {"type": "function_call", "id": new_id("fc"), "status": "in_progress",
                    "call_id": start.id, "name": name, "arguments": ""}  # fmt: skip
            if name in self.tools.namespaced:
                item["namespace"], item["name"] = self.tools.namespaced[name]
            reader = None
        self.calls[start.index] = (item, reader)
        return [*out, self._added(item)]

    def _call_delta(self, delta: CallDelta) -> list[dict[str, Any]]:
        item, reader = self.calls[delta.index]
        if reader is None:
            item["arguments"] += delta.arguments
            return [
                self.event(
                    "response.function_call_arguments.delta", **self._where(item), delta=delta.arguments
                )
            ]
        text = reader.feed(delta.arguments)
        item["input"] += text
        return (
            [self.event("response.custom_tool_call_input.delta", **self._where(item), delta=text)]
            if text
            else []
        )

    def _call_end(self, end: CallEnd) -> list[dict[str, Any]]:
        item, reader = self.calls[end.index]
        item["status"] = "completed" if end.call.complete else "incomplete"
        out = []
        if reader is None:
            item["arguments"] = end.call.arguments
            out.append(self.event("response.function_call_arguments.done", **self._where(item),
                                  name=item["name"], arguments=item["arguments"]))  # fmt: skip
        else:
            rest = reader.finish(end.call.arguments)
            if rest:
                out.append(
                    self.event("response.custom_tool_call_input.delta", **self._where(item), delta=rest)
                )
            item["input"] = call_input(end.call.arguments) if end.call.complete else item["input"] + rest
            out.append(
                self.event("response.custom_tool_call_input.done", **self._where(item), input=item["input"])
            )
        out.append(self._done(item))
        return out

    def final(self, done: Done) -> dict[str, Any]:
        """The whole response once the answer is over."""
        incomplete = "max_output_tokens" if done.finish == "length" else None
        status = "incomplete" if incomplete else "completed"
        body = self.shape.body(status, self.items, usage(done.stats, done.reasoning_tokens), incomplete)
        body["hf2q"] = speculation(done.stats, self.prep.label)
        return body

    def failed(self, failed: Failed) -> dict[str, Any]:
        error = {"code": failed.code or "server_error", "message": failed.message}
        return self.event(
            "response.failed", response=self.shape.body("failed", self.items, None, error=error)
        )
