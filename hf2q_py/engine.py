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
from typing import Callable, Hashable, Iterator, Sequence


import mlx.core as mx

from .draft_length import AdaptiveK, FixedK
from .errors import Hf2qError
from .proposers.base import Proposer
from .sampling import Greedy
from .stats import GenerationStats
from .target import Forward, Target

CLEAR_CACHE_EVERY = 256


@dataclass
class RoundInfo:
    """One round, as passed to the ``on_round`` profiling hook."""

    index: int
    k: int
    drafted: int
    accepted: int
    emitted: int
    propose_seconds: float
    verify_seconds: float
    sample_seconds: float


def generate_tokens(
    target: Target,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    proposer: Proposer | None = None,
    policy: FixedK | AdaptiveK | None = None,
    eos_token_ids: Sequence[int] = (),
    stats: GenerationStats | None = None,
    on_round: Callable[[RoundInfo], None] | None = None,
    decider: Greedy | None = None,
) -> Iterator[list[int]]:
    """Yield each round's newly committed tokens.

    ``decider`` turns logits into tokens and judges drafts: greedy by
    default, or a ``Sampler`` (lossless speculative sampling).

    With no proposer this is plain decoding. Plain decode rounds are
    pipelined as in mlx-lm: the next decode is queued before the current
    token is read back, so graph building overlaps the forward. When the
    proposer drafts during such a stretch, the queued decode's token is
    committed first and speculation starts from the next round (drafts it
    already confirmed are carried over), so no forward is wasted.

    EOS ends generation (the EOS token itself is not yielded) and
    ``max_tokens`` is never exceeded, also inside an accepted block.
    """
    prompt = list(prompt)
    if not prompt:
        raise Hf2qError("the prompt is empty")
    if max_tokens < 1:
        raise Hf2qError(f"max_tokens must be >= 1, got {max_tokens}")
    stats = stats if stats is not None else GenerationStats()
    decider = decider or Greedy()
    stats.prompt_tokens = len(prompt)
    eos = set(eos_token_ids)
    capture = tuple(proposer.capture_layers) if proposer else ()
    k_max = getattr(policy, "k_max", getattr(policy, "k", 0))
    rt = target.runtime(slack=max(64, k_max + 2))

    t0 = time.perf_counter()
    hidden: dict = {}
    if len(prompt) > 1:
        fwd = rt.prefill(prompt[:-1], logits="none", capture_layers=capture)
        hidden = fwd.hidden
        mx.eval(rt.state(), list(hidden.values()))
    stats.prefill_seconds = time.perf_counter() - t0
    t_start = time.perf_counter()
    tokens = list(prompt)
    if proposer is not None:
        proposer.decider = decider
        proposer.start(rt, prompt, hidden)

    def decode(token, context: list[int], ahead: int = 0) -> Forward:
        """Queue a single-token forward of ``token`` (``ahead`` positions after
        ``context``'s last token); ``.logits`` becomes the next token (lazy)."""
        fwd = rt.decode(token, capture_layers=capture)
        fwd.logits = decider.next_token(fwd.logits[-1], context, ahead)
        mx.async_eval(fwd.logits)
        return fwd

    def draft_key() -> Hashable:
        return proposer.draft_key(tokens) if proposer is not None and proposer.active else None

    def next_k(key: Hashable) -> int:
        if proposer is None or not proposer.active:
            return 0
        return min(policy.next_k(key), max_tokens - stats.generated_tokens - 1)

    queued: Forward | None = None  # a decode of tokens[-1], already in flight
    t_queued = 0.0  # when the queued decode could start running
    waiting: list[int] | None = None  # drafts proposed while a decode was in flight
    carried: list[int] = []  # drafts for the current context that the decode confirmed
    waiting_key: Hashable = None  # the proposer's draft key for ``waiting``
    try:
        while True:
            if queued is None:
                # -- a verify round, unless nothing is drafted ---------------
                tp = time.perf_counter()
                key = waiting_key if carried else draft_key()
                k = next_k(key)
                drafts = (carried or (proposer.propose(tokens, k) if k > 0 else []))[:k]
                carried = []
                tv = time.perf_counter()
                if not drafts:
                    queued, t_queued = decode(tokens[-1], tokens), tv
                else:
                    q = proposer.draft_probs
                    fwd = rt.verify([tokens[-1], *drafts], capture_layers=capture)
                    mx.eval(fwd.logits)
                    ts = time.perf_counter()
                    n, t = decider.verify(fwd.logits, tokens, drafts, q[: len(drafts)] if q is not None else None)
                    rt.trim(len(drafts) - n)
                    new = drafts[:n] + [t]
                    te = time.perf_counter()
                    # the round's cost includes drafting (a draft model's or a skip pass's forwards)
                    policy.update(len(drafts) + 1, ts - tp, len(drafts), n, key)
                    stats.record_round(len(drafts), n)
                    stats.propose_seconds += tv - tp
                    stats.verify_seconds += ts - tv
                    stats.sample_seconds += te - ts
                    new, done = _commit(tokens, new, eos, max_tokens, stats)
                    if on_round is not None:
                        on_round(RoundInfo(stats.rounds, k, len(drafts), n, len(new), tv - tp, ts - tv, te - ts))
                    if new:
                        yield new
                    if done:
                        return
                    proposer.update(tokens, len(drafts), n, fwd.hidden)
                    continue
            # -- a plain decode round: queue the next decode, then read this one
            tv = time.perf_counter()
            # The first token is read before anything else is queued: on backends whose
            # async_eval blocks on a full queue (MLX's CPU), chaining here would delay it
            # by one whole decode, and elsewhere it saves only one graph build.
            chain = (
                waiting is None
                and 0 < stats.generated_tokens < max_tokens - 1
                and not decider.needs_context
            )
            if chain and proposer is not None and proposer.uses_target_cache:
                chain = next_k(draft_key()) == 0  # it must draft from the cache at the last token
            following = decode(queued.logits, tokens, 1) if chain else None
            y = queued.logits.item()
            ts = time.perf_counter()
            if proposer is not None:
                # a chained decode starts when its predecessor ends: time it from there
                policy.update(1, ts - t_queued, 0, 0)
            stats.record_round(0, 0)
            stats.verify_seconds += ts - tv
            new, done = _commit(tokens, [y], eos, max_tokens, stats)
            if on_round is not None:
                on_round(RoundInfo(stats.rounds, 0, 0, 0, len(new), 0.0, ts - tv, 0.0))
            if new:
                yield new
            if done:
                return
            if waiting is not None:
                # greedy drafts stay valid if the decode confirmed the first one
                carried = waiting[1:] if decider.cfg.greedy and waiting[0] == y else []
                if decider.cfg.greedy and not carried and waiting[0] != y:
                    # the decode rejected them: the policy learns it as from a verify
                    policy.observe(len(waiting), 0, waiting_key)
                waiting = None
            if proposer is not None:
                proposer.update(tokens, 0, 0, queued.hidden)
            queued, t_queued = following, ts
            if queued is not None and proposer is not None and not proposer.uses_target_cache:
                tp = time.perf_counter()
                waiting_key = draft_key()
                k = next_k(waiting_key)
                if k > 0:  # drafts end the chain: speculation resumes after the queued decode
                    waiting = proposer.propose(tokens, k)[:k] or None
                stats.propose_seconds += time.perf_counter() - tp
            if stats.rounds % CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
    finally:
        stats.decode_seconds = time.perf_counter() - t_start
        # Leave the cache holding exactly the committed tokens but the last.
        extra = rt.offset - (len(tokens) - 1)
        if extra > 0:
            rt.trim(extra)
        if proposer is not None:
            proposer.finish(tokens)


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
