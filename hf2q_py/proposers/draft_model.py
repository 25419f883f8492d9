"""Draft-model speculation: a small model with the target's tokenizer drafts
K tokens autoregressively with its own KV cache, kept in step with the
committed tokens by trimming after each round."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..errors import Hf2qError
from ..target import Target
from .base import Draft, Proposer


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


class DraftModelProposer(Proposer):
    """Drafts with a second, smaller model.

    ``p_min`` > 0 stops a draft early once the draft model's probability of
    its own next token falls below it (llama.cpp's ``--draft-p-min``), so
    weak drafts cost less to draft and to verify.
    """

    name = "draft"

    def __init__(self, draft: Target, p_min: float = 0.0):
        self.draft = draft
        self.p_min = p_min
        self.rt = None
        self.cached: list[int] = []  # tokens whose K/V are in the draft's cache
        self.synced = 0  # cached[:synced] are known to be committed tokens

    def start(self, runtime, prompt: Sequence[int], hidden, decider) -> None:
        self.decider = decider
        self.rt = self.draft.runtime()
        self.cached = []
        if len(prompt) > 1:
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

    def _sync(self, tokens: Sequence[int]) -> list[int]:
        """Trim the draft cache to its longest prefix of ``tokens`` (leaving at
        least one token to feed); return the tokens still to feed."""
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

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        feed = self._sync(tokens)
        logits = self.rt.forward(self._embeddable(feed), logits="last").logits[-1]
        self.cached.extend(feed)
        steps: list[mx.array] = []
        dists: list[mx.array | None] = []
        confidence: list[mx.array] = []
        for i in range(k):
            y, q = self.decider.draft_token(logits, tokens, i)
            steps.append(y)
            dists.append(q)
            if self.p_min > 0:
                probs = q if q is not None else mx.softmax(logits.astype(mx.float32), axis=-1)
                confidence.append(probs[y])
            if i + 1 < k:
                logits = self.rt.decode(y).logits[-1]
            mx.async_eval(y, *confidence[-1:])
            # check the previous step while this one computes
            if self.p_min > 0 and i > 0 and confidence[i - 1].item() < self.p_min:
                steps = steps[: i - 1]
                break
        else:
            if self.p_min > 0 and confidence[-1].item() < self.p_min:
                steps.pop()
        drafts = mx.stack(steps).tolist() if steps else []
        probs = mx.stack(dists[: len(drafts)]) if drafts and dists[0] is not None else None
        # keep in the draft cache only the drafts that were fed and are returned
        fed = self.rt.offset - len(self.cached)
        keep = min(fed, len(drafts))
        self.rt.trim(fed - keep)
        self.cached.extend(drafts[:keep])
        return Draft(drafts, probs)


def build(target: Target, spec) -> DraftModelProposer:
    """The draft method's proposer (method table); a draft model given as a
    path or repo id is loaded once per target (``target.remembered``)."""
    draft = spec.draft
    if not isinstance(draft, Target):
        from ..loaders import load

        key = ("draft", str(draft))
        if key not in target.remembered:
            target.remembered[key] = load(draft)
        draft = target.remembered[key]
    check_compatible(target, draft)
    return DraftModelProposer(draft, spec.draft_p_min)
