"""Quantized KV caches: the configuration (:class:`KVConfig`), the storage of
keys and values as quantized triplets, the rule for ``quantized_kv_start``, and
what a configuration costs per token (:func:`kv_footprint`).

Keys and values are quantized per position, in groups of ``group_size`` along
the head dimension (``mx.quantize``): position p's triplet ``(packed, scales,
biases)`` depends on p's keys alone. Trimming positions is therefore a change
of offset, never a re-quantization, and a batched row stores the same bits as
a single sequence for the same keys. mlx-lm's attention
(``mlx_lm.models.base.scaled_dot_product_attention``) reads the triplets with
quantized matmuls when the cache object has ``bits`` and ``group_size``.

``quantized_kv_start`` S: a query at position q < S attends to full-precision
keys and values, a query at q >= S to the quantized ones (all of them,
positions below S included). What a query sees depends on positions only: a
forward that would cross S is split there (``Runtime.forward``); positions
below S are stored both ways, so a rollback back below S finds them.

A "store" here is either a plain array (full precision) or a triplet of
arrays; both have the positions on axis 2 and are handled alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import mlx.core as mx
from mlx.utils import tree_map

from .errors import Hf2qError
from .validate import check_int

#: The bits a quantized KV cache stores per element.
KV_BITS = (4, 8)
#: The group sizes ``mx.quantize`` takes (elements of the head dimension per scale and bias).
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True, eq=False)
class KVConfig:
    """How attention layers store keys and values: ``bits`` 4 or 8
    (None: the model's dtype, the default), quantized in groups of
    ``group_size`` (32, 64 or 128) along the head dimension, from position
    ``start`` (``quantized_kv_start``) on. Two configurations are equal when
    they store alike (every full-precision one is equal to every other)."""

    bits: int | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    start: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def key(self) -> tuple[int, int, int] | None:
        """What the layout depends on (None: full precision)."""
        return None if self.bits is None else (self.bits, self.group_size, self.start)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVConfig) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def validate(self) -> KVConfig:
        """Refuse bits other than 4, 8 or None, a group size mlx cannot
        quantize with, or a negative start (the message names the option)."""
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in KV_BITS):
            raise Hf2qError(f"kv_bits must be 4 or 8 (None: full precision), got {self.bits!r}")
        if isinstance(self.group_size, bool) or self.group_size not in KV_GROUP_SIZES:
            raise Hf2qError(f"kv_group_size must be 32, 64 or 128, got {self.group_size!r}")
        check_int("quantized_kv_start", self.start, 0)
        return self

    def describe(self) -> str:
        """One phrase: ``8-bit KV (group 64)``, ``... from position 512``, or ``full-precision KV``."""
        if self.bits is None:
            return "full-precision KV"
        start = f", from position {self.start}" if self.start else ""
        return f"{self.bits}-bit KV (group {self.group_size}{start})"

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``x`` (..., positions, dim) as ``(packed, scales, biases)``."""
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def encode(self, x: mx.array) -> Any:
        """How ``x`` is stored: quantized, or as it is."""
        return self.quantize(x) if self.bits is not None else x

    def position_bytes(self, dim: int, heads: int, dtype: mx.Dtype) -> int:
        """Bytes one position of ``heads`` heads of ``dim`` elements takes (keys or values)."""
        if self.bits is None:
            return heads * dim * dtype.size
        groups = dim // self.group_size
        return heads * (dim * self.bits // 8 + 2 * groups * dtype.size)


FULL_PRECISION = KVConfig()


def kv_config(
    kv_bits: int | None = None, kv_group_size: int | None = None, quantized_kv_start: int | None = None
) -> KVConfig:
    """A validated ``KVConfig`` from the options as mlx-lm names them; a group
    size or start without ``kv_bits`` is refused (it would do nothing)."""
    if kv_bits is None and (kv_group_size is not None or quantized_kv_start is not None):
        given = "kv_group_size" if kv_group_size is not None else "quantized_kv_start"
        raise Hf2qError(f"{given} applies to a quantized KV cache: give kv_bits (4 or 8) too")
    group = DEFAULT_GROUP_SIZE if kv_group_size is None else kv_group_size
    return KVConfig(kv_bits, group, 0 if quantized_kv_start is None else quantized_kv_start).validate()


# -- stores: a full-precision array or a quantized triplet ------------------------
def leaves(store: Any) -> list[mx.array]:
    return list(store) if isinstance(store, tuple) else [store]


def store_nbytes(store: Any) -> int:
    return 0 if store is None else sum(a.nbytes for a in leaves(store))


def positions(store: Any, lo: int, hi: int) -> Any:
    """Positions ``lo`` to ``hi`` (buffer indices on axis 2)."""
    return tree_map(lambda x: x[..., lo:hi, :], store)


def write(store: Any, at: int, new: Any, rows: mx.array | None = None) -> None:
    """Write ``new`` into ``store`` from buffer index ``at`` on (``rows``: into those rows only)."""
    n = leaves(new)[0].shape[2]
    for dst, src in zip(leaves(store), leaves(new)):
        if rows is None:
            dst[..., at : at + n, :] = src
        else:
            dst[rows, :, at : at + n, :] = src


def zeros(like: Any, capacity: int) -> Any:
    """A zero store of ``capacity`` positions shaped like ``like``'s positions."""
    return tree_map(lambda x: mx.zeros((*x.shape[:2], capacity, x.shape[3]), x.dtype), like)


def gather(store: Any, index: mx.array) -> Any:
    """``take_along_axis`` on the positions; ``index`` is (B, 1, n, 1)."""
    return tree_map(lambda x: mx.take_along_axis(x, index, axis=2), store)


def pad(store: Any, positions_: int) -> Any:
    """``positions_`` more (zero) positions at the end."""
    return tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (0, positions_), (0, 0)]), store)


