"""Serving a sharded model: rank 0 answers HTTP, every rank runs each generation.

Under ``mlx.launch`` rank 0 runs the server; the other ranks run
:func:`follow`. Before each job rank 0 sends the job (token ids and its
``GenerationConfig``) to every rank; after each round of it every rank
takes rank 0's word on whether the job goes on (a client that went away
ends it on every rank at the same round). Between jobs rank 0 sends an idle
tick every ``IDLE_TICK`` seconds, and the other ranks sleep most of the
time between ticks instead of spinning in a collective.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from ..config import GenerationConfig
from ..distributed import Sharding
from ..errors import Hf2qError
from ..generation import stream_generate
from ..target import Target

log = logging.getLogger("hf2q_py.server")

IDLE_TICK = 0.1  # seconds between rank 0's idle ticks
_FOLLOWER_NAP = 0.8 * IDLE_TICK  # what the other ranks sleep after a tick
_STOP, _IDLE = -1, 0
_SERVED_DRAFT = "<the served draft model>"


class Relay:
    """Rank 0's side of serving on a sharded target."""

    def __init__(self, sharding: Sharding):
        self.sharding = sharding
        self.stopped = False

    def send(self, ids: list[int], config: GenerationConfig) -> None:
        """Tell every rank to run this job."""
        _send(self.sharding, pickle.dumps((ids, _portable(config))))

    def idle(self) -> None:
        """Nothing to run yet (the other ranks nap, then listen again)."""
        _send(self.sharding, None, _IDLE)

    def stop(self) -> None:
        """Tell every rank to return from :func:`follow` (once; later calls do nothing)."""
        if not self.stopped:
            self.stopped = True
            _send(self.sharding, None, _STOP)

    def going_on(self, go: bool) -> bool:
        """Rank 0's ``go`` after a round, on every rank."""
        return _rank0_flag(self.sharding, go)


def follow(target: Target, models: dict[str, Any]) -> int:
    """A rank other than 0: run every job rank 0 sends until it stops.

    ``models`` holds the served draft model under ``"draft"``. SIGINT is
    ignored here: rank 0 takes it and stops every rank at a job's end.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sharding = target.sharding
    while True:
        kind, payload = _receive(sharding)
        if kind == _STOP:
            return 0
        if kind == _IDLE:
            time.sleep(_FOLLOWER_NAP)
            continue
        ids, config = pickle.loads(payload)
        _run(target, ids, _restored(config, models), sharding)


def _run(target: Target, ids: list[int], config: GenerationConfig, sharding: Sharding) -> None:
    try:
        stream = stream_generate(target, ids, config=config)
        try:
            for _ in stream:
                if not _rank0_flag(sharding, True):
                    break
        finally:
            stream.close()
    except Hf2qError:  # rank 0 meets the same error and answers the client
        pass
    except Exception:  # noqa: BLE001 - as rank 0's worker, outlive any one request
        log.exception("generation failed on rank %d", sharding.rank)


def _portable(config: GenerationConfig) -> GenerationConfig:
    """``config`` with a served draft model (a Target) named instead of held."""
    if isinstance(config.spec.draft, Target):
        return replace(config, spec=replace(config.spec, draft=_SERVED_DRAFT))
    return config


def _restored(config: GenerationConfig, models: dict[str, Any]) -> GenerationConfig:
    if config.spec.draft == _SERVED_DRAFT:
        return replace(config, spec=replace(config.spec, draft=models["draft"]))
    return config


def _send(sharding: Sharding, payload: bytes | None, kind: int = 1) -> None:
    header = len(payload) if payload is not None else kind
    _broadcast(sharding, np.array([header], dtype=np.int32))
    if payload is not None:
        _broadcast(sharding, np.frombuffer(payload, dtype=np.uint8))


def _receive(sharding: Sharding) -> tuple[int, bytes]:
    (header,) = _broadcast(sharding, np.zeros(1, dtype=np.int32)).tolist()
    if header <= 0:
        return header, b""
    return 1, bytes(_broadcast(sharding, np.zeros(header, dtype=np.uint8)))


def _broadcast(sharding: Sharding, values: np.ndarray) -> np.ndarray:
    """Rank 0's ``values`` (the others pass zeros of the same shape) on every rank."""
    mine = values if sharding.rank == 0 else np.zeros_like(values)
    out = mx.distributed.all_sum(mx.array(mine), group=sharding.group, stream=mx.cpu)
    return np.array(out)


def _rank0_flag(sharding: Sharding, flag: bool) -> bool:
    return bool(_broadcast(sharding, np.array([int(flag)], dtype=np.int32))[0])
