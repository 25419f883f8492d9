"""The server's outer layer, as pure ASGI middleware: each request's body is
read whole (at most the limit) before anything answers, so a 413 or a 401
reaches the client instead of a reset connection; then the API key is
checked (``Authorization: Bearer KEY``, or Anthropic's ``x-api-key: KEY``);
every response is counted by endpoint and status. Refusals are in the
envelope of the API the path belongs to (:func:`api_of`).

The server speaks HTTP only: a WebSocket upgrade (Codex tries one on
``/v1/responses`` before falling back to HTTP) is refused at once with 426,
whether the HTTP server hands it over as a WebSocket or as a request with
an ``Upgrade: websocket`` header."""

from __future__ import annotations

import hmac
import json
from typing import Any

from . import anthropic_protocol
from .metrics import Metrics
from .protocol import ERROR_TYPES, error_body

#: A body past the limit is still read (and dropped) up to this many times the
#: limit, so the client can read the 413; past that the connection is closed.
DRAIN_FACTOR = 16


def api_of(path: str) -> str:
    """The API a path belongs to: ``anthropic`` (``/v1/messages`` and below) or ``openai``."""
    return "anthropic" if path == "/v1/messages" or path.startswith("/v1/messages/") else "openai"


def refusal_body(path: str, status: int, message: str) -> dict:
    """An error body in the envelope of the path's API."""
    if api_of(path) == "anthropic":
        return anthropic_protocol.error_body(message, status)
    return error_body(message, ERROR_TYPES[status], None)


class Guard:
    """Reads the body (at most ``max_body_bytes``), then checks ``api_key``
    (if set; every path but ``/health``), then runs ``app``."""

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None, metrics: Metrics):
        self.app, self.max_body_bytes, self.api_key, self.metrics = app, max_body_bytes, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            return await self._refuse_websocket(scope, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            path = scope.get("path", "")
            if _upgrade(scope) == b"websocket":
                return await self._refuse(counted_send, path, 426, WEBSOCKET_REFUSED, close=True)
            body = await self._read_body(scope, receive)
            if body is None:  # too large
                return await self._refuse(counted_send, path, 413, self._too_large(), close=True)
            if not self._authorized(scope):
                message = "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)"
                return await self._refuse(counted_send, path, 401, message)
            await self.app(scope, _replay(body, receive), counted_send)
        except _Disconnected:
            status["code"] = 499
        finally:
            self.metrics.request(scope.get("path", ""), status["code"])

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_body_bytes} bytes (--max-body-bytes)"

    async def _read_body(self, scope, receive) -> bytes | None:
        limit = self.max_body_bytes
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
        key = self.api_key
        if key is None or scope.get("path") == "/health":
            return True
        headers = dict(scope.get("headers") or [])
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + key.encode())
        x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode())
        return bearer or x_api_key

    async def _refuse(self, send, path: str, status: int, message: str, close: bool = False):
        body = json.dumps(refusal_body(path, status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _refuse_websocket(self, scope, send) -> None:
        """Deny a WebSocket before it is accepted: 426 with the error body where
        the HTTP server can send a denial response, else a close (403)."""
        path = scope.get("path", "")
        if "websocket.http.response" in (scope.get("extensions") or {}):
            body = json.dumps(refusal_body(path, 426, WEBSOCKET_REFUSED)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "websocket.http.response.start", "status": 426, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})
        self.metrics.request(path, 426)


#: Why a WebSocket is refused.
WEBSOCKET_REFUSED = "this server speaks HTTP only: send the request as an HTTP POST (no WebSocket)"


def _upgrade(scope) -> bytes | None:
    """The protocol an HTTP request asks to upgrade to (lower case), if any."""
    headers = dict(scope.get("headers") or [])
    if b"upgrade" not in headers.get(b"connection", b"").lower():
        return None
    return headers.get(b"upgrade", b"").lower().strip() or None


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
