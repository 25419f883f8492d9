"""The OpenAI-compatible HTTP API: FastAPI routes over one :class:`Worker`,
inside the :class:`~hf2q_py.server.guard.Guard` (body limit, API key).

Every error is OpenAI's ``{"error": {...}}`` body with a 4xx or 5xx status,
never a traceback.
"""

from __future__ import annotations

import asyncio
import itertools
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
from .guard import Guard
from .protocol import (
    ERROR_TYPES,
    ChatRequest,
    CompletionRequest,
    Shape,
    error_body,
    finish_reason,
    speculation,
)
from .logprobs import LogprobWriter
from .tool_calls import ToolCall, ToolUse, quoted_views, split_answer, tool_use
from .worker import Busy, Failed, Finished, Job, Piece, Worker

log = logging.getLogger("hf2q_py.server")


@dataclass
class ServerConfig:
    """What ``hf2q-py serve`` was started with (besides the model).

    ``method``: the default method spec; ``method_options`` its parsed
    options; ``models`` the draft model and DFlash drafter the server
    loaded. A request may choose another method (``"hf2q": {"method": ...}``),
    which then uses these, but never another model file.
    """

    model_name: str
    method: str = "ngram"
    method_options: dict[str, Any] = field(default_factory=lambda: {"method": "ngram"})
    models: dict[str, Any] = field(default_factory=dict)  # "draft" (a Target), "drafter" (a folder)
    api_key: str | None = None
    max_tokens: int = 512
    max_context: int | None = None
    max_body_bytes: int = 8 << 20
    max_queue: int = 16
    max_batch: int = 8
    temperature: float = 0.0


class ApiError(Exception):
    """A request the server answers with an error body."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.failure = Failed(status, message, code)


SHUTTING_DOWN = Failed(503, "the server is shutting down", "server_shutting_down")


def error_response(f: Failed) -> JSONResponse:
    """OpenAI's error body for ``f``, its type read from the status."""
    return JSONResponse(error_body(f.message, ERROR_TYPES.get(f.status, "server_error"), f.code), f.status)


