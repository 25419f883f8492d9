"""Draft-model drafting for many batch rows at once: one batched forward of
the draft model per draft step for every row drafting with it, in caches of
its own with per-row rollback.

A row's draft cache (its ``DraftModelProposer``'s runtime, with the
``cached``/``synced`` bookkeeping that stays with the proposer) moves in
when its generation joins the target's batch, and out, as a single runtime
again, when the generation goes on alone. A round (:meth:`DraftBatch.propose`):
each row's cache is trimmed to its longest prefix of the committed tokens;
a row with a long catch-up (the lazy prefill, a run of copied tokens) reads
all but its last token alone, on a runtime of its own; one batched forward
feeds every row its unseen committed tokens (right-padded); then K batched
decode steps, K chosen to pay for the whole round (``plan_steps``), each
row's token drawn by its own decider, so each row's drafts follow the
distributions its own draft model gives, with its own seed. Drafts stay
lazy. With a confidence rule (``p_min``, ``min_prob``), each step makes one
read of every gated row's confidence in the step before (the solo loop's
rule, one step behind, for all rows at once), and a row whose confidence
fell takes no part in later steps: it ends at the token it would end at
alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..batch.runtime import BatchRuntime, batch_refusal
from ..draft_length.batch import BatchCosts, CatchUpCosts, DraftPlan, Pricing, StepCosts
from ..draft_length.policy import MAX_K
from ..draft_length.probes import ProbeSchedule
from ..target import Runtime, Target
from .base import Draft, DraftAsk


class DraftRow(Protocol):
    """What a batch reads and moves of a row's draft model
    (``draft_model.DraftModelProposer``): its runtime (its own, or its row
    here), the tokens in its cache, lazy drafts not yet judged, its
    confidence rule and decider, and how it catches up on tokens."""

    rt: Any
    cached: list[int]
    unread: int
    done: bool
    p_min: float
    min_prob: float
    decider: Any

    @property
    def gated(self) -> bool: ...

    def _sync(self, tokens: Sequence[int]) -> list[int]: ...

    def _embeddable(self, tokens: Sequence[int]) -> list[int]: ...


#: A row with more committed tokens than this to catch up on reads all but
#: the last alone first: padding every row of the batched catch-up to a long
#: one would cost rows x its length.
ALONE_CATCH_UP = 16

#: Draft steps a probe takes while no step pays: enough for its confidence
#: reads to time the steps again.
PROBE_K = 4


def draft_batch_refusal(draft: Target) -> str | None:
    """Why ``draft`` cannot draft for a batch (one line), or None. A draft
    rolls back the drafts of several forwards, which a batch's recurrent
    layers cannot (they roll back within the last forward)."""
    problem = batch_refusal(draft)
    if problem is None and any(isinstance(c, ArraysCache) for c in draft.runtime().cache):
        problem = "a draft model with recurrent layers runs alone (its rollback spans several forwards)"
    return problem


def step_seconds(reads: Sequence[tuple[int, float]]) -> float | None:
    """The seconds of one draft step from a round's reads (forwards waited
    for, when it came back): between its first and last read, since the
    first also waits for the round's catch-ups (a lazy prefill among them);
    None with fewer than two reads."""
    if len(reads) < 2:
        return None
    (i, first), (j, last) = reads[0], reads[-1]
    return (last - first) / (j - i)


@dataclass(eq=False)
class _Row:
    """One row's part of a round of drafting: ``k`` drafts at most, the
    tokens it catches up on, its steps and (gated) their confidences."""

    row: Hashable
    model: DraftRow
    tokens: Sequence[int]
    k: int
    feed: list[int] = field(default_factory=list)
    catch_up: int = 0
    logits: mx.array | None = None  # the latest forward's, at the row's last position
    steps: list[mx.array] = field(default_factory=list)
    dists: list[mx.array | None] = field(default_factory=list)
    top: list[mx.array] = field(default_factory=list)  # the draft's top probability per step
    own: list[mx.array] = field(default_factory=list)  # its probability of the token drawn
    n: int | None = None  # drafts kept, once decided
    whole: float = 1.0  # the estimated probability that the drafts so far are all accepted
    fed: int = 0  # drafts fed to the cache

    def draw(self, i: int) -> list[mx.array]:
        """Draw step ``i`` from the latest logits (lazy); what to evaluate."""
        m = self.model
        y, q = m.decider.draft_token(self.logits, self.tokens, i)
        self.steps.append(y)
        self.dists.append(q)
        if not m.gated:
            return [y]
        probs = q if q is not None else mx.softmax(self.logits.astype(mx.float32), axis=-1)
        self.top.append(probs.max())
        self.own.append(probs[y])
        return [y, self.top[-1], self.own[-1]]

    def checks(self, j: int) -> bool:
        """Whether its rules read step ``j``'s confidence (``min_prob`` never
        reads the last step's: that token is kept)."""
        return self.model.p_min > 0 or (self.model.min_prob > 0 and j < self.k - 1)

    def judge(self, j: int, top: float, own: float) -> None:
        """The solo rule on step ``j``: a draft ends before a token whose top
        probability is below ``p_min``, or at the token that takes the whole
        draft's estimated acceptance below ``min_prob``."""
        if top < self.model.p_min:
            self.n = j
        elif j < self.k - 1:
            self.whole *= own
            if self.whole < self.model.min_prob:
                self.n = j + 1

    def feeds(self, i: int) -> bool:
        """Whether step ``i``'s token is fed to draw the next."""
        return self.n is None and i + 1 < self.k

    def draft(self) -> Draft:
        """Its kept drafts (lazy); the cache keeps the fed ones among them,
        unread until the round's verify judges them (``update``)."""
        n = self.n
        keep = min(self.fed, n)
        self.model.rt.trim(self.fed - keep)
        self.model.unread = keep
        if not n:
            return Draft(catch_up=self.catch_up)
        probs = mx.stack(self.dists[:n]) if self.dists[0] is not None else None
        return Draft(mx.stack(self.steps[:n]), probs, catch_up=self.catch_up)


