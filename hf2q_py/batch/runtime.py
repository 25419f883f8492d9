"""One forward for many sequences: the batch's caches, its rows, and a view of
one row that a :class:`~hf2q_py.sequence.Sequence` runs on.

Rows join with the state a single-sequence :class:`~hf2q_py.target.Runtime`
prefilled (a prompt is prefilled on its own, in chunks between the batch's
rounds) and leave when their generation ends. Each forward feeds every row
its own tokens, right-padded to the widest row; a row's padding and its
rejected drafts are emptied from the caches afterwards
(:mod:`hf2q_py.batch.cache`), recurrent layers' states included
(:mod:`hf2q_py.batch.recurrent`). A batch stores keys and values as one
:class:`~hf2q_py.kv.KVConfig` says; a row joins only from a runtime with the
same one, at or past its ``quantized_kv_start`` (every query of a batched
forward reads the quantized keys).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from .. import kv as stores
from ..cache import LayerState, QuantizedKVCache, SlidingWindowCache
from ..errors import Hf2qError
from ..kv import KVConfig, shared_views
from ..prompt_cache import Snapshot
from ..target import Forward, Runtime, Target
from ..taps import keep_rows, tapped
from .cache import SlotKVCache, SlotTable
from .recurrent import BatchRecurrent

#: The layer cache kinds a batch holds: full attention, sliding windows and recurrent state.
BATCHABLE = (KVCache, QuantizedKVCache, SlidingWindowCache, ArraysCache)


def batch_refusal(target: Target) -> str | None:
    """Why ``target`` cannot run batched (one line), or None."""
    kinds = {type(c) for c in target.runtime().cache}
    odd = sorted(k.__name__ for k in kinds if k not in BATCHABLE)
    if odd:
        return f"{target.model_type or 'this model'} has {', '.join(odd)} layer caches, which hf2q-py does not batch"
    return None


class BatchRuntime:
    """The caches of up to any number of rows and the forwards over them.

    ``rows`` are the ids of the sequences in batch order. ``keep`` bounds
    rollback on sliding-window layers (positions kept behind the window).
    ``kv``: how the batch stores keys and values (default: the Target's).
    ``costs``: what the loop running the batch learns its forwards cost
    (the scheduler's ``BatchCosts``), for batch drafters that plan forwards
    of their own; None: nothing measured (they plan from a prior).
    """

    #: What rounds are timed with.
    clock = staticmethod(time.perf_counter)

    def __init__(self, target: Target, keep: int = 64, kv: KVConfig | None = None, costs: Any = None):
        problem = batch_refusal(target)
        if problem is not None:
            raise Hf2qError(f"cannot batch: {problem}")
        self.target, self.model, self.costs = target, target.model, costs
        solo = target.runtime(slack=keep, kv=kv)
        self.kv = solo.kv
        layout = solo.cache
        self.tables: dict[int | None, SlotTable] = {}
        self.caches: list[Any] = []
        for c in layout:
            if isinstance(c, ArraysCache):
                self.caches.append(None)  # filled by BatchRecurrent below
                continue
            window = c.window if isinstance(c, SlidingWindowCache) else None
            table = self.tables.setdefault(window, SlotTable(window, keep))
            self.caches.append(SlotKVCache(table, self.kv))
        self.recurrent = BatchRecurrent.create(target, layout, self.caches)
        # KV-shared layers (Gemma 4) read quantized keys through stand-ins for their caches
        self._shared = shared_views(self.model, self.caches) if self.kv.quantized else []
        self.rows: list[Any] = []

    # -- rows -------------------------------------------------------------------
    def accepts(self, kv: KVConfig, offset: int) -> bool:
        """Whether a sequence storing keys and values as ``kv``, whose next
        forward starts at ``offset``, can be a row."""
        return kv == self.kv and (not kv.quantized or offset >= kv.start)

    def add(self, row_id: Any, rt: Runtime) -> RowRuntime:
        """A new row holding ``rt``'s state (a prefilled single sequence)."""
        if not self.accepts(rt.kv, rt.offset):
            raise ValueError(f"a sequence with {rt.kv.describe()} at position {rt.offset} cannot join "
                             f"a batch of {self.kv.describe()}")  # fmt: skip
        slots = {}  # per table: the first layer's positions, which every layer of the table shares
        for c, solo in zip(self.caches, rt.cache):
            if isinstance(c, SlotKVCache) and c.table.window not in slots:
                slots[c.table.window] = _solo_positions(solo)
        for window, positions in slots.items():
            table = self.tables[window]
            if len(positions) > table.capacity:
                table.grow(len(positions))
            for c in self.caches:
                if isinstance(c, SlotKVCache) and c.table is table:
                    c.fit(None)
            table.add_row(positions, rt.offset)
        for c, solo in zip(self.caches, rt.cache):
            if isinstance(c, SlotKVCache):
                c.add_row(*_solo_kv(solo, slots[c.table.window]))
        if self.recurrent is not None:
            self.recurrent.add_row(rt.cache, rt.offset)
        self.rows.append(row_id)
        return RowRuntime(self, row_id)

    def remove(self, row_ids: Sequence[Any]) -> None:
        """Drop the rows ``row_ids``."""
        gone = set(row_ids)
        keep = [i for i, r in enumerate(self.rows) if r not in gone]
        for table in self.tables.values():
            table.remove_rows(keep)
        for c in self.caches:
            if isinstance(c, SlotKVCache):
                c.remove_rows(keep)
        if self.recurrent is not None:
            self.recurrent.remove_rows(keep)
        self.rows = [self.rows[i] for i in keep]

    def index(self, row_id: Any) -> int:
        return self.rows.index(row_id)

    # -- forwards ---------------------------------------------------------------
    @property
    def ragged(self) -> bool:
        """Whether a forward computes only the rows it feeds (a row that feeds
        nothing costs nothing); a batch with recurrent layers computes every
        row (their states step together)."""
        return self.recurrent is None

    def forward(
        self,
        feeds: Sequence[Sequence[int] | mx.array],
        *,
        logits: str = "all",
        capture_layers: Sequence[int] = (),
        skip_layers: Sequence[int] = (),
    ) -> BatchForward:
        """One forward feeding row b ``feeds[b]`` (token ids or a lazy array;
        empty: the row takes no part, and where the batch is :attr:`ragged`
        is not computed), the rows computed right-padded to the widest:
        logits (R, W, vocab) and the captured layers' outputs (R, W, H) of
        the R rows computed (``BatchForward.index``), lazy; ``logits="last"``:
        only each row's last fed position's, (R, 1, vocab) (the LM head runs
        on those alone). ``skip_layers``: those layers pass their input
        through (a partial forward, whose positions the rows trim afterwards)."""
        if len(feeds) != len(self.rows):
            raise ValueError(f"{len(feeds)} feeds for {len(self.rows)} rows")
        widths = [len(f) if not isinstance(f, mx.array) else f.shape[0] for f in feeds]
        fed = [b for b, w in enumerate(widths) if w > 0]
        if not self.ragged or not fed:
            fed = list(range(len(widths)))
        width = max(widths)
        for table in self.tables.values():
            index = table.plan(width)
            for c in self.caches:
                if isinstance(c, SlotKVCache) and c.table is table:
                    c.fit(index)
            table.begin(widths, fed if len(fed) < len(widths) else None)
        x = _inputs([feeds[b] for b in fed], [widths[b] for b in fed], width)
        last = mx.array([max(widths[b] - 1, 0) for b in fed], dtype=mx.int32) if logits == "last" else None
        if self.recurrent is not None:
            self.recurrent.begin(widths)
        taps = dict(capture_layers=capture_layers, keep_positions=last, skip_layers=skip_layers)
        with tapped(self.model, **taps) as rec:
            out = self.model(x, cache=self.caches + self._shared)
        for table in self.tables.values():
            table.end()
        if self.recurrent is not None:
            self.recurrent.end()
        if last is not None and self.target._decoder is None:  # no final norm to tap: cut the logits
            out = keep_rows(out, last)
        return BatchForward(out, rec.layers, rows=tuple(fed))

    def trim(self, row_id: Any, n: int) -> None:
        """Drop row ``row_id``'s last ``n`` positions (within the last forward)."""
        b = self.index(row_id)
        for table in self.tables.values():
            table.trim(b, n)
        if self.recurrent is not None:
            self.recurrent.trim(b, n)

    def settle(self) -> None:
        """After the rows trimmed what they rejected: bring the recurrent
        states to each row's kept positions."""
        if self.recurrent is not None:
            self.recurrent.settle()

    def mark(self) -> Mark:
        """The batch's state now, which :meth:`rewind` returns to."""
        tables = {w: t.mark() for w, t in self.tables.items()}
        recurrent = self.recurrent.mark() if self.recurrent is not None else None
        return Mark(tuple(self.rows), tables, recurrent)

    def rewind(self, mark: Mark) -> None:
        """Undo every forward since ``mark``, however many (drafting passes):
        each row's positions written since are emptied on every layer
        (skipped ones included), recurrent states are what they were. No
        row may join or leave in between."""
        if tuple(self.rows) != mark.rows:
            raise ValueError("the batch's rows changed since the mark")
        for window, table in self.tables.items():
            table.rewind(mark.tables[window])
        if self.recurrent is not None:
            self.recurrent.rewind(mark.recurrent)

    def state(self) -> list[Any]:
        out = [c.state for c in self.caches if isinstance(c, SlotKVCache) and not c.empty()]
        return out + (self.recurrent.state() if self.recurrent is not None else [])

    def offset(self, row_id: Any) -> int:
        b = self.index(row_id)
        table = next(iter(self.tables.values()), None)
        return int(table.offsets[b]) if table is not None else self.recurrent.offsets[b]

    def snapshot(self, row_id: Any, tokens: Sequence[int]) -> Snapshot:
        """Row ``row_id``'s caches as a prompt-cache snapshot holding ``tokens``."""
        b = self.index(row_id)
        layers = []
        for c in self.caches:
            if isinstance(c, SlotKVCache):
                layers.append(_row_state(c, b))
            else:
                layers.append(self.recurrent.row_state(c, b))
        mx.eval([a for layer in layers for a in layer.arrays if a is not None])
        return Snapshot(tuple(tokens), tuple(layers), self.kv)


@dataclass
class BatchForward(Forward):
    """A batch forward's outputs: ``logits`` and ``hidden`` hold one row per
    batch row computed, ``rows`` (batch indices, in order)."""

    rows: tuple[int, ...] = ()

    def index(self, b: int) -> int:
        """Where batch row ``b``'s outputs are (it must have been computed)."""
        return self.rows.index(b)


@dataclass(frozen=True)
class Mark:
    """A batch's rows, slot tables and recurrent states at one moment (``BatchRuntime.mark``)."""

    rows: tuple[Any, ...]
    tables: dict[int | None, Any]
    recurrent: Any


def _inputs(feeds: Sequence[Sequence[int] | mx.array], widths: list[int], width: int) -> mx.array:
    """The (B, W) input ids, each row right-padded with 0."""
    if not any(isinstance(f, mx.array) for f in feeds):
        x = np.zeros((len(feeds), width), dtype=np.uint32)
        for b, f in enumerate(feeds):
            x[b, : len(f)] = f
        return mx.array(x)
    rows = []
    for f, w in zip(feeds, widths):
        row = f.astype(mx.uint32) if isinstance(f, mx.array) else mx.array(list(f), dtype=mx.uint32)
        rows.append(mx.pad(row, [(0, width - w)]) if w < width else row)
    return mx.stack(rows)


def _solo_positions(cache: Any) -> np.ndarray:
    """The positions a single sequence's layer cache holds (a sliding window:
    those within reach of a rollback), in order."""
    if cache.empty():
        return np.zeros(0, dtype=np.int32)
    start = 0
    if isinstance(cache, SlidingWindowCache):
        start = max(cache.start, cache.view_start(cache.offset) - cache.slack)
    return np.arange(start, cache.offset, dtype=np.int32)


def _solo_kv(cache: Any, positions: np.ndarray) -> tuple[Any, Any]:
    """A single sequence's keys and values at ``positions`` (stores of (1, H, n, .))."""
    if cache.empty() or not len(positions):
        return None, None
    first = int(positions[0]) - getattr(cache, "start", 0)  # mlx-lm's KVCache starts at 0
    last = first + len(positions)
    return stores.positions(cache.keys, first, last), stores.positions(cache.values, first, last)


def _row_state(cache: SlotKVCache, b: int) -> LayerState:
    """One row of a slot cache as the ``LayerState`` a single sequence would save."""
    table = cache.table
    offset = int(table.offsets[b])
    kv = cache.row(b)
    if kv is None:
        raise ValueError("cannot save an empty layer cache")
    _, positions = table.row_slots(b)
    nbytes = stores.store_nbytes(kv[0]) + stores.store_nbytes(kv[1])
    if table.window is None:
        return LayerState("kv", kv, offset, nbytes, kv=cache.kv)
    start = int(positions[0]) if len(positions) else offset
    return LayerState("window", kv, offset, nbytes, start, table.window, cache.kv)


class RowRuntime:
    """One row of a :class:`BatchRuntime`, as a Sequence sees its runtime:
    the row's offset, its rollback and its prompt-cache snapshot (forwards
    and reads are the batch's)."""

    clock = staticmethod(time.perf_counter)
    trimmable = False

    def __init__(self, batch: BatchRuntime, row_id: Any):
        self.batch, self.row_id = batch, row_id
        self.target = batch.target

    @property
    def offset(self) -> int:
        return self.batch.offset(self.row_id)

    def trim(self, n: int, skip_layers: Sequence[int] = ()) -> None:
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.offset}")
        self.batch.trim(self.row_id, n)

    def read(self, result: mx.array) -> list:
        return result.tolist()

    def snapshot(self, tokens: Sequence[int]) -> Snapshot:
        if len(tokens) != self.offset:
            raise ValueError(f"the cache holds {self.offset} positions, not {len(tokens)}")
        return self.batch.snapshot(self.row_id, tokens)
