"""What a proposer declares about its drafts, once, for the draft-length policy."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

#: A prior acceptance rate: one rate for every draft position, or a pair
#: (first position, later positions).
Rate = float | tuple[float, float]


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class DraftProfile:
    """What a proposer knows about its drafts before any round runs.

    ``key_priors``: prior acceptance per draft key (``Proposer.draft_key``,
    e.g. the n-gram match depth), measured offline; keys not listed start
    from ``prior_rate``. ``geometric_keys``: keys whose draft positions share
    one acceptance rate (an autoregressive drafter errs about as often at
    every position). ``split_drafting``: drafting costs time per draft token
    (a draft model), charged per key from ``draft_cost_priors`` (seconds per
    token relative to a target decode) until measured. ``prior_slope``: a
    verify of L tokens costs ``1 + prior_slope * (L - 1)`` decodes until
    measured. ``longer_margin``: how much more a longer K must promise to be
    chosen. ``min_k``: the policy's K cap is at least this (a proposer that
    sizes some drafts itself, like copies).
    """

    key_priors: Mapping[Hashable, Rate] = field(default_factory=dict)
    geometric_keys: frozenset = frozenset()
    split_drafting: bool = False
    draft_cost_priors: Mapping[Hashable, float] = field(default_factory=dict)
    prior_rate: float = 0.5
    prior_slope: float = 0.12
    longer_margin: float = 0.02
    min_k: int = 0

    def __post_init__(self):
        object.__setattr__(self, "key_priors", _frozen(self.key_priors))
        object.__setattr__(self, "draft_cost_priors", _frozen(self.draft_cost_priors))
        object.__setattr__(self, "geometric_keys", frozenset(self.geometric_keys))

    def rekeyed(self, key: Callable[[Hashable], Hashable]) -> DraftProfile:
        """The same profile with every draft key ``k`` renamed ``key(k)``
        (``None``, one class, included)."""
        return replace(
            self,
            key_priors={key(k): v for k, v in self.key_priors.items()},
            geometric_keys=frozenset(key(k) for k in self.geometric_keys),
            draft_cost_priors={key(k): v for k, v in self.draft_cost_priors.items()},
        )

    def merged(self, other: DraftProfile) -> DraftProfile:
        """One profile for a proposer that drafts from two sources with
        disjoint keys: this one's scalars (prior rate, slope, margin), both
        key tables, the larger ``min_k``. Drafting is split when either
        splits it; the keys of a source that does not split cost nothing
        per draft token."""

        def free(p: DraftProfile) -> dict:
            return {k: 0.0 for k in p.key_priors} if not p.split_drafting else {}

        split = self.split_drafting or other.split_drafting
        return replace(
            self,
            key_priors={**self.key_priors, **other.key_priors},
            geometric_keys=self.geometric_keys | other.geometric_keys,
            split_drafting=split,
            draft_cost_priors={
                **free(self),
                **self.draft_cost_priors,
                **free(other),
                **other.draft_cost_priors,
            }
            if split
            else {**self.draft_cost_priors, **other.draft_cost_priors},
            min_k=max(self.min_k, other.min_k),
        )
