"""The draft-length policy interface and the two fixed policies."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from ..stats import Round
from ..validate import check_int

#: The largest draft length per round (``--k``): a verify forward feeds K + 1
#: tokens, and no proposer's drafts stay right for longer than this.
MAX_K = 256


def validate_k(k: int) -> None:
    check_int("k (draft length)", k, 1, MAX_K)


class Policy(Protocol):
    """Chooses each round's draft length and learns from finished rounds."""

    #: The most drafts any round may get (the engine's rollback depth).
    k_max: int

    def next_k(self, key: Hashable = None) -> int:
        """Drafts for the next round, whose drafts are of class ``key``; 0: decode plainly."""
        ...

    def update(self, r: Round) -> None:
        """Learn from a finished round."""
        ...

    def prefilled(self, tokens: int, seconds: float) -> None:
        """Learn from the prompt's prefill: ``tokens`` fed in ``seconds``."""
        ...

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        """Learn acceptance alone (a round whose cost another planner learns)."""
        ...

    def batch_k(self, key: Hashable = None) -> int:
        """The most drafts of class ``key`` a batched round may verify (the
        batch's planner chooses the width within it)."""
        ...

    def survival(self, key: Hashable, n: int) -> list[float] | None:
        """The chance that the first 1 .. ``n`` drafts of ``key`` are all
        accepted; None: verify all ``n`` whatever they promise (a fixed K)."""
        ...


class NoDrafts:
    """Plain decoding: K is always 0."""

    k_max = 0

    def next_k(self, key: Hashable = None) -> int:
        return 0

    def update(self, r: Round) -> None:
        pass

    def prefilled(self, tokens: int, seconds: float) -> None:
        pass

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        pass

    def batch_k(self, key: Hashable = None) -> int:
        return 0

    def survival(self, key: Hashable, n: int) -> list[float] | None:
        return []


class FixedK:
    """Always draft up to ``k`` tokens."""

    def __init__(self, k: int):
        validate_k(k)
        self.k = self.k_max = k

    def next_k(self, key: Hashable = None) -> int:
        return self.k

    def update(self, r: Round) -> None:
        pass

    def prefilled(self, tokens: int, seconds: float) -> None:
        pass

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        pass

    def batch_k(self, key: Hashable = None) -> int:
        return self.k

    def survival(self, key: Hashable, n: int) -> list[float] | None:
        return None