def error_event(f: Failed) -> str:
    """The same error as a server-sent event (a stream already under way)."""
    return _sse(error_body(f.message, ERROR_TYPES.get(f.status, "server_error"), f.code))


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
    def job(self, req: ChatRequest | CompletionRequest, loop) -> tuple[Job, str, ToolUse | None]:
        """The worker job for a request, its method's label and its use of
        tools (None: the answer is plain text); raises ApiError. The
        request's ``model`` may name anything: the server has one model, and
        the response names it."""
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem, code="unsupported_parameter")
        try:
            use = self._tool_use(req)
            ids = self._encode(req, use)
            max_tokens = self._budget(len(ids), req.token_limit)
            label, options = self._method(req)
            config = make_config(
                max_tokens=max_tokens, stop=req.stop_strings(), plain_first_token=req.stream, **options,
                constraint=req.constraint(), logprobs=req.logprob_count(),
                **req.sampling(self.config.temperature),
            )  # fmt: skip
        except Hf2qError as e:
            raise ApiError(400, one_line(e, limit=1000)) from None
        return Job(ids, config, loop, drafting=self._quoted(req, use)), label, use

    def _quoted(self, req: ChatRequest | CompletionRequest, use: ToolUse | None) -> list[list[int]]:
        """With tools in play: the conversation's long texts as a call would
        quote them, tokenized, for the n-gram proposer to copy drafts from."""
        tok = self.target.tokenizer
        if use is None or not use.tools or tok is None:
            return []
        return [
            list(tok.encode(text, add_special_tokens=False)) for text in quoted_views(req.template_messages())
        ]

    def _tool_use(self, req: ChatRequest | CompletionRequest) -> ToolUse | None:
        if not isinstance(req, ChatRequest):
            return None
        parallel = req.parallel_tool_calls is not False
        return tool_use(self.target.tokenizer, req.tool_dicts(), req.choice(), parallel)

    def _encode(self, req: ChatRequest | CompletionRequest, use: ToolUse | None) -> list[int]:
        if isinstance(req, ChatRequest):
            messages = req.template_messages()
            if use is None:
                return encode_messages(self.target, messages)
            return encode_messages(self.target, messages, tools=use.tools, prefix=use.prefix)
        return encode_prompt(self.target, req.prompt_input(), chat_template=False)

    def _budget(self, prompt_tokens: int, asked: int | None) -> int:
        """The request's max_tokens: the asked number (or the server default)
        cut to what the context leaves after the prompt, as agent clients
        that ask for more than any context holds expect; a prompt that
        leaves no room is refused."""
        if self.context is not None and prompt_tokens >= self.context:
            raise ApiError(
                400, f"the prompt has {prompt_tokens} tokens; this server's context holds {self.context}, "
                "with room for at least one generated token", code="context_length_exceeded",
            )  # fmt: skip
        wanted = self.config.max_tokens if asked is None else asked
        return wanted if self.context is None else min(wanted, self.context - prompt_tokens)

    def _method(self, req: ChatRequest | CompletionRequest) -> tuple[str, dict[str, Any]]:
        """The method spec (the request's, else the server's) with the server's models filled in."""
        text = req.hf2q.method if req.hf2q is not None and req.hf2q.method else None
        if text is None:
            return self.config.method, dict(self.config.method_options)
        options = parse_method(text).options
        for key in ("draft", "drafter"):
            if key in options:
                raise Hf2qError(f"hf2q.method: {key} is chosen when the server starts, not per request")
            served = self.config.models.get(key)
            if key in method_named(options["method"]).options:
                if served is None and key == "draft":
                    raise Hf2qError(
                        "hf2q.method: this server has no draft model (start it with --draft-model)"
                    )
                if served is None and key == "drafter":
                    raise Hf2qError(
                        "hf2q.method: this server has no DFlash drafter (start it with --drafter PATH)"
                    )
                options[key] = served
        return text, options

    # -- responses -------------------------------------------------------------
    async def complete(self, req: ChatRequest | CompletionRequest, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            job, label, use = self.job(req, loop)
            self.worker.submit(job)
        except ApiError as e:
            return error_response(e.failure)
        except Busy as e:
            return error_response(Failed(503, str(e), "server_busy"))
        shape = Shape(chat, self.config.model_name, f"hf2q-py-{__version__}")
        if req.stream:
            return await self._stream(job, shape, label, req, request, arrival, use)
        return_tokens = bool(req.hf2q and req.hf2q.return_tokens)
        return await self._whole(job, shape, label, request, arrival, return_tokens, use)

    async def _whole(
        self,
        job: Job,
        shape: Shape,
        label: str,
        request: Request,
        arrival: float,
        return_tokens: bool,
        use: ToolUse | None,
    ) -> Response:
        gone = asyncio.ensure_future(_disconnected(request))
        text, tokens, lps, ttft = [], [], [], None
        try:
            async for event in _until(job.stream(), gone):
                if isinstance(event, Piece):
                    if ttft is None and event.tokens:
                        ttft = time.perf_counter() - arrival
                    text.append(event.text)
                    tokens.extend(event.tokens)
                    lps.extend(event.logprobs or ())
                elif isinstance(event, Failed):
                    return error_response(event)
                elif isinstance(event, Finished):
                    if event.cancelled:
                        return error_response(SHUTTING_DOWN)
                    self.metrics.finished(event.stats, ttft, time.perf_counter() - arrival)
                    answer, calls = "".join(text), None
                    if use is not None:
                        answer, calls = split_answer(use, answer)
                    body = shape.response(answer, event.stats, label, calls)
                    if job.config.logprobs is not None:
                        body["choices"][0]["logprobs"] = LogprobWriter(
                            self.target.tokenizer, shape.chat
                        ).body(lps)
                    if return_tokens:
                        body["hf2q"]["tokens"] = tokens
                    return JSONResponse(body)
            job.cancel()  # the client left
            return Response(status_code=499)
        finally:
            gone.cancel()
            job.cancel()

    async def _stream(
        self, job: Job, shape: Shape, label: str, req, request: Request, arrival: float, use: ToolUse | None
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
            return error_response(first)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        splitter = use.splitter() if use is not None else None
        call_index = itertools.count()
        writer = LogprobWriter(self.target.tokenizer, shape.chat) if job.config.logprobs is not None else None
        held: list = []  # log-probabilities of tokens whose text is not out yet (held by the splitter)

        def text_chunk(text: str) -> str:
            chunk = shape.chunk(text, with_usage=include_usage)
            if writer is not None and held:
                chunk["choices"][0]["logprobs"] = writer.body(held)
                held.clear()
            return _sse(chunk)

        def deltas(text: str, final: bool = False) -> str:
            """The chunks for new answer text: as it is, or split into content and tool calls."""
            if splitter is None:
                return text_chunk(text) if text or held else ""
            pieces = splitter.feed(text) + (splitter.finish() if final else [])
            out = []
            for p in pieces:
                if isinstance(p, ToolCall):
                    out.append(_sse(shape.tool_chunk(p, next(call_index), with_usage=include_usage)))
                else:
                    out.append(text_chunk(p))
            return "".join(out)

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
                        held.extend(event.logprobs or ())
                        if (event.text or (held and splitter is None)) and (out := deltas(event.text)):
                            yield out
                    elif isinstance(event, Failed):
                        yield error_event(event)
                        return
                    else:
                        yield from_finished(event, ttft)
                        return
                    event = await events.__anext__()
            finally:
                job.cancel()

        def from_finished(event: Finished, ttft: float | None) -> str:
            if event.cancelled:
                return error_event(SHUTTING_DOWN)
            stats = event.stats
            self.metrics.finished(stats, ttft, time.perf_counter() - arrival)
            out = deltas("", final=True)
            called = splitter is not None and splitter.calls > 0
            last = shape.chunk(None, finish_reason(stats, called), with_usage=include_usage)
            if writer is not None and held:  # tokens whose text never came out (tool calls)
                last["choices"][0]["logprobs"] = writer.body(held)
            last["hf2q"] = speculation(stats, label)
            out += _sse(last)
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
    metrics = Metrics(lambda: worker.target.prompt_cache, lambda: worker.waiting, lambda: worker.batch_rounds)
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
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "hf2q-py",
                "max_model_len": service.context}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(Failed(400, _validation_message(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))  # fmt: skip
        return error_response(Failed(exc.status_code, message))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(Failed(500, "the server failed on this request (see the server's log)"))

    app.state.metrics, app.state.service = metrics, service
    return Guard(app, config.max_body_bytes, config.api_key, metrics)


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
    return f"{where}: {one_line(e.get('msg', 'invalid'), limit=300).removeprefix('Value error, ')}"
