"""Many generations at once: a scheduler that holds them as
:class:`~hf2q_py.sequence.Sequence` objects and runs their rounds in one
batched forward.

Each :meth:`Scheduler.step` is one round: a waiting generation is admitted
when there is room (``max_batch``); one chunk of one joining prompt is
prefilled (on its own runtime, so a long prompt never stalls the rows that
decode; the prompt with the least left to prefill first, so short prompts
start soonest); then every running row drafts, the batch's verify width is chosen
for all rows at once (``draft_length.batch``), one forward verifies every
row's drafts (a row with none decodes one token in it), and one read brings
back every row's verdict. Rows join and leave between rounds. A generation
whose method cannot share a forward (a draft model, layer skip, DFlash: they
run forwards of their own per round) runs alone, one of its rounds per step,
so it never stalls the batch nor is stalled by it. So does a generation
whose KV layout (``GenerationConfig.kv``) differs from the batch's, and one
not yet past the batch's ``quantized_kv_start``, which joins once it is.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .batch.runtime import BatchRuntime, batch_refusal
from .config import GenerationConfig
from .draft_length import AdaptiveK, FixedK
from .draft_length.batch import BatchCosts, Offer, plan_width, survival
from .errors import Hf2qError, one_line
from .generation import Chunker, GenerationChunk, GenerationResult, encode_prompt, make_config, make_sequence
from .kv import KVConfig
from .methods import method_named
from .proposers.base import Draft
from .sequence import Sequence, pack, unpack
from .sampling import TokenLogprob
from .stats import GenerationStats, Round
from .target import Target

log = logging.getLogger("hf2q_py.scheduler")

#: Methods whose proposer drafts without forwards of its own on the target:
#: their rows share the batch's forward.
BATCHED_METHODS = ("baseline", "ngram")


@dataclass
class SchedulerConfig:
    """How many generations run at once and how prompts join them."""

    max_batch: int = 8  # generations running at once (batched and alone together)
    prefill_chunk: int = 256  # prompt tokens prefilled per round while others decode
    kv: KVConfig | None = None  # how the batch stores keys and values (None: as the Target's kv)

    def validate(self) -> None:
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise Hf2qError(f"max_batch must be >= 1, got {self.max_batch!r}")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1:
            raise Hf2qError(f"prefill_chunk must be >= 1, got {self.prefill_chunk!r}")
        if self.kv is not None:
            if not isinstance(self.kv, KVConfig):
                raise Hf2qError(f"kv must be a KVConfig, got {type(self.kv).__name__}")
            self.kv.validate()


class Sink:
    """Where one generation's output goes: chunks as they are ready, then
    its end (``error``: a message, when it failed)."""

    def chunk(self, chunk: GenerationChunk) -> None: ...

    def done(self, stats: GenerationStats, error: Hf2qError | None = None) -> None: ...


@dataclass
class Entry:
    """One generation in the scheduler."""

    id: int
    ids: list[int]
    config: GenerationConfig
    sink: Sink
    stats: GenerationStats
    on_round: Callable[[Round], None] | None = None
    seq: Sequence | None = None
    chunker: Chunker | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    hidden: dict[int, list] = field(default_factory=dict)  # captured states of the chunks prefilled
    passed_over: int = 0  # rounds another joining prompt was prefilled first
    batched: bool = True
    cancelled: bool = False

    def cancel(self) -> None:
        """Stop between rounds (its caches stay whole); never start if it waits."""
        self.cancelled = True


@dataclass
class _Row:
    """A running row's round: its drafts, their key and what it reads."""

    entry: Entry
    key: Any = None
    draft: Draft = field(default_factory=Draft)
    masks: Any = None
    verdict: Any = None
    sizes: list[int] = field(default_factory=list)
    result: tuple[int, list[int], list] = (0, [], [])  # accepted drafts, tokens to commit, log-probabilities


