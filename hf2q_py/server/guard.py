"""The server's outer layer, as pure ASGI middleware: each request's body is
read whole (at most the limit) before anything answers, so a 413 or a 401
reaches the client instead of a reset connection; then the API key is
checked; every response is counted by endpoint and status."""

from __future__ import annotations

import hmac
import json
from typing import Any

from .metrics import Metrics
from .protocol import ERROR_TYPES, error_body

#: A body past the limit is still read (and dropped) up to this many times the
#: limit, so the client can read the 413; past that the connection is closed.
DRAIN_FACTOR = 16


class Guard:
    """Reads the body (at most ``max_body_bytes``), then checks ``api_key``
    (if set; every path but ``/health``), then runs ``app``."""

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None, metrics: Metrics):
        self.app, self.max_body_bytes, self.api_key, self.metrics = app, max_body_bytes, api_key, metrics

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
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + key.encode())

    async def _refuse(self, send, status: int, message: str, close: bool = False):
        body = json.dumps(error_body(message, ERROR_TYPES[status], None)).encode()
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
