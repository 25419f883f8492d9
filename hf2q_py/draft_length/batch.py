"""Draft lengths for a batch: the verify forwards of a round (one width for
all rows, or two groups of rows at two widths), priced by what a batched
forward costs, and how many steps a batch drafter takes.

A batched forward feeds the rows it computes the same number of positions
(rows that feed fewer are padded), so its cost depends on ``rows x width``,
not on any one row's drafts: within the width a row's drafts are free, past
it every row pays a column. The width chosen is the one with the most
expected tokens per second over the whole batch; each row's expected
tokens come from its own policy's acceptance rates for its draft key.
Where a forward computes only the rows it feeds (``BatchRuntime.ragged``),
:func:`plan_verify` may split the round in two forwards instead: the rows
that expect the most tokens (a long copied run) at their width, the others
at theirs, when the second forward's fixed cost buys more than the padding
it saves.

Rows whose drafts a batch drafter makes with forwards of its own (a draft
model) pay for them before the width is chosen: K draft steps of the
drafter's batched forward, and the committed tokens its rows have not read
yet (:class:`CatchUpCosts`). :func:`plan_steps` chooses K with the same
measure, the round costing those and the verify forwards that follow.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from .policy import Policy
from .probes import ProbeSchedule

#: A wider batch (or one more draft step) must promise this much more than the best narrower one.
WIDER_MARGIN = 0.02
#: Two verify forwards must promise this much more than one.
SPLIT_MARGIN = 0.05


@dataclass
class BatchCosts:
    """What a batched forward costs by the positions it computes (rows x
    width): decayed mean seconds per size, learned from the batch's rounds;
    sizes not measured lie on the line between measured ones, past the
    largest on the least slope between them (a hopeful guess, which the
    first round of that size corrects; ``slope`` decodes per position, the
    prior, until two sizes are measured).

    A forward's cost grows ever faster with its positions (flat while the
    weights' reads dominate, then in proportion once compute does), so the
    curve is the lower convex hull of the measured sizes: a size measured
    dearer than its neighbours' line (a round that also waited for other
    work) is not believed, and cannot keep the planner from the sizes
    around it, which it would then never measure again."""

    slope: float = 0.12
    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._points: list[tuple[int, float]] | None = None
        self._curve = np.zeros(0)  # costs by size (``curve``), until the next update

    @property
    def measured(self) -> bool:
        """Whether a forward was timed (costs are seconds, else relative units)."""
        return bool(self.counts)

    def update(self, positions: int, seconds: float) -> None:
        """A forward of ``positions`` took ``seconds``."""
        self.seconds[positions] = 0.9 * self.seconds.get(positions, 0.0) + seconds
        self.counts[positions] = 0.9 * self.counts.get(positions, 0.0) + 1.0
        self._points = None
        self._curve = np.zeros(0)

    def points(self) -> list[tuple[int, float]]:
        """The measured sizes and their mean seconds on the curve's lower convex hull, by size."""
        if self._points is None:
            self._points = _lower_hull(
                sorted((n, self.seconds[n] / c) for n, c in self.counts.items() if c > 0)
            )
        return self._points

    def curve(self, n: int) -> np.ndarray:
        """The costs of forwards of 1 .. ``n`` positions (index: positions - 1)."""
        if len(self._curve) < n:
            self._curve = np.array([self.cost(i) for i in range(1, n + 1)])
        return self._curve[:n]

    def cost(self, positions: int) -> float:
        """The seconds of a forward of ``positions`` (relative units until measured)."""
        points = self.points()
        if not points:
            return self._prior(positions)
        (a, ta) = points[0]
        if positions <= a or len(points) == 1:  # the prior's shape through the nearest measured size
            return ta * self._prior(positions) / self._prior(a)
        for (a, ta), (b, tb) in zip(points, points[1:]):
            if positions <= b:
                return ta + (tb - ta) * (positions - a) / (b - a)
        (a, ta), (b, tb) = points[0], points[1]  # the hull's least slope, past the largest size
        return points[-1][1] + max(0.0, (tb - ta) / (b - a)) * (positions - points[-1][0])

    def _prior(self, positions: int) -> float:
        return 1.0 + self.slope * (positions - 1)