class Scheduler:
    """Runs generations on one Target, batched where their methods allow."""

    def __init__(self, target: Target, config: SchedulerConfig | None = None):
        self.target = target
        self.config = config or SchedulerConfig()
        self.config.validate()
        self.refusal = batch_refusal(target)
        self.batch = BatchRuntime(target, kv=self.config.kv) if self.refusal is None else None
        self.costs = BatchCosts()
        self.waiting: deque[Entry] = deque()
        self.joining: deque[Entry] = deque()  # admitted, prefilling
        self.rows: list[Entry] = []  # running in the batch
        self.alone: deque[Entry] = deque()  # running on their own
        self._ids = itertools.count()
        #: Rounds run per batch size (rows sharing a forward).
        self.rounds_by_size: dict[int, int] = {}

    # -- requests ---------------------------------------------------------------
    def submit(self, ids: list[int], config: GenerationConfig, sink: Sink,
               on_round: Callable[[Round], None] | None = None) -> Entry:  # fmt: skip
        """Queue a generation of ``config`` for the prompt ``ids``."""
        config.validate()
        entry = Entry(next(self._ids), list(ids), config, sink, GenerationStats(method=config.spec.method),
                      on_round)  # fmt: skip
        entry.batched = self.batch is not None and method_named(config.spec.method).name in BATCHED_METHODS
        entry.batched = entry.batched and (config.kv or self.target.kv) == self.batch.kv
        self.waiting.append(entry)
        return entry

    @property
    def active(self) -> int:
        """Generations admitted and not finished."""
        return len(self.joining) + len(self.rows) + len(self.alone)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.active)

    # -- rounds -----------------------------------------------------------------
    def step(self) -> None:
        """One round of everything admitted (see the module docstring)."""
        self._drop_cancelled()
        self._admit()
        if self.joining:
            self._prefill(self._next_prefill())
        if self.rows:
            self._round()
        if self.alone:
            entry = self.alone[0]
            self.alone.rotate(-1)
            self._solo(entry)
            self.rounds_by_size[1] = self.rounds_by_size.get(1, 0) + 1
        self._rejoin()
        if len(self.rows) == 1 and not self.joining and not self.waiting:
            self._to_alone(self.rows[0])

    def run(self) -> None:
        """Step until every submitted generation is finished."""
        while not self.idle:
            self.step()

    def _admit(self) -> None:
        while self.waiting and self.active < self.config.max_batch:
            entry = self.waiting.popleft()
            if entry.cancelled:
                entry.sink.done(entry.stats)
                continue
            try:
                entry.seq = make_sequence(self.target, entry.ids, entry.config, entry.stats, entry.on_round)
                entry.chunker = Chunker(self.target, entry.config, entry.stats)
                entry.pending = entry.seq.begin()
            except Hf2qError as e:
                entry.sink.done(entry.stats, e)
                continue
            self.joining.append(entry)

    def _next_prefill(self) -> Entry:
        """The joining prompt with the least left to prefill (short prompts start
        soonest), unless one has been passed over ``max_batch`` times: then the
        longest passed over, so none waits for ever."""
        due = [e for e in self.joining if e.passed_over >= self.config.max_batch]
        entry = (
            max(due, key=lambda e: e.passed_over) if due else min(self.joining, key=lambda e: len(e.pending))
        )
        for other in self.joining:
            other.passed_over = 0 if other is entry else other.passed_over + 1
        return entry

    def _prefill(self, entry: Entry) -> None:
        """One chunk of a joining prompt; a prompt done starts running (:meth:`_place`)."""
        seq = entry.seq
        try:
            if entry.pending:
                size = self.config.prefill_chunk
                chunk, entry.pending = entry.pending[:size], entry.pending[size:]
                fwd = seq.rt.prefill(chunk, logits="none", capture_layers=seq.capture)
                mx.eval(seq.rt.state(), list(fwd.hidden.values()))
                for i, h in fwd.hidden.items():
                    entry.hidden.setdefault(i, []).append(h)
            if entry.pending:
                return
            cache = self.target.prompt_cache
            if cache is not None and not seq.rt.trimmable and len(seq.prompt) - 1 > seq.stats.cached_tokens:
                cache.add(seq.rt.snapshot(seq.prompt[:-1]))
            hidden = {
                i: mx.concatenate(hs, axis=1) if len(hs) > 1 else hs[0] for i, hs in entry.hidden.items()
            }
            entry.hidden = {}
            seq.after_prefill(hidden)
        except Exception as e:  # noqa: BLE001 - one request's failure ends it alone
            self.joining.remove(entry)
            self._fail(entry, e)
            return
        self.joining.remove(entry)
        self._place(entry)

    def _place(self, entry: Entry) -> None:
        """A generation whose prompt is in starts running: in the batch, or
        alone when it cannot share forwards or nothing else could share them
        (a generation alone runs the single-sequence loop: pipelined decodes,
        its own cost model); the first batchable partner moves any batchable
        generation running alone into the batch with it."""
        if not entry.batched or entry.seq.capture:
            entry.batched = False
            self.alone.append(entry)
            return
        mates = [e for e in self.alone if e.batched and self._joinable(e)]
        if not self._joinable(entry) or (not self.rows and not mates):
            self.alone.append(entry)
            return
        for mate in mates:
            self.alone.remove(mate)
            self._to_batch(mate)
        self._to_batch(entry)

    def _joinable(self, entry: Entry) -> bool:
        """Whether a batchable generation's next forward can be a batch row's
        (past the batch's ``quantized_kv_start``)."""
        return self.batch.accepts(entry.seq.kv, len(entry.seq.tokens) - 1)

    def _rejoin(self) -> None:
        """A batchable generation that ran alone only until it passed
        ``quantized_kv_start`` joins the batch, or its partners there."""
        passed = [e for e in self.alone if e.batched and self._joinable(e)]
        if passed and (self.rows or len(passed) > 1):
            for entry in passed:
                self.alone.remove(entry)
                self._to_batch(entry)

    def _to_batch(self, entry: Entry) -> None:
        """Move a generation (prefilled, or running alone) into the batch."""
        seq = entry.seq
        seq.settle_flight()
        seq.move(self.batch.add(entry.id, seq.rt))
        self.rows.append(entry)

    def _to_alone(self, entry: Entry) -> None:
        """Move the batch's last row out, to run alone: its caches rebuilt
        from the batch's as a prompt-cache state would be."""
        seq = entry.seq
        n = len(seq.tokens) - 1
        rt = self.target.runtime(
            slack=max(64, seq.policy.k_max + 2), rollback=seq.policy.k_max + 2, kv=seq.kv
        )
        if n > 0:
            rt.restore(seq.rt.snapshot(seq.tokens[:-1]), n)
        self.batch.remove([entry.id])
        self.rows.remove(entry)
        seq.move(rt)
        self.alone.append(entry)

    def _round(self) -> None:
        """One batched round of every running row."""
        rows = []
        for entry in list(self.rows):
            try:
                rows.append(self._plan(entry))
            except Exception as e:  # noqa: BLE001
                self._leave(entry, e)
        if not rows:
            return
        offers = [self._offer(r) for r in rows]
        width = plan_width(offers, self.costs)
        for r in rows:
            r.draft = r.draft.head(width - 1)
            if r.masks is not None:
                r.masks = r.masks[: len(r.draft) + 1]
        t0 = time.perf_counter()
        try:
            host = self._verify(rows)
        except Exception as e:  # noqa: BLE001 - a failed forward leaves the batch's caches unknown
            self._reset(e)
            return
        seconds = time.perf_counter() - t0
        real = max(len(r.draft) for r in rows) + 1
        self.costs.update(len(rows) * real, seconds)
        self.rounds_by_size[len(rows)] = self.rounds_by_size.get(len(rows), 0) + 1
        for r, parts in zip(rows, host):
            r.result = r.entry.seq.settle(r.draft, r.verdict, parts)
        self.batch.settle()
        for r in rows:
            self._conclude(r, seconds)

    def _plan(self, entry: Entry) -> _Row:
        seq = entry.seq
        key = seq.draft_key()
        cap = seq.room() if not isinstance(seq.policy, FixedK) else min(seq.policy.k, seq.room())
        cap = min(cap, seq.policy.k_max)
        draft = seq.propose(key, cap) if cap > 0 else Draft()
        draft, masks = seq.checked(draft)
        return _Row(entry, key, draft, masks)

    def _offer(self, r: _Row) -> Offer:
        policy = r.entry.seq.policy
        n = len(r.draft)
        if isinstance(policy, AdaptiveK):
            return Offer(n, survival(policy, r.key, n))
        return Offer(n, fixed=True)

    def _verify(self, rows: list[_Row]) -> list[list[list[float]]]:
        """The batched forward and its one read: every row's read parts."""
        logits = self.batch.forward([r.entry.seq.feed(r.draft) for r in rows])
        parts = []
        for b, r in enumerate(rows):
            r.verdict, row_parts = r.entry.seq.judge(logits[b, : len(r.draft) + 1], r.draft, r.masks)
            r.sizes = [p.size for p in row_parts]
            parts.extend(row_parts)
        flat = unpack(self.batch_read(pack(parts)), [sum(r.sizes) for r in rows])
        return [unpack(f, r.sizes) for f, r in zip(flat, rows)]

    @staticmethod
    def batch_read(packed: mx.array) -> list[float]:
        """The round's one blocking read."""
        return packed.tolist()

    def _conclude(self, r: _Row, seconds: float) -> None:
        entry, seq = r.entry, r.entry.seq
        n, new, lps = r.result
        rnd = Round(k=len(r.draft), drafted=len(r.draft), accepted=n, key=r.key, cost_seconds=seconds,
                    catch_up=seq.catch_up, propose_seconds=seq.take_propose_seconds(),
                    verify_seconds=seconds)  # fmt: skip
        try:
            committed = seq.conclude(rnd, new, {}, lps, batched=True)
            if committed:
                entry.sink.chunk(entry.chunker.feed(committed, seq.logprobs))
        except Exception as e:  # noqa: BLE001
            self._leave(entry, e)
            return
        if seq.done or entry.chunker.stopped or entry.cancelled:
            self._leave(entry)

    def _solo(self, entry: Entry) -> None:
        """One round of a generation running alone."""
        seq = entry.seq
        try:
            committed = seq.step()
            if committed:
                entry.sink.chunk(entry.chunker.feed(committed, seq.logprobs))
        except Exception as e:  # noqa: BLE001
            self.alone.remove(entry)
            self._fail(entry, e)
            return
        if seq.done or entry.chunker.stopped or entry.cancelled:
            self.alone.remove(entry)
            self._finish(entry)

    # -- endings ----------------------------------------------------------------
    def _leave(self, entry: Entry, error: Exception | None = None) -> None:
        """A row leaves the batch: finished (its caches kept for the prompt
        cache) or failed."""
        self.rows.remove(entry)
        try:
            if error is None:
                self._finish(entry)
            else:
                self._fail(entry, error)
        finally:
            self.batch.remove([entry.id])

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
        if not isinstance(error, Hf2qError):
            log.error("generation failed: %s", one_line(error), exc_info=error)
        try:
            if entry.seq is not None and entry.seq.rt is not None:
                entry.seq.close(keep=False)
        except Exception:  # noqa: BLE001 - already failing: the original error is what counts
            pass
        entry.sink.done(entry.stats, error if isinstance(error, Hf2qError) else _Failure(error))

    def _reset(self, error: Exception) -> None:
        """A batched forward failed: every running row fails, the batch starts empty."""
        for entry in list(self.rows):
            self.rows.remove(entry)
            self._fail(entry, error)
        if self.batch is not None:
            self.batch = BatchRuntime(self.target, kv=self.batch.kv)

    def _drop_cancelled(self) -> None:
        for entry in [e for e in self.waiting if e.cancelled]:
            self.waiting.remove(entry)
            entry.sink.done(entry.stats)
        for entry in [e for e in self.joining if e.cancelled]:
            self.joining.remove(entry)
            entry.seq.close(keep=False)
            entry.sink.done(entry.stats)

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
        for entry in (*self.waiting, *self.joining, *self.rows, *self.alone):
            entry.cancel()


