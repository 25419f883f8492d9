"""Turning logits into tokens: greedy, or sampling with the speculative
sampling rule that keeps the target's distribution exactly.

A *decider* is what the engine asks for the next token (plain decode) and
for the verdict on a block of drafts (verify):

- ``Greedy``: argmax; drafts are accepted while they equal the argmax.
- ``Sampler``: temperature, top-k, top-p and min-p filter the target's
  distribution p. A draft d drawn from the proposer's distribution q is
  accepted with probability min(1, p(d) / q(d)); at the first rejection the
  token is drawn from the normalised residual max(0, p - q); after K
  acceptances the bonus token is drawn from p. Proposers without
  probabilities (n-gram) give a point mass q = 1 at their draft.

Both apply the same logits processors (repetition penalty) in plain decoding
and at every verified position, each with its own context.

Randomness is keyed by (seed, position, purpose), never by how many draws
came before, so a seeded run does not depend on how rounds were split. The
target's own sample at a position is the Gumbel-max draw with that
position's key, in plain decoding and in verification alike; a point-mass
draft is accepted exactly when it equals that sample (probability p(d); the
token otherwise follows the residual p without d). N-gram speculation at
any K therefore emits exactly the tokens plain sampling with the same seed
emits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from collections.abc import Sequence

import mlx.core as mx

from .validate import check_float, check_int


MAX_INVERSE_TEMPERATURE = 1e30  # temperatures below 1e-30 act as 1e-30


@dataclass
class SamplingConfig:
    """How tokens are chosen; ``temperature`` 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    repetition_context: int = 20

    def validate(self) -> None:
        check_float("temperature", self.temperature, 0.0)
        check_float("top-p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("top-k", self.top_k, 0)
        check_float("min-p", self.min_p, 0.0, 1.0, hi_open=True)
        check_float("repetition penalty", self.repetition_penalty, 0.0, lo_open=True)
        check_int("repetition context", self.repetition_context, 1)
        if self.seed is not None:
            check_int("seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_penalty(logits: mx.array, contexts: Sequence[Sequence[int]], cfg: SamplingConfig) -> mx.array:
    """mlx-lm's repetition penalty, row by row: each row's recent context tokens
    have positive logits divided by, negative ones multiplied by, the penalty."""
    if cfg.repetition_penalty == 1.0:
        return logits
    rows = []
    for i, ctx in enumerate(contexts):
        row = logits[i]
        recent = sorted(set(ctx[-cfg.repetition_context :]))
        if recent:
            idx = mx.array(recent)
            sel = row[idx]
            row[idx] = mx.where(sel < 0, sel * cfg.repetition_penalty, sel / cfg.repetition_penalty)
        rows.append(row)
    return mx.stack(rows)


def filtered_probs(logits: mx.array, cfg: SamplingConfig) -> mx.array:
    """Row-wise distribution after temperature, top-k, min-p and top-p."""
    # Scaled after subtracting the maximum, with the factor capped: a tiny
    # temperature then tends to argmax (ties shared) instead of overflowing to NaN.
    x = logits.astype(mx.float32)
    x = (x - x.max(axis=-1, keepdims=True)) * min(1.0 / cfg.temperature, MAX_INVERSE_TEMPERATURE)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = mx.sort(x, axis=-1)[..., -cfg.top_k][..., None]
        x = mx.where(x < kth, -mx.inf, x)
    p = mx.softmax(x, axis=-1)
    if cfg.min_p > 0:
        p = mx.where(p < cfg.min_p * p.max(axis=-1, keepdims=True), 0.0, p)
    if cfg.top_p < 1.0:
        order = mx.argsort(-p, axis=-1)
        sorted_p = mx.take_along_axis(p, order, axis=-1)
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p  # mass of strictly larger tokens
        keep_sorted = before < cfg.top_p
        keep = mx.put_along_axis(mx.zeros(p.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        p = mx.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


@dataclass
class Verdict:
    """A verify round's outcome, lazy until the round's one read: ``values``
    holds the target's tokens for the ``k + 1`` positions (greedy), or which
    of the ``k`` drafts passed followed by the ``k + 1`` chosen tokens
    (sampling)."""

    values: mx.array
    k: int
    sampled: bool = False

    def resolve(self, host: Sequence[int], drafts: Sequence[int]) -> tuple[int, int]:
        """(accepted drafts, next token) from the read ``values``."""
        k = self.k
        if self.sampled:
            ok, choices = host[:k], host[k:]
            n = 0
            while n < k and ok[n]:
                n += 1
            return n, int(choices[n])
        n = 0
        while n < k and drafts[n] == host[n]:
            n += 1
        return n, int(host[n])

    def chosen(self, drafts: mx.array) -> mx.array:
        """Per position, the token emitted there if the drafts before it
        were accepted and it was not (lazy): the target's own choice."""
        return self.values[self.k :] if self.sampled else self.values


#: The most alternatives ``top_logprobs`` may ask for per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target's own
    distribution (the model's logits, before any processor, mask or
    temperature) and the ``top`` most likely tokens there, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def logprob_block(logits: mx.array, drafts: mx.array, chosen: mx.array, top: int) -> mx.array:
    """What ``TokenLogprob`` needs for the rows of one forward, lazily, as one
    float32 vector: the log-probability of each draft at its row, of each
    row's chosen token, then each row's ``top`` token ids and their
    log-probabilities (:func:`read_logprobs` takes it apart)."""
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    k = drafts.shape[0]
    parts = [
        mx.take_along_axis(lp[:k], drafts.astype(mx.uint32)[:, None], axis=-1)[:, 0],
        mx.take_along_axis(lp, chosen.astype(mx.uint32)[:, None], axis=-1)[:, 0],
    ]
    if top:
        ids = mx.argpartition(-lp, top - 1, axis=-1)[:, :top]
        vals = mx.take_along_axis(lp, ids, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        parts += [mx.take_along_axis(ids, order, axis=-1).astype(mx.float32).reshape(-1),
                  mx.take_along_axis(vals, order, axis=-1).reshape(-1)]  # fmt: skip
    return mx.concatenate(parts)


def read_logprobs(host: Sequence[float], k: int, top: int, emitted: Sequence[int]) -> list[TokenLogprob]:
    """The ``TokenLogprob`` of each emitted token (the first ``len(emitted) - 1``
    are accepted drafts, the last the chosen token) from a read
    :func:`logprob_block` of ``k`` drafts."""
    rows = k + 1
    lp_draft, lp_chosen = host[:k], host[k : k + rows]
    ids, vals = host[k + rows : k + rows + rows * top], host[k + rows + rows * top :]
    out = []
    for j, token in enumerate(emitted):
        lp = lp_draft[j] if j < len(emitted) - 1 else lp_chosen[j]
        alts = [(int(ids[j * top + i]), float(vals[j * top + i])) for i in range(top)]
        out.append(TokenLogprob(int(token), float(lp), alts))
    return out


def masked(logits: mx.array, mask: mx.array | None) -> mx.array:
    """``logits`` with the tokens ``mask`` forbids (False) at -inf."""
    if mask is None:
        return logits
    return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))


class Greedy:
    """Temperature 0: argmax after the logits processors."""

    def __init__(self, cfg: SamplingConfig | None = None):
        self.cfg = cfg or SamplingConfig()

    @property
    def needs_context(self) -> bool:
        """True when a token choice depends on the tokens before it (penalty)."""
        return self.cfg.repetition_penalty != 1.0

    def next_token(
        self, logits: mx.array, context: Sequence[int], ahead: int = 0, mask: mx.array | None = None
    ) -> mx.array:
        """Token ``ahead`` positions after ``context`` (whose tokens in between
        are still in flight) from a (vocab,) logits row (lazy); ``mask``
        (vocab,) forbids tokens (structured output)."""
        if self.cfg.repetition_penalty != 1.0:
            logits = apply_penalty(logits[None], [context], self.cfg)[0]
        return mx.argmax(masked(logits, mask), axis=-1)

    def judge(
        self,
        logits: mx.array,
        context: Sequence[int],
        drafts: Sequence[int] | mx.array,
        q: mx.array | None,
        mask: mx.array | None = None,
    ) -> Verdict:
        """The lazy verdict on ``drafts`` from the rows ``logits`` of
        ``[last, *drafts]``; ``mask`` (k + 1, vocab) forbids tokens per row.
        ``drafts`` may be a lazy array, except under a repetition penalty."""
        if self.cfg.repetition_penalty != 1.0:
            ctx, d = list(context), list(drafts)
            logits = apply_penalty(logits, [ctx + d[:i] for i in range(len(d) + 1)], self.cfg)
        return Verdict(mx.argmax(masked(logits, mask), axis=-1), logits.shape[0] - 1)

    def draft_token(
        self, logits: mx.array, context: Sequence[int], ahead: int = 0
    ) -> tuple[mx.array, mx.array | None]:
        """A proposer's draft for the position ``ahead`` tokens after ``context``
        and its distribution q (None: argmax). The penalty sees ``context`` only."""
        return self.next_token(logits, context, ahead), None


_SAMPLE, _DRAFT, _ACCEPT, _RESIDUAL = range(4)


def _mix(*parts: int) -> int:
    """A 64-bit hash of small integers (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for x in parts:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h


class Sampler(Greedy):
    """Temperature > 0: lossless speculative sampling (see module docstring)."""

    def __init__(self, cfg: SamplingConfig):
        super().__init__(cfg)
        self.seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(8), "little")

    def key(self, position: int, purpose: int) -> mx.array:
        """The random key for ``purpose`` at sequence ``position``."""
        return mx.random.key(_mix(self.seed, position, purpose))

    def probs(
        self, logits: mx.array, contexts: Sequence[Sequence[int]], mask: mx.array | None = None
    ) -> mx.array:
        return filtered_probs(masked(apply_penalty(logits, contexts, self.cfg), mask), self.cfg)

    def draw(self, p: mx.array, position: int, purpose: int = _SAMPLE) -> mx.array:
        """Gumbel-max samples from the rows of ``p``, row i keyed at ``position + i``."""
        noise = [
            mx.random.gumbel(shape=p.shape[-1:], key=self.key(position + i, purpose))
            for i in range(p.shape[0])
        ]
        return mx.argmax(mx.log(p) + mx.stack(noise), axis=-1)

    def next_token(
        self, logits: mx.array, context: Sequence[int], ahead: int = 0, mask: mx.array | None = None
    ) -> mx.array:
        p = self.probs(logits[None], [context], None if mask is None else mask[None])
        return self.draw(p, len(context) + ahead)[0]

    def draft_token(
        self, logits: mx.array, context: Sequence[int], ahead: int = 0
    ) -> tuple[mx.array, mx.array | None]:
        q = self.probs(logits[None], [context])
        return self.draw(q, len(context) + ahead, _DRAFT)[0], q[0]

    def accept(self, p_draft: mx.array, q_draft: mx.array, u: mx.array) -> mx.array:
        """Which drafts pass the test u < p(d) / q(d) (a hook tests can break)."""
        return u * q_draft < p_draft

    def judge(
        self,
        logits: mx.array,
        context: Sequence[int],
        drafts: Sequence[int] | mx.array,
        q: mx.array | None,
        mask: mx.array | None = None,
    ) -> Verdict:
        k, pos = logits.shape[0] - 1, len(context)
        if self.cfg.repetition_penalty != 1.0:
            ctx, d = list(context), list(drafts)
            contexts = [ctx + d[:i] for i in range(k + 1)]
        else:
            contexts = [()] * (k + 1)
        p = self.probs(logits, contexts, mask)  # (k+1, V)
        own = self.draw(p, pos)  # the target's own sample at every position
        d = drafts if isinstance(drafts, mx.array) else mx.array(list(drafts), dtype=mx.uint32)
        if q is None:  # point masses: accept a draft exactly when it is the target's sample
            ok = d.astype(own.dtype) == own[:k]
            choices = own
        else:
            if q.shape[-1] < p.shape[-1]:  # a draft vocabulary may be smaller
                q = mx.pad(q, [(0, 0), (0, p.shape[-1] - q.shape[-1])])
            p_d = mx.take_along_axis(p[:k], d.astype(mx.uint32)[:, None], axis=-1)[:, 0]
            q_d = mx.take_along_axis(q, d.astype(mx.uint32)[:, None], axis=-1)[:, 0]
            u = mx.stack([mx.random.uniform(shape=(), key=self.key(pos + i, _ACCEPT)) for i in range(k)])
            ok = self.accept(p_d, q_d, u)
            resid = mx.maximum(p[:k] - q, 0.0)
            mass = resid.sum(axis=-1, keepdims=True)
            resid = mx.where(mass > 0, resid / mx.maximum(mass, 1e-30), p[:k])
            choices = mx.concatenate([self.draw(resid, pos, _RESIDUAL), own[k:]])  # bonus: own sample
        values = mx.concatenate([ok.astype(mx.uint32), choices.astype(mx.uint32)]) if k else choices
        return Verdict(values.astype(mx.uint32), k, sampled=True)


def make_decider(cfg: SamplingConfig | None) -> Greedy:
    cfg = cfg or SamplingConfig()
    cfg.validate()
    return Greedy(cfg) if cfg.greedy else Sampler(cfg)
