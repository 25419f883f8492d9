"""The HTTP API: FastAPI routes over one :class:`Engine`, inside the
:class:`~hf2q_py.server.guard.Guard` (body limit, API key).

Each API is a thin translation into the engine's conversation and back:
OpenAI's chat and text completions (``openai_api``), Anthropic's Messages
(``anthropic_api``), OpenAI's Responses (``responses_api``). Every error is in the envelope of the API its path
belongs to (:func:`api_of`), with a 4xx or 5xx status, never a traceback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..budget import MemoryBudget
from ..errors import one_line
from . import anthropic_api, openai_api, responses_api
from .anthropic_protocol import CountRequest, MessagesRequest
from .engine import Engine, EngineConfig
from .guard import Guard, api_of
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest
from .responses_protocol import ResponsesRequest
from .worker import Failed, Worker

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
    memory: MemoryBudget | None = None  # what the server may hold in all (None: no budget)

    def engine(self) -> EngineConfig:
        return EngineConfig(self.method, dict(self.method_options), dict(self.models), self.max_tokens,
                            self.max_context, self.temperature)  # fmt: skip


def error_response(path: str, f: Failed) -> JSONResponse:
    """The error in the envelope of the API ``path`` belongs to."""
    if api_of(path) == "anthropic":
        return anthropic_api.error_response(f)
    return openai_api.error_response(f)


def create_app(worker: Worker, config: ServerConfig) -> Any:
    """The ASGI application: the routes inside :class:`Guard`."""
    metrics = Metrics(
        lambda: worker.target.prompt_cache,
        lambda: worker.waiting,
        lambda: worker.batch_rounds,
        lambda: worker.scheduler.ledger,
    )
    engine = Engine(worker, config.engine(), metrics)
    app = FastAPI(title="hf2q-py", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    _api_routes(app, engine, config.model_name)
    _service_routes(app, engine, metrics, config.model_name)
    _error_handlers(app)
    app.state.metrics, app.state.engine = metrics, engine
    return Guard(app, config.max_body_bytes, config.api_key, metrics)


def _api_routes(app: FastAPI, engine: Engine, name: str) -> None:
    """The generation APIs: OpenAI's chat and text completions and Responses, Anthropic's Messages."""
    store = responses_api.ResponseStore()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await openai_api.complete(engine, name, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await openai_api.complete(engine, name, body, request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await anthropic_api.messages(engine, name, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountRequest) -> Response:
        return await anthropic_api.count_tokens(engine, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await responses_api.responses(engine, store, name, body, request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        body = store.get(response_id)
        if body is None:
            return openai_api.error_response(Failed(404, f"no stored response with id {response_id!r}"))
        return JSONResponse(body)


def _service_routes(app: FastAPI, engine: Engine, metrics: Metrics, name: str) -> None:
    """The model list, the health check and the Prometheus metrics."""

    @app.get("/v1/models")
    async def models() -> dict:
        """The one model, in OpenAI's list shape with Anthropic's fields beside."""
        card = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "hf2q-py",
            "max_model_len": engine.context,
            "type": "model",
            "display_name": name,
            "created_at": "1970-01-01T00:00:00Z",
        }
        return {"object": "list", "data": [card], "has_more": False, "first_id": name, "last_id": name}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _error_handlers(app: FastAPI) -> None:
    """Every error as a 4xx or 5xx in the envelope of the path's API, never a traceback."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, Failed(400, _validation_message(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))  # fmt: skip
        return error_response(request.url.path, Failed(exc.status_code, message))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(
            request.url.path, Failed(500, "the server failed on this request (see the server's log)")
        )


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
