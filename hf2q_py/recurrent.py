"""Exact rollback of recurrent layer state (mlx-lm's ``ArraysCache``).

Hybrid models keep, per recurrent layer, a convolution state (the last
``kernel - 1`` inputs of a causal depthwise convolution) and possibly a
recurrence state: the gated delta rule of Qwen3-Next and Qwen3.5
(``gated_delta_update``) or the selective scan of Mamba-2 layers as in
Nemotron-H (``ssm_update``); LFM2's short convolutions have the convolution
state only. mlx-lm's ``trim`` of these caches does nothing.

:class:`RecurrentLog` records every forward short enough to be rolled back
while it runs, at no extra compute: for each recurrent layer, the input of its
convolution (the old convolution state followed by the new positions) and the
arguments of its recurrence call (the per-position inputs and the state it
started from). Trimming ``n`` positions off a recorded forward of ``L`` keeps
``m = L - n``: the convolution state becomes a slice of the recorded input and
the recurrence state is the recurrence re-run over the first ``m`` positions
from its recorded start. Only the state update runs again; no projection, MLP
or other layer does. Trimming a whole forward restores the states it started
from.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from .errors import UnsupportedModelError
from .taps import StandIn

#: Recurrence functions of mlx-lm's hybrid models -> their arguments with a
#: time axis (axis 1). Each returns ``(output, new_state)`` and takes its
#: initial state as ``state``.
RECURRENCES: dict[str, tuple[str, ...]] = {
    "gated_delta_update": ("q", "k", "v", "a", "b", "mask"),
    "ssm_update": ("hidden_states", "B", "C", "dt", "mask"),
}


@dataclass
class _Layer:
    """One recurrent layer's recorded forward."""

    conv_input: mx.array  # (B, n_keep + L, C): old conv state, then the new inputs
    conv_slot: int
    recurrence: tuple[Callable, inspect.BoundArguments] | None = None
    state_slot: int | None = None


@dataclass
class _Entry:
    length: int
    before: list[list[Any]]  # every recurrent cache's slots before the forward
    layers: dict[int, _Layer]  # by index into RecurrentLog.caches


class _Recording:
    def __init__(self) -> None:
        self.conv: dict[int, mx.array] = {}
        self.calls: dict[int, tuple[Callable, inspect.BoundArguments, mx.array]] = {}
        self.current: int | None = None


class _ConvTap(StandIn):
    """Stands in for a recurrent layer's ``Conv1d`` during a recorded forward."""

    wrapped = "conv"

    def __init__(self, conv: nn.Module, index: int, rec: _Recording):
        super().__init__()
        self.conv, self.index, self.rec = conv, index, rec

    def __call__(self, x: mx.array) -> mx.array:
        self.rec.conv[self.index] = x
        self.rec.current = self.index
        return self.conv(x)


def _resolve(root: nn.Module, path: str) -> tuple[Any, str]:
    parts = path.split(".")
    parent: Any = root
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else getattr(parent, p)
    return parent, parts[-1]


