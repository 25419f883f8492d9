"""The worker: the one owner of the model, running generations through a
:class:`~hf2q_py.scheduler.Scheduler` (continuous batching: requests join
and leave the batch between rounds, up to ``max_batch`` at once).

The HTTP side submits a :class:`Job` (token ids and a ``GenerationConfig``)
and reads its events (:class:`Piece` per round, then :class:`Finished` or
:class:`Failed`) from an asyncio queue; the worker runs on the thread that
calls :meth:`Worker.run`, the process's main thread (MLX's compute stays on
one thread). A job cancelled while it runs stops within one round; one
cancelled while it waits never starts. ``submit`` refuses a job at once when
``max_queue`` jobs already wait. A sharded target (``relay``) runs one
generation at a time, every rank in step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..config import GenerationConfig
from ..errors import Hf2qError, one_line
from ..generation import GenerationChunk, stream_generate
from ..sampling import TokenLogprob
from ..scheduler import Entry, Scheduler, SchedulerConfig
from ..stats import GenerationStats
from ..target import Target
from .relay import Relay

log = logging.getLogger("hf2q_py.server")


@dataclass
class Piece:
    """Text decoded in one round, the tokens behind it and their
    log-probabilities (when the request asked for them)."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None


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
    """One generation; its events go to the event loop that submitted it."""

    ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    #: Token sequences the generation may copy drafts from besides its prompt
    #: (added to the Target's memory on the worker's thread before it starts).
    drafting: list[list[int]] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the generation (within one round) or, if it waits, never start it."""
        self.cancelled.set()

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
    events (``ended`` is called once it is over)."""

    def __init__(self, job: Job, ended: Callable[[], None] = lambda: None):
        self.job, self.ended = job, ended

    def chunk(self, chunk: GenerationChunk) -> None:
        self.job.emit(Piece(chunk.text, chunk.tokens, chunk.logprobs))

    def done(self, stats: GenerationStats, error: Hf2qError | None = None) -> None:
        self.ended()
        if error is None:
            self.job.emit(Finished(stats, cancelled=self.job.cancelled.is_set()))
        elif getattr(error, "cause", None) is not None:  # not the request's fault
            self.job.emit(
                Failed(500, "the generation failed on the server (see the server's log)", "server_error")
            )
        else:
            self.job.emit(Failed(400, one_line(error, limit=1000), "invalid_request"))


