"""What a round costs, relative to a plain decode: measured from the rounds'
timings (``MeasuredCosts``), or the prior's (``PriorCosts``)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

from ..stats import Round
from .profile import DraftProfile

#: Committed tokens a drafter reads before a routine round's drafts (the last
#: round's bonus token and final draft); a round that read more caught up on
#: a stretch it did not draft, and its drafting time is not a per-draft cost.
MAX_ROUTINE_CATCH_UP = 2
#: A prefill of at least this many tokens times what one more token of a
#: wide forward costs (shorter ones mostly time the forward's fixed cost).
MIN_PREFILL_TOKENS = 64


@dataclass
class Timings:
    """What a Target's forwards cost: decayed sums of the seconds of rounds
    per forward width, and of what breaks of the decode pipeline cost beyond
    pipelined decodes. A Target keeps one per method, so each generation
    starts from what the earlier ones measured instead of from the prior."""

    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, float] = field(default_factory=dict)
    break_seconds: float = 0.0
    breaks: float = 0.0
    prefill_seconds: float = 0.0  # decayed sums over prefills of at least MIN_PREFILL_TOKENS
    prefill_tokens: float = 0.0


class CostModel(Protocol):
    """What adaptive K asks of costs (all relative to a plain decode)."""

    def costs(self) -> list[float]:
        """``cost(n)`` of a round feeding n = 0 .. k_max + 1 tokens (index n)."""
        ...

    def draft_cost(self, key: Hashable = None) -> float:
        """Drafting cost per draft token of ``key`` (split drafting)."""
        ...

    def excess(self) -> float:
        """Extra cost of a failed draft attempt."""
        ...

    def knows_decode(self) -> bool:
        """Whether a plain decode, the yardstick, has been timed."""
        ...

    def update(self, r: Round) -> None:
        """Learn from a finished round."""
        ...

    def prefilled(self, tokens: int, seconds: float) -> None:
        """Learn from a prefill of ``tokens`` tokens that took ``seconds``."""
        ...


class MeasuredCosts:
    """Round costs from the rounds' own wall times.

    A verify round costs ``c(K+1)``: its measured seconds relative to a
    pipelined decode; a width not measured yet costs the line between the
    measured widths around it (a decode costs 1), and past the widest one
    each more token costs the ``slope``: a prefill's seconds per token
    relative to a decode once one is timed (wide forwards of the same
    kernels), else the prior ``1 + prior_slope (L - 1)``'s shape through
    the widest (all of it when nothing is measured). To that comes the measured
    cost of restarting the decode pipeline: plain decodes overlap each other (the
    next one is queued while the current one runs), a verify round does not.
    The decodes around a break of the pipeline (the chain's last one, the
    restarted one, the first chained one after it) are timed together
    against as many pipelined decodes; what they cost extra is charged to
    every verify round.

    Split drafting (a draft model): a round's cost is the target forward's
    plus K times the drafting cost per token, measured per key
    (``profile.draft_cost_priors`` until measured), the decode time
    estimated from the measured widths until a plain decode measures it. A
    round whose drafter first caught up on more than
    ``MAX_ROUTINE_CATCH_UP`` committed tokens is no sample of drafting cost.
    """

    timed = True

    def __init__(self, k_max: int, profile: DraftProfile, timings: Timings | None = None, probe_k: int = 2):
        self.k_max, self.profile, self.probe_k = k_max, profile, probe_k
        self.timings = timings if timings is not None else Timings()
        self.probe_excess: float | None = (
            None  # decayed mean extra cost of a failed draft attempt, in decodes
        )
        self.draft_seconds: dict[Hashable, float] = {}  # key -> decayed sum of drafting seconds
        self.draft_tokens: dict[Hashable, float] = {}  # key -> decayed sum of drafted tokens
        self._break = [0.0, 0]  # seconds and decodes of the pipeline break in progress
        self._after_restart = False
        self._costs: tuple[tuple, list[float]] | None = None  # (the timings they were computed from, costs)

    # -- reading -----------------------------------------------------------
    def time(self, n: int) -> float | None:
        """Mean recent seconds of a round that feeds ``n`` tokens (pipelined
        decodes overlap, so single rounds are noisy; sums average them out)."""
        c = self.timings.counts.get(n)
        return self.timings.seconds[n] / c if c else None

    def knows_decode(self) -> bool:
        return self.time(1) is not None

    def prior_cost(self, n: int) -> float:
        return 1.0 + self.profile.prior_slope * (n - 1)

    def restart_cost(self) -> float:
        """What a break of the decode pipeline costs, relative to a pipelined
        decode (0 until measured, or untimed)."""
        t1 = self.time(1)
        b = self.timings
        if not (self.timed and t1 and b.breaks):
            return 0.0
        return max(0.0, b.break_seconds / b.breaks / t1)

    def decode_time(self) -> float | None:
        """Seconds of a plain decode: measured, or estimated from the
        narrowest measured verify width through the prior's shape (a first
        request that drafts from its first round times no decode for a while)."""
        t1 = self.time(1)
        if t1 is None:
            widths = [w for w, c in self.timings.counts.items() if c and w > 1]
            if widths:
                m = min(widths)
                t1 = self.time(m) / self.prior_cost(m)
        return t1

    def draft_cost(self, key: Hashable = None) -> float:
        """Drafting cost per draft token relative to a plain decode: measured
        for ``key``, else its prior, else measured over all keys, else 0."""
        if not self.profile.split_drafting:
            return 0.0
        priors = self.profile.draft_cost_priors
        t1 = self.decode_time() if self.timed else None
        tokens = self.draft_tokens.get(key)
        if t1 and tokens:
            return self.draft_seconds[key] / tokens / t1
        if key in priors:
            return priors[key]
        total = sum(self.draft_tokens.values())
        if t1 and total:
            return sum(self.draft_seconds.values()) / total / t1
        return priors.get(None, 0.0)

    def costs(self) -> list[float]:
        """``cost(n)`` for n = 0 .. k_max + 1 (index n); a verify (n >= 2)
        includes the pipeline restart it causes. Computed once per change of
        the timings (a round asks several times)."""
        key = self._timings_key()
        if self._costs is None or self._costs[0] != key:
            self._costs = (key, self._compute_costs())
        return self._costs[1]

    def _timings_key(self) -> tuple:
        tm = self.timings
        return (tm.break_seconds, tm.breaks, tm.prefill_seconds, tm.prefill_tokens,
                tuple(tm.seconds.items()), tuple(tm.counts.items()))  # fmt: skip

    def _compute_costs(self) -> list[float]:
        t1 = self.decode_time()
        counts = self.timings.counts
        measured = sorted(w for w, c in counts.items() if c and w > 1) if self.timed and t1 else []
        # timings are noisy; no forward costs less than a decode
        points = [(1, 1.0)] + [(w, max(1.0, self.time(w) / t1)) for w in measured]
        slope, restart = self._slope(t1), self.restart_cost()
        out, i = [1.0, 1.0], 0
        for n in range(2, self.k_max + 2):
            while i + 1 < len(points) and points[i + 1][0] <= n:
                i += 1
            a, ca = points[i]
            if i + 1 < len(points):  # between two measured widths
                b, cb = points[i + 1]
                c = ca + (cb - ca) * (n - a) / (b - a)
            elif slope is not None:  # past the widest: a prefilled token's share per token
                c = ca + slope * (n - a)
            else:  # past the widest, no prefill timed: the prior's shape through the widest
                c = ca * self.prior_cost(n) / self.prior_cost(a)
            out.append(c + restart)
        return out

    def slope(self) -> float | None:
        """What one more token of a wide forward costs, relative to a plain
        decode: a prefill's seconds per token (prefills of at least
        ``MIN_PREFILL_TOKENS``); None until one is timed."""
        return self._slope(self.decode_time())

    def _slope(self, t1: float | None) -> float | None:
        tm = self.timings
        if self.timed and t1 and tm.prefill_tokens:
            return tm.prefill_seconds / tm.prefill_tokens / t1
        return None

    def cost(self, n: int) -> float:
        """A round feeding ``n`` tokens relative to a plain decode."""
        return self.costs()[n] if n <= self.k_max + 1 else self.prior_cost(n)

    def excess(self) -> float:
        """Extra cost of a failed draft attempt in decodes: measured, else the
        prior's cost of a probe-sized verify."""
        if self.timed and self.probe_excess is not None:
            return self.probe_excess
        return self.prior_cost(self.probe_k + 1) - 1.0

    # -- learning ----------------------------------------------------------
    def prefilled(self, tokens: int, seconds: float) -> None:
        """Learn from a prefill: its seconds per token give the slope."""
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            tm = self.timings
            tm.prefill_seconds = 0.9 * tm.prefill_seconds + seconds
            tm.prefill_tokens = 0.9 * tm.prefill_tokens + tokens

    def update(self, r: Round) -> None:
        """Learn a finished round's cost: per forward width, or as part of a
        break of the decode pipeline (timed together until it is over)."""
        t1 = self.time(1)
        if not r.drafted and t1 and r.propose_seconds > 0.05 * t1:
            # drafts made (or tried) while a decode ran, catch-up included: what a probe costs
            self._note_excess(r.propose_seconds / t1)
        if r.drafted == 0 and (r.chain_end or r.restarted or self._after_restart):
            self._break[0] += r.cost_seconds - r.propose_seconds  # drafting is no break cost
            self._break[1] += 1
            self._after_restart = r.restarted
            return
        self._end_break(t1)
        seconds = r.cost_seconds
        # a proposer that first read many committed tokens (a draft model reading
        # the prompt or copied tokens) did one-off work: not a sample of drafting cost
        caught_up = r.catch_up > MAX_ROUTINE_CATCH_UP
        if self.profile.split_drafting and r.drafted:  # drafting is charged per draft token, per key
            seconds -= r.propose_seconds
            if not (caught_up or r.predrafted):  # drafts made (and timed) during a decode: no sample
                key = r.key
                self.draft_seconds[key] = 0.9 * self.draft_seconds.get(key, 0.0) + r.propose_seconds
                self.draft_tokens[key] = 0.9 * self.draft_tokens.get(key, 0.0) + r.drafted
        tm, width = self.timings, r.forward_tokens
        tm.seconds[width] = 0.9 * tm.seconds.get(width, 0.0) + seconds
        tm.counts[width] = 0.9 * tm.counts.get(width, 0.0) + 1.0
        t1 = self.time(1)
        if (
            t1 and r.drafted and not r.accepted and not caught_up
        ):  # a failed verify: drafting + the wider forward
            self._note_excess(r.cost_seconds / t1 - 1.0)

    def _end_break(self, t1: float | None) -> None:
        """The break in progress is over: what it cost beyond pipelined decodes."""
        if self._break[1] and t1:
            tm = self.timings
            tm.break_seconds = 0.9 * tm.break_seconds + self._break[0] - self._break[1] * t1
            tm.breaks = 0.9 * tm.breaks + 1.0
        self._break, self._after_restart = [0.0, 0], False

    def _note_excess(self, x: float) -> None:
        x = max(0.0, x)
        self.probe_excess = x if self.probe_excess is None else 0.7 * self.probe_excess + 0.3 * x


class PriorCosts(MeasuredCosts):
    """The prior's costs, whatever the rounds measure (which still go into the
    Target's timings): K then depends on acceptance alone, so seeded
    sampling with a draft model or layer skip repeats exactly (which random
    draws a position uses depends on whether it was drafted)."""

    timed = False
