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
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

START_SECONDS = 120


@dataclass
class Server:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Any = None  # the process's stderr, a file
    _stderr: str | None = None  # what it held when the server stopped

    def stderr(self) -> str:
        if self._stderr is not None:
            return self._stderr
        self.log.seek(0)
        return self.log.read()

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


#: Flags that say where the prompt cache on disk goes, or that it is off.
DISK_FLAGS = ("--prompt-cache-dir", "--no-disk-cache", "--no-prompt-cache")


_shared_cache: list[tempfile.TemporaryDirectory] = []  # removed when the test process exits


def server_command(*flags: str, cache_dir: str | None = None) -> list[str]:
    """The serve command; unless ``flags`` place the prompt cache on disk,
    it goes to ``cache_dir`` (default: a temporary folder of this test
    process), never into the user's cache folder."""
    if not any(f.split("=")[0] in DISK_FLAGS for f in flags):
        if cache_dir is None and not _shared_cache:
            _shared_cache.append(tempfile.TemporaryDirectory(prefix="hf2q-test-cache-"))
        flags = ("--prompt-cache-dir", cache_dir or _shared_cache[0].name, *flags)
    return [sys.executable, "-m", "hf2q_py", "serve", *flags]


@contextmanager
def running_server(*flags: str, launcher: Sequence[str] = ()):
    """The server started as a user starts it (after ``launcher``, such as
    ``mlx.launch -n 2``, in a session of its own), stopped with SIGTERM
    afterwards (SIGINT to the session under a launcher, as Ctrl-C sends)."""
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed below; stderr: a pipe nobody reads could fill and block it
    cache = tempfile.TemporaryDirectory(prefix="hf2q-test-cache-")
    bin_dir = os.path.dirname(sys.executable)
    proc = subprocess.Popen(
        [*launcher, *server_command("--port", "0", *flags, cache_dir=cache.name)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        },
        start_new_session=bool(launcher),
    )
    server = None
    try:
        server = Server(proc, _announced_url(proc, log), log)
        yield server
    finally:
        if launcher:
            stop_session(proc)
        else:
            stop(proc)
        if server is not None:
            server._stderr = server.stderr()
        log.close()
        cache.cleanup()


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_session(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGINT to every process of ``proc``'s session (Ctrl-C in its terminal)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
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
