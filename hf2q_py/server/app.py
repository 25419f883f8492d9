"""The OpenAI-compatible HTTP API: FastAPI routes over one :class:`Worker`.

Every error is OpenAI's ``{"error": {...}}`` body with a 4xx or 5xx status,
never a traceback. :class:`Guard`, outside the routes, reads each body whole
before anything answers (so a 413 or 401 reaches the client instead of a
reset connection), checks the API key and counts responses by status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import Hf2qError, one_line
from ..generation import context_length, encode_messages, encode_prompt, make_config
from ..method_spec import parse_method
from ..methods import method_named
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest, Shape, error_body, speculation
from .worker import Busy, Failed, Finished, Job, Piece, Worker

log = logging.getLogger("hf2q_py.server")

#: A body past the limit is still read (and dropped) up to this many times the
#: limit, so the client can read the 413; past that the connection is closed.
DRAIN_FACTOR = 16


@dataclass
class ServerConfig:
    """What ``hf2q-py serve`` was started with (besides the model).

    ``method``: the default method spec; ``method_options`` its parsed
    options, with ``draft`` (and ``drafter``) as the server loaded them: a
    request may choose another method (``"hf2q": {"method": ...}``) but never
    another model file.
    """

    model_name: str
    method: str = "ngram"
    method_options: dict[str, Any] = field(default_factory=lambda: {"method": "ngram"})
    api_key: str | None = None
    max_tokens: int = 512
    max_context: int | None = None
    max_body_bytes: int = 8 << 20
    max_queue: int = 16
    temperature: float = 0.0


class ApiError(Exception):
    """A request the server answers with an error body."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind, self.code)


def error_response(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code), status_code=status)


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "server_error", 500: "server_error"}  # fmt: skip