def _lower_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points (sorted by size) on their lower convex hull."""
    hull: list[tuple[int, float]] = []
    for n, t in points:
        while len(hull) > 1:
            (a, ta), (b, tb) = hull[-2], hull[-1]
            if (tb - ta) * (n - a) < (t - ta) * (b - a):  # b lies below the line from a to n
                break
            hull.pop()
        hull.append((n, t))
    return hull


@dataclass
class StepCosts:
    """What one step of a batch drafter costs (one batched forward of its
    model over its rows): decayed mean seconds by rows, measured from the
    steps it read; scaled to other row counts along the batch's own cost
    curve; until measured, ``ratio`` times the batch's forward of as many
    positions (a draft model's weights against the target's)."""

    ratio: float = 0.0
    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, float] = field(default_factory=dict)

    def update(self, rows: int, seconds: float) -> None:
        """One step over ``rows`` rows took ``seconds`` (a mean over several)."""
        self.seconds[rows] = 0.9 * self.seconds.get(rows, 0.0) + seconds
        self.counts[rows] = 0.9 * self.counts.get(rows, 0.0) + 1.0

    def price(self, rows: int, costs: BatchCosts) -> float:
        """A step over ``rows`` rows in ``costs``' units (seconds once both are measured)."""
        measured = {n: self.seconds[n] / c for n, c in self.counts.items() if c > 0}
        if not measured or not costs.measured:
            return self.ratio * costs.cost(rows)
        near = min(measured, key=lambda n: (abs(n - rows), n))
        return measured[near] * costs.cost(rows) / costs.cost(near)


@dataclass
class CatchUpCosts:
    """What a draft model's catch-up costs (the committed tokens its rows
    read before they draft: a lazily read prompt, copied runs, accepted
    drafts): decayed mean seconds per token, measured from the rounds it
    drafted; until then one forward over them, priced from a step as the
    target batch's forward of as many positions is from a decode."""

    seconds: float = 0.0
    tokens: float = 0.0

    def update(self, tokens: int, seconds: float) -> None:
        """Reading ``tokens`` took ``seconds``."""
        self.seconds = 0.9 * self.seconds + seconds
        self.tokens = 0.9 * self.tokens + tokens

    def price(self, tokens: int, step: float, costs: BatchCosts) -> float:
        """Reading ``tokens``, a step costing ``step`` (seconds once measured)."""
        if self.tokens > 0:
            return tokens * self.seconds / self.tokens
        return step * costs.cost(tokens) / costs.cost(1) if tokens else 0.0


@dataclass
class Offer:
    """One row's drafts for the round: how many it has, and the chance that
    each prefix of them is accepted (``survival[j]``: the first j + 1)."""

    drafts: int
    survival: Sequence[float] = ()
    fixed: bool = False  # a fixed K: verify every draft

    def head(self, n: int) -> Offer:
        """Its first ``n`` drafts."""
        return Offer(min(self.drafts, n), self.survival[:n], self.fixed)

    def expected(self) -> list[float]:
        """Expected tokens from verifying its first 0, 1, ... drafts (index j: j drafts)."""
        return list(accumulate(self.survival[: self.drafts], initial=1.0))


def offer(policy: Policy, key: Hashable, drafts: int) -> Offer:
    """A row's offer of ``drafts`` drafts of class ``key``, as its policy prices them."""
    rates = policy.survival(key, drafts)
    return Offer(drafts, fixed=True) if rates is None else Offer(drafts, rates)


@dataclass(frozen=True)
class Verify:
    """One verify forward of a round: the rows it feeds (indices into the
    round's offers) and its width."""

    rows: tuple[int, ...]
    width: int


