"""How many tokens to draft each round.

A policy answers one question per round (``next_k``) and learns from each
finished round (``update``): ``NoDrafts`` (plain decoding), ``FixedK`` and
``AdaptiveK``. Proposers do not tune a policy: they declare what they know
about their drafts in a ``DraftProfile``, from which ``build_policy`` makes
one. ``AdaptiveK`` is three parts that can be read and tested alone:
``Acceptance`` (how often drafts pass), a ``CostModel`` (what a round
costs: ``MeasuredCosts`` live, ``PriorCosts`` untimed) and a
``ProbeSchedule`` (when to try drafting again after standing down).
"""

from .acceptance import Acceptance
from .adaptive import AdaptiveK
from .costs import CostModel, MeasuredCosts, PriorCosts, Timings
from .policy import MAX_K, FixedK, NoDrafts, Policy, validate_k
from .probes import ProbeSchedule
from .profile import DraftProfile

__all__ = [
    "MAX_K",
    "Acceptance",
    "AdaptiveK",
    "CostModel",
    "DraftProfile",
    "FixedK",
    "MeasuredCosts",
    "NoDrafts",
    "Policy",
    "PriorCosts",
    "ProbeSchedule",
    "Timings",
    "build_policy",
    "validate_k",
]


def build_policy(
    profile: DraftProfile,
    k: int,
    *,
    adaptive: bool = True,
    timed: bool = True,
    timings: Timings | None = None,
) -> Policy:
    """The policy for a proposer that declared ``profile``: K up to
    ``max(k, profile.min_k)``, fixed or adaptive. ``timed=False``: adaptive K
    charges the prior costs (seeded sampling repeats exactly); ``timings``:
    the forward timings to learn into (a Target keeps one per method)."""
    k = max(k, profile.min_k)
    if not adaptive:
        return FixedK(k)
    return AdaptiveK(k, profile, timings=timings, timed=timed)
