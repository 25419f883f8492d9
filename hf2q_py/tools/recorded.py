"""A Target that answers from a recorded greedy stream, on modelled time.

The engine's loop runs on it unchanged: a forward's logits point at the
recorded answer's next token at every position (the fed tokens do not
matter, as the engine only reads positions whose inputs it accepted), and
the runtime's clock advances by a cost model's seconds when the engine
waits for a forward. Forwards queued back to back overlap as on a device: a
decode queued while another is in flight starts when that one ends; one
queued with nothing in flight restarts the pipeline and costs ``restart``
extra. Drafting takes no modelled time unless a proposer says so
(``Runtime.spend``). So the real loop and the real draft-length policy are
judged on recorded answers without a model and without timing noise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..kv import FULL_PRECISION
from ..memory import DraftMemory
from ..target import Forward, Kept

#: Seconds of one forward of ``width`` tokens.
Seconds = Callable[[int], float]


class RecordedTarget:
    """What the engine and the model-free proposers need of a Target, for one
    recorded stream (``prompt`` then the greedy ``answer``); ``memory`` and
    ``kept`` are shared with other streams as on one Target."""

    prompt_cache = None
    sharding = None
    kv = FULL_PRECISION  # a recorded stream has no caches

    def __init__(
        self,
        prompt: Sequence[int],
        answer: Sequence[int],
        seconds: Seconds,
        restart: float = 0.0,
        memory: DraftMemory | None = None,
        kept: Kept | None = None,
        line_breaks: frozenset[int] = frozenset(),
    ):
        self.stream = [*prompt, *answer]
        self.line_breaks = line_breaks
        self.seconds, self.restart = seconds, restart
        self.memory = memory if memory is not None else DraftMemory()
        self.kept = kept if kept is not None else Kept()
        self.vocab_size = max(self.stream) + 1

    def runtime(self, slack: int = 0, rollback: int | None = None, kv: Any = None) -> RecordedRuntime:
        return RecordedRuntime(self)


class RecordedRuntime:
    """One sequence over a recorded stream; its ``clock`` is modelled time."""

    trimmable = True

    def __init__(self, target: RecordedTarget):
        self.target = target
        self.offset = 0
        self.now = 0.0
        self._ends: deque[float] = deque()  # end times of forwards not yet waited for
        self._busy_until = 0.0

    def clock(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        """Host work (drafting) that takes ``seconds`` of modelled time."""
        self.now += seconds

    def prefill(self, tokens: Sequence[int], **kw: Any) -> Forward:
        self.offset += len(tokens)
        self.now += self.target.seconds(len(tokens)) if tokens else 0.0
        return Forward(None, {})

    def decode(self, token: Any, **kw: Any) -> Forward:
        return self._forward(1)

    def verify(self, tokens: Sequence[int], **kw: Any) -> Forward:
        return self._forward(len(tokens))

    def read(self, result: mx.array) -> list:
        self.now = max(self.now, self._ends.popleft())
        return result.tolist()

    def trim(self, n: int, skip_layers: Sequence[int] = ()) -> None:
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.offset}")
        self.offset -= n

    def state(self) -> list:
        return []

    def _forward(self, width: int) -> Forward:
        """Queue a forward of ``width`` tokens after the cache's; its logits
        point at the recorded token after each position."""
        t = self.target
        idle = not self._ends
        start = max(self.now, self._busy_until)
        self._busy_until = start + t.seconds(width) + (t.restart if idle and width == 1 else 0.0)
        self._ends.append(self._busy_until)
        ahead = [
            t.stream[i] if i < len(t.stream) else 0 for i in range(self.offset + 1, self.offset + 1 + width)
        ]
        self.offset += width
        logits = mx.zeros((width, t.vocab_size))
        logits[mx.arange(width), mx.array(ahead)] = 1.0
        return Forward(logits, {})