def plan_verify(offers: Sequence[Offer], costs: BatchCosts, ragged: bool = False) -> list[Verify]:
    """The round's verify forwards: one for every row, at the width with the
    most expected tokens per second over the batch (rows with a fixed K get
    theirs verified whole); or, where a forward computes only the rows it feeds
    (``ragged``), two when they promise ``SPLIT_MARGIN`` more expected
    tokens per second: the rows that expect the most tokens in one, the
    rest in the other, each at its own width (a row copying a long run is
    then not verified as narrowly as rows with few drafts, nor do they pay
    for its width)."""
    return _best_plan(offers, costs, 0.0, ragged)[0]


def _best_plan(
    offers: Sequence[Offer], costs: BatchCosts, extra: float, ragged: bool
) -> tuple[list[Verify], float]:
    """The best verify forwards and their expected tokens per second, the
    round costing ``extra`` besides them."""
    if not offers:
        return [Verify((), 1)], 0.0
    widest = max(o.drafts for o in offers) + 1
    tokens = np.array([_tokens_by_width(o, widest) for o in offers])  # (rows, widths)
    cost = costs.curve(len(offers) * widest)  # index: positions - 1
    width, rate = _best_width(tokens, cost, extra)
    plan = [Verify(tuple(range(len(offers))), width)]
    if not ragged or len(offers) < 2:
        return plan, rate
    split = _best_split(tokens, cost, extra)
    if split[1] > rate * (1.0 + SPLIT_MARGIN):
        return split
    return plan, rate


def _best_split(tokens: np.ndarray, cost: np.ndarray, extra: float) -> tuple[list[Verify], float]:
    """The best two verify forwards, the rows (of ``tokens``: expected tokens
    by width) ordered by the tokens they expect at most and split in two
    runs, and their tokens per second: every split and pair of widths priced at once."""
    rows, widest = tokens.shape
    order = np.argsort(-tokens.max(axis=1), kind="stable")
    finite = np.maximum(tokens[order], -1e9)  # a fixed K's -inf, kept finite for the sums
    wide = np.cumsum(finite, axis=0)[:-1]  # (splits, widths): the tokens of the first s + 1 rows
    narrow = finite.sum(axis=0) - wide
    counts, widths = np.arange(1, rows)[:, None], np.arange(1, widest + 1)[None, :]
    ca, cb = cost[counts * widths - 1], cost[(rows - counts) * widths - 1]
    rates = (wide[:, :, None] + narrow[:, None, :]) / (ca[:, :, None] + cb[:, None, :] + extra)
    s, i, j = np.unravel_index(np.argmax(rates), rates.shape)
    groups = (tuple(sorted(int(r) for r in order[: s + 1])), tuple(sorted(int(r) for r in order[s + 1 :])))
    return [Verify(groups[0], int(i) + 1), Verify(groups[1], int(j) + 1)], float(rates[s, i, j])


def _tokens_by_width(offer: Offer, widest: int) -> np.ndarray:
    """A row's expected tokens by verify width 1 .. ``widest`` (a fixed K: -inf
    below its whole drafts' width)."""
    widths = np.arange(1, widest + 1)
    if offer.fixed:
        return np.where(widths <= offer.drafts, -np.inf, 1.0 + offer.drafts)
    curve = np.asarray(offer.expected())
    return curve[np.minimum(widths, len(curve)) - 1]


def _best_width(tokens: np.ndarray, cost: np.ndarray, extra: float) -> tuple[int, float]:
    """The best width for every row (``tokens``: their expected tokens by
    width; rows with a fixed K verified whole) and its expected tokens per
    second, the round costing ``extra`` besides its forward; a wider width
    must promise ``WIDER_MARGIN`` more."""
    rows, widest = tokens.shape
    rates = tokens.sum(axis=0) / (cost[rows * np.arange(1, widest + 1) - 1] + extra)
    best, best_rate = 1, -1.0
    for width, rate in enumerate(rates.tolist(), start=1):
        if rate > best_rate * (1.0 + WIDER_MARGIN):
            best, best_rate = width, rate
    return best, best_rate


