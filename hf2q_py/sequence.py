"""One generation as an object: the state it carries between rounds, and its
side of a round, which whatever drives it (the scheduler's loop) calls.

A round, as the driver runs it for one or many generations:

1. :meth:`Sequence.ask`: the drafts it offers (early drafts a decode
   confirmed, else the draft key and how many to draft: its policy's
   ``next_k`` alone, ``batch_k`` in a batch, where the batch's planner
   chooses the width from :meth:`Sequence.offer`);
2. :meth:`Sequence.propose` (host drafts; a batched drafter may fill
   ``Turn.draft`` instead) and :meth:`Sequence.check` (a grammar cuts drafts
   it forbids);
3. one forward feeds :meth:`Sequence.inputs`: its own runtime
   (:meth:`Sequence.queue`) or the batch's, whose logits rows go to
   :meth:`Sequence.judge` (the lazy verdict and what the round reads);
4. one blocking read for the whole round, then :meth:`Sequence.land`:
   the verdict resolved, rejected positions trimmed, the round recorded
   (one ``Round``), tokens committed, policy and proposer updated.

A generation running alone pipelines its decodes (:meth:`Sequence.chain`
queues the next decode before the current token is read) and drafts while
such a decode is in flight; drafts the decode confirms are offered next
round, so no forward is wasted.

Invariant between rounds: the cache holds every committed token but the last
(``runtime.offset == len(tokens) - 1``) plus, while a decode is in flight,
the last; the last one is fed next round.
"""

from __future__ import annotations

import time
from collections import abc
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .distributed import Sharding, agree, gathered, token_check
from .draft_length import NoDrafts, Policy, build_policy
from .draft_length.batch import Offer, offer
from .errors import Hf2qError
from .kv import KVConfig
from .proposers.base import Draft, PlainDecoding, Proposer
from .sampling import Greedy, TokenLogprob, Verdict, logprob_block, read_logprobs
from .stats import GenerationStats, Round
from .target import Runtime, Target

CLEAR_CACHE_EVERY = 256
DEFAULT_POLICY_K = 8
#: The Round fields that are measured (and so differ between ranks).
TIMED_FIELDS = ("cost_seconds", "propose_seconds", "verify_seconds", "sample_seconds")


def pack(parts: abc.Sequence[mx.array]) -> mx.array:
    """Lazy arrays as one float32 vector, so a round reads them in one go
    (token ids are exact in float32)."""
    return mx.concatenate([p.reshape(-1).astype(mx.float32) for p in parts])


def unpack(host: list[float], sizes: abc.Sequence[int]) -> list[list[float]]:
    out, i = [], 0
    for n in sizes:
        out.append(host[i : i + n])
        i += n
    return out


@dataclass
class Turn:
    """One generation's part of one round: the drafts it offers, then its
    forward's lazy results, then the facts its ``Round`` records."""

    key: Hashable = None
    k: int = 0  # the draft length the policy chose (the drafts may be fewer)
    draft: Draft = field(default_factory=Draft)
    masks: mx.array | None = None  # a grammar's masks of the verified positions
    predrafted: bool = False  # drafts made during the decode before (timed there)
    verdict: Verdict | None = None  # None: a decode
    token: mx.array | None = None  # a decode's lazy next token (a chained decode's input)
    parts: list[mx.array] = field(default_factory=list)  # what the round reads, lazy
    hidden: dict[int, mx.array] = field(default_factory=dict)  # captured states (alone)
    read: mx.array | None = None  # ``parts`` packed (alone: queued on its own)
    since: float = 0.0  # when its forward could start
    queued: float = 0.0  # when its forward was queued
    chained: bool = False  # a decode queued while the decode before it ran
    landing: float = 0.0  # alone, a decode: when its driver began waiting for it
    read_at: float = 0.0  # when its read came back

    @property
    def decode(self) -> bool:
        return not self.draft

    @property
    def wants_drafts(self) -> bool:
        """Whether drafts are still to be made for it."""
        return self.k > 0 and not self.predrafted

    @property
    def sizes(self) -> list[int]:
        return [p.size for p in self.parts]