class Guard:
    """Pure ASGI middleware: reads the body (at most ``max_body_bytes``),
    then checks the API key (all but ``/health``), then runs the app;
    counts every response by endpoint and status."""

    def __init__(self, app: Any, config: ServerConfig, metrics: Metrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            body = await self._read_body(scope, receive)
            if body is None:  # too large
                return await self._refuse(counted_send, 413, self._too_large(), close=True)
            if not self._authorized(scope):
                return await self._refuse(
                    counted_send, 401, "missing or wrong API key (Authorization: Bearer KEY)"
                )
            await self.app(scope, _replay(body, receive), counted_send)
        except _Disconnected:
            status["code"] = 499
        finally:
            self.metrics.request(scope.get("path", ""), status["code"])

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.config.max_body_bytes} bytes (--max-body-bytes)"

    async def _read_body(self, scope, receive) -> bytes | None:
        limit = self.config.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit * DRAIN_FACTOR:
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            size += len(chunk)
            if size > limit * DRAIN_FACTOR:
                return None
            if size <= limit:
                chunks.append(chunk)
        return b"".join(chunks) if size <= limit else None

    def _authorized(self, scope) -> bool:
        key = self.config.api_key
        if key is None or scope.get("path") == "/health":
            return True
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + key.encode())

    async def _refuse(self, send, status: int, message: str, close: bool = False):
        body = json.dumps(error_body(message, _KINDS[status], None)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _Disconnected(Exception):
    pass


def _replay(body: bytes, receive):
    """A ``receive`` that gives the read body once, then the client's later messages (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Service:
    """Turns validated requests into jobs for the worker and their events into responses."""

    def __init__(self, worker: Worker, config: ServerConfig, metrics: Metrics):
        self.worker, self.config, self.metrics = worker, config, metrics
        self.target = worker.target
        limit = context_length(self.target)
        if config.max_context is not None:
            limit = min(limit, config.max_context) if limit else config.max_context
        self.context = limit

    # -- requests --------------------------------------------------------------
    def job(self, req: ChatRequest | CompletionRequest, loop) -> tuple[Job, str]:
        """The worker job for a request and its method's label; raises ApiError."""
        if req.model is not None and req.model != self.config.model_name:
            raise ApiError(
                404, f"the model {req.model!r} does not exist; this server has {self.config.model_name!r}",
                "not_found_error", "model_not_found",
            )  # fmt: skip
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem, code="unsupported_parameter")
        try:
            ids = self._encode(req)
            max_tokens = self._budget(len(ids), req.token_limit)
            label, options = self._method(req)
            config = make_config(
                max_tokens=max_tokens, stop=req.stop_strings(), plain_first_token=req.stream, **options,
                **req.sampling(self.config.temperature),
            )  # fmt: skip
        except Hf2qError as e:
            raise ApiError(400, one_line(e, limit=1000)) from None
        return Job(ids, config, loop), label

    def _encode(self, req: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            messages = [
                {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages
            ]
            return encode_messages(self.target, messages)
        return encode_prompt(self.target, req.prompt_input(), chat_template=False)

    def _budget(self, prompt_tokens: int, asked: int | None) -> int:
        """The request's max_tokens: the asked number, or the server default
        cut to the context; a prompt (with the asked tokens) past it is refused."""
        if self.context is not None and prompt_tokens >= self.context:
            raise ApiError(
                400, f"the prompt has {prompt_tokens} tokens; this server's context holds {self.context}, "
                "with room for at least one generated token", code="context_length_exceeded",
            )  # fmt: skip
        if asked is None:
            room = self.context - prompt_tokens if self.context is not None else self.config.max_tokens
            return min(self.config.max_tokens, room)
        if self.context is not None and prompt_tokens + asked > self.context:
            raise ApiError(
                400, f"the prompt ({prompt_tokens} tokens) and max_tokens ({asked}) exceed this server's "
                f"context of {self.context} tokens", code="context_length_exceeded",
            )  # fmt: skip
        return asked

    def _method(self, req: ChatRequest | CompletionRequest) -> tuple[str, dict[str, Any]]:
        """The method spec (the request's, else the server's) with the server's models filled in."""
        text = req.hf2q.method if req.hf2q is not None and req.hf2q.method else None
        if text is None:
            return self.config.method, dict(self.config.method_options)
        options = parse_method(text).options
        for key in ("draft", "drafter"):
            if key in options:
                raise Hf2qError(f"hf2q.method: {key} is chosen when the server starts, not per request")
            served = self.config.method_options.get(key)
            if key in method_named(options["method"]).options:
                if served is None and key == "draft":
                    raise Hf2qError(
                        "hf2q.method: this server has no draft model (start it with --draft-model)"
                    )
                if served is None and key == "drafter":
                    raise Hf2qError(
                        "hf2q.method: this server has no DFlash drafter (start it with --method dflash:drafter=PATH)"
                    )
                options[key] = served
        return text, options

    # -- responses -------------------------------------------------------------
    async def complete(self, req: ChatRequest | CompletionRequest, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            job, label = self.job(req, loop)
            self.worker.submit(job)
        except ApiError as e:
            return e.response()
        except Busy as e:
            return error_response(503, str(e), "server_error", "server_busy")
        shape = Shape(chat, self.config.model_name, f"hf2q-py-{__version__}")
        if req.stream:
            return await self._stream(job, shape, label, req, request, arrival)
        return_tokens = bool(req.hf2q and req.hf2q.return_tokens)
        return await self._whole(job, shape, label, request, arrival, return_tokens)

    async def _whole(
        self, job: Job, shape: Shape, label: str, request: Request, arrival: float, return_tokens: bool
    ) -> Response:
        gone = asyncio.ensure_future(_disconnected(request))
        text, tokens, ttft = [], [], None
        try:
            async for event in _until(job.stream(), gone):
                if isinstance(event, Piece):
                    if ttft is None and event.tokens:
                        ttft = time.perf_counter() - arrival
                    text.append(event.text)
                    tokens.extend(event.tokens)
                elif isinstance(event, Failed):
                    return error_response(
                        event.status, event.message, _KINDS.get(event.status, "server_error"), event.code
                    )
                elif isinstance(event, Finished):
                    if event.cancelled:
                        return error_response(
                            503, "the server is shutting down", "server_error", "server_shutting_down"
                        )
                    self.metrics.finished(event.stats, ttft, time.perf_counter() - arrival)
                    body = shape.response("".join(text), event.stats, label)
                    if return_tokens:
                        body["hf2q"]["tokens"] = tokens
                    return JSONResponse(body)
            job.cancel()  # the client left
            return Response(status_code=499)
        finally:
            gone.cancel()
            job.cancel()

    async def _stream(
        self, job: Job, shape: Shape, label: str, req, request: Request, arrival: float
    ) -> Response:
        events = job.stream()
        gone = asyncio.ensure_future(_disconnected(request))
        try:  # a client that leaves while its request waits never starts it
            first = await anext(_until(events, gone), None)
        finally:
            gone.cancel()
        if first is None:
            job.cancel()
            return Response(status_code=499)
        if isinstance(first, Failed):
            return error_response(
                first.status, first.message, _KINDS.get(first.status, "server_error"), first.code
            )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def sse() -> AsyncIterator[str]:
            ttft = None
            try:
                if shape.chat:
                    yield _sse(shape.chunk("", role=True, with_usage=include_usage))
                event = first
                while True:
                    if isinstance(event, Piece):
                        if ttft is None and event.tokens:
                            ttft = time.perf_counter() - arrival
                        if event.text:
                            yield _sse(shape.chunk(event.text, with_usage=include_usage))
                    elif isinstance(event, Failed):
                        yield _sse(
                            error_body(event.message, _KINDS.get(event.status, "server_error"), event.code)
                        )
                        return
                    else:
                        yield from_finished(event, ttft)
                        return
                    event = await events.__anext__()
            finally:
                job.cancel()

        def from_finished(event: Finished, ttft: float | None) -> str:
            if event.cancelled:
                return _sse(error_body("the server is shutting down", "server_error", "server_shutting_down"))
            stats = event.stats
            self.metrics.finished(stats, ttft, time.perf_counter() - arrival)
            last = shape.chunk(None, stats.finish_reason or "stop", with_usage=include_usage)
            last["hf2q"] = speculation(stats, label)
            out = _sse(last)
            if include_usage:
                out += _sse(shape.usage_chunk(stats))
            return out + "data: [DONE]\n\n"

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until(events: AsyncIterator, gone: asyncio.Future) -> AsyncIterator:
    """``events`` until ``gone`` completes."""
    while True:
        nxt = asyncio.ensure_future(events.__anext__())
        done, _ = await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
        if nxt not in done:
            nxt.cancel()
            return
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return


def create_app(worker: Worker, config: ServerConfig) -> Any:
    """The ASGI application: the routes inside :class:`Guard`."""
    metrics = Metrics(lambda: worker.target.prompt_cache, lambda: worker.waiting)
    service = Service(worker, config, metrics)
    app = FastAPI(title="hf2q-py", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await service.complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await service.complete(body, request, chat=False)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "hf2q-py"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))  # fmt: skip
        return error_response(exc.status_code, message, _KINDS.get(exc.status_code, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, "the server failed on this request (see the server's log)", "server_error")

    app.state.metrics, app.state.service = metrics, service
    return Guard(app, config, metrics)


def _validation_message(exc: RequestValidationError) -> str:
    """The first problem of a request body, as one line naming the field."""
    errors = exc.errors()
    if not errors:
        return "the request body is not valid"
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({one_line(e.get('ctx', {}).get('error', ''))})"
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    where = ".".join(loc) if loc else "the request body"
    if e.get("type") == "missing":
        return (
            "the request body is missing (send a JSON object)"
            if not loc
            else f"{where}: this field is required"
        )
    return f"{where}: {one_line(e.get('msg', 'invalid'), limit=300)}"