def plan_steps(
    drafted: Sequence[Offer],
    others: Sequence[Offer],
    costs: BatchCosts,
    step: float,
    ragged: bool = False,
    start: float = 0.0,
    idle: Sequence[Offer] | None = None,
) -> int:
    """How many steps a batch drafter takes for the rows it drafts for
    (``drafted``: what each asks for; each gets at most that many): the K
    whose round promises the most expected tokens per second over the batch,
    the round costing K steps of ``step`` (in ``costs``' units), ``start``
    if K > 0 (a draft model's catch-up) and the verify forwards
    :func:`plan_verify` would choose for those rows' first K drafts and the
    ``others``' drafts; at K = 0 the rows offer ``idle`` instead (drafts they
    make without the drafter: shallow copies; default none). Rows with a
    fixed K get theirs whole."""
    most = max((o.drafts for o in drafted), default=0)
    best = max((o.drafts for o in drafted if o.fixed), default=0)
    best_rate = -1.0
    for k in range(best, most + 1):
        extra = k * step + (start if k else 0.0)
        rows = [o.head(k) for o in drafted] if k or idle is None else list(idle)
        _, rate = _best_plan(rows + list(others), costs, extra, ragged)
        if rate > best_rate * (1.0 + WIDER_MARGIN):
            best, best_rate = k, rate
    return best


@dataclass
class Pricing:
    """The rest of a batched round, for a batch drafter choosing its steps
    (:class:`DraftPlan`, at the costs of the batch it was made for): the
    offers of the rows it does not draft for."""

    others: list[Offer] = field(default_factory=list)
    #: Measured seconds as every rank of a sharded target decides from them
    #: (rank 0's); the identity when the target is whole.
    agree: Callable[[list[float]], list[float]] = lambda values: list(values)


@dataclass
class DraftPlan:
    """How many drafts a batch drafter makes for its rows in a round (before
    the batch's planner picks the verify width from them): the number of
    steps :func:`plan_steps` finds best at the batch's ``costs`` (measured by
    the loop, or the prior until measured), each step costing ``step_cost``
    decodes of the batch's rows (a drafter that runs a forward per draft:
    layer skip; 0: one forward drafts any number, DFlash) unless the drafter
    prices its steps itself (a draft model). When no draft pays, a short
    probe now and then (``ProbeSchedule``) keeps the rows' rates and the
    steps' price measured, unless what drafting at all costs first (a draft
    model's catch-up: a prompt it has not read) exceeds the probe's steps;
    rows with a fixed K get all theirs."""

    step_cost: float = 0.0
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)
    costs: BatchCosts = field(default_factory=BatchCosts)
    probing: bool = False
    ragged: bool = False  # the batch's forwards compute only the rows they feed (``BatchRuntime.ragged``)

    def drafts(
        self,
        offers: Sequence[Offer],
        others: Sequence[Offer] = (),
        step: float | None = None,
        start: float = 0.0,
        idle: Sequence[Offer] | None = None,
    ) -> int:
        """Steps to draft for ``offers`` beside the batch's ``others``;
        ``step``: what one costs in ``costs``' units (default: ``step_cost``
        decodes of the rows a step computes); ``start``: what drafting at
        all costs besides (a draft model's catch-up); ``idle``: what the
        rows offer if it drafts nothing (:func:`plan_steps`)."""
        decode = self.costs.cost(len(offers) + (0 if self.ragged else len(others)))
        step = self.step_cost * decode if step is None else step
        n = plan_steps(offers, others, self.costs, step, self.ragged, start, idle)
        probe = self.probes.probe_k * step
        if self.probing:
            self.probes.probed(n > 0, (probe + start) / decode)
            self.probing = False
        if n > 0:
            return n
        self.probes.tick()
        if not self.probes.due() or start > probe:  # a probe that would mostly pay for a catch-up waits
            return 0
        self.probing = True
        return min(self.probes.probe_k, max((o.drafts for o in offers), default=0))
