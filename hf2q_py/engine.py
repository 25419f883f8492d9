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
from typing import Callable, Iterator, Sequence


import mlx.core as mx

from .draft_length import AdaptiveK, FixedK
from .errors import Hf2qError
from .proposers.base import Proposer
from .stats import GenerationStats
from .target import Target

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


def _greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


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
) -> Iterator[list[int]]:
    """Yield each round's newly committed tokens (greedy, temperature 0).

    EOS ends generation (the EOS token itself is not yielded) and
    ``max_tokens`` is never exceeded, also inside an accepted block.
    """
    prompt = list(prompt)
    if not prompt:
        raise Hf2qError("the prompt is empty")
    if max_tokens < 1:
        raise Hf2qError(f"max_tokens must be >= 1, got {max_tokens}")
    stats = stats if stats is not None else GenerationStats()
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
    try:
        if proposer is None:
            yield from _plain_decode(rt, tokens, max_tokens, eos, stats)
            return
        proposer.start(rt, prompt, hidden)
        emitted = 0
        while emitted < max_tokens:
            tp = time.perf_counter()
            k = min(policy.next_k(), max_tokens - emitted - 1)
            drafts = proposer.propose(tokens, k)[:k] if k > 0 else []
            tv = time.perf_counter()
            fwd = rt.forward([tokens[-1], *drafts], capture_layers=capture)
            targets = _greedy(fwd.logits).tolist()
            ts = time.perf_counter()
            n = 0
            while n < len(drafts) and drafts[n] == targets[n]:
                n += 1
            new = drafts[:n] + [targets[n]]
            rt.trim(len(drafts) - n)
            te = time.perf_counter()

            policy.update(len(drafts) + 1, ts - tv, len(drafts), n)
            stats.record_round(len(drafts), n)
            stats.propose_seconds += tv - tp
            stats.verify_seconds += ts - tv
            stats.sample_seconds += te - ts
            finished = False
            for i, t in enumerate(new):
                if t in eos:
                    new, finished = new[:i], True
                    stats.finish_reason = "stop"
                    break
            tokens.extend(new)
            emitted += len(new)
            stats.generated_tokens = emitted
            if not finished:
                proposer.update(tokens, len(drafts), n, fwd.hidden)
            if on_round is not None:
                on_round(RoundInfo(stats.rounds, k, len(drafts), n, len(new), tv - tp, ts - tv, te - ts))
            if new:
                yield new
            if finished:
                return
            if stats.rounds % CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
        stats.finish_reason = "length"
    finally:
        stats.decode_seconds = time.perf_counter() - t_start
        # Leave the cache holding exactly the committed tokens but the last.
        extra = rt.offset - (len(tokens) - 1)
        if extra > 0:
            rt.trim(extra)


def _plain_decode(rt, tokens: list[int], max_tokens: int, eos: set[int], stats: GenerationStats):
    """Plain greedy decoding, pipelined like mlx-lm: the next step's graph is
    built and queued before the current token is read back."""

    def step(y):
        return _greedy(rt.decode(y).logits[-1])

    y = step(tokens[-1])
    mx.async_eval(y)
    n = 0
    while True:
        if n + 1 < max_tokens:
            y_next = step(y)
            mx.async_eval(y_next)
        t = y.item()
        stats.rounds += 1
        stats.empty_proposals += 1
        if t in eos:
            stats.finish_reason = "stop"
            return
        tokens.append(t)
        n += 1
        stats.generated_tokens = n
        yield [t]
        if n == max_tokens:
            stats.finish_reason = "length"
            return
        if n % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        y = y_next