class _Failure(Hf2qError):
    """An unexpected error inside a generation (not the request's fault)."""

    def __init__(self, cause: Exception):
        super().__init__(f"the generation failed: {one_line(cause)}")
        self.cause = cause


def batch_generate(
    target: Target,
    prompts: abc.Sequence[str | abc.Sequence[int]],
    *,
    max_tokens: int = 256,
    method: str = "ngram",
    max_batch: int = 8,
    on_round: Callable[[Round], None] | None = None,
    configs: abc.Sequence[GenerationConfig] | None = None,
    **options: Any,
) -> list[GenerationResult]:
    """Generate completions of several prompts at once, sharing forwards:
    up to ``max_batch`` run in one batch, each speculating with its own
    drafts; the results come back in the order of ``prompts``, each as
    ``generate`` would return it (greedy tokens equal, but at near-ties).

    ``configs``: one ``GenerationConfig`` per prompt instead of the keyword
    options (which :func:`stream_generate` lists).
    """
    if isinstance(prompts, str) or not isinstance(prompts, abc.Sequence):
        raise Hf2qError("prompts must be a list of prompts (strings or token id lists)")
    if configs is None:
        configs = [make_config(max_tokens=max_tokens, method=method, **options)] * len(prompts)
    elif options or max_tokens != 256 or method != "ngram":
        raise Hf2qError("pass either configs= or keyword options, not both")
    elif len(configs) != len(prompts):
        raise Hf2qError(f"{len(configs)} configs for {len(prompts)} prompts")
    kvs = {c.kv or target.kv for c in configs}
    kv = kvs.pop() if len(kvs) == 1 else None  # the batch stores as its generations do
    scheduler = Scheduler(target, SchedulerConfig(max_batch=max_batch, kv=kv))
    sinks = []
    for prompt, config in zip(prompts, configs):
        config.validate()
        ids = encode_prompt(target, prompt, config.chat_template)
        sink = _Collect(ids)
        scheduler.submit(ids, config, sink, on_round)
        sinks.append(sink)
    scheduler.run()
    return [s.result() for s in sinks]


class _Collect:
    """A scheduler sink that keeps one generation's output."""

    def __init__(self, ids: list[int]):
        self.ids, self.tokens, self.text = ids, [], []
        self.logprobs: list[TokenLogprob] | None = None
        self.stats: GenerationStats | None = None
        self.error: Hf2qError | None = None

    def chunk(self, chunk: GenerationChunk) -> None:
        self.tokens.extend(chunk.tokens)
        self.text.append(chunk.text)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs

    def done(self, stats: GenerationStats, error: Hf2qError | None = None) -> None:
        self.stats, self.error = stats, error

    def result(self) -> GenerationResult:
        if self.error is not None:
            raise self.error
        return GenerationResult(self.tokens, "".join(self.text), self.ids, self.stats, self.logprobs)
