"""Adaptive K: the draft length that maximises expected tokens per second."""

from __future__ import annotations

from collections.abc import Hashable

from ..stats import Round
from .acceptance import Acceptance
from .costs import MeasuredCosts, PriorCosts, Timings
from .policy import validate_k
from .probes import ProbeSchedule
from .profile import DraftProfile


class AdaptiveK:
    """Chooses K in [0, k_max] to maximise expected tokens per unit cost.

    K drafts yield ``1 + sum_{i<=K} prod_{j<=i} a_i`` tokens per round (the
    ``Acceptance`` rates) at a cost of ``c(K+1) + K d`` decodes (the
    ``CostModel``: the verify's cost, pipeline restart included, and the
    drafting cost per token for split drafting). K = 0 means plain
    decoding; then the ``ProbeSchedule`` decides when a short probe runs,
    so a workload where drafts never pay runs at plain-decoding speed.
    Drafts that could not pay even if every one were accepted (a draft
    model as dear as its target) are not probed. Until a plain decode is
    timed, costs are the prior's, and drafts of a key the profile declared
    no prior for wait for that first decode.
    """

    def __init__(
        self,
        k_max: int,
        profile: DraftProfile | None = None,
        *,
        timings: Timings | None = None,
        timed: bool = True,
    ):
        validate_k(k_max)
        self.k_max = k_max
        self.profile = profile or DraftProfile()
        self.probes = ProbeSchedule()
        self.acceptance = Acceptance(k_max, self.profile)
        costs = MeasuredCosts if timed else PriorCosts
        self.cost_model = costs(k_max, self.profile, timings, probe_k=self.probes.probe_k)

    def next_k(self, key: Hashable = None) -> int:
        split = self.profile.split_drafting
        if not (self.cost_model.knows_decode() or split or self.acceptance.knows(key)):
            return 0  # nothing known about these drafts yet: first time a plain decode
        k = self.best_k(key)  # until a pipelined decode is timed, from the prior costs
        if k > 0:
            return k
        if self.probes.due() and self.could_pay(key):
            return min(self.probes.probe_k, self.k_max)
        return 0

    def best_k(self, key: Hashable = None) -> int:
        """The K with the highest expected tokens per unit cost (linear in k_max);
        a longer K must beat the best shorter one by ``longer_margin``."""
        best, best_rate = 0, 1.0
        total, p = 1.0, 1.0
        costs = self.cost_model.costs()
        per_draft = self.cost_model.draft_cost(key)
        margin = 1.0 + self.profile.longer_margin
        for k, r in enumerate(self.acceptance.rates(key), start=1):
            p *= r
            total += p
            rate = total / (costs[k + 1] + k * per_draft)
            if rate > best_rate * margin:
                best, best_rate = k, rate
        return best

    def could_pay(self, key: Hashable = None) -> bool:
        """Whether drafts of ``key`` would beat plain decoding if every one were
        accepted, at the current costs. A draft model as dear as its target
        (a model drafting for itself) could not: it is never probed, since a
        probe then costs drafting (and the draft model's catch-up) for nothing."""
        costs = self.cost_model.costs()
        per_draft = self.cost_model.draft_cost(key)
        return any((k + 1) / (costs[k + 1] + k * per_draft) > 1.0 for k in range(1, self.k_max + 1))

    def update(self, r: Round) -> None:
        """Learn from a finished round: its cost, then the acceptance of its
        drafts (and of drafts made while it decoded that its token rejected)."""
        self.cost_model.update(r)
        self.observe(r.drafted, r.accepted, r.key)
        if r.early_rejected:
            self.observe(r.early_rejected, 0, r.early_key)

    def batch_k(self, key: Hashable = None) -> int:
        """In a batch every draft up to ``k_max`` is offered: the batch's planner
        prices the width from the rates (``survival``) and the batch's costs.
        Untimed (seeded sampling with drafts drawn from distributions), K is
        the one ``next_k`` gives alone, verified whole (``survival`` None): a
        batch's timings must not decide which positions are drafted."""
        return self.k_max if self.cost_model.timed else self.next_k(key)

    def survival(self, key: Hashable, n: int) -> list[float] | None:
        if not self.cost_model.timed:
            return None
        out, p = [], 1.0
        for r in self.acceptance.rates(key)[:n]:
            p *= r
            out.append(p)
        return out

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill's time per token: what wide verifies cost (``CostModel``)."""
        self.cost_model.prefilled(tokens, seconds)

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        """Acceptance alone, without a timed round (no drafts: one more round
        towards the next probe); a probe's outcome sets the next cool-down."""
        if not drafted:
            self.probes.tick()
            return
        probing = self.best_k(key) == 0
        self.acceptance.observe(drafted, accepted, key)
        if probing:
            self.probes.probed(self.best_k(key) > 0, self.cost_model.excess())
