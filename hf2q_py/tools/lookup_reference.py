"""mlx-dspark's drafter-free lookup rule, re-stated as a proposer for replay.

A reference to compare the n-gram method's rule against on the same
recorded streams (``python -m hf2q_py.tools.replay --reference``), written
from a reading of mlx-dspark 0.20.3's ``lookup_generate`` (no code taken):

- the last 4 tokens, else the last 3, are looked up among earlier positions
  of the prompt and the answer so far; the most recent earlier occurrence
  of the longest n-gram found is copied;
- a draft is 6 tokens, or, when the match extends backwards to ``m >= 8``
  matching tokens, ``min(32, 2 m)``;
- long drafts stop after two in a row accept less than half of themselves,
  and one is tried again after 8 rounds of base-length drafts.

It drafts every round a match exists (no cost model); run it with a fixed
K of ``LONG`` so the rule alone sizes its drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..proposers.base import Draft, Proposer

BASE = 6  #: draft length of an ordinary match
LONG = 32  #: the longest draft
LONG_MATCH = 8  #: backward match length from which drafts are long
N_MAX, N_MIN = 4, 3  #: n-gram lengths looked up, longest first
PROBE_EVERY = 8  #: base-length rounds before a failed long draft is tried again


class LookupReference(Proposer):
    """The lookup rule above over the context (prompt and committed tokens)."""

    name = "mlx-dspark lookup rule"

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its two latest ends
        self.indexed = 0
        self.fails = 0
        self.since_long = 0
        self.drafted = 0  # length of the latest draft, for the gate

    def start(self, runtime, prompt: Sequence[int], hidden, decider) -> None:
        self._index(prompt)

    def _index(self, tokens: Sequence[int]) -> None:
        """Record the n-grams ending at every position not indexed yet."""
        for end in range(self.indexed + 1, len(tokens) + 1):
            for n in range(N_MIN, N_MAX + 1):
                if end >= n:
                    ends = self.last.setdefault(tuple(tokens[end - n : end]), [])
                    ends[:] = [*ends[-1:], end]
        self.indexed = len(tokens)

    def _long_allowed(self) -> bool:
        return self.fails < 2 or self.since_long >= PROBE_EVERY

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        self._index(tokens)
        end = len(tokens)
        for n in range(N_MAX, N_MIN - 1, -1):
            earlier = (
                [e for e in self.last.get(tuple(tokens[end - n : end]), ()) if e != end] if end >= n else []
            )
            if not earlier:
                continue
            pos = earlier[-1]
            cap = BASE
            if self._long_allowed():
                m, i, j = n, end - n - 1, pos - n - 1
                while j >= 0 and m < LONG and tokens[i] == tokens[j]:
                    m, i, j = m + 1, i - 1, j - 1
                if m >= LONG_MATCH:
                    cap = min(LONG, 2 * m)
            draft = list(tokens[pos : pos + min(cap, k)])
            if draft:
                self.drafted = len(draft)
                return Draft(draft)
        self.drafted = 0
        return Draft()

    def update(self, tokens: Sequence[int], drafted: int, accepted: int, hidden) -> None:
        """The long-draft gate: failures of long drafts, base rounds since."""
        if not drafted:
            return
        if drafted <= BASE:
            self.since_long += 1
        else:
            self.fails = self.fails + 1 if 2 * accepted < drafted else 0
            self.since_long = 0
