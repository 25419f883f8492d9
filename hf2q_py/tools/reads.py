"""Counting the blocking reads a piece of code makes: every ``mx.eval``,
``array.item()`` and ``array.tolist()`` (MLX's ways to wait for a result and
bring it to the host), and the seconds spent inside them.

For the length of a ``with count_reads()`` block those three are wrapped:
``mx.eval`` in its module, the two methods in ``mx.array``'s type dictionary
(a nanobind type refuses attribute assignment, so the dictionary is reached
through ``gc`` and the type's method cache is invalidated). Nothing else
changes; the originals are back when the block ends. A tool for benchmarks
and tests, not for the library's own paths.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


@dataclass
class ReadCount:
    """Blocking reads seen, by kind, the seconds spent inside them, and the
    non-blocking ``mx.async_eval`` calls."""

    by_kind: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    async_evals: int = 0
    #: Seconds inside ``mx.async_eval``: on a backend that computes inline
    #: (MLX's CPU, once its queue is full) the forward's own time.
    async_seconds: float = 0.0

    @property
    def reads(self) -> int:
        return sum(self.by_kind.values())


def _type_dict(cls: type) -> dict[str, Any]:
    return gc.get_referents(cls.__dict__)[0]


def _set_methods(cls: type, methods: dict[str, Any]) -> None:
    _type_dict(cls).update(methods)
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))


@contextmanager
def count_reads() -> Iterator[ReadCount]:
    """Count the blocking reads made inside the ``with`` block."""
    count = ReadCount()
    depth = [0]  # an eval inside a counted read (none today) is not counted twice

    def counted(kind: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            count.by_kind[kind] = count.by_kind.get(kind, 0) + 1
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                count.seconds += time.perf_counter() - t0
                depth[0] -= 1

        return wrapper

    def async_eval(*args, **kwargs):
        count.async_evals += 1
        t0 = time.perf_counter()
        try:
            return original_async(*args, **kwargs)
        finally:
            count.async_seconds += time.perf_counter() - t0

    methods = {name: _type_dict(mx.array)[name] for name in ("item", "tolist")}
    original_eval, original_async = mx.eval, mx.async_eval
    _set_methods(mx.array, {name: counted(name, fn) for name, fn in methods.items()})
    mx.eval, mx.async_eval = counted("eval", original_eval), async_eval
    try:
        yield count
    finally:
        mx.eval, mx.async_eval = original_eval, original_async
        _set_methods(mx.array, methods)