class RecurrentLog:
    """Records recurrent state changes so that ``trim`` is exact (see module doc).

    ``capacity`` bounds how many of the latest positions can be rolled back;
    a longer forward (a prefill chunk) is not recorded and ends rollback
    before it.
    """

    def __init__(self, layers: Sequence[nn.Module], caches: Sequence[Any], capacity: int):
        self.caches: list[ArraysCache] = [c for c in caches if isinstance(c, ArraysCache)]
        self.capacity = capacity
        self.entries: list[_Entry] = []
        self.convs: list[tuple[Any, str]] = []  # (parent module, attribute) per recurrent cache
        self.functions: set[tuple[Any, str]] = set()  # (python module, function name)
        for layer in layers:
            convs = [p for p, m in layer.named_modules() if isinstance(m, nn.Conv1d)]
            if not convs:
                continue
            if len(convs) > 1:
                raise UnsupportedModelError(
                    f"{type(layer).__name__} has {len(convs)} convolutions; hf2q-py rolls back "
                    "recurrent layers with one convolution state"
                )
            self.convs.append(_resolve(layer, convs[0]))
            mods = {sys.modules[type(m).__module__] for _, m in layer.named_modules()}
            for mod in mods:
                for name in RECURRENCES:
                    if callable(getattr(mod, name, None)):
                        self.functions.add((mod, name))
        model_name = type(layers[0]).__module__.split(".")[-1] if layers else "this model"
        if len(self.convs) != len(self.caches):
            raise UnsupportedModelError(
                f"{model_name}: {len(self.caches)} recurrent caches but {len(self.convs)} layers with a "
                "convolution state; hf2q-py cannot roll back this model's recurrent state"
            )
        sizes = {len(c.cache) for c in self.caches}
        if not sizes <= {1, 2} or (2 in sizes and not self.functions):
            raise UnsupportedModelError(
                f"{model_name} keeps recurrent state hf2q-py cannot roll back (cache slots {sorted(sizes)}; "
                f"supported: a convolution state, plus one of {', '.join(RECURRENCES)})"
            )

    @classmethod
    def create(cls, layers: Sequence[nn.Module], caches: Sequence[Any], capacity: int) -> RecurrentLog | None:
        """A log for ``caches``, or None when none of them is recurrent."""
        if not any(isinstance(c, ArraysCache) for c in caches):
            return None
        return cls(layers, caches, capacity)

    # -- recording -------------------------------------------------------------
    @contextmanager
    def recording(self, length: int) -> Iterator[None]:
        """Record the body's forward of ``length`` positions (if it can be rolled back)."""
        if length > self.capacity:
            self.entries.clear()
            yield
            return
        before = [list(c.cache) for c in self.caches]
        rec = _Recording()
        saved_convs = []
        saved_fns = []
        try:
            for i, (parent, name) in enumerate(self.convs):
                conv = getattr(parent, name)
                saved_convs.append((parent, name, conv))
                setattr(parent, name, _ConvTap(conv, i, rec))
            for mod, name in self.functions:
                fn = getattr(mod, name)
                saved_fns.append((mod, name, fn))
                setattr(mod, name, _recorder(fn, rec))
            yield
        finally:
            for parent, name, conv in saved_convs:
                setattr(parent, name, conv)
            for mod, name, fn in saved_fns:
                setattr(mod, name, fn)
        self._append(_Entry(length, before, self._layers(rec, length)))

    def _layers(self, rec: _Recording, length: int) -> dict[int, _Layer]:
        layers = {}
        for i, conv_input in rec.conv.items():
            cache = self.caches[i]
            if cache.left_padding is not None:
                raise UnsupportedModelError("recurrent caches with left padding cannot be rolled back")
            state_slot = None
            call = rec.calls.get(i)
            if call is not None:
                state_slot = next((s for s, v in enumerate(cache.cache) if v is call[2]), None)
                if state_slot is None:
                    raise UnsupportedModelError(
                        f"recurrent layer {i}: the recurrence state is not stored in its cache as returned; "
                        "cannot roll it back"
                    )
            n_keep = conv_input.shape[1] - length
            conv_slot = next(
                (
                    s
                    for s, v in enumerate(cache.cache)
                    if s != state_slot
                    and v is not None
                    and tuple(v.shape) == (conv_input.shape[0], n_keep, conv_input.shape[2])
                ),
                None,
            )
            unknown = [s for s in range(len(cache.cache)) if s not in (conv_slot, state_slot)]
            if conv_slot is None or unknown:
                raise UnsupportedModelError(
                    f"recurrent layer {i}: cache slots {unknown or 'conv'} are not understood; cannot roll them back"
                )
            layers[i] = _Layer(conv_input, conv_slot, call[:2] if call else None, state_slot)
        return layers

    def _append(self, entry: _Entry) -> None:
        self.entries.append(entry)
        total = sum(e.length for e in self.entries)
        while total > self.capacity:
            total -= self.entries.pop(0).length

    # -- rollback --------------------------------------------------------------
    def trim(self, n: int) -> None:
        """Make every recurrent state what it was ``n`` positions ago."""
        while n > 0:
            if not self.entries:
                raise RuntimeError(
                    f"cannot roll recurrent state back {n} more positions: only the last "
                    f"{self.capacity} positions of short forwards are recorded"
                )
            e = self.entries[-1]
            if n >= e.length:
                for c, slots in zip(self.caches, e.before):
                    c.cache = list(slots)
                self.entries.pop()
                n -= e.length
            else:
                self._keep(e, e.length - n)
                n = 0

    def _keep(self, e: _Entry, m: int) -> None:
        """Set the states to those after the first ``m`` positions of ``e``; ``e`` becomes that shorter forward."""
        for c, slots in zip(self.caches, e.before):
            c.cache = list(slots)
        for i, layer in e.layers.items():
            cache = self.caches[i]
            n_keep = layer.conv_input.shape[1] - e.length
            cache.cache[layer.conv_slot] = layer.conv_input[:, m : m + n_keep]
            layer.conv_input = layer.conv_input[:, : n_keep + m]
            if layer.recurrence is not None:
                fn, bound = layer.recurrence
                args = dict(bound.arguments)
                for name in RECURRENCES[fn.__name__]:
                    if args.get(name) is not None:
                        args[name] = args[name][:, :m]
                bound = inspect.BoundArguments(bound.signature, args)
                cache.cache[layer.state_slot] = fn(*bound.args, **bound.kwargs)[1]
                layer.recurrence = (fn, bound)
        e.length = m


def _recorder(fn: Callable, rec: _Recording) -> Callable:
    sig = inspect.signature(fn)

    def recorded(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        with_lengths(bound)
        out = fn(*bound.args, **bound.kwargs)
        if rec.current is not None:
            rec.calls[rec.current] = (fn, bound, out[1])
        return out

    recorded.__name__ = fn.__name__
    return recorded


def with_lengths(bound: inspect.BoundArguments, lengths: mx.array | None = None) -> None:
    """Give a masked recurrence call that takes ``lengths`` (``ssm_update``)
    each row's length: ``lengths``, or the count of its mask (a batch's
    right-padded rows). mlx-lm's Mamba-2 scan (``ssm_attn``) takes a row's
    new state from the decay of its last position, which the mask empties
    for a padded row (its inputs would be lost), unless it is told where
    each row ends. Unmasked calls (a single sequence's) are left as they are."""
    if "lengths" not in bound.signature.parameters:
        return
    mask = bound.arguments.get("mask")
    if lengths is None and mask is not None and bound.arguments.get("lengths") is None:
        lengths = mask.astype(mx.int32).sum(axis=-1)
    if lengths is not None:
        bound.arguments["lengths"] = lengths
