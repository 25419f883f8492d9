"""Starting the real ``hf2q-py serve`` process on a free loopback port, and raw HTTP."""

from __future__ import annotations

import http.client
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

START_SECONDS = 120


@dataclass
class Server:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT

    @property
    def base(self) -> str:
        return self.url + "/v1"

    @property
    def port(self) -> int:
        return urlsplit(self.url).port

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request over a new connection: status, headers, body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body.encode() if isinstance(body, str) else body
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post(self, path: str, obj, **kw) -> tuple[int, dict]:
        status, _, body = self.raw("POST", path, json.dumps(obj), **kw)
        return status, json.loads(body)

    def alive(self) -> bool:
        return self.process.poll() is None and self.raw("GET", "/health")[0] == 200


def server_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "hf2q_py", "serve", *flags]


@contextmanager
def running_server(*flags: str):
    """The server started as a user starts it, stopped with SIGTERM afterwards."""
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed below; stderr: a pipe nobody reads could fill and block it
    proc = subprocess.Popen(
        server_command("--port", "0", *flags),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = _announced_url(proc, log)
        yield Server(proc, url)
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _announced_url(proc: subprocess.Popen, log) -> str:
    """The URL from the line ``hf2q-py serve: NAME (METHOD) at URL/v1``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if not sel.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        if " at http://" in line:
            return line.rsplit(" at ", 1)[1].strip().removesuffix("/v1")
    proc.kill()
    proc.wait()
    log.seek(0)
    raise RuntimeError(f"the server did not start: {log.read()[-2000:]}")
