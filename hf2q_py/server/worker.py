"""The worker: the one owner of the model, running generations through a
:class:`~hf2q_py.scheduler.Scheduler` (continuous batching: requests join
and leave the batch between rounds, up to ``max_batch`` at once).

The HTTP side submits a :class:`Job` (token ids and a ``GenerationConfig``)
and reads its events (:class:`Piece` per round, then :class:`Finished` or
:class:`Failed`) from an asyncio queue; the worker runs on the thread that
calls :meth:`Worker.run`, the process's main thread (MLX's compute stays on
one thread). A job cancelled while it runs stops within one round; one
cancelled while it waits never starts. ``submit`` refuses a job at once when
``max_queue`` jobs already wait. On a sharded target (``relay``) every rank
runs a worker: rank 0's runs (HTTP jobs, each step's news sent to the other
ranks), the others follow (:meth:`Worker.follow`), every rank stepping its
scheduler in step (:mod:`~hf2q_py.server.relay`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..budget import MemoryExhausted, MemoryRefused
from ..config import GenerationConfig
from ..distributed import RanksDiverged
from ..errors import Hf2qError, one_line
from ..request import GenerationChunk
from ..sampling import TokenLogprob
from ..scheduler import Entry, Failure, News, Scheduler, SchedulerConfig
from ..stats import GenerationStats
from ..target import Target
from .relay import IDLE_TICK, Relay

log = logging.getLogger("hf2q_py.server")


@dataclass
class Piece:
    """Text decoded in one round, the tokens behind it and their
    log-probabilities (when the request asked for them); ``stop``: the stop
    string that ended the text; ``ends``: where each token's text ends in
    ``text``."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    stop: str | None = None
    ends: list[int] = field(default_factory=list)


@dataclass
class Finished:
    stats: GenerationStats
    cancelled: bool = False


@dataclass
class Failed:
    """The generation could not run: an HTTP status and a message for the client."""

    status: int
    message: str
    code: str | None = None


Event = Piece | Finished | Failed


class Busy(Exception):
    """The queue is full, or the worker is stopping."""


@dataclass
class Job:
    """One generation; its events go to the event loop that submitted it.
    Once submitted, its cancel flag is its scheduler entry's."""

    ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    #: Token sequences the generation may copy drafts from besides its prompt
    #: (added to the Target's memory on the worker's thread before it starts).
    drafting: list[list[int]] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    entry: Entry | None = None
    _cancelled: bool = False  # before it is submitted (then its entry's)

    def cancel(self) -> None:
        """Stop the generation (within one round) or, if it waits, never start it."""
        self._cancelled = True
        if self.entry is not None:
            self.entry.cancel()

    @property
    def cancelled(self) -> bool:
        return self.entry.cancelled if self.entry is not None else self._cancelled

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancel()

    async def stream(self) -> AsyncIterator[Event]:
        """The job's events until its last one."""
        while True:
            event = await self.events.get()
            yield event
            if not isinstance(event, Piece):
                return


class JobSink:
    """A scheduler sink that turns one generation's output into its job's
    events: the one place an error becomes a status and a message."""

    def __init__(self, job: Job):
        self.job = job

    def chunk(self, chunk: GenerationChunk) -> None:
        self.job.emit(Piece(chunk.text, chunk.tokens, chunk.logprobs, chunk.stop, chunk.ends))

    def done(self, stats: GenerationStats, error: Hf2qError | None = None) -> None:
        if error is None:
            self.job.emit(Finished(stats, cancelled=self.job.cancelled))
        elif isinstance(error, (MemoryRefused, MemoryExhausted)):  # the budget's 413/429, a failed allocation
            self.job.emit(Failed(error.status, one_line(error, limit=1000), error.code))
        elif isinstance(error, (Failure, RanksDiverged)):  # not the request's fault
            self.job.emit(
                Failed(500, "the generation failed on the server (see the server's log)", "server_error")
            )
        else:
            self.job.emit(Failed(400, one_line(error, limit=1000), "invalid_request"))


class Worker:
    """Runs jobs on ``target`` through a scheduler (continuous batching), at
    most ``max_queue`` waiting (a cancelled job frees its place at once). A
    job crosses one queue, the scheduler's. ``relay``: the target is
    sharded, and each step's news goes from rank 0 to the other ranks."""

    def __init__(
        self,
        target: Target,
        max_queue: int = 16,
        relay: Relay | None = None,
        scheduling: SchedulerConfig | None = None,
    ):
        self.target = target
        self.max_queue = max_queue
        self.relay = relay
        self.scheduler = Scheduler(target, scheduling)
        if relay is not None and relay.leads:
            self.scheduler.announce = relay.send
        self._wake = threading.Condition()
        self._stopping = False

    @property
    def waiting(self) -> int:
        """Jobs submitted, not cancelled and not yet started."""
        return self.scheduler.queued

    @property
    def batch_rounds(self) -> dict[int, int]:
        """Rounds run per batch size (rows sharing a forward)."""
        return dict(self.scheduler.rounds_by_size)

    def submit(self, job: Job) -> None:
        """Queue ``job``; Busy when ``max_queue`` jobs wait or the server stops."""
        with self.scheduler.lock:
            if self._stopping:
                raise Busy("the server is shutting down")
            waiting = self.scheduler.queued
            if waiting >= self.max_queue:
                raise Busy(f"the server is busy: {waiting} requests are waiting (--max-queue)")
            job.entry = self.scheduler.submit(job.ids, job.config, JobSink(job), drafting=job.drafting)
            if job._cancelled:
                job.entry.cancel()
        with self._wake:
            self._wake.notify()

    def run(self) -> None:
        """Serve jobs until :meth:`stop`; call from the thread that owns the
        model (on a sharded target, rank 0's)."""
        sched = self.scheduler
        try:
            while not self._stopping:
                with self._wake:
                    if sched.idle and not self._stopping:
                        self._wake.wait(IDLE_TICK)
                if not sched.idle:
                    self._step()
                elif self.relay is not None:
                    self.relay.idle()
            sched.cancel_all()  # stopping: the running ones end between rounds, the waiting never start
            while not sched.idle:
                self._step()
        finally:
            if self.relay is not None:
                self.relay.stop()
            self._flush()

    def follow(self) -> None:
        """A rank of a sharded target other than 0: run the steps rank 0's
        worker runs, with its news, until it stops."""
        try:
            while (news := self.relay.receive()) is not None:
                self._step(news)
        finally:
            self._flush()

    def _step(self, news: News | None = None) -> None:
        try:
            self.scheduler.step(news)
        except Exception:  # noqa: BLE001 - the server outlives any one round
            log.exception("a scheduling round failed")
            self.scheduler.fail_all()

    def _flush(self) -> None:
        if self.target.prompt_cache is not None:
            self.target.prompt_cache.flush()  # what the disk tier was given is on disk before exit

    def stop(self) -> None:
        """Stop: running jobs are cancelled, waiting ones end unstarted.
        Safe to call from a signal handler (it takes no lock)."""
        self._stopping = True
        self.scheduler.cancel_all()
