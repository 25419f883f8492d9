"""The draft-length policy interface, the two fixed policies, and the one
place that makes a policy for a proposer."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from ..stats import Round
from ..validate import check_int
from .profile import DraftProfile

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


class NoDrafts:
    """Plain decoding: K is always 0."""

    k_max = 0

    def next_k(self, key: Hashable = None) -> int:
        return 0

    def update(self, r: Round) -> None:
        pass


class FixedK:
    """Always draft up to ``k`` tokens."""

    def __init__(self, k: int):
        validate_k(k)
        self.k = self.k_max = k

    def next_k(self, key: Hashable = None) -> int:
        return self.k

    def update(self, r: Round) -> None:
        pass


def build_policy(
    profile: DraftProfile, k: int, *, adaptive: bool = True, timed: bool = True, timings=None
) -> Policy:
    """The policy for a proposer that declared ``profile``: K up to
    ``max(k, profile.min_k)``, fixed or adaptive. ``timed=False``: adaptive K
    charges the prior costs (seeded sampling repeats exactly); ``timings``:
    the forward timings to learn into (a Target keeps one per method)."""
    from .adaptive import AdaptiveK

    k = max(k, profile.min_k)
    if not adaptive:
        return FixedK(k)
    return AdaptiveK(k, profile, timings=timings, timed=timed)
