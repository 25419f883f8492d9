"""How often drafts pass: a decayed conditional acceptance rate per draft
position, pooled and per draft key."""

from __future__ import annotations

from collections.abc import Hashable

from .profile import DraftProfile


class Acceptance:
    """Conditional acceptance ``a_i = P(draft i accepted | drafts before it
    accepted)`` per draft position, with decay, so bursty proposers (an
    n-gram match is usually right for many tokens or not at all) are
    modelled as they behave.

    Pooled rates start from ``profile.prior_rate`` (weight ``prior_weight``);
    each key keeps its own rates with the pooled ones (or the profile's
    ``key_priors`` entry: one rate, or (first position, later positions)) as
    a prior of weight ``key_weight``. Keys in ``profile.geometric_keys``
    share one rate across positions, estimated from every position tried.
    """

    def __init__(
        self,
        k_max: int,
        profile: DraftProfile,
        decay: float = 0.9,
        prior_weight: float = 1.0,
        key_weight: float = 1.0,
    ):
        self.k_max, self.profile = k_max, profile
        self.decay, self.prior_weight, self.key_weight = decay, prior_weight, key_weight
        self.tried = [0.0] * k_max
        self.hits = [0.0] * k_max
        self.keyed: dict[Hashable, tuple[list[float], list[float]]] = {}  # key -> (tried, hits)

    def rates(self, key: Hashable = None) -> list[float]:
        """Conditional acceptance estimate at every draft position; a position
        barely tried yet borrows the (pooled) estimate of the one before."""
        if key in self.profile.geometric_keys:
            return [self._geometric_rate(key)] * self.k_max
        pooled: list[float] = []
        w, prior_rate = self.prior_weight, self.profile.prior_rate
        for i in range(self.k_max):
            prior = prior_rate if i == 0 or self.tried[i] >= 0.5 else pooled[i - 1]
            pooled.append((self.hits[i] + prior * w) / (self.tried[i] + w))
        if key is None:
            return pooled
        prior = self.profile.key_priors.get(key)
        if prior is not None:
            first, rest = prior if isinstance(prior, tuple) else (prior, prior)
            pooled = [first] + [rest] * (self.k_max - 1)
        if key not in self.keyed:
            return pooled
        tried, hits = self.keyed[key]
        kw = self.key_weight
        return [(h + p * kw) / (t + kw) for h, p, t in zip(hits, pooled, tried)]

    def _geometric_rate(self, key: Hashable) -> float:
        """One conditional rate for every draft position of ``key``: accepted
        over tried drafts (decayed), from the key's prior (or ``prior_rate``)."""
        if key is None:
            tried, hits, w = self.tried, self.hits, self.prior_weight
        else:
            tried, hits = self.keyed.get(key, ((), ()))
            w = self.key_weight
        prior = self.profile.key_priors.get(key, self.profile.prior_rate)
        prior = prior[1] if isinstance(prior, tuple) else prior
        return (sum(hits) + prior * w) / (sum(tried) + w)

    def knows(self, key: Hashable) -> bool:
        """Whether the profile declared a prior for ``key``."""
        return key in self.profile.key_priors

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        """Count one verify of ``drafted`` drafts that accepted ``accepted``
        (pooled and for ``key``), after decaying the older counts."""
        tables = [(self.tried, self.hits)]
        if key is not None:
            tables.append(self.keyed.setdefault(key, ([0.0] * self.k_max, [0.0] * self.k_max)))
        for tried, hits in tables:
            for i in range(self.k_max):
                tried[i] *= self.decay
                hits[i] *= self.decay
            for i in range(min(accepted + 1, drafted)):
                tried[i] += 1
                if i < accepted:
                    hits[i] += 1
