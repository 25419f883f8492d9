"""Draft lengths for a batch: one verify width for all rows, priced by what a
batched forward costs.

A batched forward feeds every row the same number of positions (rows that
feed fewer are padded), so its cost depends on ``rows x width``, not on any
one row's drafts: within the width a row's drafts are free, past it every
row pays a column. The width chosen is the one with the most expected
tokens per second over the whole batch; each row's expected tokens come
from its own policy's acceptance rates for its draft key.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .policy import Policy
from .probes import ProbeSchedule

#: A wider batch must promise this much more than the best narrower one.
WIDER_MARGIN = 0.02


@dataclass
class BatchCosts:
    """What a batched forward costs by the positions it computes (rows x
    width): decayed mean seconds per size, learned from the batch's rounds;
    sizes not measured lie on the line between measured ones, past the
    largest on the slope of the last two (or ``slope`` decodes per
    position, the prior, until two sizes are measured)."""

    slope: float = 0.12
    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, float] = field(default_factory=dict)

    def update(self, positions: int, seconds: float) -> None:
        """A forward of ``positions`` took ``seconds``."""
        self.seconds[positions] = 0.9 * self.seconds.get(positions, 0.0) + seconds
        self.counts[positions] = 0.9 * self.counts.get(positions, 0.0) + 1.0

    def cost(self, positions: int) -> float:
        """The seconds of a forward of ``positions`` (relative units until measured)."""
        points = sorted((n, self.seconds[n] / c) for n, c in self.counts.items() if c > 0)
        if not points:
            return self._prior(positions)
        (a, ta) = points[0]
        if positions <= a or len(points) == 1:  # the prior's shape through the nearest measured size
            return ta * self._prior(positions) / self._prior(a)
        for (a, ta), (b, tb) in zip(points, points[1:]):
            if positions <= b:
                return ta + (tb - ta) * (positions - a) / (b - a)
        (a, ta), (b, tb) = points[-2], points[-1]
        return tb + max(0.0, (tb - ta) / (b - a)) * (positions - b)

    def _prior(self, positions: int) -> float:
        return 1.0 + self.slope * (positions - 1)


@dataclass
class Offer:
    """One row's drafts for the round: how many it has, and the chance that
    each prefix of them is accepted (``survival[j]``: the first j + 1)."""

    drafts: int
    survival: Sequence[float] = ()
    fixed: bool = False  # a fixed K: verify every draft


def offer(policy: Policy, key: Hashable, drafts: int) -> Offer:
    """A row's offer of ``drafts`` drafts of class ``key``, as its policy prices them."""
    rates = policy.survival(key, drafts)
    return Offer(drafts, fixed=True) if rates is None else Offer(drafts, rates)


def plan_width(offers: Sequence[Offer], costs: BatchCosts, step_cost: float = 0.0) -> int:
    """The verify width (drafts + 1) with the most expected tokens per second
    over the batch; rows with a fixed K get theirs verified whole.
    ``step_cost``: what each draft costs besides its column, as a share of a
    decode of the rows (a drafter that runs a forward per draft: layer skip)."""
    rows = len(offers)
    widest = max((o.drafts for o in offers), default=0) + 1
    floor = max((o.drafts + 1 for o in offers if o.fixed), default=1)
    best, best_rate = floor, -1.0
    for width in range(floor, widest + 1):
        tokens = sum(1.0 + sum(o.survival[: min(width - 1, o.drafts)]) for o in offers if not o.fixed)
        tokens += sum(1.0 + o.drafts for o in offers if o.fixed)
        rate = tokens / (costs.cost(rows * width) + (width - 1) * step_cost * costs.cost(rows))
        if rate > best_rate * (1.0 + WIDER_MARGIN):
            best, best_rate = width, rate
    return best


@dataclass
class DraftPlan:
    """How many drafts a batch drafter makes for its rows in a round (before
    the batch's planner picks the verify width from them): the width the
    rows' acceptance rates promise at the batch's ``costs`` (measured by the
    loop, or the prior until measured), each
    draft also costing ``step_cost`` decodes of the rows (a drafter that
    runs a forward per draft: layer skip; 0: one forward for any number,
    DFlash). When no draft pays, a short probe now and then
    (``ProbeSchedule``) keeps the rows' rates learning; rows with a fixed K
    get all theirs."""

    step_cost: float = 0.0
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)
    costs: BatchCosts = field(default_factory=BatchCosts)
    probing: bool = False

    def drafts(self, offers: Sequence[Offer]) -> int:
        n = plan_width(offers, self.costs, self.step_cost) - 1
        if self.probing:
            self.probes.probed(n > 0, self.probes.probe_k * self.step_cost)
            self.probing = False
        if n > 0:
            return n
        self.probes.tick()
        if not self.probes.due():
            return 0
        self.probing = True
        return min(self.probes.probe_k, max((o.drafts for o in offers), default=0))
