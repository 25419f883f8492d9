"""Caches that can be trimmed back exactly after rejected drafts.

Full-attention layers use mlx-lm's ``KVCache`` (its ``trim`` is exact).
Recurrent layers of hybrid models keep mlx-lm's ``ArraysCache``; their
rollback is :mod:`hf2q_py.recurrent`'s job.
Sliding-window layers use :class:`SlidingWindowCache` instead of mlx-lm's
``RotatingKVCache``: the rotating buffer overwrites the oldest entries in
place, so trimming after the window has wrapped leaves the wrong keys behind.
``SlidingWindowCache`` keeps ``window - 1 + slack`` positions of history
behind the newest update and masks the window explicitly, so ``trim(n)`` is
exact for any ``n`` up to the last update's length plus ``slack``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence


import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .errors import UnsupportedModelError

DEFAULT_SLACK = 64


class SlidingWindowCache:
    """Sliding-window KV cache with exact rollback.

    Every query at absolute position ``q`` sees keys at positions
    ``q - window < p <= q`` (the same window as mlx-lm's rotating cache).
    ``update_and_fetch`` returns the keys from ``view_start(offset)`` on, a
    pure function of the offset, so all sliding layers of a model agree on
    the mask even when some of them were skipped for a while.
    """

    step = 256

    def __init__(self, window: int, slack: int = DEFAULT_SLACK):
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window = window
        self.slack = slack
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.start = 0  # absolute position of buffer index 0
        self.offset = 0  # number of positions written so far

    # -- positions -----------------------------------------------------------
    def view_start(self, offset: int) -> int:
        """First position a query at ``offset`` or later can attend to."""
        return max(0, offset - self.window + 1)

    def _keep_from(self, offset: int) -> int:
        return max(0, offset - self.window + 1 - self.slack)

    # -- mlx-lm cache protocol ------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        prev = self.offset
        if self.keys is None:
            self._allocate(keys, values, prev, n)
        elif prev + n > self.start + self.keys.shape[2]:
            self._compact(keys, values, prev, n)
        i = prev - self.start
        self.keys[..., i : i + n, :] = keys
        self.values[..., i : i + n, :] = values
        self.offset = prev + n
        v0 = self.view_start(prev) - self.start
        return self.keys[..., v0 : self.offset - self.start, :], self.values[
            ..., v0 : self.offset - self.start, :
        ]

    def _capacity(self, n: int) -> int:
        need = self.window + self.slack + n
        return ((need + self.step - 1) // self.step) * self.step

    def _allocate(self, keys, values, prev, n):
        B, H, _, Dk = keys.shape
        cap = self._capacity(n)
        self.start = prev
        self.keys = mx.zeros((B, H, cap, Dk), keys.dtype)
        self.values = mx.zeros((B, H, cap, values.shape[3]), values.dtype)

    def _compact(self, keys, values, prev, n):
        keep = max(self.start, self._keep_from(prev))
        old_k = self.keys[..., keep - self.start : prev - self.start, :]
        old_v = self.values[..., keep - self.start : prev - self.start, :]
        B, H, kept, Dk = old_k.shape
        cap = max(self._capacity(n), kept + n)
        new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
        new_v = mx.zeros((B, H, cap, old_v.shape[3]), values.dtype)
        new_k[..., :kept, :] = old_k
        new_v[..., :kept, :] = old_v
        self.keys, self.values, self.start = new_k, new_v, keep

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or self.window
        lo = self.view_start(self.offset)
        q = mx.arange(self.offset, self.offset + N)[:, None]
        k = mx.arange(lo, self.offset + N)[None]
        if N == 1 and window >= self.window and not return_array:
            return None  # the view already is the window
        return (k <= q) & (k > q - window)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        new_offset = self.offset - n
        if self.keys is not None and self.view_start(new_offset) < self.start:
            raise RuntimeError(
                f"cannot trim {n} positions: this sliding-window cache keeps only "
                f"{self.slack} positions of slack beyond its window"
            )
        self.offset = new_offset
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def make_cache(model: Any, slack: int = DEFAULT_SLACK) -> list[Any]:
    """The model's per-layer caches, with sliding layers made exactly trimmable.

    Raises :class:`UnsupportedModelError` for caches that cannot be rolled
    back, naming the cache type.
    """
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
    else:
        caches = [KVCache() for _ in model.layers]
    out = []
    for c in caches:
        if type(c) in (KVCache, ArraysCache):
            out.append(c)
        elif type(c) is RotatingKVCache:
            if c.keep:
                raise UnsupportedModelError(
                    "sliding-window caches with kept sink tokens (keep > 0) are not supported"
                )
            out.append(SlidingWindowCache(c.max_size, slack))
        else:
            raise UnsupportedModelError(
                f"{type(model).__module__.split('.')[-1]} uses a {type(c).__name__} layer "
                "cache, which cannot be trimmed back after rejected drafts; "
                "hf2q-py supports KV caches and recurrent ArraysCache layers"
            )
    return out


def trim_cache(caches: Sequence[Any], n: int) -> None:
    """Remove the last ``n`` positions from every layer's KV cache."""
    if n > 0:
        for c in caches:
            c.trim(n)


def cache_state(caches: Sequence[Any]) -> list[Any]:
    """Arrays to evaluate so the caches are materialised."""
    out = []
    for c in caches:
        if isinstance(c, ArraysCache):
            out.extend(a for a in c.cache if a is not None)
        elif not c.empty():
            out.append(c.state)
    return out


# -- saved states (the prompt cache) ---------------------------------------------
@dataclass(frozen=True)
class LayerState:
    """One layer cache's contents, saved so that later sequences can start
    from them. ``arrays``: attention keys and values (positions ``start`` to
    ``offset``) or a recurrent layer's state arrays. They are new MLX array
    objects, so the saved contents never change when the cache they came
    from is written again. ``nbytes``: the memory they keep alive."""

    kind: str  # "kv" (full attention), "window" (sliding window) or "recurrent"
    arrays: tuple[Any, ...]
    offset: int
    nbytes: int
    start: int = 0
    window: int = 0

    def reaches(self, n: int) -> bool:
        """Whether a cache holding exactly the first ``n`` positions can be
        rebuilt from this state: any ``n`` for full attention; for a sliding
        window, while the window of position ``n`` is still held; for a
        recurrent state (which cannot be rolled back) only ``n == offset``."""
        if not 0 < n <= self.offset:
            return False
        if self.kind == "window":
            return max(0, n - self.window + 1) >= self.start
        return self.kind == "kv" or n == self.offset


def save_layer(cache: Any, offset: int) -> LayerState:
    """The contents of one layer cache (of :func:`make_cache`) holding
    ``offset`` positions, without copying."""
    if isinstance(cache, ArraysCache):
        arrays = tuple(cache.cache)
        return LayerState("recurrent", arrays, offset, sum(a.nbytes for a in arrays if a is not None))
    if cache.keys is None:
        raise ValueError("cannot save an empty layer cache")
    nbytes = cache.keys.nbytes + cache.values.nbytes
    if isinstance(cache, SlidingWindowCache):
        held = cache.offset - cache.start
        kv = (cache.keys[..., :held, :], cache.values[..., :held, :])
        return LayerState("window", kv, cache.offset, nbytes, cache.start, cache.window)
    kv = (cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])
    return LayerState("kv", kv, cache.offset, nbytes)


def restore_layer(cache: Any, state: LayerState, n: int) -> None:
    """Make an empty layer cache of the same kind hold the first ``n``
    positions of ``state`` (``state.reaches(n)``). The cache gets new array
    objects: its next update copies them instead of writing into ``state``."""
    if state.kind == "recurrent":
        cache.cache = list(state.arrays)
        return
    keys, values = state.arrays
    held = n - state.start
    cache.keys, cache.values = keys[..., :held, :], values[..., :held, :]
    cache.offset = n
    if state.kind == "window":
        cache.start = state.start
