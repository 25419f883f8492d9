"""Model states kept across generations, keyed by the tokens they hold (the
prompt cache): a request whose prompt extends an earlier conversation starts
from the state after the longest prefix held and prefills only the rest.

A :class:`Snapshot` is every layer cache's contents after some tokens
(``hf2q_py.cache.LayerState``). Reuse is exact: a snapshot gives the state
after its first ``n`` tokens only where that state is held exactly, which is
any ``n`` for full attention, ``n`` inside the kept history for sliding
windows and exactly all its tokens for recurrent layers (see
``LayerState.reaches``). A snapshot is only ever reused by a sequence whose
caches store keys and values alike (the same :class:`~hf2q_py.kv.KVConfig`).
Bounded by entries and bytes, least recently used out; a scheduler's memory
budget also evicts by bytes (:meth:`PromptCache.evict`) to admit a request.

With a disk tier (``hf2q_py.disk_cache.DiskCache``) the snapshots it keeps
are also written to disk, and a lookup that memory cannot serve as far is
asked of the disk, whose snapshot then joins memory (the disk holds states
of the Target's own KV layout).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .cache import LayerState
from .errors import Hf2qError
from .kv import FULL_PRECISION, KVConfig


DEFAULT_MAX_ENTRIES = 8
DEFAULT_MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class Snapshot:
    """The caches of a sequence after ``tokens``, one ``LayerState`` per
    layer, made by caches that store keys and values as ``kv`` says."""

    tokens: tuple[int, ...]
    layers: tuple[LayerState, ...]
    kv: KVConfig = FULL_PRECISION

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def reaches(self, n: int) -> bool:
        """Whether the state after the first ``n`` tokens can be rebuilt exactly."""
        return 0 < n <= len(self.tokens) and all(layer.reaches(n) for layer in self.layers)


@dataclass
class DiskTier(Protocol):
    """What a prompt cache asks of its tier on disk (``hf2q_py.disk_cache.DiskCache``)."""

    def holds(self, kv: Any) -> bool: ...

    def lookup(self, tokens: list[int], limit: int, longer_than: int = 0) -> tuple[Snapshot | None, int]: ...

    def add(self, snap: Snapshot) -> None: ...

    def flush(self) -> list[str]: ...


class PromptCacheStats:
    """What the prompt cache did: lookups, hits (a lookup that reused at
    least one token), tokens reused, snapshots kept and evicted."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0


class PromptCache:
    """Snapshots by token prefix, at most ``max_entries`` of them and
    ``max_bytes`` in all; the least recently used leaves first. ``disk``:
    the tier on disk behind them (None: memory only)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        disk: DiskTier | None = None,
    ):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise Hf2qError(f"prompt cache entries must be an integer >= 1, got {max_entries!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise Hf2qError(f"prompt cache bytes must be an integer >= 1, got {max_bytes!r}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.disk = disk
        self.stats = PromptCacheStats()
        #: (KV layout, tokens) -> (snapshot, its tokens as an array)
        self._entries: OrderedDict[tuple[Any, tuple[int, ...]], tuple[Snapshot, np.ndarray]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every snapshot held in memory (the statistics and the disk stay)."""
        self._entries.clear()
        self.nbytes = 0

    def snapshots(self) -> list[Snapshot]:
        """The snapshots held in memory, least recently used first."""
        return [snap for snap, _ in self._entries.values()]

    def lookup(
        self, tokens: Sequence[int], limit: int, kv: KVConfig = FULL_PRECISION
    ) -> tuple[Snapshot | None, int]:
        """The snapshot made with ``kv`` that rebuilds the longest prefix of
        ``tokens`` (at most ``limit`` tokens long) and that prefix's length;
        (None, 0) if none does. The disk tier is asked when memory holds no
        prefix as long as it may."""
        self.stats.lookups += 1
        best = self.match(tokens, limit, kv)
        if self.disk is not None and best[1] < limit and self.disk.holds(kv):
            snap, n = self.disk.lookup(list(tokens), limit, longer_than=best[1])
            if snap is not None:
                self._keep(snap)
                best = (snap, n)
        if best[0] is not None:
            if _key(best[0]) in self._entries:
                self._entries.move_to_end(_key(best[0]))
            self.stats.hits += 1
            self.stats.reused_tokens += best[1]
        return best

    def match(
        self, tokens: Sequence[int], limit: int, kv: KVConfig = FULL_PRECISION
    ) -> tuple[Snapshot | None, int]:
        """What :meth:`lookup` finds in memory, without counting or reordering
        anything: the snapshot rebuilding the longest prefix and its length."""
        ids = np.asarray(tokens[:limit], dtype=np.int64)
        best: tuple[Snapshot | None, int] = (None, 0)
        for snap, arr in reversed(self._entries.values()):  # most recent first wins ties
            if snap.kv != kv:
                continue
            # a shorter prefix never helps: sliding windows need a long enough one,
            # recurrent layers exactly theirs, full attention reaches any
            n = _common_prefix(arr, ids)
            if n > best[1] and snap.reaches(n):
                best = (snap, n)
        return best

    def evict(self, nbytes: int, keep: Snapshot | None = None) -> int:
        """Drop snapshots from memory, least recently used first and never
        ``keep``, until ``nbytes`` are freed or none is left; returns how many
        were dropped (a memory budget making room)."""
        freed = dropped = 0
        for key in [k for k, (snap, _) in self._entries.items() if snap is not keep]:
            if freed >= nbytes:
                break
            freed += self._entries[key][0].nbytes
            self._drop(key)
            dropped += 1
        self.stats.evicted += dropped
        return dropped

    def add(self, snap: Snapshot) -> None:
        """Keep ``snap`` (see :meth:`_keep`) and hand it to the disk tier."""
        if not snap.tokens:
            return
        self._keep(snap)
        if self.disk is not None:
            self.disk.add(snap)

    def flush(self) -> None:
        """Wait until the disk tier has written what it was given."""
        if self.disk is not None:
            self.disk.flush()

    def _keep(self, snap: Snapshot) -> None:
        """Keep ``snap`` in memory; drop the entries it makes redundant (the
        same tokens, or a prefix of them it can rebuild), then the least
        recently used while over the bounds. A snapshot larger than
        ``max_bytes`` is not kept."""
        if snap.nbytes > self.max_bytes:
            return
        for key in [k for k, (old, _) in self._entries.items() if _covers(snap, old)]:
            self._drop(key)
        self._entries[_key(snap)] = (snap, np.asarray(snap.tokens, dtype=np.int64))
        self.nbytes += snap.nbytes
        self.stats.stored += 1
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop(self, key: tuple[Any, tuple[int, ...]]) -> None:
        snap, _ = self._entries.pop(key)
        self.nbytes -= snap.nbytes


def _key(snap: Snapshot) -> tuple[Any, tuple[int, ...]]:
    return (snap.kv.key, snap.tokens)


def _covers(snap: Snapshot, old: Snapshot) -> bool:
    """Whether ``snap`` holds ``old``'s tokens as a prefix and can rebuild its
    state (both made with the same KV layout)."""
    n, key = len(old.tokens), old.tokens
    return snap.kv == old.kv and n <= len(snap.tokens) and snap.tokens[:n] == key and snap.reaches(n)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
