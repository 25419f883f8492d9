"""One generation as an object: the state a generation carries between
rounds and the rounds themselves.

Each round the proposer drafts up to K tokens after the committed ones;
nothing drafted: one single-token decode (the baseline's own step);
otherwise one batched verify of ``[last, d1..dK]``, accepting the longest
prefix the target agrees with plus the target's own token there, and
trimming the rejected positions from the caches. Every round makes one
blocking read: the target's tokens, the verdict on the drafts, lazy drafts
(model drafts are never read before their verify) and log-probabilities
come back together.

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

from .distributed import Sharding, agree, token_check
from .draft_length import NoDrafts, Policy, build_policy
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
class Flight:
    """A round whose target forward is queued and not yet read."""

    read: mx.array  # everything the round reads, packed
    sizes: list[int]  # the packed parts: lazy drafts, verdict, log-probabilities
    hidden: dict[int, mx.array]
    since: float  # when its forward could start
    queued: float  # when it was queued
    k: int = 0
    key: Hashable = None
    draft: Draft = field(default_factory=Draft)
    verdict: Verdict | None = None
    token: mx.array | None = None  # a decode's lazy next token (the input of a decode chained behind it)
    chained: bool = False  # a decode queued while the decode before it ran (pipelined)
    predrafted: bool = False  # its drafts were made during the decode before it

    @property
    def decode(self) -> bool:
        return self.verdict is None


class Sequence:
    """One generation: its runtime, proposer, draft-length policy, decider,
    committed tokens and statistics, run one round per :meth:`step`.

    ``decider`` turns logits into tokens and judges drafts: greedy by
    default, or a ``Sampler`` (lossless speculative sampling). With no
    proposer this is plain decoding; a proposer without a ``policy`` gets an
    adaptive K of at most 8 (or its profile's ``min_k``) from its declared
    profile. ``plain_first_token``: the first round is a single-token
    decode (a stream's time to first token). ``logprobs``: N >= 0 keeps
    each committed token's log-probability and N alternatives
    (:attr:`logprobs`). ``constraint``: a grammar state (structured output)
    that cuts drafts it forbids and masks every verified position.
    ``kv``: how its caches store keys and values (default: the Target's).

    Decode rounds are pipelined as in mlx-lm: the next decode is queued
    before the current token is read, so graph building overlaps the
    forward. When the proposer drafts during such a stretch (``early``),
    the queued decode's token is committed first and speculation starts
    from the next round, with the drafts the decode confirmed (``ready``),
    so no forward is wasted. EOS ends generation (the EOS token itself is
    not committed) and ``max_tokens`` is never exceeded, also inside an
    accepted block.
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
        #: The log-probabilities of the tokens the last step committed (``logprobs`` set).
        self.logprobs: list[TokenLogprob] = []
        self.done = False
        self.rt: Runtime | None = None
        self.flight: Flight | None = None
        self.early: tuple[Hashable, Draft] | None = None  # drafted while a decode ran
        self.ready: tuple[Hashable, Draft] | None = None  # early drafts the decode confirmed
        self.propose_seconds = 0.0  # drafting time not yet charged to a round
        self.catch_up = 0  # committed tokens the proposer read in that time
        self._t0 = self._tp = self._t_start = (
            0.0  # wall and runtime clocks at begin, prefill's start, decode's
        )

    # -- life cycle ------------------------------------------------------------
    def start(self) -> None:
        """Restore what the prompt cache holds of the prompt, prefill the rest
        (all but its last token) and start the proposer."""
        self.begin()
        self.after_prefill(prefill(self.rt, self.prompt, self.capture))

    def begin(self, runtime: Runtime | None = None) -> list[int]:
        """Take a runtime (default: a fresh one, from the prompt cache where it
        holds part of the prompt); returns the prompt tokens still to prefill."""
        self.stats.prompt_tokens = len(self.prompt)
        self._t0 = time.perf_counter()
        if runtime is None:
            reuse = not self.proposer.capture_layers
            runtime = resume(self.target, self.prompt, self.policy.k_max, reuse=reuse, kv=self.kv)
        self.rt = runtime
        self.stats.cached_tokens = runtime.offset
        self._tp = runtime.clock()
        return self.prompt[runtime.offset : -1]

    def after_prefill(self, hidden: dict[int, mx.array]) -> None:
        """The prompt is prefilled (``hidden``: its captured states): the
        policy learns the prefill's speed, the proposer starts."""
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
        or a single sequence's runtime again); nothing may be in flight."""
        self.rt = runtime

    def settle_flight(self) -> None:
        """Drop a decode queued ahead (and drafts made meanwhile): the caches
        then hold exactly the committed tokens but the last, as between
        rounds; the dropped decode is computed again next round."""
        if self.flight is not None:
            self.flight = None
            extra = self.rt.offset - (len(self.tokens) - 1)
            if extra > 0:
                self.rt.trim(extra)
        self.early = self.ready = None

    def step(self) -> list[int]:
        """One round: queue it (unless a chained decode already is), read it,
        commit its tokens; returns them (possibly none). Sets ``done``."""
        flight = self.flight if self.flight is not None else self._launch()
        self.flight = None
        return self.conclude(*self._land(flight))

    def conclude(
        self, r: Round, new: list[int], hidden: dict[int, Any], lps: list[TokenLogprob], batched: bool = False
    ) -> list[int]:
        """Commit a settled round's tokens (up to EOS and the budget), let the
        policy and the proposer learn from it; returns the committed tokens.
        ``batched``: the round was one row of a batch, whose cost the batch's
        planner learns, so the policy learns acceptance only."""
        if self.target.sharding is not None and self.proposer.active:
            _agree(self.target.sharding, r, new)
        if batched:
            if r.drafted:
                self.policy.observe(r.drafted, r.accepted, r.key)
        elif not (self.plain_first_token and self.stats.rounds == 0):  # a decode by rule: no sample
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

    def close(self, keep: bool = True) -> None:
        """Leave the cache holding exactly the committed tokens but the last,
        tell the proposer, and (``keep``: the caches are whole) add the state
        to the Target's prompt cache."""
        if self.rt is None:
            return
        rt = self.rt
        self.stats.decode_seconds = rt.clock() - self._t_start
        self.flight = None
        extra = rt.offset - (len(self.tokens) - 1)
        if extra > 0:
            rt.trim(extra)
        self.proposer.finish(self.tokens)
        if keep and rt.target.prompt_cache is not None:
            rt.target.prompt_cache.add(rt.snapshot(self.tokens[:-1]))
        self.rt = None

    # -- choosing drafts -------------------------------------------------------
    def draft_key(self) -> Hashable:
        return self.proposer.draft_key(self.tokens) if self.proposer.active else None

    def room(self) -> int:
        """The most drafts the budget leaves room for this round (0 while the
        proposer is inactive, and for a plain first token)."""
        if not self.proposer.active or (self.plain_first_token and self.stats.generated_tokens == 0):
            return 0
        return self.max_tokens - self.stats.generated_tokens - 1

    def next_k(self, key: Hashable) -> int:
        """The policy's draft length for ``key``, within :meth:`room`."""
        room = self.room()
        return min(self.policy.next_k(key), room) if room > 0 else 0

    def propose(self, key: Hashable, k: int) -> Draft:
        """Up to ``k`` drafts after the committed tokens (``key``: their draft key)."""
        draft = self.proposer.propose(self.tokens, k) if k > 0 else Draft()
        self.catch_up += draft.catch_up
        return draft.head(k)

    def _plan(self) -> tuple[Hashable, int, Draft, bool]:
        """This round's drafts: the early ones a decode confirmed, else new ones."""
        if self.ready is not None:
            (key, draft), self.ready = self.ready, None
            k = self.next_k(key)
            return key, k, draft.head(k), True
        key = self.draft_key()
        k = self.next_k(key)
        return key, k, self.propose(key, k), False

    # -- rounds ----------------------------------------------------------------
    def _launch(self) -> Flight:
        """Plan this round and queue its forward: a verify of the drafts, or
        (nothing drafted) a decode."""
        t0 = self.rt.clock()
        key, k, draft, predrafted = self._plan()
        draft, masks = self.checked(draft)
        tv = self.rt.clock()
        self.propose_seconds += tv - t0
        if not draft:
            return self._queue(self.tokens[-1], 0, since=tv, mask=masks)
        fwd = self.rt.verify(self.feed(draft), capture_layers=self.capture)
        verdict, parts = self.judge(fwd.logits, draft, masks)
        read = pack(parts)
        mx.async_eval(read)
        return Flight(read, [p.size for p in parts], fwd.hidden, since=t0, queued=tv, k=k, key=key,
                      draft=draft, verdict=verdict, predrafted=predrafted)  # fmt: skip

    def checked(self, draft: Draft) -> tuple[Draft, mx.array | None]:
        """The drafts cut where the constraint forbids one, and its masks for
        the positions the round verifies (None without a constraint)."""
        if draft.lazy and (self.constraint is not None or self.decider.needs_context):
            draft = self._materialize(draft)  # a grammar and a penalty walk token ids
        if self.constraint is None:
            return draft, None
        allowed, masks = self.constraint.plan(list(draft.tokens))
        return draft.head(allowed), masks[: allowed + 1]

    def judge(self, logits: mx.array, draft: Draft, masks: mx.array | None) -> tuple[Verdict, list[mx.array]]:
        """The lazy verdict on ``draft`` from the rows ``logits`` of its verify,
        and what the round must read: lazy drafts, the verdict, log-probabilities."""
        verdict = self.decider.judge(logits, self.tokens, draft.tokens, draft.probs, masks)
        parts = [draft.tokens] if draft.lazy else []
        parts.append(verdict.values)
        if self.top_logprobs is not None:
            drafts = draft.tokens if draft.lazy else mx.array(draft.tokens, dtype=mx.uint32)
            parts.append(logprob_block(logits, drafts, verdict.chosen(drafts), self.top_logprobs))
        return verdict, parts

    def settle(
        self, draft: Draft, verdict: Verdict, host: list[list[float]]
    ) -> tuple[int, list[int], list[TokenLogprob]]:
        """A verify's read parts (as :meth:`judge` listed them) resolved:
        accepted drafts, the tokens to commit, their log-probabilities; the
        rejected positions are trimmed."""
        host = list(host)
        if draft.lazy:
            draft.values = [int(t) for t in host.pop(0)]
        drafts = draft.values if draft.lazy else draft.tokens
        n, t = verdict.resolve(host[0], drafts)
        self.rt.trim(len(drafts) - n)
        new = [*drafts[:n], t]
        lps = read_logprobs(host[1], len(drafts), self.top_logprobs, new) if len(host) > 1 else []
        return n, new, lps

    def feed(self, draft: Draft) -> list[int] | mx.array:
        """What the round feeds: the last committed token, then the drafts."""
        last = self.tokens[-1]
        if draft.lazy:
            return mx.concatenate([mx.array([last], dtype=mx.uint32), draft.tokens.astype(mx.uint32)])
        return [last, *draft.tokens]

    @staticmethod
    def _materialize(draft: Draft) -> Draft:
        """Lazy drafts read now (a read of their own), as token ids."""
        draft.values = draft.tokens.tolist()
        return Draft(list(draft.values), draft.probs, draft.catch_up)

    def _queue(self, token: int | mx.array, ahead: int, since: float, chained: bool = False,
               mask: mx.array | None = None) -> Flight:  # fmt: skip
        """Queue a single-token forward of ``token`` (``ahead`` positions after
        the last committed token); its next token is computed lazily."""
        tq = self.rt.clock()
        fwd = self.rt.decode(token, capture_layers=self.capture)
        y = self.decider.next_token(fwd.logits[-1], self.tokens, ahead, None if mask is None else mask[0])
        parts = [y]
        if self.top_logprobs is not None:
            none = mx.zeros((0,), dtype=mx.uint32)
            parts.append(logprob_block(fwd.logits[-1:], none, y.reshape(1), self.top_logprobs))
        read = pack(parts)
        mx.async_eval(read)
        return Flight(read, [p.size for p in parts], fwd.hidden, since, tq, token=y, chained=chained)

    def _land(self, f: Flight) -> tuple[Round, list[int], dict[int, Any], list[TokenLogprob]]:
        """Read a round (one blocking read) and settle it: the tokens it
        commits, with the rejected positions trimmed."""
        if f.decode:
            return self._land_decode(f)
        host = unpack(self.rt.read(f.read), f.sizes)
        ts = self.rt.clock()
        n, new, lps = self.settle(f.draft, f.verdict, host)
        te = self.rt.clock()
        r = Round(k=f.k, drafted=len(f.draft), accepted=n, key=f.key, cost_seconds=ts - f.since,
                  catch_up=self.catch_up, propose_seconds=self.take_propose_seconds(),
                  verify_seconds=ts - f.queued, sample_seconds=te - ts,
                  predrafted=f.predrafted)  # fmt: skip
        return r, new, f.hidden, lps

    def _land_decode(self, f: Flight) -> tuple[Round, list[int], dict[int, Any], list[TokenLogprob]]:
        """Read a decode round, after queuing the next decode behind it if
        the pipeline allows."""
        tv = self.rt.clock()
        following = self._queue(f.token, 1, since=0.0, chained=True) if self._may_chain() else None
        host = unpack(self.rt.read(f.read), f.sizes)
        ts = self.rt.clock()
        y = int(host[0][0])
        if following is not None:
            following.since = ts
        self.flight = following
        lps = read_logprobs(host[1], 0, self.top_logprobs, [y]) if len(host) > 1 else []
        r = Round(cost_seconds=ts - f.since, catch_up=self.catch_up,
                  propose_seconds=self.take_propose_seconds(),
                  verify_seconds=ts - tv, restarted=not f.chained,
                  chain_end=f.chained and following is None)  # fmt: skip
        self._judge_early(r, y)
        return r, [y], f.hidden, lps

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
        if self.flight is not None and not self._drafts_at_round_start():
            t0 = self.rt.clock()
            key = self.draft_key()
            draft = self.propose(key, self.next_k(key))
            self.early = (key, draft) if draft else None  # drafts end the chain
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
            chain = self.next_k(self.draft_key()) == 0  # it drafts only once nothing is in flight
        return chain

    def _drafts_at_round_start(self) -> bool:
        """Whether the proposer drafts only with no decode in flight: from
        the target's cache at the last token (layer skip), or lazily from a
        model (no read to judge its drafts against the decode's token)."""
        return self.proposer.uses_target_cache or self.proposer.lazy_drafts

    def take_propose_seconds(self) -> float:
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


def resume(target: Target, prompt: list[int], k_max: int, reuse: bool, kv: KVConfig | None = None) -> Runtime:
    """A sequence for ``prompt`` whose caches store keys and values as ``kv``
    says (default: the Target's): fresh, or (``reuse``) holding the longest
    prefix of ``prompt[:-1]`` that the Target's prompt cache rebuilds exactly."""
    rt = target.runtime(slack=max(64, k_max + 2), rollback=k_max + 2, kv=kv)
    cache = target.prompt_cache
    if cache is not None and reuse:
        snap, n = cache.lookup(prompt, limit=len(prompt) - 1, kv=rt.kv)
        if snap is not None:
            rt.restore(snap, n)
    return rt


def prefill(rt: Runtime, prompt: list[int], capture: abc.Sequence[int]) -> dict[int, mx.array]:
    """Prefill all but the last prompt token (fed by the first round) after
    what the cache already holds; returns the captured hidden states. With a
    prompt cache, a state that later rounds cannot be cut back to (sliding
    windows, recurrent layers) is kept at the prompt's end."""
    if len(prompt) - 1 <= rt.offset:
        return {}
    fwd = rt.prefill(prompt[rt.offset : -1], logits="none", capture_layers=capture)
    mx.eval(rt.state(), list(fwd.hidden.values()))
    cache = rt.target.prompt_cache
    if cache is not None and not rt.trimmable:
        cache.add(rt.snapshot(prompt[:-1]))
    return fwd.hidden


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
