"""Running the server: the HTTP side (uvicorn) on a thread of its own, the
worker on the calling (main) thread, which also takes SIGINT and SIGTERM.

MLX's compute stays on the main thread: a process whose other threads ran
MLX can abort as it exits.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from ..errors import Hf2qError
from ..scheduler import SchedulerConfig
from ..target import Target
from .app import ServerConfig, create_app
from .relay import Relay
from .worker import Worker

STARTUP_SECONDS = 30.0
GRACE_SECONDS = 5


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        raise Hf2qError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _quiet_upgrades(record: logging.LogRecord) -> bool:
    """Drops uvicorn's warnings about WebSocket upgrades, which the server
    refuses itself (a 426 each; Codex tries one before every session)."""
    message = record.getMessage()
    return not message.startswith(("Unsupported upgrade request", "No supported WebSocket library"))


def serve(
    target: Target,
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    sock: socket.socket | None = None,
    access_log: bool = False,
    announce: Callable[[str], None] | None = None,
) -> int:
    """Serve ``target`` on ``host:port`` (or on ``sock``, already listening)
    until SIGINT or SIGTERM; returns the exit status. ``announce`` receives
    the URL once the server answers. A sharded target is served from rank 0
    while the other ranks run :func:`follow`."""
    _log_to_stderr()
    logging.getLogger("uvicorn.error").addFilter(_quiet_upgrades)
    sock = sock or bind(host, port)
    sharding = getattr(target, "sharding", None)
    relay = Relay(sharding) if sharding is not None else None
    worker = Worker(
        target, config.max_queue, relay, SchedulerConfig(max_batch=config.max_batch, memory=config.memory)
    )
    if worker.scheduler.ledger is not None:
        worker.scheduler.ledger.limit_mlx()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(worker, config),
            log_level="warning",
            access_log=access_log,
            lifespan="off",
            timeout_graceful_shutdown=GRACE_SECONDS,
        )
    )
    try:
        _run(server, worker, sock, host, announce)
    finally:
        if relay is not None:
            relay.stop()
        sock.close()
    return 0


def _run(
    server: uvicorn.Server,
    worker: Worker,
    sock: socket.socket,
    host: str,
    announce: Callable[[str], None] | None,
) -> None:
    """HTTP on a thread of its own, the worker here until a signal stops both."""

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            worker.stop()

    def on_signal(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        worker.stop()
        server.should_exit = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="hf2q-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            raise Hf2qError("the HTTP server did not start")
        shown = host if ":" not in host else f"[{host}]"
        if announce is not None:
            announce(f"http://{shown}:{sock.getsockname()[1]}")
        worker.run()
        thread.join(GRACE_SECONDS + 5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def follow(target: Target, models: dict[str, Any], scheduling: SchedulerConfig) -> int:
    """A rank of a sharded target other than 0: run every step rank 0's
    server runs (``models``: the served draft model under ``"draft"``;
    ``scheduling`` as rank 0's) until it stops; returns the exit status.
    SIGINT is ignored here: rank 0 takes it and stops every rank."""
    _log_to_stderr()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Worker(target, relay=Relay(target.sharding, models), scheduling=scheduling).follow()
    return 0


def _log_to_stderr() -> None:
    logging.basicConfig(
        level=logging.INFO, format="hf2q-py serve: %(levelname)s %(message)s", stream=sys.stderr
    )