class Worker:
    """Runs jobs on ``target`` (batched by a scheduler), at most ``max_queue``
    waiting (a cancelled job frees its place at once)."""

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
        self._pending: deque[Job] = deque()
        self._ready = threading.Condition()
        self.running: Job | None = None
        self._stopping = False
        self.scheduler = Scheduler(target, scheduling) if relay is None else None
        self._entries: dict[int, tuple[Job, Entry]] = {}  # by id(job)

    @property
    def waiting(self) -> int:
        """Jobs submitted, not cancelled and not yet started."""
        with self._ready:
            pending = sum(not j.cancelled.is_set() for j in self._pending)
        if self.scheduler is not None:
            pending += sum(not e.cancelled for e in list(self.scheduler.waiting))
        return pending

    @property
    def batch_rounds(self) -> dict[int, int]:
        """Rounds run per batch size (rows sharing a forward)."""
        return dict(self.scheduler.rounds_by_size) if self.scheduler is not None else {}

    def submit(self, job: Job) -> None:
        with self._ready:
            if self._stopping:
                raise Busy("the server is shutting down")
            waiting = sum(not j.cancelled.is_set() for j in self._pending)
            if self.scheduler is not None:
                waiting += sum(not e.cancelled for e in list(self.scheduler.waiting))
            if waiting >= self.max_queue:
                raise Busy(f"the server is busy: {waiting} requests are waiting (--max-queue)")
            self._pending.append(job)
            self._ready.notify()

    def run(self) -> None:
        """Serve jobs until :meth:`stop`; call from the thread that owns the model."""
        try:
            if self.scheduler is None:
                self._run_alone()
            else:
                self._run_batched()
        finally:
            if self.relay is not None:
                self.relay.stop()
        self._fail_waiting()
        if self.target.prompt_cache is not None:
            self.target.prompt_cache.flush()  # what the disk tier was given is on disk before exit

    # -- batched -------------------------------------------------------------------
    def _run_batched(self) -> None:
        sched = self.scheduler
        while True:
            with self._ready:  # jobs move to the scheduler under the lock: always counted as waiting
                if not self._pending and sched.idle and not self._stopping:
                    self._ready.wait(0.1)
                if self._stopping:
                    break
                while self._pending:
                    job = self._pending.popleft()
                    if not job.cancelled.is_set():
                        self._remember(job)
                        self._entries[id(job)] = (job, sched.submit(job.ids, job.config, self._sink(job)))
            for job, entry in list(self._entries.values()):
                if job.cancelled.is_set():
                    entry.cancel()
            if not sched.idle:
                self._step()
        sched.cancel_all()  # stopping: the running ones end between rounds, the waiting never start
        while not sched.idle:
            self._step()

    def _remember(self, job: Job) -> None:
        """A job's drafting sources go into the Target's memory (the worker owns it)."""
        if job.config.spec.memory:
            for tokens in job.drafting:
                self.target.memory.add(tokens)

    def _sink(self, job: Job) -> JobSink:
        key = id(job)
        return JobSink(job, lambda: self._entries.pop(key, None))

    def _step(self) -> None:
        try:
            self.scheduler.step()
        except Exception:  # noqa: BLE001 - the server outlives any one round
            log.exception("a scheduling round failed")
            self.scheduler.fail_all()

    # -- one at a time (a sharded target) -------------------------------------------
    def _run_alone(self) -> None:
        while (job := self._next()) is not None:
            self.running = job
            try:
                self._serve(job)
            finally:
                self.running = None

    def _next(self) -> Job | None:
        """The next job not cancelled, or None once stopping (idle ticks to the other ranks meanwhile)."""
        while True:
            with self._ready:
                if not self._pending and not self._stopping:
                    self._ready.wait(0.1)
                if self._stopping:
                    return None
                job = self._pending.popleft() if self._pending else None
            if job is None:
                if self.relay is not None:
                    self.relay.idle()
            elif not job.cancelled.is_set():
                return job

    def stop(self) -> None:
        """Stop: running jobs are cancelled, waiting ones fail with 503.
        Safe to call from a signal handler (it takes no lock)."""
        self._stopping = True
        running = self.running
        if running is not None:
            running.cancel()
        for job, _ in list(self._entries.values()):
            job.cancel()

    def _going_on(self, job: Job) -> bool:
        go = not job.cancelled.is_set()
        return go if self.relay is None else self.relay.going_on(go)

    def _fail_waiting(self) -> None:
        with self._ready:
            pending, self._pending = list(self._pending), deque()
        for job in pending:
            job.emit(Failed(503, "the server is shutting down", "server_shutting_down"))

    def _serve(self, job: Job) -> None:
        """Run one job, emitting its events; never raises."""
        stats = GenerationStats(method=job.config.spec.method)
        self._remember(job)
        try:
            if self.relay is not None:
                self.relay.send(job.ids, job.config)
            stream = stream_generate(self.target, job.ids, config=job.config, stats=stats)
            try:
                for chunk in stream:
                    job.emit(Piece(chunk.text, chunk.tokens, chunk.logprobs))
                    if not self._going_on(job):
                        break
            finally:
                stream.close()
        except Hf2qError as e:
            job.emit(Failed(400, one_line(e, limit=1000), "invalid_request"))
            return
        except Exception:  # noqa: BLE001 - the server outlives any one request
            log.exception("generation failed")
            job.emit(
                Failed(500, "the generation failed on the server (see the server's log)", "server_error")
            )
            return
        job.emit(Finished(stats, cancelled=job.cancelled.is_set()))
