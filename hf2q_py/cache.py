"""Caches that can be trimmed back exactly after rejected drafts.

Full-attention layers use mlx-lm's ``KVCache`` (its ``trim`` is exact), or
:class:`QuantizedKVCache` with a quantized :class:`~hf2q_py.kv.KVConfig`.
Recurrent layers of hybrid models keep mlx-lm's ``ArraysCache``; their
rollback is :mod:`hf2q_py.recurrent`'s job.
Sliding-window layers use :class:`SlidingWindowCache` instead of mlx-lm's
``RotatingKVCache``: the rotating buffer overwrites the oldest entries in
place, so trimming after the window has wrapped leaves the wrong keys behind.
``SlidingWindowCache`` keeps ``window - 1 + slack`` positions of history
behind the newest update and masks the window explicitly, so ``trim(n)`` is
exact for any ``n`` up to the last update's length plus ``slack``.

Both of hf2q-py's own caches store keys and values as the KVConfig says
(full precision, or quantized per position: :mod:`hf2q_py.kv`), so trimming
a quantized cache changes its offset and re-quantizes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence


import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.models.cache import create_attention_mask as _causal_mask

from . import kv as stores
from .errors import UnsupportedModelError
from .kv import FULL_PRECISION, FullPrecisionPrefix, KVConfig, LayerShape, QuantizedPhases

DEFAULT_SLACK = 64


class StoredKV(QuantizedPhases):
    """Keys and values of the positions from ``start`` to ``offset``, stored
    as ``kv`` says, in buffers that grow in steps; with a ``window``, the
    positions no query (even after a rollback of ``slack``) can reach again
    are dropped when the buffers are compacted. With ``kv.start`` > 0, the
    positions below it are also kept at full precision (``prefix``), which
    forwards below it attend to (see :mod:`hf2q_py.kv`)."""

    step = 256
    window: int | None = None
    slack = 0

    def __init__(self, kv: KVConfig = FULL_PRECISION):
        self.kv = kv
        self.keys: Any = None  # a store: an array, or a quantized triplet
        self.values: Any = None
        self.start = 0  # absolute position of buffer index 0
        self.offset = 0  # number of positions written so far
        self.prefix = FullPrecisionPrefix(kv.start) if kv.quantized and kv.start > 0 else None
        self._full = not kv.quantized

    # -- positions -----------------------------------------------------------
    def view_start(self, offset: int) -> int:
        """First position a query at ``offset`` or later can attend to."""
        return 0 if self.window is None else max(0, offset - self.window + 1)

    def _keep_from(self, offset: int) -> int:
        return 0 if self.window is None else max(0, offset - self.window + 1 - self.slack)

    # -- mlx-lm cache protocol ------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n, prev = keys.shape[2], self.offset
        full = self.prefix is not None and prev < self.kv.start
        if full and prev + n > self.kv.start:
            raise RuntimeError(
                f"a forward of positions {prev}..{prev + n - 1} crosses quantized_kv_start "
                f"{self.kv.start}; split it there (Runtime.forward does)"
            )
        new_k, new_v = self.kv.encode(keys), self.kv.encode(values)
        if self.keys is None:
            self._allocate(new_k, new_v, prev, n)
        elif prev + n > self.start + stores.length(self.keys):
            self._compact(new_k, new_v, prev, n)
        i = prev - self.start
        stores.write(self.keys, i, new_k)
        stores.write(self.values, i, new_v)
        self.offset = prev + n
        self._full = full or not self.kv.quantized
        if full:
            return self.prefix.update(prev, keys, values, self.view_start(prev))
        v0, end = self.view_start(prev) - self.start, self.offset - self.start
        return stores.positions(self.keys, v0, end), stores.positions(self.values, v0, end)

    def _capacity(self, kept: int, n: int) -> int:
        need = (self.window + self.slack if self.window is not None else 0) + n
        need = max(need, kept + n)
        return ((need + self.step - 1) // self.step) * self.step

    def _allocate(self, keys, values, prev, n):
        cap = self._capacity(0, n)
        self.start = prev
        self.keys, self.values = stores.zeros(keys, cap), stores.zeros(values, cap)

    def _compact(self, keys, values, prev, n):
        keep = max(self.start, self._keep_from(prev))
        old_k = stores.positions(self.keys, keep - self.start, prev - self.start)
        old_v = stores.positions(self.values, keep - self.start, prev - self.start)
        kept = prev - keep
        cap = self._capacity(kept, n)
        new_k, new_v = stores.zeros(keys, cap), stores.zeros(values, cap)
        if kept:
            stores.write(new_k, 0, old_k)
            stores.write(new_v, 0, old_v)
        self.keys, self.values, self.start = new_k, new_v, keep

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        return _causal_mask(N, self.offset, return_array, window_size)

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
        if self.prefix is not None and new_offset < min(self.offset, self.kv.start):
            if self.prefix.held < new_offset:
                raise RuntimeError(
                    f"cannot trim back to position {new_offset}: below quantized_kv_start "
                    f"{self.kv.start}, and this cache holds no full-precision copy of it"
                )
            self.prefix.held = min(self.prefix.held, new_offset)
        self.offset = new_offset
        return n

    def size(self) -> int:
        return self.offset if self.window is None else min(self.offset, self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        if self.prefix is not None and self.prefix.keys is not None:
            return self.keys, self.values, self.prefix.keys, self.prefix.values
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        prefix = self.prefix.nbytes if self.prefix is not None else 0
        return stores.store_nbytes(self.keys) + stores.store_nbytes(self.values) + prefix


class SlidingWindowCache(StoredKV):
    """Sliding-window KV cache with exact rollback.

    Every query at absolute position ``q`` sees keys at positions
    ``q - window < p <= q`` (the same window as mlx-lm's rotating cache).
    ``update_and_fetch`` returns the keys from ``view_start(offset)`` on, a
    pure function of the offset, so all sliding layers of a model agree on
    the mask even when some of them were skipped for a while.
    """

    def __init__(self, window: int, slack: int = DEFAULT_SLACK, kv: KVConfig = FULL_PRECISION):
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        super().__init__(kv)
        self.window = window
        self.slack = slack

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or self.window
        lo = self.view_start(self.offset)
        q = mx.arange(self.offset, self.offset + N)[:, None]
        k = mx.arange(lo, self.offset + N)[None]
        if N == 1 and window >= self.window and not return_array:
            return None  # the view already is the window
        return (k <= q) & (k > q - window)


class QuantizedKVCache(StoredKV):
    """A full-attention layer's keys and values, quantized as ``kv`` says
    (mlx-lm's ``KVCache`` holds the full-precision ones)."""

    def __init__(self, kv: KVConfig):
        if not kv.quantized:
            raise ValueError("QuantizedKVCache needs a quantized KVConfig")
        super().__init__(kv)


def make_cache(model: Any, slack: int = DEFAULT_SLACK, kv: KVConfig = FULL_PRECISION) -> list[Any]:
    """The model's per-layer caches, with sliding layers made exactly
    trimmable and attention layers storing keys and values as ``kv`` says.

    Raises :class:`UnsupportedModelError` for caches that cannot be rolled
    back, naming the cache type.
    """
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
    else:
        caches = [KVCache() for _ in model.layers]
    out = []
    for c in caches:
        if type(c) is ArraysCache:
            out.append(c)
        elif type(c) is KVCache:
            out.append(QuantizedKVCache(kv) if kv.quantized else c)
        elif type(c) is RotatingKVCache:
            if c.keep:
                raise UnsupportedModelError(
                    "sliding-window caches with kept sink tokens (keep > 0) are not supported"
                )
            out.append(SlidingWindowCache(c.max_size, slack, kv))
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
    ``offset``; each a quantized triplet ``(packed, scales, biases)`` when
    ``kv`` is quantized), then, when ``prefix`` > 0, the full-precision keys
    and values of positions ``0 .. prefix - 1`` (those below
    ``kv.start``); or a recurrent layer's state arrays. They are new MLX
    array objects, so the saved contents never change when the cache they
    came from is written again. ``nbytes``: the memory they keep alive.
    ``kv``: how the attention keys and values are stored."""

    kind: str  # "kv" (full attention), "window" (sliding window) or "recurrent"
    arrays: tuple[Any, ...]
    offset: int
    nbytes: int
    start: int = 0
    window: int = 0
    kv: KVConfig = FULL_PRECISION
    prefix: int = 0

    def reaches(self, n: int) -> bool:
        """Whether a cache holding exactly the first ``n`` positions can be
        rebuilt from this state: any ``n`` for full attention; for a sliding
        window, while the window of position ``n`` is still held; for a
        recurrent state (which cannot be rolled back) only ``n == offset``;
        below a quantized cache's ``kv.start``, only where the full-precision
        positions are held."""
        if not 0 < n <= self.offset:
            return False
        if self.kind != "recurrent" and self.kv.quantized and self.prefix < n < self.kv.start:
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
    if not isinstance(cache, StoredKV):  # mlx-lm's KVCache
        kv = (cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])
        return LayerState("kv", kv, cache.offset, cache.keys.nbytes + cache.values.nbytes)
    held = cache.offset - cache.start
    arrays = (stores.positions(cache.keys, 0, held), stores.positions(cache.values, 0, held))
    prefix = cache.prefix.held if cache.prefix is not None else 0
    if prefix:
        arrays += (cache.prefix.keys[..., :prefix, :], cache.prefix.values[..., :prefix, :])
    kind = "kv" if cache.window is None else "window"
    return LayerState(
        kind, arrays, cache.offset, cache.nbytes, cache.start, cache.window or 0, cache.kv, prefix
    )


def restore_layer(cache: Any, state: LayerState, n: int) -> None:
    """Make an empty layer cache of the same kind hold the first ``n``
    positions of ``state`` (``state.reaches(n)``). The cache gets new array
    objects: its next update copies them instead of writing into ``state``."""
    if state.kind == "recurrent":
        cache.cache = list(state.arrays)
        return
    if getattr(cache, "kv", FULL_PRECISION) != state.kv:
        raise ValueError(f"a layer saved with {state.kv.describe()} cannot be restored into one of "
                         f"{getattr(cache, 'kv', FULL_PRECISION).describe()}")  # fmt: skip
    keys, values = state.arrays[:2]
    held = n - state.start
    cache.keys, cache.values = stores.positions(keys, 0, held), stores.positions(values, 0, held)
    cache.offset = n
    if isinstance(cache, StoredKV):
        cache.start = state.start
        if cache.prefix is not None and state.prefix:
            p = min(state.prefix, n)
            cache.prefix.restore(state.arrays[2][..., :p, :], state.arrays[3][..., :p, :], p)


def layer_shapes(target: Any) -> tuple[LayerShape, ...]:
    """Each layer cache's shape, read from a 1-token forward that is built
    lazily and never evaluated (no compute, no memory)."""
    caches = make_cache(target.model, kv=FULL_PRECISION)
    target.model(mx.zeros((1, 1), dtype=mx.uint32), cache=caches)
    out = []
    for c in caches:
        if isinstance(c, ArraysCache):
            out.append(LayerShape("recurrent", fixed_bytes=sum(a.nbytes for a in c.cache if a is not None)))
            continue
        if c.keys is None:  # a layer the forward never reached
            continue
        k, v = c.keys, c.values
        window = c.window if isinstance(c, SlidingWindowCache) else 0
        out.append(LayerShape("window" if window else "kv", k.shape[1], k.shape[3], v.shape[3], window,
                              dtype=k.dtype))  # fmt: skip
    return tuple(out)