class Sequence:
    """One generation: its runtime, proposer, draft-length policy, decider,
    committed tokens and statistics, and its side of each round.

    ``decider`` turns logits into tokens and judges drafts: greedy by
    default, or a ``Sampler`` (lossless speculative sampling). With no
    proposer this is plain decoding; a proposer without a ``policy`` gets an
    adaptive K of at most 8 (or its profile's ``min_k``) from its declared
    profile. ``plain_first_token``: the first round is a single-token
    decode (a stream's time to first token). ``logprobs``: N >= 0 keeps
    each committed token's log-probability and N alternatives
    (:attr:`logprobs`). ``constraint``: a grammar state (structured output)
    that cuts drafts it forbids and masks every verified position. ``kv``:
    how its caches store keys and values (default: the Target's). EOS ends
    generation (the EOS token itself is not committed) and ``max_tokens``
    is never exceeded, also inside an accepted block.
    """

    def __init__(
        self,
        target: Target,
        prompt: abc.Sequence[int],
        *,
        max_tokens: int,
        proposer: Proposer | None = None,
        policy: Policy | None = None,
        eos_token_ids: abc.Sequence[int] = (),
        stats: GenerationStats | None = None,
        on_round: Callable[[Round], None] | None = None,
        decider: Greedy | None = None,
        plain_first_token: bool = False,
        logprobs: int | None = None,
        constraint: Any = None,
        kv: KVConfig | None = None,
    ):
        prompt = list(prompt)
        if not prompt:
            raise Hf2qError("the prompt is empty")
        if max_tokens < 1:
            raise Hf2qError(f"max_tokens must be >= 1, got {max_tokens}")
        self.target, self.prompt, self.max_tokens = target, prompt, max_tokens
        self.proposer = proposer or PlainDecoding()
        if policy is None:
            active = self.proposer.active
            policy = build_policy(self.proposer.profile, DEFAULT_POLICY_K) if active else NoDrafts()
        self.policy = policy
        self.stats = stats if stats is not None else GenerationStats()
        self.decider = decider or Greedy()
        self.eos = set(eos_token_ids)
        self.on_round, self.plain_first_token = on_round, plain_first_token
        self.top_logprobs, self.constraint = logprobs, constraint
        self.kv = target.kv if kv is None else kv
        self.capture = tuple(self.proposer.capture_layers)
        self.tokens = list(prompt)
        #: The log-probabilities of the tokens the last round committed (``logprobs`` set).
        self.logprobs: list[TokenLogprob] = []
        self.done = False
        self.rt: Runtime | None = None
        self.pending: list[int] = []  # prompt tokens still to prefill
        self._hidden: dict[int, list[mx.array]] = {}  # captured states of the prompt so far
        self.ahead: Turn | None = None  # a decode queued behind the last round (alone)
        self.early: tuple[Hashable, Draft] | None = None  # drafted while a decode ran
        self.ready: tuple[Hashable, Draft] | None = None  # early drafts the decode confirmed
        self.propose_seconds = 0.0  # drafting time not yet charged to a round
        self.catch_up = 0  # committed tokens the proposer read in that time
        self._t0 = self._tp = self._t_start = 0.0  # wall and runtime clocks: begin, prefill, decode

    # -- life cycle ------------------------------------------------------------
    def new_runtime(self) -> Runtime:
        """A fresh runtime sized for this generation's rollback depth."""
        k = self.policy.k_max
        return self.target.runtime(slack=max(64, k + 2), rollback=k + 2, kv=self.kv)

    def begin(self, runtime: Runtime | None = None) -> None:
        """Take a runtime (default: a fresh one, from the prompt cache where it
        holds part of the prompt: on a sharded target, where every rank's
        holds the same length); :attr:`pending` is what remains to prefill
        (all of the prompt but its last token, which the first round feeds)."""
        self.stats.prompt_tokens = len(self.prompt)
        self._t0 = time.perf_counter()
        if runtime is None:
            runtime = self.new_runtime()
            cache = self.target.prompt_cache
            if cache is not None and not self.proposer.capture_layers:
                snap, n = cache.lookup(self.prompt, limit=len(self.prompt) - 1, kv=runtime.kv)
                if self.target.sharding is not None and len(set(gathered(self.target.sharding, n))) > 1:
                    snap = None  # every rank prefills alike: a prefix not every rank holds is not reused
                if snap is not None:
                    runtime.restore(snap, n)
        self.rt = runtime
        self.stats.cached_tokens = runtime.offset
        self.pending = self.prompt[runtime.offset : -1]
        self._tp = runtime.clock()

    def prefill(self, chunk: int) -> bool:
        """Prefill the next ``chunk`` pending prompt tokens; True once the
        prompt is in (the proposer then starts)."""
        if self.pending:
            feed, self.pending = self.pending[:chunk], self.pending[chunk:]
            fwd = self.rt.prefill(feed, logits="none", capture_layers=self.capture)
            mx.eval(self.rt.state(), list(fwd.hidden.values()))
            for i, h in fwd.hidden.items():
                self._hidden.setdefault(i, []).append(h)
        if self.pending:
            return False
        cache = self.target.prompt_cache
        if cache is not None and not self.rt.trimmable and len(self.prompt) - 1 > self.stats.cached_tokens:
            cache.add(self.rt.snapshot(self.prompt[:-1]))  # a state later rounds cannot cut back to
        hidden = {i: mx.concatenate(hs, axis=1) if len(hs) > 1 else hs[0] for i, hs in self._hidden.items()}
        self._hidden = {}
        self._after_prefill(hidden)
        return True

    def _after_prefill(self, hidden: dict[int, mx.array]) -> None:
        """The policy learns the prefill's speed, the proposer starts."""
        rt, stats = self.rt, self.stats
        seconds = rt.clock() - self._tp
        if self.target.sharding is not None and self.proposer.active:  # every rank learns rank 0's time
            (seconds,) = agree(self.target.sharding, [seconds])
        self.policy.prefilled(len(self.prompt) - 1 - stats.cached_tokens, seconds)
        stats.prefill_seconds = time.perf_counter() - self._t0
        self._t_start = rt.clock()
        self.proposer.start(rt, self.prompt, hidden, self.decider)

    def move(self, runtime: Any) -> None:
        """Go on with another runtime holding the same state (a batch's row,
        or a single sequence's runtime again); nothing may be in flight. The
        proposer is told (layer skip drafts on it)."""
        self.rt = runtime
        self.proposer.move(runtime)

    def settle(self) -> None:
        """Drop a decode queued ahead (and drafts made meanwhile): the caches
        then hold exactly the committed tokens but the last, as between
        rounds; the dropped decode is computed again next round."""
        self.ahead = None
        self.early = self.ready = None
        extra = self.rt.offset - (len(self.tokens) - 1)
        if extra > 0:
            self.rt.trim(extra)

    def close(self, keep: bool = True) -> None:
        """Leave the cache holding exactly the committed tokens but the last,
        tell the proposer, and (``keep``: the caches are whole) add the state
        to the Target's prompt cache."""
        if self.rt is None:
            return
        rt = self.rt
        self.stats.decode_seconds = rt.clock() - self._t_start
        self.settle()
        self.proposer.finish(self.tokens)
        if keep and rt.target.prompt_cache is not None:
            rt.target.prompt_cache.add(rt.snapshot(self.tokens[:-1]))
        self.rt = None

    # -- a round: what it offers -------------------------------------------------
    def room(self) -> int:
        """The most drafts the budget leaves room for this round (0 while the
        proposer is inactive, and for a plain first token)."""
        if not self.proposer.active or (self.plain_first_token and self.stats.generated_tokens == 0):
            return 0
        return self.max_tokens - self.stats.generated_tokens - 1

    def ask(self, batched: bool = False) -> Turn:
        """This round's turn: early drafts a decode confirmed, else the draft
        key and how many drafts to make (:meth:`propose` makes them)."""
        room = self.room()
        if self.ready is not None:
            (key, draft), self.ready = self.ready, None
            k = min(self.policy.next_k(key), room) if room > 0 else 0
            return Turn(key, k, draft.head(k), predrafted=True)
        key = self.proposer.draft_key(self.tokens) if self.proposer.active else None
        want = self.policy.batch_k(key) if batched else self.policy.next_k(key)
        return Turn(key, min(want, room) if room > 0 else 0)

    def propose(self, turn: Turn) -> None:
        """Draft ``turn.k`` tokens with the proposer (unless the turn has its drafts)."""
        if turn.wants_drafts:
            self.take(turn, self.proposer.propose(self.tokens, turn.k))

    def take(self, turn: Turn, draft: Draft) -> None:
        """The turn's drafts, made by the proposer or by a batch's drafter for
        it (under the key of their source, when it names one)."""
        self.catch_up += draft.catch_up
        if draft.key is not None:
            turn.key = draft.key
        turn.draft = draft.head(turn.k)

    def check(self, turn: Turn) -> None:
        """Cut the drafts where the constraint forbids one; its masks for the
        positions the round verifies."""
        draft = turn.draft
        if draft.lazy and (self.constraint is not None or self.decider.needs_context):
            draft = self._materialize(draft)  # a grammar and a penalty walk token ids
        if self.constraint is not None:
            allowed, masks = self.constraint.plan(list(draft.tokens))
            draft, turn.masks = draft.head(allowed), masks[: allowed + 1]
        turn.draft = draft

    def offer(self, turn: Turn) -> Offer:
        """The turn's drafts as the batch's width planner prices them."""
        return offer(self.policy, turn.key, len(turn.draft))

    def promise(self, turn: Turn) -> Offer:
        """The turn's ``k`` drafts, before they are made, as the batch's planner prices them."""
        return self.price(turn.key, turn.k)

    def price(self, key: Hashable, drafts: int) -> Offer:
        """``drafts`` drafts of class ``key`` as the batch's planner prices them."""
        return offer(self.policy, key, drafts)

    def cut(self, turn: Turn, width: int) -> None:
        """Keep the drafts that fit a forward of ``width`` positions."""
        turn.draft = turn.draft.head(width - 1)
        if turn.masks is not None:
            turn.masks = turn.masks[: len(turn.draft) + 1]

    @staticmethod
    def _materialize(draft: Draft) -> Draft:
        """Lazy drafts read now (a read of their own), as token ids."""
        draft.values = draft.tokens.tolist()
        return Draft(list(draft.values), draft.probs, draft.catch_up, draft.key)

    # -- a round: its forward ----------------------------------------------------
    def inputs(self, turn: Turn) -> list[int] | mx.array:
        """What the round feeds: the last committed token, then the drafts."""
        last, draft = self.tokens[-1], turn.draft
        if draft.lazy:
            return mx.concatenate([mx.array([last], dtype=mx.uint32), draft.tokens.astype(mx.uint32)])
        return [last, *draft.tokens]

    def judge(self, turn: Turn, logits: mx.array, ahead: int = 0) -> None:
        """The lazy verdict (or a decode's next token, ``ahead`` positions past
        the committed tokens) from the rows ``logits`` of the turn's forward,
        and what the round reads: lazy drafts, the verdict, log-probabilities."""
        draft, masks = turn.draft, turn.masks
        if turn.decode:
            y = self.decider.next_token(logits[-1], self.tokens, ahead, None if masks is None else masks[0])
            turn.token, turn.parts = y, [y]
            drafts, chosen = mx.zeros((0,), dtype=mx.uint32), y.reshape(1)
        else:
            turn.verdict = self.decider.judge(logits, self.tokens, draft.tokens, draft.probs, masks)
            turn.parts = [draft.tokens, turn.verdict.values] if draft.lazy else [turn.verdict.values]
            drafts = draft.tokens if draft.lazy else mx.array(draft.tokens, dtype=mx.uint32)
            chosen = turn.verdict.chosen(drafts)
        if self.top_logprobs is not None:
            turn.parts.append(
                logprob_block(logits[-len(turn.draft) - 1 :], drafts, chosen, self.top_logprobs)
            )

    def queue(self, turn: Turn, token: int | mx.array | None = None, ahead: int = 0) -> Turn:
        """Queue the turn's forward on this generation's own runtime (alone):
        a decode of ``token`` (default: the last committed one, ``ahead``
        positions before the one it computes) or a verify of its drafts."""
        turn.queued = self.rt.clock()
        if turn.decode:
            fwd = self.rt.decode(self.tokens[-1] if token is None else token, capture_layers=self.capture)
        else:
            fwd = self.rt.verify(self.inputs(turn), capture_layers=self.capture)
        self.judge(turn, fwd.logits, ahead)
        turn.hidden, turn.read = fwd.hidden, pack(turn.parts)
        mx.async_eval(turn.read)
        return turn

    def launch(self) -> Turn:
        """Alone: plan this round (the pipelined decode queued ahead, if any)
        and queue its forward on this generation's own runtime."""
        if self.ahead is not None:
            turn, self.ahead = self.ahead, None
            return turn
        t0 = self.rt.clock()
        turn = self.ask()
        self.propose(turn)
        self.check(turn)
        tv = self.rt.clock()
        self.propose_seconds += tv - t0
        turn.since = tv if turn.decode else t0
        return self.queue(turn)

    def chain(self, turn: Turn) -> None:
        """Alone: queue the next decode behind a decode turn before the turn is
        read (:attr:`ahead`), when the pipeline allows."""
        turn.landing = self.rt.clock()
        if turn.decode and self._may_chain():
            self.ahead = self.queue(Turn(chained=True), turn.token, ahead=1)

    # -- a round: what comes back ------------------------------------------------
    def land(self, turn: Turn, host: list[list[float]], *, seconds: float | None = None) -> list[int]:
        """The round's read parts (as :meth:`judge` listed them) resolved and
        the round recorded; returns the committed tokens. ``seconds``: the
        batch's forward time (a batched row), else the turn's own timings."""
        return self.record(turn, self.resolve(turn, host), seconds=seconds)

    def resolve(self, turn: Turn, host: list[list[float]]) -> tuple[int, list[int], list[TokenLogprob]]:
        """Accepted drafts, the tokens to commit and their log-probabilities;
        the rejected positions are trimmed."""
        ts = turn.read_at = self.rt.clock()
        if self.ahead is not None:
            self.ahead.since = ts  # the decode behind this one could start now
        if turn.decode:
            new = [int(host[0][0])]
            lps = read_logprobs(host[1], 0, self.top_logprobs, new) if len(host) > 1 else []
            return 0, new, lps
        host, draft = list(host), turn.draft
        if draft.lazy:
            draft.values = [int(t) for t in host.pop(0)]
        drafts = draft.values if draft.lazy else draft.tokens
        n, t = turn.verdict.resolve(host[0], drafts)
        self.rt.trim(len(drafts) - n)
        new = [*drafts[:n], t]
        lps = read_logprobs(host[1], len(drafts), self.top_logprobs, new) if len(host) > 1 else []
        return n, new, lps

    def record(
        self, turn: Turn, result: tuple[int, list[int], list[TokenLogprob]], *, seconds: float | None = None
    ) -> list[int]:
        """Record a resolved turn's round, commit its tokens, let the policy and
        the proposer learn; returns the committed tokens."""
        n, new, lps = result
        r = self._round(turn, n, turn.read_at, seconds)
        if turn.decode:
            self._judge_early(r, new[0])
        return self._conclude(r, new, turn.hidden, lps, batched=seconds is not None)

    def _round(self, turn: Turn, accepted: int, ts: float, seconds: float | None) -> Round:
        """The ``Round`` record of a landed turn."""
        te = self.rt.clock()
        drafted = len(turn.draft)
        if seconds is not None:  # a batched row: the batch's forward
            k, cost, verify = drafted, seconds, seconds
        else:
            k, cost = (0 if turn.decode else turn.k), ts - turn.since
            verify = ts - (turn.landing if turn.decode else turn.queued)
        return Round(
            k=k, drafted=drafted, accepted=accepted, key=turn.key,
            cost_seconds=cost, catch_up=self.catch_up, propose_seconds=self._take_propose_seconds(),
            verify_seconds=verify, sample_seconds=te - ts, predrafted=turn.predrafted,
            restarted=turn.decode and not turn.chained and seconds is None,
            chain_end=turn.chained and self.ahead is None,
        )  # fmt: skip

    def _conclude(
        self, r: Round, new: list[int], hidden: dict[int, Any], lps: list[TokenLogprob], batched: bool
    ) -> list[int]:
        """Commit a settled round's tokens (up to EOS and the budget), let the
        policy and the proposer learn from it; returns the committed tokens.
        ``batched``: the round was one row of a batch, whose cost the batch's
        planner learns, so the policy learns acceptance only."""
        if self.target.sharding is not None and self.proposer.active and not batched:
            _agree(self.target.sharding, r, new)  # a batch's rows: the scheduler's one agreement a round
        if self.plain_first_token and self.stats.rounds == 0:
            pass  # a decode by rule: no sample
        elif batched:
            self.policy.observe(r.drafted, r.accepted, r.key)
        else:
            self.policy.update(r)
        new, self.done = commit(self.tokens, new, self.eos, self.max_tokens, self.stats)
        self.logprobs = lps[: len(new)]
        r.emitted = len(new)
        self.stats.record(r)
        if self.on_round is not None:
            self.on_round(r)
        if self.constraint is not None:
            self.constraint.commit(new)
        if not self.done:
            self._after(r, hidden)
            if self.stats.rounds % CLEAR_CACHE_EVERY == 0 and not batched:
                mx.clear_cache()
        return new

    # -- pipelining (alone) --------------------------------------------------------
    def _judge_early(self, r: Round, token: int) -> None:
        """Drafts made while this decode ran: kept, less their first, when its
        token confirms that one (greedy); else the round reports them rejected."""
        early, self.early = self.early, None
        if early is None or not self.decider.cfg.greedy:
            return
        key, draft = early
        if draft.tokens[0] == token:
            self.ready = (key, draft.tail()) if len(draft) > 1 else None
        else:
            r.early_key, r.early_rejected = key, len(draft)

    def _after(self, r: Round, hidden: dict[int, Any]) -> None:
        """Once a round's tokens are committed: update the proposer, and draft
        early while a decode is in flight."""
        self.proposer.update(self.tokens, r.drafted, r.accepted, hidden)
        if self.ahead is not None and not self._drafts_at_round_start():
            t0 = self.rt.clock()
            turn = self.ask()
            self.propose(turn)
            self.early = (turn.key, turn.draft) if turn.draft else None  # drafts end the chain
            self.propose_seconds += self.rt.clock() - t0

    def _may_chain(self) -> bool:
        """Whether the next decode may be queued before this one is read. The
        first token is read before anything else is queued: on backends whose
        async_eval blocks on a full queue (MLX's CPU), chaining there would
        delay it by a whole decode. A constraint's mask needs the token first."""
        done = self.stats.generated_tokens
        chain = (
            self.early is None
            and 0 < done < self.max_tokens - 1
            and not self.decider.needs_context
            and self.constraint is None
        )
        if chain and self._drafts_at_round_start():
            key = self.proposer.draft_key(self.tokens) if self.proposer.active else None
            chain = self.room() <= 0 or self.policy.next_k(key) == 0  # it drafts only with nothing in flight
        return chain

    def _drafts_at_round_start(self) -> bool:
        """Whether the proposer drafts only with no decode in flight: from
        the target's cache at the last token (layer skip), or lazily from a
        model (no read to judge its drafts against the decode's token)."""
        return self.proposer.uses_target_cache or self.proposer.lazy_drafts

    def _take_propose_seconds(self) -> float:
        """The drafting time (and catch-up) not yet charged, which the caller's round takes."""
        seconds, self.propose_seconds, self.catch_up = self.propose_seconds, 0.0, 0
        return seconds


def _agree(sharding: Sharding, r: Round, new: list[int]) -> None:
    """On a sharded target: give this round rank 0's timings on every rank, so
    every rank's policy chooses the same draft lengths, and check that every
    rank committed the same tokens."""
    values = agree(sharding, [getattr(r, f) for f in TIMED_FIELDS], token_check(new))
    for name, value in zip(TIMED_FIELDS, values):
        setattr(r, name, value)


def commit(
    tokens: list[int], new: list[int], eos: set[int], max_tokens: int, stats: GenerationStats
) -> tuple[list[int], bool]:
    """Append ``new`` up to the first EOS and within the budget; returns the
    committed tokens and whether generation is over."""
    for i, t in enumerate(new):
        if t in eos:
            new = new[:i]
            stats.finish_reason = "stop"
            break
    new = new[: max_tokens - stats.generated_tokens]
    tokens.extend(new)
    stats.generated_tokens += len(new)
    if not stats.finish_reason and stats.generated_tokens >= max_tokens:
        stats.finish_reason = "length"
    return new, bool(stats.finish_reason)
