"""Serving a sharded model: every rank runs the same scheduler, in step.

Under ``mlx.launch`` every rank runs a :class:`~hf2q_py.server.worker.Worker`
over its shard of the model; rank 0's answers HTTP. Before each step of its
scheduler rank 0 sends the step's news (the generations submitted since the
step before: rank 0's entry ids, token ids, ``GenerationConfig`` and
drafting sources; the ids of those cancelled since) to every rank; the other
ranks apply it to their own schedulers (output discarded) and step too
(:meth:`Worker.follow`). With nothing to run rank 0 sends an idle tick every
``IDLE_TICK`` seconds, and the other ranks sleep most of the time between
ticks instead of spinning in a collective; a stop ends them.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from ..config import GenerationConfig
from ..distributed import Sharding
from ..scheduler import News
from ..target import Target

IDLE_TICK = 0.1  # seconds between rank 0's idle ticks
_FOLLOWER_NAP = 0.8 * IDLE_TICK  # what the other ranks sleep after a tick
_IDLE, _STEP, _STOP = 0, 1, 2
_SERVED_DRAFT = "<the served draft model>"


class Relay:
    """A sharded target's step news: rank 0 sends it, the other ranks
    receive it. ``models`` holds the served draft model under ``"draft"``
    (sent by name, not pickled)."""

    def __init__(self, sharding: Sharding, models: dict[str, Any] | None = None):
        self.sharding = sharding
        self.models = models or {}
        self.stopped = False

    @property
    def leads(self) -> bool:
        """Whether this rank sends (rank 0)."""
        return self.sharding.rank == 0

    # -- rank 0 -----------------------------------------------------------------
    def send(self, news: News) -> None:
        """Tell every rank to run a step that first applies ``news``."""
        if not (news.arrivals or news.cancelled):
            _send(self.sharding, _STEP)
            return
        arrivals = [replace(a, config=_portable(a.config)) for a in news.arrivals]
        _send(self.sharding, _STEP, pickle.dumps(News(arrivals, list(news.cancelled))))

    def idle(self) -> None:
        """Nothing to run yet (the other ranks nap, then listen again)."""
        _send(self.sharding, _IDLE)

    def stop(self) -> None:
        """Tell every rank to stop following (once; later calls do nothing)."""
        if not self.stopped:
            self.stopped = True
            _send(self.sharding, _STOP)

    # -- the other ranks --------------------------------------------------------
    def receive(self) -> News | None:
        """The next step's news (napping after idle ticks), or None once rank 0 stops."""
        while True:
            kind, payload = _receive(self.sharding)
            if kind == _STOP:
                return None
            if kind == _STEP:
                break
            time.sleep(_FOLLOWER_NAP)
        if not payload:
            return News()
        news = pickle.loads(payload)
        news.arrivals = [replace(a, config=_restored(a.config, self.models)) for a in news.arrivals]
        return news


def _portable(config: GenerationConfig | None) -> GenerationConfig | None:
    """``config`` with a served draft model (a Target) named instead of held."""
    if config is not None and isinstance(config.spec.draft, Target):
        return replace(config, spec=replace(config.spec, draft=_SERVED_DRAFT))
    return config


def _restored(config: GenerationConfig | None, models: dict[str, Any]) -> GenerationConfig | None:
    if config is not None and config.spec.draft == _SERVED_DRAFT:
        return replace(config, spec=replace(config.spec, draft=models["draft"]))
    return config


def _send(sharding: Sharding, kind: int, payload: bytes = b"") -> None:
    _broadcast(sharding, np.array([kind, len(payload)], dtype=np.int32))
    if payload:
        _broadcast(sharding, np.frombuffer(payload, dtype=np.uint8))


def _receive(sharding: Sharding) -> tuple[int, bytes]:
    kind, length = _broadcast(sharding, np.zeros(2, dtype=np.int32)).tolist()
    if not length:
        return kind, b""
    return kind, bytes(_broadcast(sharding, np.zeros(length, dtype=np.uint8)))


def _broadcast(sharding: Sharding, values: np.ndarray) -> np.ndarray:
    """Rank 0's ``values`` (the others pass zeros of the same shape) on every rank."""
    mine = values if sharding.rank == 0 else np.zeros_like(values)
    out = mx.distributed.all_sum(mx.array(mine), group=sharding.group, stream=mx.cpu)
    return np.array(out)
