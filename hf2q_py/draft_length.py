"""How many tokens to draft each round: a fixed K, or an adaptive K chosen
from measured acceptance and measured verify cost."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Hashable

from .stats import Round
from .validate import check_int


#: The largest draft length per round (``--k``): a verify forward feeds K + 1
#: tokens, and no proposer's drafts stay right for longer than this.
MAX_K = 256

#: The longest wait between probes of a proposer whose drafts keep failing.
MAX_COOLDOWN = 4096

#: Committed tokens a drafter reads before a routine round's drafts (the last
#: round's bonus token and final draft); a round that read more caught up on
#: a stretch it did not draft, and its drafting time is not a per-draft cost.
MAX_ROUTINE_CATCH_UP = 2


def validate_k(k: int) -> None:
    check_int("k (draft length)", k, 1, MAX_K)


class NoDrafts:
    """Plain decoding: K is always 0."""

    k_max = 0

    def next_k(self, key: Hashable = None) -> int:
        return 0

    def update(self, r: Round) -> None:
        pass

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
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

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        pass


@dataclass
class Timings:
    """What a Target's forwards cost, as adaptive K measures them: decayed
    sums of the seconds of rounds per forward width, and of what breaks of
    the decode pipeline cost beyond pipelined decodes. A Target keeps one
    per method (in ``target.remembered``), so each generation starts from
    what the earlier ones measured instead of from the prior."""

    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, float] = field(default_factory=dict)
    break_seconds: float = 0.0
    breaks: float = 0.0


@dataclass
class AdaptiveK:
    """Chooses K in [0, k_max] to maximise expected tokens per second.

    Acceptance is tracked per draft position as a conditional rate
    ``a_i = P(draft i accepted | drafts before it accepted)``, with decay, so
    bursty proposers (an n-gram match is usually right for many tokens or
    not at all) are modelled as they behave. K drafts then yield
    ``1 + sum_{i<=K} prod_{j<=i} a_j`` tokens per round at a cost ``c(K+1)``:
    the measured wall time of a round that feeds K+1 tokens relative to a
    plain decode round (a prior until measured), plus the measured cost of
    restarting the decode pipeline: plain decodes overlap each other (the
    next one is queued while the current one runs), a verify round does
    not. The decodes around a break of the pipeline (the chain's last one,
    the restarted one, the first chained one after it) are timed together
    against as many pipelined decodes; what they cost extra is charged to
    every verify round. On a small CPU model a break costs about one
    decode, so a draft that saves less than that does not pay. K = 0 means plain
    decoding; then a short probe round runs after a cool-down that doubles
    while probes keep failing, so a workload where drafts never pay runs at
    plain-decoding speed; drafts that could not pay even if every one were
    accepted (a draft model as dear as its target) are not probed. Until a
    pipelined decode is timed (the yardstick
    of every cost), costs are the prior's, so the first round may draft.

    Proposers that know something about their drafts before drafting (the
    n-gram match depth) pass it as ``key``: each key keeps its own
    conditional rates, with the pooled rates as a prior of weight
    ``key_weight``, so a new key starts from what is known overall; or, for
    keys in ``key_priors``, from the proposer's own prior rate for that key
    (e.g. measured acceptance per n-gram match depth): one rate for every
    draft position, or a pair (first position, later positions).

    ``split_drafting`` (proposers whose drafting costs time per token, like a
    draft model): a round's cost is the target forward's, measured per width,
    plus K times the drafting cost per token, measured per key
    (``draft_cost_priors``: key -> cost per token relative to a plain decode,
    until measured), with the decode time estimated from the measured widths
    until a plain decode measures it. A round whose drafter first caught up
    on more than ``MAX_ROUTINE_CATCH_UP`` committed tokens (a draft model
    reading the prompt lazily, or tokens copied without it) is no sample of
    drafting cost: one such round would otherwise price the draft model out.

    Keys in ``geometric_keys`` (autoregressive drafters: a draft model)
    share one conditional rate across draft positions, estimated from every
    position tried: one rejected late draft then lowers K a little instead
    of pinning it below that position until the evidence decays.

    ``timed=False`` replaces measured costs by the prior model, so K depends
    only on acceptance: seeded sampling with a draft model or layer skip
    then repeats exactly (which random draws a position uses depends on
    whether it was drafted).
    """

    k_max: int
    decay: float = 0.9
    prior_rate: float = 0.5
    prior_weight: float = 1.0
    prior_slope: float = 0.12  # c(L) = 1 + slope * (L - 1) until measured
    key_weight: float = 1.0
    timed: bool = True
    probe_k: int = 2
    min_cooldown: int = 8
    max_cooldown: int = 128  # the doubling's cap; a costly probe may wait longer (see probe_budget)
    probe_budget: float = 0.015  # the share of decode time failed probes may cost
    probe_excess: float | None = None  # decayed mean extra cost of a failed draft attempt, in decodes
    timings: Timings = field(default_factory=Timings)  # round costs per width, pipeline breaks
    cooldown: int = 8
    since_probe: int = 0
    key_priors: dict = field(default_factory=dict)  # key -> prior rate, or (first, later)
    split_drafting: bool = False  # charge drafting per draft token and key (a draft model)
    draft_cost_priors: dict = field(default_factory=dict)  # key -> drafting cost per token / decode
    draft_seconds: dict = field(default_factory=dict)  # key -> decayed sum of drafting seconds
    draft_tokens: dict = field(default_factory=dict)  # key -> decayed sum of drafted tokens
    geometric_keys: frozenset = frozenset()  # keys whose draft positions share one rate
    longer_margin: float = 0.02  # a longer K must promise this much more to be chosen

    def __post_init__(self):
        validate_k(self.k_max)
        self.tried = [0.0] * self.k_max
        self.hits = [0.0] * self.k_max
        self.keyed: dict[Hashable, tuple[list[float], list[float]]] = {}  # key -> (tried, hits)
        self._break: list = [0.0, 0]  # seconds and decodes of the pipeline break in progress
        self._after_restart = False

    def rates(self, key: Hashable = None) -> list[float]:
        """Conditional acceptance estimate at every draft position; a position
        barely tried yet borrows the (pooled) estimate of the one before."""
        if key in self.geometric_keys:
            return [self._geometric_rate(key)] * self.k_max
        pooled: list[float] = []
        w = self.prior_weight
        for i in range(self.k_max):
            prior = self.prior_rate if i == 0 or self.tried[i] >= 0.5 else pooled[i - 1]
            pooled.append((self.hits[i] + prior * w) / (self.tried[i] + w))
        if key is None:
            return pooled
        prior = self.key_priors.get(key)
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
        prior = self.key_priors.get(key, self.prior_rate)
        prior = prior[1] if isinstance(prior, tuple) else prior
        return (sum(hits) + prior * w) / (sum(tried) + w)

    def rate(self, i: int, key: Hashable = None) -> float:
        """Conditional acceptance estimate at draft position ``i`` (0-based)."""
        return self.rates(key)[i]

    def time(self, n: int) -> float | None:
        """Mean recent seconds of a round that feeds ``n`` tokens (pipelined
        decodes overlap, so single rounds are noisy; sums average them out)."""
        c = self.timings.counts.get(n)
        return self.timings.seconds[n] / c if c else None

    def prior_cost(self, n: int) -> float:
        return 1.0 + self.prior_slope * (n - 1)

    def restart_cost(self) -> float:
        """What a break of the decode pipeline costs, relative to a pipelined
        decode (0 until measured, or untimed)."""
        t1 = self.time(1)
        b = self.timings
        if not (self.timed and t1 and b.breaks):
            return 0.0
        return max(0.0, b.break_seconds / b.breaks / t1)

    def decode_time(self) -> float | None:
        """Seconds of a plain decode: measured, or (``split_drafting``) estimated
        from the nearest measured verify width through the prior's shape."""
        t1 = self.time(1)
        if t1 is None and self.split_drafting:
            widths = [w for w, c in self.timings.counts.items() if c and w > 1]
            if widths:
                m = min(widths)
                t1 = self.time(m) / self.prior_cost(m)
        return t1

    def draft_cost(self, key: Hashable = None) -> float:
        """Drafting cost per draft token relative to a plain decode (``split_drafting``):
        measured for ``key``, else its prior, else measured over all keys, else 0."""
        t1 = self.decode_time() if self.timed else None
        tokens = self.draft_tokens.get(key)
        if t1 and tokens:
            return self.draft_seconds[key] / tokens / t1
        if key in self.draft_cost_priors:
            return self.draft_cost_priors[key]
        total = sum(self.draft_tokens.values())
        if t1 and total:
            return sum(self.draft_seconds.values()) / total / t1
        return self.draft_cost_priors.get(None, 0.0)

    def costs(self) -> list[float]:
        """``cost(n)`` for n = 0 .. k_max + 1 (index n); a verify (n >= 2)
        includes the pipeline restart it causes."""
        t1 = self.decode_time()
        counts = self.timings.counts
        measured = sorted(w for w, c in counts.items() if c and w > 1) if self.timed and t1 else []
        restart = self.restart_cost()
        out = [1.0, 1.0]
        for n in range(2, self.k_max + 2):
            tn = self.time(n) if measured else None
            if tn:
                c = max(1.0, tn / t1)  # timings are noisy; more tokens never cost less
            elif measured:  # the prior's shape through the nearest measured width
                m = min(measured, key=lambda w: abs(w - n))
                c = max(1.0, self.time(m) / t1 * self.prior_cost(n) / self.prior_cost(m))
            else:
                c = self.prior_cost(n)
            out.append(c + restart)
        return out

    def cost(self, n: int) -> float:
        """A round feeding ``n`` tokens relative to a plain decode: measured,
        else the prior model scaled through the nearest measured width."""
        return self.costs()[n] if n <= self.k_max + 1 else self.prior_cost(n)

    def best_k(self, key: Hashable = None) -> int:
        """The K with the highest expected tokens per unit cost (linear in k_max);
        a longer K must beat the best shorter one by ``longer_margin``."""
        best, best_rate = 0, 1.0
        total, p = 1.0, 1.0
        costs = self.costs()
        per_draft = self.draft_cost(key) if self.split_drafting else 0.0
        for k, r in enumerate(self.rates(key), start=1):
            p *= r
            total += p
            rate = total / (costs[k + 1] + k * per_draft)
            if rate > best_rate * (1.0 + self.longer_margin):
                best, best_rate = k, rate
        return best

    def excess(self) -> float:
        """Extra cost of a failed draft attempt in decodes: measured, else the
        prior's cost of a probe-sized verify."""
        if self.timed and self.probe_excess is not None:
            return self.probe_excess
        return self.prior_cost(self.probe_k + 1) - 1.0

    def next_k(self, key: Hashable = None) -> int:
        if self.time(1) is None and not self.split_drafting and key not in self.key_priors:
            return 0  # nothing known about these drafts yet: first time a plain decode
        k = self.best_k(key)  # until a pipelined decode is timed, from the prior costs
        if k > 0:
            return k
        if self.since_probe >= self.cooldown and self.could_pay(key):
            return min(self.probe_k, self.k_max)
        return 0

    def could_pay(self, key: Hashable = None) -> bool:
        """Whether drafts of ``key`` would beat plain decoding if every one were
        accepted, at the current costs. A draft model as dear as its target
        (a model drafting for itself) could not: it is never probed, since a
        probe then costs drafting (and the draft model's catch-up) for nothing."""
        costs = self.costs()
        per_draft = self.draft_cost(key) if self.split_drafting else 0.0
        return any((k + 1) / (costs[k + 1] + k * per_draft) > 1.0 for k in range(1, self.k_max + 1))

    def update(self, r: Round) -> None:
        """Learn from a finished round: its cost per forward width, or as part
        of a break of the decode pipeline (a chain's last decode, a restarted
        one, the first chained one after it: timed together), and, when it
        drafted, the acceptance per draft position (pooled and for ``r.key``)."""
        width, key, drafted, accepted = r.forward_tokens, r.key, r.drafted, r.accepted
        t1 = self.time(1)
        if not drafted and t1 and r.propose_seconds > 0.05 * t1:
            # drafts made (or tried) while a decode ran, catch-up included: what a probe costs
            self._note_excess(r.propose_seconds / t1)
        if drafted == 0 and (r.chain_end or r.restarted or self._after_restart):
            self._break[0] += r.cost_seconds - r.propose_seconds  # drafting is no break cost
            self._break[1] += 1
            self._after_restart = r.restarted
            self.since_probe += 1
            return
        if self._break[1] and t1:  # the break is over: what it cost beyond pipelined decodes
            tm = self.timings
            tm.break_seconds = 0.9 * tm.break_seconds + self._break[0] - self._break[1] * t1
            tm.breaks = 0.9 * tm.breaks + 1.0
        self._break, self._after_restart = [0.0, 0], False
        seconds = r.cost_seconds
        # a proposer that first read many committed tokens (a draft model reading
        # the prompt or copied tokens) did one-off work: not a sample of drafting cost
        caught_up = r.catch_up > MAX_ROUTINE_CATCH_UP
        if self.split_drafting and drafted:  # drafting is charged per draft token, per key
            seconds -= r.propose_seconds
            if not (caught_up or r.predrafted):  # drafts made (and timed) during a decode: no sample
                self.draft_seconds[key] = 0.9 * self.draft_seconds.get(key, 0.0) + r.propose_seconds
                self.draft_tokens[key] = 0.9 * self.draft_tokens.get(key, 0.0) + drafted
        tm = self.timings
        tm.seconds[width] = 0.9 * tm.seconds.get(width, 0.0) + seconds
        tm.counts[width] = 0.9 * tm.counts.get(width, 0.0) + 1.0
        t1 = self.time(1)
        if t1 and drafted and not accepted and not caught_up:  # a failed verify: drafting + the wider forward
            self._note_excess(r.cost_seconds / t1 - 1.0)
        if drafted == 0:
            self.since_probe += 1
            return
        self.observe(drafted, accepted, key)

    def _note_excess(self, x: float) -> None:
        x = max(0.0, x)
        self.probe_excess = x if self.probe_excess is None else 0.7 * self.probe_excess + 0.3 * x

    def observe(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        """Acceptance alone, without a timed round: e.g. drafts proposed while
        a plain decode ran, whose first token that decode already rejected."""
        probing = self.best_k(key) == 0
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
        if probing:
            self.since_probe = 0
            if self.best_k(key) == 0:
                floor = math.ceil(self.excess() / self.probe_budget)
                self.cooldown = max(min(self.cooldown * 2, self.max_cooldown), min(floor, MAX_COOLDOWN))
            else:
                self.cooldown = self.min_cooldown
