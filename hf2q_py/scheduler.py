"""The one loop: a scheduler that holds generations as
:class:`~hf2q_py.sequence.Sequence` objects and runs their rounds, every
generation of every entry point (``generate``, ``stream_generate``,
``batch_generate``, the server, ``ab``, ``bench``, replay) included.

Each :meth:`Scheduler.step` is one round: a waiting generation is admitted
when there is room (``max_batch``); one chunk of one joining prompt is
prefilled (on its own runtime, so a long prompt never stalls the rows that
decode; the prompt with the least left to prefill first, so short prompts
start soonest); then the batch's rows run one round together (each row's
drafts; one verify forward for all rows at one width, or two, each for its
group of rows at its width, ``plan_verify``; one read) and each
generation running alone runs one round on its own runtime. A generation
runs alone when nothing could share its forwards (then it pipelines its
decodes), when its proposer cannot draft for a batch (``Proposer.batchable``),
when its KV layout (``GenerationConfig.kv``) differs from the batch's, and
until it is past the batch's ``quantized_kv_start`` (it joins once it is).

Under a memory budget (``SchedulerConfig.memory``, :mod:`hf2q_py.budget`) a
waiting generation is admitted only when its reservation fits beside the
live ones (prompt-cache snapshots evicted to make room); otherwise it and
every generation behind it wait, in order, for rows to finish. MLX's buffer
cache is given back every ``clear_cache_every`` steps, and soon after a
generation ends.


Generations may be submitted and cancelled from other threads (the server's
HTTP side); everything else runs on the thread that calls
:meth:`Scheduler.step`. A step starts by taking its news (:meth:`Scheduler.news`:
what was submitted and cancelled since the step before), and nothing in the
step reads a submission or a cancellation that arrives later, so on a
sharded target every rank can run the same steps: rank 0 hands each step's
news to the other ranks (``Scheduler.announce``), they apply it
(:meth:`Scheduler.apply`), and every decision the step makes from something
measured on one rank takes rank 0's value (:meth:`Scheduler._agreed`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .batch.runtime import BatchRuntime, batch_refusal
from .budget import MemoryBudget, MemoryLedger, Reservation, allocation_failure, arrays_bytes
from .config import GenerationConfig
from .distributed import RanksDiverged, agree, token_check
from .draft_length.batch import BatchCosts, Offer, Pricing, Verify, plan_verify
from .errors import Hf2qError, one_line
from .kv import KVConfig
from .proposers.base import BatchDrafter, DraftAsk
from .request import Chunker, GenerationChunk, make_sequence
from .sequence import Sequence, Turn, pack, unpack
from .stats import GenerationStats, Round
from .target import PREFILL_CHUNK, Target

log = logging.getLogger("hf2q_py.scheduler")

#: The least share of a round's verify seconds charged to the verify forward
#: itself, whatever a batch drafter's unread forwards are estimated to cost.
UNREAD_FLOOR = 0.25


@dataclass
class SchedulerConfig:
    """How many generations run at once and how prompts join them."""

    max_batch: int = 8  # generations running at once (batched and alone together)
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens prefilled per round (between the others' rounds)
    kv: KVConfig | None = None  # how the batch stores keys and values (None: as the Target's kv)
    memory: MemoryBudget | None = None  # what its generations may hold in all (None: no budget)
    #: Steps between ``mx.clear_cache()`` calls (MLX's freed buffers given back;
    #: also at the first step 16 or more steps after the last call once a generation ended); 0: never.
    clear_cache_every: int = 256

    def validate(self) -> None:
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise Hf2qError(f"max_batch must be >= 1, got {self.max_batch!r}")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1:
            raise Hf2qError(f"prefill_chunk must be >= 1, got {self.prefill_chunk!r}")
        if self.kv is not None:
            if not isinstance(self.kv, KVConfig):
                raise Hf2qError(f"kv must be a KVConfig, got {type(self.kv).__name__}")
            self.kv.validate()
        if self.memory is not None:
            if not isinstance(self.memory, MemoryBudget):
                raise Hf2qError(f"memory must be a MemoryBudget, got {type(self.memory).__name__}")
            self.memory.validate()
        if isinstance(self.clear_cache_every, bool) or not isinstance(self.clear_cache_every, int):
            raise Hf2qError(f"clear_cache_every must be an integer >= 0, got {self.clear_cache_every!r}")
        if self.clear_cache_every < 0:
            raise Hf2qError(f"clear_cache_every must be an integer >= 0, got {self.clear_cache_every!r}")


class Sink:
    """Where one generation's output goes: chunks as they are ready, then
    its end (``error``: a message, when it failed). This base discards both
    (the sink of a generation another rank answers)."""

    def chunk(self, chunk: GenerationChunk) -> None: ...

    def done(self, stats: GenerationStats, error: Hf2qError | None = None) -> None: ...


@dataclass(eq=False)
class Entry:
    """One generation in the scheduler. ``cancel`` may be called from any thread."""

    id: int
    ids: list[int]
    config: GenerationConfig | None
    sink: Sink
    stats: GenerationStats
    on_round: Callable[[Round], None] | None = None
    seq: Sequence | None = None
    chunker: Chunker | None = None
    #: Token sequences its proposer may copy drafts from (into the Target's memory at admission).
    drafting: list[list[int]] = field(default_factory=list)
    passed_over: int = 0  # rounds another joining prompt was prefilled first
    reservation: Reservation | None = None  # what it may hold, under a memory budget
    cancelled: bool = False  # asked to stop (any thread)
    halted: bool = False  # the cancellation as a step took it (what the scheduler's decisions read)

    def cancel(self) -> None:
        """Stop between rounds, from the next step on (its caches stay whole);
        never start if it waits."""
        self.cancelled = True

    @property
    def over(self) -> bool:
        """Whether it is finished, stopped by a stop string or cancelled."""
        return self.seq.done or self.chunker.stopped or self.halted


@dataclass(frozen=True)
class Arrival:
    """A submitted generation as a step takes it: its entry's id, prompt
    ids, config and drafting sources."""

    id: int
    ids: list[int]
    config: GenerationConfig | None
    drafting: list[list[int]]


@dataclass
class News:
    """What changes the schedule at the start of a step: the generations
    submitted since the step before, and the ids of those cancelled since."""

    arrivals: list[Arrival] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)


class Scheduler:
    """Runs generations on one Target, batched where they can share forwards."""

    def __init__(self, target: Target, config: SchedulerConfig | None = None):
        self.target = target
        self.config = config or SchedulerConfig()
        self.config.validate()
        self._batch: BatchRuntime | None = None
        self._refusal: str | None | bool = False  # False: not asked yet
        self.costs = BatchCosts()
        self.lock = threading.RLock()  # guards ``incoming`` and ``waiting`` (read from other threads)
        self.incoming: deque[Entry] = deque()  # submitted, not yet taken by a step
        self.waiting: deque[Entry] = deque()  # taken, waiting to be admitted
        self.joining: deque[Entry] = deque()  # admitted, prefilling
        self.rows: list[Entry] = []  # running in the batch
        self.alone: deque[Entry] = deque()  # running on their own
        self._ids = itertools.count()
        self._drafters: dict[Hashable, BatchDrafter] = {}  # by their proposers' key
        self._row_drafters: dict[int, BatchDrafter] = {}  # by entry id: the rows they draft for
        #: Rounds run per batch size (rows sharing a forward).
        self.rounds_by_size: dict[int, int] = {}
        #: Called with each step's news as the step takes it (rank 0 of a sharded target tells the others).
        self.announce: Callable[[News], None] | None = None
        #: The memory budget's accounting (None: no budget).
        self.ledger = (
            MemoryLedger(target, self.config.memory, self.config.prefill_chunk)
            if self.config.memory
            else None
        )
        self._memory_blocked: Entry | None = None  # the first waiting generation, when it waits for memory
        self._since_clear = 0  # steps since the last mx.clear_cache()
        self._last_active = 0  # generations admitted and running after the last admission
        self._fit_now: tuple[Any, int] = (None, 0)  # what fits beside the live generations, by their set

    # -- requests ---------------------------------------------------------------
    def submit(
        self,
        ids: list[int],
        config: GenerationConfig | None,
        sink: Sink,
        on_round: Callable[[Round], None] | None = None,
        *,
        drafting: Iterable[list[int]] = (),
        sequence: Sequence | None = None,
        stats: GenerationStats | None = None,
    ) -> Entry:
        """Queue a generation of ``config`` (validated where it was made) for
        the prompt ``ids``, or a ``sequence`` built by the caller (not
        started); ``stats`` (default: new) is filled as it runs."""
        if sequence is not None:
            stats = sequence.stats
        elif stats is None:
            stats = GenerationStats(method=config.spec.method)
        with self.lock:
            entry = Entry(next(self._ids), list(ids), config, sink, stats, on_round, seq=sequence,
                          drafting=list(drafting))  # fmt: skip
            if self.ledger is not None:  # too many wait for memory already: MemoryRefused (429)
                max_tokens = sequence.max_tokens if sequence is not None else config.max_tokens
                kv = sequence.kv if sequence is not None else (config.kv or self.target.kv)
                self.ledger.check_queue(len(entry.ids), max_tokens, kv, self.waiting_for_memory)
            self.incoming.append(entry)
        return entry

    @property
    def queued(self) -> int:
        """Generations waiting to be admitted, not cancelled."""
        with self.lock:
            return sum(not e.cancelled for e in (*self.incoming, *self.waiting))

    @property
    def waiting_for_memory(self) -> int:
        """Generations waiting because the memory budget has no room for the first of them."""
        with self.lock:
            waiting = (*self.incoming, *self.waiting)
            return sum(not e.cancelled for e in waiting) if self._memory_blocked is not None else 0

    @property
    def active(self) -> int:
        """Generations admitted and not finished."""
        return len(self.joining) + len(self.rows) + len(self.alone)

    @property
    def idle(self) -> bool:
        return not (self.incoming or self.waiting or self.active)

    @property
    def batch(self) -> BatchRuntime | None:
        """The batch's runtime (made when first needed), or None when the target cannot batch."""
        if self._refusal is False:
            self._refusal = batch_refusal(self.target)
        if self._batch is None and self._refusal is None:
            self._batch = BatchRuntime(self.target, kv=self.config.kv, costs=self.costs)
        return self._batch

    # -- news -------------------------------------------------------------------
    def news(self) -> News:
        """Take what was submitted and cancelled since the last step: the
        submitted join the waiting queue, the cancelled are halted (the
        step's decisions read ``Entry.halted``, so a cancellation that
        arrives during a step counts from the next one)."""
        with self.lock:
            arrived = list(self.incoming)
            self.incoming.clear()
            self.waiting.extend(arrived)
            waiting = list(self.waiting)
        halted = []
        for entry in (*waiting, *self.joining, *self.rows, *self.alone):
            if entry.cancelled and not entry.halted:
                entry.halted = True
                halted.append(entry.id)
        return News([Arrival(e.id, e.ids, e.config, e.drafting) for e in arrived], halted)

    def apply(self, news: News) -> None:
        """Take another scheduler's ``news`` instead (a rank of a sharded target
        other than 0 takes rank 0's): the same generations wait, under the
        same ids, their output discarded, and the same ones are halted."""
        with self.lock:
            for a in news.arrivals:
                stats = GenerationStats(**({"method": a.config.spec.method} if a.config is not None else {}))
                entry = Entry(a.id, list(a.ids), a.config, Sink(), stats, drafting=list(a.drafting))
                self.waiting.append(entry)
            waiting = list(self.waiting)
        gone = set(news.cancelled)
        for entry in (*waiting, *self.joining, *self.rows, *self.alone):
            if entry.id in gone:
                entry.cancelled = entry.halted = True

    # -- rounds -----------------------------------------------------------------
    def step(self, news: News | None = None) -> None:
        """One round of everything admitted (see the module docstring), after
        taking this step's news (:meth:`news`, handed to :attr:`announce`),
        or applying ``news`` from elsewhere (:meth:`apply`)."""
        if news is None:
            news = self.news()
            if self.announce is not None:
                self.announce(news)
        else:
            self.apply(news)
        self._drop_cancelled()
        self._admit()
        if self.joining:
            self._prefill(self._next_prefill())
        if self.rows:
            self._round()
        if self.alone:  # one round of one of them, in turn
            entry = self.alone[0]
            self.alone.rotate(-1)
            self._solo(entry)
            self.rounds_by_size[1] = self.rounds_by_size.get(1, 0) + 1
        self._rejoin()
        if len(self.rows) == 1 and not self.joining and not self.waiting:
            last = self.rows[0].seq
            if last.proposer.goes_alone(last.tokens):
                self._to_alone(self.rows[0])
        if self.ledger is not None:
            self._record()

    def run(self) -> None:
        """Step until every submitted generation is finished."""
        while not self.idle:
            self.step()

    def _admit(self) -> None:
        """Admit waiting generations in order while fewer than ``max_batch``
        run and, under a memory budget, while the first one's reservation
        fits (after this step's memory upkeep)."""
        self._upkeep()
        blocked = False
        while self.active < self.config.max_batch:
            with self.lock:
                if not self.waiting:
                    break
                entry = self.waiting[0]
            if not entry.halted and self.ledger is not None:
                try:
                    blocked = not self._room(entry)
                except Exception as e:  # noqa: BLE001 - refused (it never fits) or failed: it alone ends
                    self._pop(entry)
                    self._fail(entry, e)
                    continue
                if blocked:
                    break
            self._pop(entry)
            if entry.halted:
                entry.sink.done(entry.stats)
                continue
            try:
                self._start(entry)
            except Exception as e:  # noqa: BLE001 - one request's failure ends it alone
                self._fail(entry, e)
                continue
            self.joining.append(entry)
        self._memory_blocked = entry if blocked else None
        self._last_active = self.active

    def _pop(self, entry: Entry) -> None:
        with self.lock:
            if self.waiting and self.waiting[0] is entry:
                self.waiting.popleft()
            elif entry in self.waiting:
                self.waiting.remove(entry)

    # -- memory -----------------------------------------------------------------
    def _room(self, entry: Entry) -> bool:
        """Whether the memory budget has room for ``entry`` beside the live
        generations now (prompt-cache snapshots evicted to make it, never the
        one it would reuse). Its ``max_tokens`` is first cut to what fits
        alone; one that cannot fit even alone is refused (``MemoryRefused``)."""
        if entry.seq is None:
            entry.seq = make_sequence(self.target, entry.ids, entry.config, entry.stats, entry.on_round)
        seq, ledger = entry.seq, self.ledger
        if entry.reservation is None:
            width, own, n = seq.policy.k_max + 1, seq.proposer.own_memory, len(seq.prompt)
            seq.max_tokens = ledger.clamp(n, seq.max_tokens, seq.kv, width, own)
            entry.reservation = ledger.reserve(n, seq.max_tokens, seq.kv, width, own)
        live, columns = self._reservations(), self._columns()
        if ledger.make_room([*live, entry.reservation], columns, keep=self._reusable(seq)):
            return True
        if live:
            return False
        if ledger.make_room([entry.reservation], columns):  # alone: even the state it would reuse goes
            return True
        r = entry.reservation
        raise ledger.refusal(r.prompt, r.max_tokens, 0, r.kv)

    def _reusable(self, seq: Sequence) -> Any:
        """The prompt-cache snapshot ``seq`` would start from, if any."""
        cache = self.target.prompt_cache
        if cache is None or seq.proposer.capture_layers:
            return None
        return cache.match(seq.prompt, len(seq.prompt) - 1, seq.kv)[0]

    def _reservations(self) -> list[Reservation]:
        live = (*self.joining, *self.rows, *self.alone)
        return [e.reservation for e in live if e.reservation is not None]

    def _columns(self) -> int:
        """The batch's full-attention slot columns now (a row that left leaves them until they pack)."""
        tables = self._batch.tables.values() if self._batch is not None else ()
        return max((t.capacity for t in tables if t.window is None and t.rows), default=0)

    def _upkeep(self) -> None:
        """Each step: MLX's freed buffers given back every ``clear_cache_every``
        steps (after a generation ended, once 16 steps passed); under a
        budget, prompt-cache snapshots evicted while it is exceeded."""
        self._since_clear += 1
        every = self.config.clear_cache_every
        ended = self.active < self._last_active
        if every and (self._since_clear >= every or (ended and self._since_clear >= min(every, 16))):
            mx.clear_cache()
            self._since_clear = 0
        if self.ledger is not None:
            self.ledger.make_room(self._reservations(), self._columns(), partly=True)

    def _record(self) -> None:
        """The budget's numbers at the end of a step, for metrics (what
        would fit beside the live generations: again only when they changed)."""
        live, columns = self._reservations(), self._columns()
        fit, head = 0, self._memory_blocked
        if head is not None and head.reservation is not None:
            r = head.reservation
            key = (tuple(id(x) for x in live), columns, id(r))
            if self._fit_now[0] != key:
                self._fit_now = (key, self.ledger.fit(r.prompt, r.kv, live, columns, r.width))
            fit = self._fit_now[1]
        trees = [e.seq.rt.state() for e in (*self.joining, *self.alone) if hasattr(e.seq.rt, "state")]
        if self._batch is not None and self.rows:
            trees.append(self._batch.state())
        waiting = self.waiting_for_memory
        self.ledger.record(live, columns, arrays_bytes(trees), waiting, fit)

    def _start(self, entry: Entry) -> None:
        """An admitted generation's sequence, chunker, drafting sources and runtime."""
        if entry.seq is None:
            entry.seq = make_sequence(self.target, entry.ids, entry.config, entry.stats, entry.on_round)
        entry.chunker = Chunker(self.target, entry.config, entry.stats)
        if entry.config is not None and entry.config.spec.memory:
            for tokens in entry.drafting:
                self.target.memory.add(tokens)
        entry.seq.begin()

    def _next_prefill(self) -> Entry:
        """The joining prompt with the least left to prefill (short prompts start
        soonest), unless one has been passed over ``max_batch`` times: then the
        longest passed over, so none waits for ever."""
        due = [e for e in self.joining if e.passed_over >= self.config.max_batch]
        entry = (
            max(due, key=lambda e: e.passed_over)
            if due
            else min(self.joining, key=lambda e: len(e.seq.pending))
        )
        for other in self.joining:
            other.passed_over = 0 if other is entry else other.passed_over + 1
        return entry

    def _prefill(self, entry: Entry) -> None:
        """One chunk of a joining prompt; a prompt done starts running (:meth:`_place`)."""
        try:
            if not entry.seq.prefill(self.config.prefill_chunk):
                return
        except Exception as e:  # noqa: BLE001 - one request's failure ends it alone
            self.joining.remove(entry)
            self._fail(entry, e)
            return
        self.joining.remove(entry)
        self._place(entry)

    def _place(self, entry: Entry) -> None:
        """A generation whose prompt is in starts running: in the batch, or
        alone when it cannot share forwards or nothing else could share them
        (a generation alone pipelines its decodes); the first partner moves
        any batchable generation running alone into the batch with it."""
        mates = [e for e in self.alone if e.seq.proposer.batchable]
        if (self.rows or mates) and self._joinable(entry):
            mates = [e for e in mates if self._joinable(e)]
        if not (self.rows or mates) or not self._joinable(entry):
            self.alone.append(entry)
            return
        for mate in mates:
            self.alone.remove(mate)
            self._to_batch(mate)
        self._to_batch(entry)

    def _joinable(self, entry: Entry) -> bool:
        """Whether a generation can be a batch row now: its proposer can, the
        target batches, its KV layout is the batch's and its next forward is
        past the batch's ``quantized_kv_start``."""
        if not entry.seq.proposer.batchable or self.batch is None:
            return False
        return self.batch.accepts(entry.seq.kv, len(entry.seq.tokens) - 1)

    def _rejoin(self) -> None:
        """Generations that ran alone only until they could share forwards
        (past ``quantized_kv_start``, or once their proposer became
        batchable: layer skip's calibration done) join the batch, or their
        partners there: every generation alone that could be a row now."""
        if not (self.rows or len(self.alone) > 1):
            return  # a generation alone with nobody to share with stays alone
        passed = [e for e in self.alone if self._joinable(e)]
        if passed and (self.rows or len(passed) > 1):
            for entry in passed:
                self.alone.remove(entry)
                self._to_batch(entry)

    def _to_batch(self, entry: Entry) -> None:
        """Move a generation (prefilled, or running alone) into the batch (and
        its proposer's state into the batch drafter it shares, if it has one)."""
        seq = entry.seq
        seq.settle()
        seq.move(self.batch.add(entry.id, seq.rt))
        self.rows.append(entry)
        spec = seq.proposer.batch_drafter(self.batch)
        if spec is not None:
            key, make = spec
            drafter = self._drafters.get(key)
            if drafter is None:
                drafter = self._drafters[key] = make()
            drafter.join(entry.id, seq.proposer)
            self._row_drafters[entry.id] = drafter

    def _out_of_batch(self, entry: Entry) -> None:
        """A row leaves the batch's caches and its batch drafter (dropped once it drafts for no row)."""
        self.batch.remove([entry.id])
        drafter = self._row_drafters.pop(entry.id, None)
        if drafter is not None:
            drafter.leave(entry.id, entry.seq.proposer)
            if drafter not in self._row_drafters.values():
                self._drafters = {k: d for k, d in self._drafters.items() if d is not drafter}

    def _to_alone(self, entry: Entry) -> None:
        """Move the batch's last row out, to run alone: its caches rebuilt
        from the batch's as a prompt-cache state would be."""
        seq = entry.seq
        rt = seq.new_runtime()
        n = len(seq.tokens) - 1
        if n > 0:
            rt.restore(seq.rt.snapshot(seq.tokens[:-1]), n)
        self._out_of_batch(entry)
        self.rows.remove(entry)
        seq.move(rt)
        self.alone.append(entry)

    def _round(self) -> None:
        """One round of every row of the batch: drafts, the verify forwards
        (one width for all rows, or two groups at two widths), one read; on
        a sharded target then one agreement (rank 0's seconds, every row's
        tokens checked). A failure fails every row (on every rank)."""
        turns, drafters = self._turns(self.rows)
        if not turns:
            return
        plan = plan_verify([e.seq.offer(t) for e, t in turns], self.costs, self.batch.ragged)
        for forward in plan:
            for i in forward.rows:
                e, t = turns[i]
                e.seq.cut(t, forward.width)
        t0 = time.perf_counter()
        results, error = [], None
        try:
            host = self._verify(turns, plan)
            seconds = time.perf_counter() - t0
            results = [e.seq.resolve(t, parts) for (e, t), parts in zip(turns, host)]
        except Exception as e:  # noqa: BLE001 - a failed forward leaves the batch's caches unknown
            seconds, error = time.perf_counter() - t0, e
        sizes = [len(f.rows) * max(len(turns[i][1].draft) + 1 for i in f.rows) for f in plan]
        verify = self._verify_share(sum(sizes), seconds, drafters)
        try:
            seconds, verify = self._agreed(
                [seconds, verify], _tokens_check(results), failed=error is not None
            )
        except RanksDiverged as e:
            error = error or e
        if error is not None:
            self._reset(error)
            return
        self._learn(sizes, verify)
        self.rounds_by_size[len(turns)] = self.rounds_by_size.get(len(turns), 0) + 1
        self.batch.settle()
        for (e, t), result in zip(turns, results):
            self._emit(e, e.seq.record, t, result, seconds=seconds)

    def _learn(self, sizes: list[int], seconds: float) -> None:
        """The batch's costs learn a round's verify forwards (of ``sizes``
        positions) took ``seconds`` together: each its share as the costs
        price them now."""
        if len(sizes) == 1:
            self.costs.update(sizes[0], seconds)
            return
        priced = [self.costs.cost(n) for n in sizes]
        for n, p in zip(sizes, priced):
            self.costs.update(n, seconds * p / sum(priced))

    def _agreed(self, values: list[float], check: int = 0, *, failed: bool = False) -> list[float]:
        """``values`` as every rank decides from them: on a sharded target rank
        0's, in one small collective that also compares every rank's ``check``
        (a hash of the tokens just committed) and whether any rank ``failed``
        (:func:`~hf2q_py.distributed.agree`); else ``values`` themselves.
        Whatever the scheduler decides from a measurement of its own rank
        (seconds, free memory) goes through here."""
        sharding = self.target.sharding
        return list(values) if sharding is None else agree(sharding, values, check, failed=failed)

    def _verify_share(self, positions: int, seconds: float, drafters: list[BatchDrafter]) -> float:
        """The seconds of a round's verify forward: draft forwards the batch
        drafters left unread computed within its read, at their estimated cost
        (in proportion to the verify's until the batch's costs are measured)."""
        unread = sum(d.unread_seconds(self.costs) for d in drafters)
        if not unread:
            return seconds
        if not self.costs.measured:  # relative units
            verify = self.costs.cost(positions)
            return seconds * verify / (verify + unread)
        return max(seconds - unread, UNREAD_FLOOR * seconds)

    def _turns(self, entries: list[Entry]) -> tuple[list[tuple[Entry, Turn]], list[BatchDrafter]]:
        """Each row's turn of the round: asked, drafted and checked (on the
        host row by row first, then by the batch drafter its rows share,
        priced against the rest of the round); a row whose drafting fails
        leaves the batch. Also the batch drafters that drafted."""
        turns = []
        for entry in list(entries):
            if (turn := self._guarded(entry, entry.seq.ask, batched=True)) is not None:
                turns.append((entry, turn))
        groups: dict[int, list[tuple[Entry, Turn]]] = {}
        for entry, turn in turns:
            if turn.wants_drafts and entry.id in self._row_drafters:
                groups.setdefault(id(self._row_drafters[entry.id]), []).append((entry, turn))
        grouped = {e.id for members in groups.values() for e, _ in members}
        ready = {e.id for e, t in turns if e.id not in grouped and self._guarded(e, self._checked, e, t)}
        drafters = []
        for members in groups.values():
            mine = {e.id for e, _ in members}
            others = [e.seq.offer(t) for e, t in turns if e.id not in mine and e in self.rows]
            drafters.append(self._batch_drafts(members, others))
            ready |= {e.id for e, t in members if e in self.rows and self._guarded(e, self._checked, e, t)}
        return [(e, t) for e, t in turns if e.id in ready and e in self.rows], drafters

    def _guarded(self, entry: Entry, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``, or None when it fails: the row then leaves with the error."""
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - one row's failure ends it alone
            self._leave(entry, e)
            return None

    def _checked(self, entry: Entry, turn: Turn) -> Turn:
        """Host drafts where no batch drafter made them, then the constraint's cut."""
        if turn.wants_drafts and entry.id not in self._row_drafters:
            entry.seq.propose(turn)  # host drafts (a batch drafter made the others')
        entry.seq.check(turn)
        return turn

    def _batch_drafts(self, members: list[tuple[Entry, Turn]], others: list[Offer]) -> BatchDrafter:
        """Drafts for the rows that share one batch drafter, made together and
        priced against the ``others``' offers; if it fails, its rows leave."""
        drafter = self._row_drafters[members[0][0].id]
        asks = [
            DraftAsk(e.id, e.seq.proposer, e.seq.tokens, t.k, e.seq.promise(t), e.seq.price)
            for e, t in members
        ]
        try:
            drafts = drafter.propose(asks, Pricing(others, self._agreed))
        except Exception as error:  # noqa: BLE001
            for e, _ in members:
                self._leave(e, error)
            return drafter
        for (e, t), draft in zip(members, drafts):
            e.seq.take(t, draft)
        return drafter

    def _verify(self, turns: list[tuple[Entry, Turn]], plan: list[Verify]) -> list[list[list[float]]]:
        """The round's verify forwards (``plan``: each feeding its rows) and
        its one read: every row's read parts."""
        capture = sorted({i for e, _ in turns for i in e.seq.capture})
        forwards = {}
        for forward in plan:
            feeds = [e.seq.inputs(t) if b in forward.rows else [] for b, (e, t) in enumerate(turns)]
            fwd = self.batch.forward(feeds, capture_layers=capture)
            forwards.update({b: fwd for b in forward.rows})
        parts = []
        for b, (e, t) in enumerate(turns):
            fwd = forwards[b]
            width, r = len(t.draft) + 1, fwd.index(b)
            e.seq.judge(t, fwd.logits[r, :width])
            t.hidden = {i: fwd.hidden[i][r : r + 1, :width] for i in e.seq.capture}
            parts.extend(t.parts)
        flat = unpack(self.batch_read(pack(parts)), [sum(t.sizes) for _, t in turns])
        return [unpack(f, t.sizes) for f, (_, t) in zip(flat, turns)]

    @staticmethod
    def batch_read(packed: mx.array) -> list[float]:
        """The round's one blocking read."""
        return packed.tolist()

    def _solo(self, entry: Entry) -> None:
        """One round of a generation running alone, on its own runtime: its
        forward queued, the next decode queued behind it where it may, one read."""
        self._emit(entry, self._solo_round, entry.seq)

    @staticmethod
    def _solo_round(seq: Sequence) -> list[int]:
        turn = seq.launch()
        seq.chain(turn)
        return seq.land(turn, unpack(seq.rt.read(turn.read), turn.sizes))

    def _emit(self, entry: Entry, land: Callable[..., list[int]], *args: Any, **kw: Any) -> None:
        """Land one generation's round (``land(*args, **kw)`` commits it): its
        text goes to the sink; a generation that is over leaves, one that
        failed fails."""
        seq = entry.seq
        try:
            committed = land(*args, **kw)
            if committed:
                entry.sink.chunk(entry.chunker.feed(committed, seq.logprobs))
        except Exception as e:  # noqa: BLE001 - one generation's failure ends it alone
            self._leave(entry, e)
            return
        if entry.over:
            self._leave(entry)

    # -- endings ----------------------------------------------------------------
    def _leave(self, entry: Entry, error: Exception | None = None) -> None:
        """A running generation leaves: finished (its caches kept for the
        prompt cache) or failed."""
        in_batch = entry in self.rows
        (self.rows if in_batch else self.alone).remove(entry)
        try:
            if error is None:
                self._finish(entry)
            else:
                self._fail(entry, error)
        finally:
            if in_batch:
                self._out_of_batch(entry)

    def _finish(self, entry: Entry) -> None:
        try:
            last = entry.chunker.finish() if not entry.chunker.stopped else None
            if last is not None:
                entry.sink.chunk(last)
            entry.seq.close(keep=True)
        except Exception as e:  # noqa: BLE001
            self._fail(entry, e)
            return
        entry.sink.done(entry.stats)

    def _fail(self, entry: Entry, error: Exception) -> None:
        memory = allocation_failure(error)
        if memory is not None:  # MLX could not allocate: its buffer cache goes back, the others go on
            log.error("generation failed: out of memory: %s", one_line(error))
            mx.clear_cache()
            if self.ledger is not None:
                self.ledger.count("allocation_failed")
            error = memory
        elif not isinstance(error, Hf2qError):
            log.error("generation failed: %s", one_line(error), exc_info=error)
        elif isinstance(error, RanksDiverged):
            log.error("generation failed: %s", one_line(error))
        try:
            if entry.seq is not None and entry.seq.rt is not None:
                entry.seq.close(keep=False)
        except Exception:  # noqa: BLE001 - already failing: the original error is what counts
            pass
        entry.sink.done(entry.stats, error if isinstance(error, Hf2qError) else Failure(error))

    def _reset(self, error: Exception) -> None:
        """A batched forward failed: every running row fails, the batch starts empty."""
        for entry in list(self.rows):
            self.rows.remove(entry)
            self._fail(entry, error)
        if self._batch is not None:
            self._batch = BatchRuntime(self.target, kv=self._batch.kv, costs=self.costs)
        self._drafters, self._row_drafters = {}, {}

    def _drop_cancelled(self) -> None:
        """Cancelled generations end before the round: waiting ones never
        start, joining and running ones close with their caches whole."""
        with self.lock:
            gone = [e for e in self.waiting if e.halted]
            for entry in gone:
                self.waiting.remove(entry)
        for entry in gone:
            entry.sink.done(entry.stats)
        for entry in [e for e in self.joining if e.halted]:
            self.joining.remove(entry)
            entry.seq.close(keep=False)
            entry.sink.done(entry.stats)
        for entry in [e for e in (*self.rows, *self.alone) if e.halted]:
            self._leave(entry)

    def fail_all(self, error: Exception | None = None) -> None:
        """Something failed outside any one generation: every admitted one
        fails, the waiting ones stay, the batch starts empty."""
        error = error or Hf2qError("the scheduler failed")
        for queue in (self.joining, self.alone):
            while queue:
                self._fail(queue.popleft(), error)
        self._reset(error)

    def cancel_all(self) -> None:
        """Cancel every generation (waiting ones never start)."""
        with self.lock:
            waiting = [*self.incoming, *self.waiting]
        for entry in (*waiting, *self.joining, *self.rows, *self.alone):
            entry.cancel()


def _tokens_check(results: list[tuple[int, list[int], Any]]) -> int:
    """A hash of the tokens a batched round resolved, row by row."""
    return token_check([x for _, new, _ in results for x in (len(new), *new)])


class Failure(Hf2qError):
    """An unexpected error inside a generation (not the request's fault);
    ``cause`` is the original exception."""

    def __init__(self, cause: Exception):
        super().__init__(f"the generation failed: {one_line(cause)}")
        self.cause = cause
