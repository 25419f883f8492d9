"""Recurrent layers (hybrid models) in a batch: one state per row, and each
row rolled back to its own kept positions.

A batched forward feeds row b ``widths[b]`` tokens right-padded to the
widest; mlx-lm's recurrent layers take the padding as masked steps (the
state stays as it was, the convolution sees zeros) through the cache's
``lengths``. What a single sequence's :class:`~hf2q_py.recurrent.RecurrentLog`
records (each layer's convolution input and the arguments of its
recurrence call) gives, once every row has trimmed its rejected drafts,
each row's convolution state at its own kept length (a gather) and its
recurrence state (the recurrence re-run with steps past each row's kept
length masked, only where a row rejected something).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from ..cache import LayerState
from ..recurrent import RECURRENCES, RecurrentLog, _Entry, with_lengths
from ..target import Target


class BatchRecurrent:
    """The recurrent layers' caches of a batch, with per-row rollback of the last forward."""

    def __init__(self, target: Target, layout: Sequence[Any], caches: list[Any]):
        self.positions = [i for i, c in enumerate(layout) if isinstance(c, ArraysCache)]
        for i in self.positions:
            caches[i] = ArraysCache(len(layout[i].cache))
        self.caches: list[ArraysCache] = [caches[i] for i in self.positions]
        self.log = RecurrentLog(target.layers, caches, capacity=1 << 30)
        self.offsets = np.zeros(0, dtype=np.int64)
        self.widths: np.ndarray | None = None
        self.keep: np.ndarray | None = None
        self._recording: AbstractContextManager | None = None

    @classmethod
    def create(cls, target: Target, layout: Sequence[Any], caches: list[Any]) -> BatchRecurrent | None:
        if not any(isinstance(c, ArraysCache) for c in layout):
            return None
        return cls(target, layout, caches)

    # -- rows -------------------------------------------------------------------
    def add_row(self, solo: Sequence[Any], offset: int) -> None:
        """Append the states of a single sequence's caches ``solo``."""
        rows = len(self.offsets)
        for c, s in zip(self.caches, (solo[i] for i in self.positions)):
            for slot, value in enumerate(s.cache):
                c.cache[slot] = _append(c.cache[slot], value, rows)
        self.offsets = np.concatenate([self.offsets, [offset]])

    def remove_rows(self, keep: Sequence[int]) -> None:
        idx = mx.array(list(keep), dtype=mx.int32)
        for c in self.caches:
            c.cache = [None if v is None or not keep else v[idx] for v in c.cache]
        self.offsets = self.offsets[list(keep)]

    def row_state(self, cache: ArraysCache, b: int) -> LayerState:
        arrays = tuple(None if v is None else v[b : b + 1] for v in cache.cache)
        nbytes = sum(a.nbytes for a in arrays if a is not None)
        return LayerState("recurrent", arrays, int(self.offsets[b]), nbytes)

    def state(self) -> list[Any]:
        return [v for c in self.caches for v in c.cache if v is not None]

    # -- one forward ------------------------------------------------------------
    def begin(self, widths: Sequence[int]) -> None:
        """Before a forward: mask each row's padding, record the forward."""
        self.widths = np.asarray(widths, dtype=np.int64)
        ragged = len(set(widths)) > 1
        for c in self.caches:
            c.lengths = mx.array(self.widths.astype(np.int32)) if ragged else None
        self.log.entries.clear()
        self._recording = self.log.recording(int(self.widths.max()))
        self._recording.__enter__()

    def end(self) -> None:
        for c in self.caches:
            c.lengths = None
        self._recording.__exit__(None, None, None)
        self._recording = None
        self.offsets = self.offsets + self.widths
        self.keep = self.widths.copy()

    def trim(self, b: int, n: int) -> None:
        """Row ``b`` keeps ``n`` positions fewer of the last forward."""
        if n > self.keep[b]:
            raise RuntimeError("a batch rolls recurrent state back within its last forward only")
        self.keep[b] -= n
        self.offsets[b] -= n

    def mark(self) -> tuple[list[list[Any]], np.ndarray]:
        """What :meth:`rewind` brings the states back to."""
        return [list(c.cache) for c in self.caches], self.offsets.copy()

    def rewind(self, mark: tuple[list[list[Any]], np.ndarray]) -> None:
        """Every row's states as they were at ``mark`` (the rows unchanged
        since): whatever forwards ran since, however many."""
        states, offsets = mark
        for c, slots in zip(self.caches, states):
            c.cache = list(slots)
        self.offsets = offsets.copy()
        self.keep = self.widths = None
        self.log.entries.clear()

    def settle(self) -> None:
        """Every row's states at its kept positions of the last forward."""
        if self.keep is None or not self.log.entries:
            return
        entry = self.log.entries[-1]
        width = int(self.widths.max())
        if (self.keep == width).all():
            return
        rejected = self.keep < self.widths
        for i, layer in entry.layers.items():
            _settle_layer(self.caches[i], entry, layer, self.keep, rejected, width)
        self.keep = None


def _settle_layer(cache: ArraysCache, entry: _Entry, layer: Any, keep: np.ndarray, rejected: np.ndarray,
                  width: int) -> None:  # fmt: skip
    """One recurrent layer: convolution state from each row's kept inputs;
    the recurrence re-run for the rows that rejected positions."""
    n_keep = layer.conv_input.shape[1] - entry.length
    kept = mx.array(keep.astype(np.int32))
    idx = kept[:, None] + mx.arange(n_keep, dtype=mx.int32)[None]
    cache.cache[layer.conv_slot] = mx.take_along_axis(layer.conv_input, idx[..., None], axis=1)
    if layer.recurrence is None or not rejected.any():
        return
    fn, bound = layer.recurrence
    args = dict(bound.arguments)
    args["mask"] = mx.arange(width, dtype=mx.int32)[None] < kept[:, None]
    call = inspect.BoundArguments(bound.signature, args)
    with_lengths(call, kept)  # Mamba-2: each row's state at its own kept length
    replayed = fn(*call.args, **call.kwargs)[1]
    redo = mx.array(rejected)[(...,) + (None,) * (replayed.ndim - 1)]
    cache.cache[layer.state_slot] = mx.where(redo, replayed, cache.cache[layer.state_slot])


def _append(batch: mx.array | None, row: mx.array | None, rows: int) -> mx.array | None:
    """``batch`` (rows, ...) with ``row`` (1, ...) appended; zeros where one is missing."""
    if row is None and batch is None:
        return None
    if row is None:
        row = mx.zeros((1, *batch.shape[1:]), batch.dtype)
    if batch is None:
        batch = mx.zeros((rows, *row.shape[1:]), row.dtype) if rows else None
    return row if batch is None else mx.concatenate([batch, row])


assert "mask" in RECURRENCES["gated_delta_update"] and "mask" in RECURRENCES["ssm_update"]
