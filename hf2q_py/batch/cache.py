"""KV caches shared by the rows of a batch, each row with its own length,
position and rollback.

A batch's attention layers keep their keys and values in slots: buffers of
shape ``(B, heads, S, dim)`` written column by column, every row at the same
column, each slot tagged with the position it holds in its row (a
:class:`SlotTable`, shared by the layers of one kind). A forward of width W
writes columns ``used .. used + W``; a row that feeds fewer tokens than W
leaves the rest of its columns empty, and a row that rejects drafts empties
their slots. Attention masks by position, so empty slots cost memory, never
correctness: a rollback is exact on every layer kind, sliding windows
included, whatever has wrapped. When the buffers fill, :meth:`SlotTable.plan`
packs each row's slots to the left (and drops positions a sliding window no
longer reaches), which every layer applies as one gather. Quantized slots
(a quantized :class:`~hf2q_py.kv.KVConfig`) hold each position's triplet, as
a single sequence's cache does, and every operation here moves them whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .. import kv as stores
from ..kv import FULL_PRECISION, KVConfig

#: The position of an empty slot: after every real one, so causality masks it.
EMPTY = 1 << 30
#: Slots are allocated in steps of this many columns.
STEP = 256


class SlotTable:
    """Positions per slot for the rows of a batch, for the layers of one kind
    (``window``: a sliding window's length, None for full attention).

    ``offsets[b]`` is the next position of row b. Between forwards, row b's
    slots hold exactly its positions ``0 .. offsets[b] - 1`` (a sliding
    window: at least the last ``window + keep`` of them).
    """

    def __init__(self, window: int | None = None, keep: int = 64):
        self.window, self.keep = window, keep
        self.pos = np.full((0, 0), EMPTY, dtype=np.int32)  # (B, capacity)
        self.offsets = np.zeros(0, dtype=np.int64)
        self.used = 0  # columns written so far
        self.width = 0  # the forward in progress
        self.fed: np.ndarray | None = None  # the rows it computes, when not every row
        self.packs = 0  # times the slots were packed
        self._mask: tuple[int, mx.array] | None = None
        self._offset: mx.array | None = None
        self._fed: mx.array | None = None

    @property
    def rows(self) -> int:
        return self.pos.shape[0]

    @property
    def capacity(self) -> int:
        return self.pos.shape[1]

    # -- rows -------------------------------------------------------------------
    def add_row(self, positions: Sequence[int], offset: int) -> None:
        """A row whose cache holds ``positions`` (in slot order), next position ``offset``."""
        n = len(positions)
        if n > self.capacity:
            self.grow(n)
        row = np.full((1, self.capacity), EMPTY, dtype=np.int32)
        row[0, :n] = positions
        self.pos = np.concatenate([self.pos, row])
        self.offsets = np.concatenate([self.offsets, [offset]])
        self.used = max(self.used, n)

    def remove_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep`` (indices, in order); with none left, start over."""
        self.pos, self.offsets = self.pos[list(keep)], self.offsets[list(keep)]
        if not keep:
            self.pos, self.used = np.full((0, 0), EMPTY, dtype=np.int32), 0

    def grow(self, columns: int) -> None:
        """At least ``columns`` slots per row (whole steps)."""
        cap = -(-columns // STEP) * STEP
        if cap > self.capacity:
            pad = np.full((self.rows, cap - self.capacity), EMPTY, dtype=np.int32)
            self.pos = np.concatenate([self.pos, pad], axis=1)

    def plan(self, width: int) -> np.ndarray | None:
        """Make room for a forward of ``width`` columns: when the slots would
        overflow, pack each row's live slots to the left and return the
        gather index (B, columns) every layer must apply; else None."""
        if self.used + width <= self.capacity:
            return None
        live = self.pos < EMPTY
        if self.window is not None:  # positions no query can reach again, even after a rollback
            live &= self.pos > (self.offsets[:, None] - self.window - self.keep)
        counts = live.sum(axis=1)
        n = int(counts.max(initial=0))
        index = np.zeros((self.rows, n), dtype=np.int32)
        pos = np.full((self.rows, n), EMPTY, dtype=np.int32)
        for b in range(self.rows):
            cols = np.flatnonzero(live[b])
            index[b, : len(cols)] = cols
            pos[b, : len(cols)] = self.pos[b, cols]
        self.pos, self.used = pos, n
        self.packs += 1
        self.grow(n + width + STEP)
        return index

    # -- one forward ------------------------------------------------------------
    def begin(self, widths: Sequence[int], fed: Sequence[int] | None = None) -> None:
        """Tag the next ``max(widths)`` columns: row b's first ``widths[b]``
        with its next positions, the rest empty. ``fed``: the rows the
        forward computes (None: every row; the others feed nothing)."""
        width = max(widths)
        j = np.arange(width)
        cols = np.where(j[None] < np.asarray(widths)[:, None], self.offsets[:, None] + j[None], EMPTY)
        self.pos[:, self.used : self.used + width] = cols
        self.width = width
        self.fed = None if fed is None else np.asarray(fed, dtype=np.int32)
        self._mask = self._offset = self._fed = None

    def fed_rows(self) -> mx.array | None:
        """The rows this forward computes (None: every row)."""
        if self.fed is not None and self._fed is None:
            self._fed = mx.array(self.fed)
        return self._fed

    def _computed(self, rows: np.ndarray) -> np.ndarray:
        """The computed rows' entries of a per-row table."""
        return rows if self.fed is None else rows[self.fed]

    def offset_array(self) -> mx.array:
        """Each computed row's first position in this forward (for RoPE), (R,)."""
        if self._offset is None:
            self._offset = mx.array(self._computed(self.offsets).astype(np.int32))
        return self._offset

    def mask(self, n: int, window: int | None = None) -> mx.array:
        """The (R, 1, n, columns) attention mask of this forward's queries (R: the rows computed)."""
        window = window or self.window
        if self._mask is not None and self._mask[0] == (window or 0):
            return self._mask[1]
        end = self.used + self.width
        pos = mx.array(self._computed(self.pos[:, :end]))[:, None, None, :]
        q = (
            mx.array(self._computed(self.offsets).astype(np.int32))[:, None]
            + mx.arange(n, dtype=mx.int32)[None]
        )
        q = q[:, None, :, None]
        m = pos <= q
        if window is not None:
            m = m & (pos > q - window)
        self._mask = (window or 0, m)
        return m

    def end(self) -> None:
        """After the forward: every row holds its fed positions."""
        self.used += self.width
        self.offsets = self.offsets + (self.pos[:, self.used - self.width : self.used] < EMPTY).sum(axis=1)
        self.width = 0
        self.fed = self._fed = None
        self._mask = self._offset = None

    def trim(self, row: int, n: int) -> None:
        """Empty row ``row``'s last ``n`` positions."""
        if n <= 0:
            return
        cut = self.offsets[row] - n
        tail = self.pos[row, : self.used]
        tail[(tail >= cut) & (tail < EMPTY)] = EMPTY
        self.offsets[row] = cut

    def mark(self) -> tuple[np.ndarray, int, int]:
        """What :meth:`rewind` brings the table back to."""
        return self.offsets.copy(), self.used, self.packs

    def rewind(self, mark: tuple[np.ndarray, int, int]) -> None:
        """Empty every position written since ``mark`` (the rows unchanged
        since); their columns are reclaimed when nothing was packed meanwhile."""
        offsets, used, packs = mark
        for b in range(self.rows):
            self.trim(b, int(self.offsets[b] - offsets[b]))
        if packs == self.packs:
            self.used = used
        self._mask = self._offset = None

    def row_slots(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``row``'s live columns and their positions, in position order."""
        cols = np.flatnonzero(self.pos[row, : self.used] < EMPTY)
        return cols, self.pos[row, cols]


class SlotKVCache:
    """One attention layer's keys and values for a batch, in the slots of
    ``table`` (mlx-lm's cache protocol: ``update_and_fetch``, ``offset``,
    ``make_mask``, ``state``), stored as ``kv`` says; quantized, it shows
    ``bits`` and ``group_size`` (a batch row is always past ``kv.start``)."""

    def __init__(self, table: SlotTable, kv: KVConfig = FULL_PRECISION):
        self.table, self.kv = table, kv
        self.keys = None  # a store: an array, or a quantized triplet
        self.values = None
        if kv.quantized:
            self.bits, self.group_size = kv.bits, kv.group_size

    @property
    def offset(self) -> mx.array:
        return self.table.offset_array()

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **kw):
        return self.table.mask(N, window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        t = self.table
        keys, values = self.kv.encode(keys), self.kv.encode(values)
        if self.keys is None:
            self._allocate(keys, values)
        start, end = t.used, t.used + stores.length(keys)
        rows = t.fed_rows()  # None: every row computed, else only theirs written and read
        stores.write(self.keys, start, keys, rows)
        stores.write(self.values, start, values, rows)
        k, v = stores.positions(self.keys, 0, end), stores.positions(self.values, 0, end)
        return (k, v) if rows is None else (stores.take_rows(k, rows), stores.take_rows(v, rows))

    def _allocate(self, keys, values) -> None:
        cap = self.table.capacity
        self.keys, self.values = stores.zeros(keys, cap), stores.zeros(values, cap)

    # -- the batch's changes ------------------------------------------------------
    def fit(self, index: np.ndarray | None) -> None:
        """Follow the table: apply its packing ``index`` and its capacity."""
        if self.keys is None:
            return
        if index is not None:
            idx = mx.array(index)[:, None, :, None]
            self.keys, self.values = stores.gather(self.keys, idx), stores.gather(self.values, idx)
        grow = self.table.capacity - stores.length(self.keys)
        if grow > 0:
            self.keys, self.values = stores.pad(self.keys, grow), stores.pad(self.values, grow)

    def add_row(self, keys, values) -> None:
        """Append a row holding ``keys``/``values`` (stores of (1, H, n, .)) in its first slots."""
        if keys is None:  # an empty row: zeros, once the shapes are known
            if self.keys is not None:
                one = slice(0, 1)
                k = stores.zeros(stores.take_rows(self.keys, one), self.table.capacity)
                v = stores.zeros(stores.take_rows(self.values, one), self.table.capacity)
                self.keys, self.values = stores.concat_rows(self.keys, k), stores.concat_rows(self.values, v)
            return
        grow = self.table.capacity - stores.length(keys)
        k, v = stores.pad(keys, grow), stores.pad(values, grow)
        if self.keys is None:
            rows = self.table.rows - 1  # rows before this one, empty so far
            if rows:
                k = stores.concat_rows(_zero_rows(k, rows), k)
                v = stores.concat_rows(_zero_rows(v, rows), v)
            self.keys, self.values = k, v
            return
        self.keys, self.values = stores.concat_rows(self.keys, k), stores.concat_rows(self.values, v)

    def remove_rows(self, keep: Sequence[int]) -> None:
        if not keep:
            self.keys = self.values = None
        elif self.keys is not None:
            idx = mx.array(list(keep), dtype=mx.int32)
            self.keys, self.values = stores.take_rows(self.keys, idx), stores.take_rows(self.values, idx)

    def row(self, row: int):
        """Row ``row``'s live keys and values (stores of (1, H, n, .)), in position order."""
        if self.keys is None:
            return None
        cols, _ = self.table.row_slots(row)
        idx = mx.array(cols)
        return _pick(self.keys, row, idx), _pick(self.values, row, idx)

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return stores.store_nbytes(self.keys) + stores.store_nbytes(self.values)


def _pick(store, row: int, columns: mx.array):
    """Row ``row``'s slots ``columns`` of a store, (1, H, n, .)."""
    return tree_map(lambda x: x[row : row + 1][:, :, columns], store)


def _zero_rows(store, rows: int):
    """A zero store of ``rows`` rows shaped like ``store``'s one."""
    return tree_map(lambda x: mx.zeros((rows, *x.shape[1:]), x.dtype), store)
