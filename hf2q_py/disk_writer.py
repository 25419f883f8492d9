"""The prompt cache's writer thread and its bound on disk.

Jobs hold host arrays only (copied from MLX on MLX's thread), so this thread
never touches MLX: it writes each file atomically (``cache_file``), marks
files it was asked to keep as just used, and keeps the folder within its
bytes by removing the least recently used files. Which files are recently
used is read from the files themselves (their modification times), never
from an index of its own, so servers sharing a folder agree without talking.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .cache_file import TEMP_PREFIX, Host, write_file

log = logging.getLogger("hf2q_py.prompt_cache")

#: The files the disk tier owns: blocks and tails (see ``disk_cache``).
NAME = re.compile(r"^(b-[0-9a-f]{32}|t-[0-9a-f]{32}-\d+-[0-9a-f]{32})\.safetensors$")
#: Host memory that writes waiting for the disk may hold (one job is always taken).
BACKLOG_BYTES = 1 << 30
#: Temporary files older than this are left over from a process that died.
STALE_SECONDS = 3600.0
#: Removal leaves the folder at this fraction of its bound, so it is not scanned on every write.
LOW_WATER = 0.9


@dataclass
class Job:
    """One file to write (``arrays``), or to mark as just used (``arrays`` None)."""

    name: str
    arrays: dict[str, Host] | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.arrays.values()) if self.arrays else 0


@dataclass
class DiskStats:
    """What the disk tier did: lookups that reused its states and how many
    tokens, files and bytes written, files skipped (unusable), files and
    bytes removed to stay in bounds, writes dropped (backlog full), and the
    bytes its files held at the last scan."""

    hits: int = 0
    reused_tokens: int = 0
    files_written: int = 0
    bytes_written: int = 0
    skipped: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    dropped: int = 0
    bytes: int = 0


class Writer:
    """Writes jobs on a thread of its own, started when jobs come and ended
    when none is left (so a process that exits waits for the files it queued)."""

    def __init__(self, directory: Path, max_bytes: int | None, stats: DiskStats):
        self.directory, self.max_bytes, self.stats = directory, max_bytes, stats
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running = False
        self._pending = 0
        self._since_scan = 0
        self.errors: list[str] = []

    def put(self, jobs: list[Job]) -> bool:
        """Queue ``jobs`` (together or not at all); False when the backlog is full."""
        size = sum(j.nbytes for j in jobs)
        with self._cond:
            if self._jobs and self._pending + size > BACKLOG_BYTES:
                self.stats.dropped += 1
                return False
            self._jobs.extend(jobs)
            self._pending += size
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="hf2q-cache-writer").start()
        return True

    def flush(self) -> list[str]:
        """Wait until every queued job is done; the write errors since the last flush."""
        with self._cond:
            while self._running:
                self._cond.wait()
            errors, self.errors = self.errors, []
        return errors

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._running = False
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
            try:
                self._do(job)
            except Exception as e:  # noqa: BLE001 - a failed write loses one file, never the server
                self._failed(job, e)
            finally:
                with self._cond:
                    self._pending -= job.nbytes

    def _do(self, job: Job) -> None:
        path = self.directory / job.name
        if job.arrays is None or path.exists():
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
            return
        self.directory.mkdir(parents=True, exist_ok=True)  # removed while the server runs: made again
        size = write_file(path, job.arrays, job.metadata)
        self.stats.files_written += 1
        self.stats.bytes_written += size
        self._since_scan += size
        if self.max_bytes is not None and self.stats.bytes + self._since_scan > self.max_bytes:
            self.evict()

    def _failed(self, job: Job, e: Exception) -> None:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        text = f"cannot write {self.directory / job.name}: {why}"
        if not self.errors or self.errors[-1] != text:
            log.warning("prompt cache on disk: %s", text)
        self.errors.append(text)

    def evict(self) -> None:
        """Remove the least recently used files until the folder holds at
        most ``LOW_WATER`` of its bound (and temporary files left by
        processes that died)."""
        files, now = [], time.time()
        total = 0
        if not self.directory.is_dir():
            return
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if NAME.match(entry.name):
                files.append((st.st_mtime_ns, entry.name, st.st_size))
                total += st.st_size
            elif entry.name.startswith(TEMP_PREFIX) and now - st.st_mtime > STALE_SECONDS:
                Path(entry.path).unlink(missing_ok=True)
        if self.max_bytes is not None and total > self.max_bytes:
            for _, name, size in sorted(files):
                if total <= self.max_bytes * LOW_WATER:
                    break
                (self.directory / name).unlink(missing_ok=True)
                total -= size
                self.stats.evicted += 1
                self.stats.evicted_bytes += size
        self.stats.bytes, self._since_scan = total, 0
