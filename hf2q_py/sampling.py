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
from dataclasses import dataclass
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


class Greedy:
    """Temperature 0: argmax after the logits processors."""

    def __init__(self, cfg: SamplingConfig | None = None):
        self.cfg = cfg or SamplingConfig()

    @property
    def needs_context(self) -> bool:
        """True when a token choice depends on the tokens before it (penalty)."""
        return self.cfg.repetition_penalty != 1.0

    def next_token(self, logits: mx.array, context: Sequence[int], ahead: int = 0) -> mx.array:
        """Token ``ahead`` positions after ``context`` (whose tokens in between
        are still in flight) from a (vocab,) logits row (lazy)."""
        if self.cfg.repetition_penalty != 1.0:
            logits = apply_penalty(logits[None], [context], self.cfg)[0]
        return mx.argmax(logits, axis=-1)

    def verify(
        self, logits: mx.array, context: Sequence[int], drafts: Sequence[int], q: mx.array | None
    ) -> tuple[int, int]:
        """(accepted drafts, next token) for rows ``logits`` of ``[last, *drafts]``."""
        if self.cfg.repetition_penalty != 1.0:
            ctx = list(context)
            logits = apply_penalty(logits, [ctx + list(drafts[:i]) for i in range(len(drafts) + 1)], self.cfg)
        targets = mx.argmax(logits, axis=-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == targets[n]:
            n += 1
        return n, targets[n]

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

    def probs(self, logits: mx.array, contexts: Sequence[Sequence[int]]) -> mx.array:
        return filtered_probs(apply_penalty(logits, contexts, self.cfg), self.cfg)

    def draw(self, p: mx.array, position: int, purpose: int = _SAMPLE) -> mx.array:
        """Gumbel-max samples from the rows of ``p``, row i keyed at ``position + i``."""
        noise = [
            mx.random.gumbel(shape=p.shape[-1:], key=self.key(position + i, purpose))
            for i in range(p.shape[0])
        ]
        return mx.argmax(mx.log(p) + mx.stack(noise), axis=-1)

    def next_token(self, logits: mx.array, context: Sequence[int], ahead: int = 0) -> mx.array:
        return self.draw(self.probs(logits[None], [context]), len(context) + ahead)[0]

    def draft_token(
        self, logits: mx.array, context: Sequence[int], ahead: int = 0
    ) -> tuple[mx.array, mx.array | None]:
        q = self.probs(logits[None], [context])
        return self.draw(q, len(context) + ahead, _DRAFT)[0], q[0]

    def accept(self, p_draft: mx.array, q_draft: mx.array, u: mx.array) -> mx.array:
        """Which drafts pass the test u < p(d) / q(d) (a hook tests can break)."""
        return u * q_draft < p_draft

    def verify(
        self, logits: mx.array, context: Sequence[int], drafts: Sequence[int], q: mx.array | None
    ) -> tuple[int, int]:
        k, pos = len(drafts), len(context)
        ctx = list(context)
        p = self.probs(logits, [ctx + list(drafts[:i]) for i in range(k + 1)])  # (k+1, V)
        own = self.draw(p, pos)  # the target's own sample at every position
        if q is None:  # point masses: accept a draft exactly when it is the target's sample
            ok = mx.array(list(drafts), dtype=own.dtype) == own[:k]
            choices = own
        else:
            if q.shape[-1] < p.shape[-1]:  # a draft vocabulary may be smaller
                q = mx.pad(q, [(0, 0), (0, p.shape[-1] - q.shape[-1])])
            d = mx.array(list(drafts), dtype=mx.uint32)[:, None]
            p_d = mx.take_along_axis(p[:k], d, axis=-1)[:, 0]
            q_d = mx.take_along_axis(q, d, axis=-1)[:, 0]
            u = mx.stack([mx.random.uniform(shape=(), key=self.key(pos + i, _ACCEPT)) for i in range(k)])
            ok = self.accept(p_d, q_d, u)
            resid = mx.maximum(p[:k] - q, 0.0)
            mass = resid.sum(axis=-1, keepdims=True)
            resid = mx.where(mass > 0, resid / mx.maximum(mass, 1e-30), p[:k])
            choices = mx.concatenate([self.draw(resid, pos, _RESIDUAL), own[k:]])  # bonus: own sample
        ok_list, choice_list = ok.tolist(), choices.tolist()
        n = 0
        while n < k and ok_list[n]:
            n += 1
        return n, choice_list[n]


def make_decider(cfg: SamplingConfig | None) -> Greedy:
    cfg = cfg or SamplingConfig()
    cfg.validate()
    return Greedy(cfg) if cfg.greedy else Sampler(cfg)
