"""Draft-model speculation: a small model with the target's tokenizer drafts
K tokens autoregressively with its own KV cache, kept in step with the
committed tokens by trimming after each round."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..draft_length.profile import DraftProfile
from ..errors import Hf2qError
from ..kv import kv_footprint
from ..target import PREFILL_CHUNK, Target
from .base import BatchDrafter, Draft, Proposer
from .draft_batch import DraftBatch, draft_batch_refusal


def check_compatible(target: Target, draft: Target) -> None:
    """Same tokenizer (identical token strings), draft ids valid for the target,
    and a draft embedding row for every id the tokenizer can produce."""
    tv, dv = target.vocab_size, draft.vocab_size
    if target.tokenizer is not None and draft.tokenizer is not None:
        vocab = target.tokenizer.get_vocab()
        if vocab != draft.tokenizer.get_vocab():
            raise Hf2qError(
                "the draft model's tokenizer differs from the target's (token strings do not "
                "match); a draft model must share the target's vocabulary"
            )
        ids = max(vocab.values(), default=-1) + 1
        if dv is not None and dv < ids:
            raise Hf2qError(
                f"the draft model's vocabulary ({dv}) is smaller than its tokenizer's ({ids} token ids)"
            )
    elif tv != dv:
        raise Hf2qError(f"the draft model's vocabulary ({dv}) differs from the target's ({tv})")
    if dv is not None and tv is not None and dv > tv:
        raise Hf2qError(f"the draft model's vocabulary ({dv}) is larger than the target's ({tv})")


#: Prior acceptance of a draft model's tokens (a same-family draft model with the
#: confidence rule ``draft_min_prob`` 0.5: 93-100% on the code-editing workloads of
#: Qwen2.5-Coder 1.5B/0.5B; 86-100% without it): adaptive K starts from it, then measures.
DRAFT_PRIOR_RATE = 0.95
#: Prior extra cost of each verified token relative to a decode, for a target big
#: enough to want a draft model (Qwen2.5-Coder 1.5B on a 2-core CPU: 9 tokens cost
#: 1.35-1.45 decodes; memory-bound GPUs verify cheaper still), until measured.
DRAFT_PRIOR_SLOPE = 0.05


#: Committed tokens a draft model may have left unread when its generation
#: leaves a batch to go on alone (a round's drafts and the token after them).
ALONE_BEHIND = 17


def relative_cost(target: Target, draft: Target) -> float:
    """A prior for the cost of one draft-model step relative to a target decode:
    the ratio of their weights' bytes (decoding reads every weight once)."""

    def size(t: Target) -> int:
        return sum(v.nbytes for _, v in tree_flatten(t.model.parameters()))

    return min(1.0, size(draft) / max(size(target), 1))


