"""Progress while a model loads: tqdm bars on stderr, shown by default only
when stderr is a terminal, and only for loads that take more than a second."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import mlx.core as mx

#: Seconds a load runs before its bar appears (short loads stay silent).
DELAY = 1.0
#: Weights evaluated at a time while a bar counts them.
CHUNK_BYTES = 256 << 20

T = TypeVar("T")


def shown(progress: bool | None) -> bool:
    """``progress`` as given, or (None) whether stderr is a terminal and
    ``HF_HUB_DISABLE_PROGRESS_BARS`` is not set."""
    if progress is not None:
        return bool(progress)
    from huggingface_hub import constants

    return bool(getattr(sys.stderr, "isatty", lambda: False)()) and not constants.HF_HUB_DISABLE_PROGRESS_BARS


def _bar(show: bool, **kw: Any) -> Any:
    from tqdm import tqdm

    return tqdm(disable=not show, delay=DELAY, file=sys.stderr, dynamic_ncols=True, **kw)


def counted(items: Iterable[T], total: int, desc: str, show: bool) -> Iterator[T]:
    """``items``, counted on a bar (tensors read from a file)."""
    with _bar(show, total=total, desc=desc, unit=" tensors") as bar:
        for item in items:
            yield item
            bar.update(1)


def evaluate(params: Any, desc: str, show: bool) -> None:
    """Evaluate a tree of (lazy) weights; with ``show``, a chunk at a time
    on a bar counting bytes."""
    from mlx.utils import tree_flatten

    arrays = [v for _, v in tree_flatten(params) if isinstance(v, mx.array)]
    if not show:
        mx.eval(arrays)
        return
    with _bar(show, total=sum(a.nbytes for a in arrays), desc=desc, unit="B", unit_scale=True) as bar:
        batch: list[mx.array] = []
        size = 0
        for a in arrays:
            batch.append(a)
            size += a.nbytes
            if size >= CHUNK_BYTES:
                mx.eval(batch)
                bar.update(size)
                batch, size = [], 0
        mx.eval(batch)
        bar.update(size)
