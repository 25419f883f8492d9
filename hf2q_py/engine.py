"""The one speculative loop shared by every method.

Each round: the proposer drafts up to K tokens after the committed ones ->
nothing drafted: one single-token decode (the baseline's own step) ->
otherwise one batched verify of ``[last, d1..dK]`` -> per-position target
tokens -> accept the longest matching prefix plus the target's token at the
first mismatch (or the bonus token after all K) -> trim the rejected
positions from the KV cache.

Invariant between rounds: the cache holds every committed token but the last
(``runtime.offset == len(tokens) - 1``); the last one is fed next round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Hashable, Iterator, Sequence

import mlx.core as mx

from .distributed import Sharding, agree, token_check
from .draft_length import NoDrafts, Policy, build_policy
from .errors import Hf2qError
from .proposers.base import Draft, PlainDecoding, Proposer
from .sampling import Greedy
from .stats import GenerationStats, Round
from .target import Runtime, Target

CLEAR_CACHE_EVERY = 256
DEFAULT_POLICY_K = 8


def generate_tokens(
    target: Target,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    proposer: Proposer | None = None,
    policy: Policy | None = None,
    eos_token_ids: Sequence[int] = (),
    stats: GenerationStats | None = None,
    on_round: Callable[[Round], None] | None = None,
    decider: Greedy | None = None,
    plain_first_token: bool = False,
) -> Iterator[list[int]]:
    """Yield each round's newly committed tokens.

    ``decider`` turns logits into tokens and judges drafts: greedy by
    default, or a ``Sampler`` (lossless speculative sampling). With no
    proposer this is plain decoding; a proposer without a ``policy`` gets an
    adaptive K of at most 8 (or its profile's ``min_k``) from its declared profile. ``plain_first_token``: the first round is a
    single-token decode, so the first token comes after one decode instead
    of a wider verify (a stream's time to first token).

    EOS ends generation (the EOS token itself is not yielded) and
    ``max_tokens`` is never exceeded, also inside an accepted block.
    """
    prompt = list(prompt)
    if not prompt:
        raise Hf2qError("the prompt is empty")
    if max_tokens < 1:
        raise Hf2qError(f"max_tokens must be >= 1, got {max_tokens}")
    proposer = proposer or PlainDecoding()
    if policy is None:
        policy = build_policy(proposer.profile, DEFAULT_POLICY_K) if proposer.active else NoDrafts()
    stats = stats if stats is not None else GenerationStats()
    decider = decider or Greedy()
    eos = set(eos_token_ids)
    stats.prompt_tokens = len(prompt)

    t0 = time.perf_counter()
    rt = _resume(target, prompt, policy.k_max, reuse=not proposer.capture_layers)
    stats.cached_tokens = rt.offset
    tp = rt.clock()
    hidden = _prefill(rt, prompt, proposer.capture_layers)
    prefill_seconds = rt.clock() - tp
    if target.sharding is not None and proposer.active:  # every rank's policy learns rank 0's time
        (prefill_seconds,) = agree(target.sharding, [prefill_seconds])
    policy.prefilled(len(prompt) - 1 - stats.cached_tokens, prefill_seconds)
    stats.prefill_seconds = time.perf_counter() - t0
    t_start = rt.clock()
    loop = _Loop(rt, proposer, policy, decider, prompt, max_tokens, stats)
    loop.plain_first_token = plain_first_token
    proposer.start(rt, prompt, hidden, decider)
    finished = False
    try:
        while True:
            step = loop.speculate() if loop.queued is None else None
            r, new, hidden = step or loop.decode()
            if target.sharding is not None and proposer.active:
                _agree(target.sharding, r, new)
            if not (plain_first_token and stats.rounds == 0):  # a decode by rule: no sample for the policy
                policy.update(r)
            new, done = _commit(loop.tokens, new, eos, max_tokens, stats)
            r.emitted = len(new)
            stats.record(r)
            if on_round is not None:
                on_round(r)
            if new:
                try:
                    yield new
                except GeneratorExit:  # closed between rounds: the caches are whole
                    finished = True
                    raise
            if done:
                finished = True
                return
            loop.after(r, hidden)
            if stats.rounds % CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
    finally:
        stats.decode_seconds = rt.clock() - t_start
        _finish(rt, proposer, loop.tokens, keep=finished)


#: The Round fields that are measured (and so differ between ranks).
TIMED_FIELDS = ("cost_seconds", "propose_seconds", "verify_seconds", "sample_seconds")


def _agree(sharding: Sharding, r: Round, new: list[int]) -> None:
    """On a sharded target: give this round rank 0's timings on every rank, so
    every rank's policy chooses the same draft lengths, and check that every
    rank committed the same tokens."""
    values = agree(sharding, [getattr(r, f) for f in TIMED_FIELDS], token_check(new))
    for name, value in zip(TIMED_FIELDS, values):
        setattr(r, name, value)


def _finish(rt: Runtime, proposer: Proposer, tokens: list[int], keep: bool) -> None:
    """Leave the cache holding exactly the committed tokens but the last, tell
    the proposer, and (``keep``: generation ended between rounds) add the
    state to the Target's prompt cache."""
    extra = rt.offset - (len(tokens) - 1)
    if extra > 0:
        rt.trim(extra)
    proposer.finish(tokens)
    if keep and rt.target.prompt_cache is not None:
        rt.target.prompt_cache.add(rt.snapshot(tokens[:-1]))


def _resume(target: Target, prompt: list[int], k_max: int, reuse: bool) -> Runtime:
    """A sequence for ``prompt``: fresh, or (``reuse``) holding the longest
    prefix of ``prompt[:-1]`` that the Target's prompt cache rebuilds exactly."""
    rt = target.runtime(slack=max(64, k_max + 2), rollback=k_max + 2)
    cache = target.prompt_cache
    if cache is not None and reuse:
        snap, n = cache.lookup(prompt, limit=len(prompt) - 1)
        if snap is not None:
            rt.restore(snap, n)
    return rt


def _prefill(rt: Runtime, prompt: list[int], capture: Sequence[int]) -> dict[int, mx.array]:
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


@dataclass
class _Queued:
    """A single-token decode in flight: ``token`` is its (lazy) next token."""

    token: mx.array
    hidden: dict[int, mx.array]
    since: float  # when it could start running: a chained decode starts when its predecessor ends
    chained: bool = False  # queued while the decode before it ran (pipelined)


Step = tuple[Round, list[int], dict[int, Any]]


class _Loop:
    """The state between rounds of one generation, and its two kinds of round.

    A *verify round* drafts and verifies ``[last, d1..dK]`` in one forward.
    A *decode round* reads one queued single-token decode. Decode rounds are
    pipelined as in mlx-lm: the next decode is queued before the current
    token is read back, so graph building overlaps the forward. When the
    proposer drafts during such a stretch (``early``), the queued decode's
    token is committed first and speculation starts from the next round,
    with the drafts the decode confirmed (``ready``), so no forward is wasted.

    Invariant between rounds: the cache holds every committed token but the
    last (``rt.offset == len(tokens) - 1``) plus, if ``queued``, the last.
    """

    def __init__(self, rt, proposer, policy, decider, prompt, max_tokens, stats):
        self.rt, self.proposer, self.policy, self.decider = rt, proposer, policy, decider
        self.clock = rt.clock
        self.capture = tuple(proposer.capture_layers)
        self.tokens = list(prompt)
        self.max_tokens, self.stats = max_tokens, stats
        self.queued: _Queued | None = None
        self.plain_first_token = False
        self.early: tuple[Hashable, Draft] | None = None  # drafted while a decode ran
        self.ready: tuple[Hashable, Draft] | None = None  # early drafts the decode confirmed
        self.propose_seconds = 0.0  # drafting time not yet charged to a round
        self.catch_up = 0  # committed tokens the proposer read in that time

    # -- choosing drafts -------------------------------------------------------
    def _key(self) -> Hashable:
        return self.proposer.draft_key(self.tokens) if self.proposer.active else None

    def _next_k(self, key: Hashable) -> int:
        if not self.proposer.active or (self.plain_first_token and self.stats.generated_tokens == 0):
            return 0
        return min(self.policy.next_k(key), self.max_tokens - self.stats.generated_tokens - 1)

    def _propose(self, key: Hashable) -> tuple[int, Draft]:
        k = self._next_k(key)
        draft = self.proposer.propose(self.tokens, k) if k > 0 else Draft()
        self.catch_up += draft.catch_up
        return k, draft.head(k)

    # -- rounds ----------------------------------------------------------------
    def speculate(self) -> Step | None:
        """A verify round; with nothing drafted, queue a decode and return None."""
        t0 = self.clock()
        predrafted = self.ready is not None
        if predrafted:
            (key, draft), self.ready = self.ready, None
            k = self._next_k(key)
            draft = draft.head(k)
        else:
            key = self._key()
            k, draft = self._propose(key)
        tv = self.clock()
        self.propose_seconds += tv - t0
        if not draft:
            self.queued = self._queue(self.tokens[-1], 0, since=tv)
            return None
        fwd = self.rt.verify([self.tokens[-1], *draft.tokens], capture_layers=self.capture)
        self.rt.wait(fwd.logits)
        ts = self.clock()
        n, t = self.decider.verify(fwd.logits, self.tokens, draft.tokens, draft.probs)
        self.rt.trim(len(draft) - n)
        te = self.clock()
        r = Round(k=k, drafted=len(draft), accepted=n, key=key, cost_seconds=ts - t0,
                  catch_up=self.catch_up, propose_seconds=self._take_propose_seconds(),
                  verify_seconds=ts - tv, sample_seconds=te - ts, predrafted=predrafted)  # fmt: skip
        return r, draft.tokens[:n] + [t], fwd.hidden

    def decode(self) -> Step:
        """A decode round: queue the next decode if the pipeline allows, then
        read the queued one's token."""
        tv = self.clock()
        q = self.queued
        following = self._queue(q.token, 1, since=0.0, chained=True) if self._may_chain() else None
        self.rt.wait(q.token)
        y = q.token.item()
        ts = self.clock()
        if following is not None:
            following.since = ts
        self.queued = following
        r = Round(cost_seconds=ts - q.since, catch_up=self.catch_up,
                  propose_seconds=self._take_propose_seconds(),
                  verify_seconds=ts - tv, restarted=not q.chained,
                  chain_end=q.chained and following is None)  # fmt: skip
        self._judge_early(r, y)
        return r, [y], q.hidden

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

    def after(self, r: Round, hidden: dict[int, Any]) -> None:
        """Once a round's tokens are committed: update the proposer, and draft
        early while a decode is in flight."""
        self.proposer.update(self.tokens, r.drafted, r.accepted, hidden)
        if self.queued is not None and not self.proposer.uses_target_cache:
            t0 = self.clock()
            key = self._key()
            _, draft = self._propose(key)
            self.early = (key, draft) if draft else None  # drafts end the chain
            self.propose_seconds += self.clock() - t0

    # -- helpers ---------------------------------------------------------------
    def _queue(self, token: int | mx.array, ahead: int, since: float, chained: bool = False) -> _Queued:
        """Queue a single-token forward of ``token`` (``ahead`` positions after
        the last committed token); its next token is computed lazily."""
        fwd = self.rt.decode(token, capture_layers=self.capture)
        y = self.decider.next_token(fwd.logits[-1], self.tokens, ahead)
        mx.async_eval(y)
        return _Queued(y, fwd.hidden, since, chained)

    def _may_chain(self) -> bool:
        """Whether the next decode may be queued before this one is read. The
        first token is read before anything else is queued: on backends whose
        async_eval blocks on a full queue (MLX's CPU), chaining there would
        delay it by a whole decode."""
        done = self.stats.generated_tokens
        chain = self.early is None and 0 < done < self.max_tokens - 1 and not self.decider.needs_context
        if chain and self.proposer.uses_target_cache:
            chain = self._next_k(self._key()) == 0  # it must draft from the cache at the last token
        return chain

    def _take_propose_seconds(self) -> float:
        """The drafting time (and catch-up) not yet charged, which the caller's round takes."""
        seconds, self.propose_seconds, self.catch_up = self.propose_seconds, 0.0, 0
        return seconds


def _commit(
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