class DraftBatch:
    """The ``BatchDrafter`` of the rows drafting with one draft model: their
    draft caches as rows of one ``BatchRuntime`` over it (rows without any
    state yet stay on their own runtime until they first draft), and what
    its steps cost (``steps``: measured from the steps a confidence rule
    reads; until then ``ratio``, the draft's weights against the
    target's, times the target batch's forward of as many rows)."""

    def __init__(
        self, draft: Target, ratio: float = 0.0, costs: BatchCosts | None = None, ragged: bool = False
    ):
        self.draft = draft
        self.batch = BatchRuntime(draft, keep=MAX_K + 2)  # a round's drafts roll back on sliding windows too
        self.rows: dict[Hashable, DraftRow] = {}
        self.steps = StepCosts(ratio)
        self.catch_ups = CatchUpCosts()
        #: How many steps pay (with probes while none does), at the target batch's ``costs``.
        self.plan = DraftPlan(
            probes=ProbeSchedule(probe_k=PROBE_K), costs=costs or BatchCosts(), ragged=ragged
        )
        #: Forwards the last propose left unread, the batch's rows then, and the seconds it
        #: ran after its last read (a backend that computes inline may have run them there).
        self._unread = (0, 0, 0.0)

    # -- rows -------------------------------------------------------------------
    def join(self, row: Hashable, proposer) -> None:
        """The row's draft cache moves in (one with nothing in it yet joins when it first drafts)."""
        model = proposer.model
        self.rows[row] = model
        if model.rt.offset > 0:
            model.rt = self.batch.add(row, model.rt)

    def leave(self, row: Hashable, proposer) -> None:
        """The row's draft cache moves out, as a single runtime for its
        generation to go on alone (dropped when the generation is over)."""
        model = self.rows.pop(row, None)
        if model is None or row not in self.batch.rows:
            return
        alone = None
        if not model.done:
            if model.unread:  # drafts no verify judged (none between rounds): not known to be committed
                model.rt.trim(model.unread)
                model.unread = 0
            alone = self._single(row, model)
        self.batch.remove([row])
        model.rt = alone

    def _single(self, row: Hashable, model: DraftRow) -> Runtime:
        """A single runtime holding the row's draft cache (as a prompt-cache state is restored)."""
        n = model.rt.offset
        if n != len(model.cached):
            raise RuntimeError(f"a draft row holds {n} positions for {len(model.cached)} known tokens")
        rt = self.draft.runtime()
        if n:
            rt.restore(self.batch.snapshot(row, model.cached), n)
        return rt

    # -- a round ------------------------------------------------------------------
    def propose(self, asks: Sequence[DraftAsk], pricing: Pricing | None = None) -> list[Draft]:
        """Each ask's drafts: copies made on the host where its proposer copies
        (``route``), else the draft model's, made together; with ``pricing``,
        the model's steps capped at what pays for the whole round, and a row
        the model then drafts none for takes its proposer's ``fallback``
        (shallow copies, keyed as such)."""
        self._unread = (0, 0, 0.0)
        drafts: list[Draft | None] = []
        wanted: list[tuple[int, DraftAsk, int]] = []
        for i, ask in enumerate(asks):
            routed = ask.proposer.route(ask.tokens, ask.k)
            drafts.append(routed if isinstance(routed, Draft) else None)
            if not isinstance(routed, Draft):
                wanted.append((i, ask, routed))
        spare = {i: ask.proposer.fallback(ask.tokens, ask.k) for i, ask, _ in wanted}
        if wanted and pricing is not None and all(a.offer is not None for _, a, _ in wanted):
            cap = self._plan(wanted, asks, drafts, spare, pricing)
            wanted = [(i, a, min(n, cap)) for i, a, n in wanted]
        rows = [_Row(a.row, a.proposer.model, a.tokens, n) for _, a, n in wanted if n > 0]
        agree = pricing.agree if pricing is not None else None
        made = iter(self._draft(rows, agree) if rows else [])
        for i, _, n in wanted:
            drafts[i] = next(made) if n > 0 else spare[i]
        return drafts

    def _plan(self, wanted: list[tuple[int, DraftAsk, int]], asks: Sequence[DraftAsk],
              drafts: list[Draft | None], spare: dict[int, Draft], pricing: Pricing) -> int:  # fmt: skip
        """How many steps pay for the round (``DraftPlan``: a probe now and
        then while none does), the rows' ``spare`` drafts (their fallbacks)
        priced as what they verify if the model drafts none."""
        others = list(pricing.others)
        for ask, draft in zip(asks, drafts):
            if draft is not None and ask.offer is not None:  # copies
                others.append(ask.offer.head(len(draft)))
        idle = [
            a.price(spare[i].key, len(spare[i])) if spare[i] and a.price else a.offer.head(0)
            for i, a, _ in wanted
        ]
        step = self.steps.price(len(self.rows), self.plan.costs)
        unseen = sum(max(1, len(a.tokens) - len(a.proposer.model.cached)) for _, a, _ in wanted)
        start = self.catch_ups.price(unseen, step, self.plan.costs)
        return self.plan.drafts([a.offer.head(n) for _, a, n in wanted], others, step, start, idle)

    def unread_seconds(self, costs: BatchCosts) -> float:
        forwards, rows, spent = self._unread
        if not forwards:
            return 0.0
        price = forwards * self.steps.price(rows, costs)
        return max(0.0, price - spent) if costs.measured else price

    def _draft(
        self, rows: list[_Row], agree: Callable[[list[float]], list[float]] | None = None
    ) -> list[Draft]:
        """The rows' drafts: caches synced, catch-ups, then the steps (their
        measured seconds as ``agree`` gives them: rank 0's on a sharded target)."""
        t0 = time.perf_counter()
        for r in rows:
            r.feed = r.model._sync(r.tokens)
            r.catch_up = len(r.feed)
        self._alone_catch_ups(rows)
        self._catch_up(rows)
        forwards, reads = self._run(rows)
        self._measure(reads, t0, sum(r.catch_up for r in rows), agree)
        drafts = [r.draft() for r in rows]
        timed, t_read = reads[-1] if reads else (0, t0)
        self._unread = (forwards - timed, len(self.batch.rows), time.perf_counter() - t_read)
        return drafts

    def _measure(
        self, reads: list[tuple[int, float]], t0: float, tokens: int,
        agree: Callable[[list[float]], list[float]] | None,
    ) -> None:  # fmt: skip
        """What a round's reads tell of a step's seconds, and of the
        catch-up's (``tokens`` read before the first step, which the first
        read waited for, with the steps before it)."""
        step = step_seconds(reads)
        if step is None:
            return
        i, first = reads[0]
        values = [step, max(0.0, first - t0 - i * step)]
        step, catch_up = agree(values) if agree is not None else values
        self.steps.update(len(self.batch.rows), step)
        self.catch_ups.update(tokens, catch_up)

    def _alone_catch_ups(self, rows: list[_Row]) -> None:
        """Rows with a long catch-up, or not in the batch yet, read all but
        their last unseen token on a runtime of their own, then (re)join."""
        for r in rows:
            inside = r.row in self.batch.rows
            if inside and len(r.feed) <= ALONE_CATCH_UP:
                continue
            m = r.model
            rt = m.rt
            if inside:
                rt = self._single(r.row, m)
                self.batch.remove([r.row])
            if len(r.feed) > 1:
                rt.prefill(m._embeddable(r.feed[:-1]), logits="none")
                m.cached.extend(r.feed[:-1])
                r.feed = r.feed[-1:]
            m.rt = self.batch.add(r.row, rt)

    def _catch_up(self, rows: list[_Row]) -> None:
        """One batched forward of every row's unseen committed tokens (rows not drafting feed none)."""
        feeds = {r.row: r.model._embeddable(r.feed) for r in rows}
        fwd = self.batch.forward([feeds.get(b, []) for b in self.batch.rows], logits="last")
        for r in rows:
            r.model.cached.extend(r.feed)
            r.logits = fwd.logits[fwd.index(self.batch.index(r.row)), 0]

    def _run(self, rows: list[_Row]) -> tuple[int, list[tuple[int, float]]]:
        """The draft steps: each drawing row draws, the step before is judged
        (one read, gated rows only), the rows going on feed their token in one
        batched forward. Returns the forwards run and each read: how many
        forwards it waited for, and when it came back."""
        forwards, reads, i = 1, [], 0
        while True:
            drawn = {r: r.draw(i) for r in rows if r.n is None and i < r.k}
            if i and self._judge(rows, i - 1):
                reads.append((i, time.perf_counter()))
            if not drawn:
                return forwards, reads
            going = [a for r, arrays in drawn.items() if r.n is None for a in arrays]
            if going:
                mx.async_eval(going)
            feeding = [r for r in rows if r.feeds(i)]
            if feeding:
                self._step(feeding, i)
                forwards += 1
            i += 1

    def _judge(self, rows: list[_Row], j: int) -> bool:
        """The confidence rules on step ``j`` of the rows that drew it, in one
        read; rows whose last step it was end there. True when it read."""
        at = [r for r in rows if r.n is None and j < r.k]
        asked = [r for r in at if r.checks(j)]
        if asked:
            values = mx.stack([mx.stack([r.top[j], r.own[j]]) for r in asked]).tolist()
            for r, (top, own) in zip(asked, values):
                r.judge(j, top, own)
        for r in at:
            if r.n is None and j == r.k - 1:
                r.n = r.k
        return bool(asked)

    def _step(self, feeding: list[_Row], i: int) -> None:
        """One batched decode feeding each row in ``feeding`` its step ``i`` token."""
        feeds = {r.row: r.steps[i].reshape(1) for r in feeding}
        fwd = self.batch.forward([feeds.get(b, []) for b in self.batch.rows], logits="last")
        for r in feeding:
            r.fed += 1
            r.logits = fwd.logits[fwd.index(self.batch.index(r.row)), 0]