def concat_rows(a: Any, b: Any) -> Any:
    return tree_map(lambda x, y: mx.concatenate([x, y]), a, b)


def take_rows(store: Any, rows: mx.array | slice) -> Any:
    return tree_map(lambda x: x[rows], store)


def length(store: Any) -> int:
    """Positions a store holds (axis 2)."""
    return leaves(store)[0].shape[2]


def dtype_of(store: Any) -> mx.Dtype:
    """The dtype keys had before they were stored (a triplet's scales')."""
    return store[1].dtype if isinstance(store, tuple) else store.dtype


# -- positions below quantized_kv_start ---------------------------------------------
class FullPrecisionPrefix:
    """Keys and values of positions ``0 .. held - 1`` at full precision: the
    positions below ``quantized_kv_start``, which queries below it attend to."""

    step = 256

    def __init__(self, start: int):
        self.start = start
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.held = 0

    def update(self, prev: int, keys: mx.array, values: mx.array, lo: int) -> tuple[mx.array, mx.array]:
        """Write positions ``prev ..`` (``prev == held``); returns positions ``lo`` to the last written."""
        n = keys.shape[2]
        if prev != self.held:
            raise RuntimeError(f"full-precision KV holds {self.held} positions, a write starts at {prev}")
        if self.keys is None or prev + n > self.keys.shape[2]:
            cap = -(-(prev + n) // self.step) * self.step
            old = (self.keys, self.values)
            self.keys, self.values = zeros(keys, cap), zeros(values, cap)
            if old[0] is not None and prev:
                write(self.keys, 0, positions(old[0], 0, prev))
                write(self.values, 0, positions(old[1], 0, prev))
        write(self.keys, prev, keys)
        write(self.values, prev, values)
        self.held = prev + n
        return positions(self.keys, lo, self.held), positions(self.values, lo, self.held)

    def restore(self, keys: mx.array | None, values: mx.array | None, held: int) -> None:
        self.keys, self.values, self.held = keys, values, held

    @property
    def nbytes(self) -> int:
        return store_nbytes(self.keys) + store_nbytes(self.values)


class QuantizedPhases:
    """What a quantized layer cache shows mlx-lm's attention: ``bits`` and
    ``group_size`` while its last update was at or past ``quantized_kv_start``
    (quantized keys), and neither before it (full-precision keys), so
    ``scaled_dot_product_attention`` picks the matching kernel."""

    kv: KVConfig = FULL_PRECISION
    _full: bool = True

    @property
    def bits(self) -> int:
        if self._full:
            raise AttributeError("bits")  # full-precision keys this forward: mlx-lm's plain attention
        return self.kv.bits

    @property
    def group_size(self) -> int:
        if self._full:
            raise AttributeError("group_size")
        return self.kv.group_size


class SharedKV:
    """Stands in for the missing cache of a KV-shared layer (Gemma 4): the
    layer is handed its source layer's keys and values as that layer's cache
    returned them (quantized or not), which this passes through, showing the
    source's ``bits`` and ``group_size`` so attention reads them the same way."""

    def __init__(self, source: Any):
        self.source = source

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        return keys, values

    def __getattr__(self, name: str) -> Any:
        if name in ("bits", "group_size"):
            return getattr(self.source, name)
        raise AttributeError(name)


def shared_views(model: Any, caches: Sequence[Any]) -> list[SharedKV]:
    """Stand-ins for the KV-shared layers after ``caches`` (one per layer
    that has its own), each showing its source layer's cache; empty for models
    without KV sharing."""
    from .taps import kv_sources

    sources = kv_sources(model)
    return [SharedKV(caches[sources[j]]) for j in sorted(sources) if j >= len(caches)]


# -- which models can read quantized keys -------------------------------------------
def attention_refusal(layers: Sequence[Any], model_type: str) -> str | None:
    """Why the attention of ``layers`` cannot read quantized keys (one line), or None.

    An attention module is one whose ``__call__`` writes a cache
    (``update_and_fetch``); it must attend through mlx-lm's
    ``scaled_dot_product_attention`` (which dispatches to the quantized
    kernel) and have no attention sinks (which that kernel refuses).
    """
    from mlx_lm.models import base

    name = model_type or "this model"
    for layer in layers:
        for _, module in layer.named_modules():
            call = type(module).__call__
            code = getattr(call, "__code__", None)
            if code is None or "update_and_fetch" not in code.co_names:
                continue
            if "sinks" in module:
                return (
                    f"{name}'s attention has sinks, which mlx-lm's quantized attention does not take: "
                    "run it with kv_bits None (full-precision KV)"
                )
            if call.__globals__.get("scaled_dot_product_attention") is not base.scaled_dot_product_attention:
                return (
                    f"{name}'s attention computes its scores itself instead of through mlx-lm's "
                    "scaled_dot_product_attention, so it cannot read quantized keys: run it with kv_bits None"
                )
    return None


# -- what a configuration costs -----------------------------------------------------
@dataclass(frozen=True)
class LayerShape:
    """One layer cache as a 1-token forward builds it: ``kind`` "kv" (full
    attention), "window" (sliding, ``window`` positions) or "recurrent"
    (``fixed_bytes`` of state whatever the length); attention layers' KV heads
    and key/value head dimensions, and the dtype keys are computed in."""

    kind: str
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    window: int = 0
    fixed_bytes: int = 0
    dtype: mx.Dtype = mx.float32


@dataclass(frozen=True)
class KVFootprint:
    """The memory a target's caches take for a context, under one KVConfig:
    every layer's cache (full attention: every position; a sliding window: at
    most ``window`` positions; recurrent layers: their fixed state)."""

    layers: tuple[LayerShape, ...]
    kv: KVConfig
    dtype: mx.Dtype | None = None  # None: the dtype each layer computes keys in

    def position_bytes(self, layer: LayerShape) -> int:
        dtype = self.dtype or layer.dtype
        return self.kv.position_bytes(layer.k_dim, layer.heads, dtype) + self.kv.position_bytes(
            layer.v_dim, layer.heads, dtype
        )

    def bytes(self, tokens: int) -> int:
        """Bytes the caches hold after ``tokens`` positions."""
        total = 0
        for layer in self.layers:
            if layer.kind == "recurrent":
                total += layer.fixed_bytes
            else:
                held = min(tokens, layer.window) if layer.kind == "window" else tokens
                total += held * self.position_bytes(layer)
        return total

    def per_token(self, tokens: int) -> float:
        """Bytes per token of a ``tokens``-long context."""
        return self.bytes(tokens) / tokens


def head_dim_refusal(shapes: Sequence[LayerShape], group_size: int) -> str | None:
    """Why ``group_size`` cannot quantize these layers' keys and values, or None."""
    dims = sorted({d for s in shapes if s.kind != "recurrent" for d in (s.k_dim, s.v_dim)})
    bad = [d for d in dims if d % group_size]
    if not bad:
        return None
    fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in dims)]
    hint = (
        f"use kv_group_size {' or '.join(map(str, fits))}"
        if fits
        else "no KV group size fits: use kv_bits None"
    )
    return f"kv_group_size {group_size} does not divide this model's head dimension {bad[0]} ({hint})"


def kv_footprint(target: Any, kv: KVConfig | None = None, dtype: mx.Dtype | None = None) -> KVFootprint:
    """What ``target``'s caches take under ``kv`` (default: the target's own),
    with keys computed in ``dtype`` (default: the model's own; e.g.
    ``mx.float16`` for what a Mac's half-precision model takes)."""
    if kv is None:
        kv = target.kv
    target.check_kv(kv)
    return KVFootprint(target.layer_shapes(), kv, dtype)


def kv_bytes_per_token(
    target: Any, kv: KVConfig | None = None, tokens: int = 4096, dtype: mx.Dtype | None = None
) -> float:
    """Bytes per token that ``target``'s caches take, under ``kv``, for a
    context of ``tokens`` (``kv_footprint(...).per_token(tokens)``): every
    layer, sliding windows counting at most their window, recurrent states
    their fixed size."""
    check_int("tokens", tokens, 1)
    return kv_footprint(target, kv, dtype).per_token(tokens)