class DraftModelProposer(Proposer):
    """Drafts with a second, smaller model.

    A draft follows the draft model's confidence. ``min_prob`` > 0: a draft
    ends at the token where its estimated probability of being accepted
    whole (the product of the draft model's probabilities of its tokens)
    falls below ``min_prob``, that token kept; ``p_min`` > 0: a draft ends
    before the first token whose top probability is below ``p_min``
    (llama.cpp's ``--draft-p-min``). Weak drafts then cost neither draft
    steps nor verify width, and a K large enough for long sure runs (the
    draft method's default is 16) stays cheap where the draft model is
    unsure. Each step's confidence is read after the next step is built,
    before it runs.

    ``lazy_prefill``: the draft model reads the prompt only when it first
    drafts (adaptive K or copies may never need it), in one batched catch-up.

    In a batch, the rows drafting with the same draft model share one
    :class:`~hf2q_py.proposers.draft_batch.DraftBatch`: its batched forwards
    draft for all of them at once, its caches hold this proposer's as a row.
    """

    name = "draft"

    def __init__(
        self,
        draft: Target,
        p_min: float = 0.0,
        lazy_prefill: bool = False,
        cost: float = 0.0,
        min_prob: float = 0.0,
    ):
        self.draft = draft
        self.cost = cost  # prior cost of one draft step relative to a target decode
        self.p_min = p_min
        self.min_prob = min_prob
        self.lazy_prefill = lazy_prefill
        self.rt = None  # the draft's runtime: its own, or its row of a DraftBatch
        self.cached: list[int] = []  # tokens whose K/V are in the draft's cache
        self.synced = 0  # cached[:synced] are known to be committed tokens
        self.confidence: list[float] = []  # the latest draft's top probability per token (when gated)
        #: Lazy drafts in the cache after ``cached`` (their values known once verified: ``update``).
        self.unread = 0
        self.done = False  # finished: its cache is no longer needed
        self._refusal: str | None | bool = False  # why the draft model cannot batch (False: not asked)

    @property
    def model(self) -> DraftModelProposer:
        """The proposer that drafts with the model (itself)."""
        return self

    @property
    def batchable(self) -> bool:
        """Whether its rows can share a batch: when the draft model can run
        batched with rollback across steps (attention layers; no recurrent
        state, no sharding). Otherwise the generation runs alone beside the batch."""
        if self._refusal is False:
            self._refusal = draft_batch_refusal(self.draft)
        return self._refusal is None

    def batch_drafter(self, batch: Any) -> tuple[Hashable, Callable[[], BatchDrafter]] | None:
        """Rows drafting with the same draft model (the same Target) share one ``DraftBatch``."""
        if not self.batchable:
            return None
        return ("draft model", self.draft), lambda: DraftBatch(
            self.draft, self.cost, batch.costs, batch.ragged
        )

    def route(self, tokens: Sequence[int], k: int) -> Draft | int:
        """A round's drafts made on the host (none here), or how many drafts
        the model makes (a batch drafter asks this first)."""
        return k

    def goes_alone(self, tokens: Sequence[int]) -> bool:
        """Not while more committed tokens than a round's drafts are unread (a
        row that copied in a batch): alone it would read them all before drafting."""
        return len(tokens) - len(self.cached) <= ALONE_BEHIND

    def fallback(self, tokens: Sequence[int], k: int) -> Draft:
        """A batch row's drafts in a round its model drafts none for (no step
        pays): none here."""
        return Draft()

    @property
    def profile(self) -> DraftProfile:
        """Drafting is charged per draft token (``split_drafting``), from this
        model's weight-size prior until measured; acceptance and verify cost
        start from a same-family pair's; draft positions share one
        acceptance rate (an autoregressive draft errs about as often at
        every position). The shared rate is pessimistic for long drafts when
        rejections cluster at the first positions (code): no margin against
        longer K (benchmarks/bench_draft_length.py)."""
        return DraftProfile(
            geometric_keys=frozenset({None}),
            split_drafting=True,
            draft_cost_priors={None: self.cost},
            prior_rate=DRAFT_PRIOR_RATE,
            prior_slope=DRAFT_PRIOR_SLOPE,
            longer_margin=0.0,
        )

    def own_memory(self, tokens: int) -> tuple[tuple[Any, ...], int]:
        """The draft model, and its caches for ``tokens`` positions."""
        return (self.draft.model,), kv_footprint(self.draft).bytes(tokens)

    def start(self, runtime, prompt: Sequence[int], hidden, decider) -> None:
        self.decider = decider
        self.rt = self.draft.runtime()
        self.cached = []
        self.unread, self.done = 0, False
        if len(prompt) > 1 and not self.lazy_prefill:
            self.rt.prefill(self._embeddable(prompt[:-1]), logits="none")
            self.cached = list(prompt[:-1])
            mx.eval(self.rt.state())
        self.synced = len(self.cached)

    def _embeddable(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` with ids past the draft's embedding (padding ids of a larger
        target vocabulary, never produced by the shared tokenizer) replaced by
        its last id: the draft sees a wrong token there, never an out-of-bounds read."""
        dv = self.draft.vocab_size
        if dv is None or max(tokens, default=0) < dv:
            return list(tokens)
        return [min(t, dv - 1) for t in tokens]

    def update(self, tokens: Sequence[int], drafted: int, accepted: int, hidden) -> None:
        """After a round: lazy drafts in the cache that the target accepted
        are committed tokens now (``tokens`` holds them), the rest is trimmed."""
        if self.unread:
            keep = min(accepted, self.unread)
            start = len(self.cached)
            self.cached.extend(tokens[start : start + keep])
            self.rt.trim(self.unread - keep)
            self.unread = 0

    def finish(self, tokens: Sequence[int]) -> None:
        self.done = True

    def _sync(self, tokens: Sequence[int]) -> list[int]:
        """Trim the draft cache to its longest prefix of ``tokens`` (leaving at
        least one token to feed); return the tokens still to feed."""
        if self.unread:  # lazy drafts no round judged: not known to be committed
            self.rt.trim(self.unread)
            self.unread = 0
        # cached[:synced] are committed tokens (history never changes); past
        # that the cache holds drafts, valid only as far as they were accepted
        n, limit = self.synced, min(len(self.cached), len(tokens) - 1)
        n = min(n, limit)
        while n < limit and self.cached[n] == tokens[n]:
            n += 1
        self.rt.trim(len(self.cached) - n)
        del self.cached[n:]
        self.synced = len(tokens)
        return list(tokens[n:])

    def _catch_up(self, feed: list[int]) -> mx.array:
        """Feed the committed tokens the draft has not seen; the last one's logits.
        A long catch-up (a lazy prefill) goes through the chunked prefill."""
        feed = self._embeddable(feed)
        if len(feed) > PREFILL_CHUNK:
            self.rt.prefill(feed[:-1], logits="none")
            feed = feed[-1:]
        return self.rt.forward(feed, logits="last").logits[-1]

    @property
    def gated(self) -> bool:
        """Whether a confidence rule (``p_min``, ``min_prob``) may end a draft early."""
        return self.p_min > 0 or self.min_prob > 0

    @property
    def lazy_drafts(self) -> bool:
        """Drafts stay lazy (no read before their verify) unless a confidence
        rule needs each step's probability read to end a draft early."""
        return not self.gated

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        feed = self._sync(tokens)
        logits = self._catch_up(feed)
        self.cached.extend(feed)
        if self.lazy_drafts:
            return self._lazy(tokens, k, logits, len(feed))
        return self._gated(tokens, k, logits, len(feed))

    def _lazy(self, tokens: Sequence[int], k: int, logits: mx.array, fed: int) -> Draft:
        """``k`` drafts queued step after step without a read; the draft cache
        keeps the ``k - 1`` fed ones, as many as the target accepts (``update``)."""
        steps: list[mx.array] = []
        dists: list[mx.array | None] = []
        for i in range(k):
            y, q = self.decider.draft_token(logits, tokens, i)
            steps.append(y)
            dists.append(q)
            mx.async_eval(y)
            if i + 1 < k:
                logits = self.rt.decode(y).logits[-1]
        self.confidence = []
        self.unread = k - 1
        return Draft(mx.stack(steps), mx.stack(dists) if dists[0] is not None else None, catch_up=fed)

    def _gated(self, tokens: Sequence[int], k: int, logits: mx.array, fed: int) -> Draft:
        """Drafts that end where the draft model's confidence falls (``p_min``,
        ``min_prob``): each step's confidence is read after the next step is
        built, before it runs, so a draft can end there at no extra step."""
        steps: list[mx.array] = []
        dists: list[mx.array | None] = []
        top: list[mx.array] = []  # the draft model's top probability at each step
        own: list[mx.array] = []  # its probability of the token drafted
        n, whole = k, 1.0  # drafts kept; the estimated probability that all are accepted
        for i in range(k):
            y, q = self.decider.draft_token(logits, tokens, i)
            steps.append(y)
            dists.append(q)
            probs = q if q is not None else mx.softmax(logits.astype(mx.float32), axis=-1)
            top.append(probs.max())
            own.append(probs[y])
            if i > 0:
                if top[i - 1].item() < self.p_min:
                    n = i - 1
                    break
                whole *= own[i - 1].item()
                if whole < self.min_prob:
                    n = i
                    break
            mx.async_eval(y, top[-1], own[-1])
            if i + 1 < k:
                logits = self.rt.decode(y).logits[-1]
        else:
            if top[-1].item() < self.p_min:
                n = k - 1
        self.confidence = [c.item() for c in top[:n]]
        drafts = mx.stack(steps[:n]).tolist() if n else []
        probs = mx.stack(dists[:n]) if n and dists[0] is not None else None
        # keep in the draft cache only the drafts that were fed and are returned
        fed_drafts = self.rt.offset - len(self.cached)
        keep = min(fed_drafts, n)
        self.rt.trim(fed_drafts - keep)
        self.cached.extend(drafts[:keep])
        return Draft(drafts, probs, catch_up=fed)
