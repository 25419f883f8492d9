"""Two draft sources in one: copy from the context (the suffix proposer)
where the current suffix occurred earlier at least ``min_depth`` tokens
deep, else run the draft model. A copy costs no draft forward; the draft
model catches up on the copied tokens in one batched forward the next time
it drafts, and reads the prompt only then (lazy prefill)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..target import Target
from .base import Draft, Proposer
from .draft_model import DraftModelProposer, check_compatible, relative_cost
from .suffix import SuffixOptions, SuffixProposer

#: ``draft_key`` of rounds the draft model drafts; copy rounds have ("copy", the suffix proposer's key).
MODEL_KEY = "model"
#: Most tokens a copy round drafts (the suffix proposer's own cap for the n-gram method).
COPY_K = 32


class CombinedProposer(Proposer):
    """Copies where the suffix proposer has a deep match, else drafts with the model.

    ``model_k`` caps the draft model's drafts (copies are sized by the suffix
    proposer and the engine's K). Rounds are keyed ``("copy", the suffix proposer's key)``
    or ``"model"``, so adaptive K keeps acceptance and drafting cost per
    source. Drafts of one round come from one source: copies are point
    masses, model drafts carry the model's distributions, and verification
    under sampling stays exact either way.
    """

    name = "draft"
    min_k_cap = COPY_K

    def __init__(self, model: DraftModelProposer, copier: SuffixProposer, min_depth: int, model_k: int):
        self.model, self.copier = model, copier
        self.min_depth, self.model_k = min_depth, model_k
        self.copied_rounds = 0  # rounds drafted by copying (statistics)
        self.model_rounds = 0

    @property
    def key_priors(self) -> dict[Hashable, float]:
        """Prior acceptance per copy depth class (the suffix proposer's)."""
        return {("copy", c): rate for c, rate in self.copier.key_priors.items()}

    def tune(self, policy) -> None:
        """As the draft model's, with drafting cost kept per source: copies cost none."""
        self.model.tune(policy)
        policy.geometric_keys = frozenset({MODEL_KEY})
        policy.draft_cost_priors = {MODEL_KEY: self.model.cost, **{key: 0.0 for key in self.key_priors}}

    def start(self, runtime, prompt: Sequence[int], hidden, decider) -> None:
        self.copier.start(runtime, prompt, hidden, decider)
        self.model.start(runtime, prompt, hidden, decider)

    def _depth(self, tokens: Sequence[int]) -> int:
        return self.copier.match_depth(tokens)

    def draft_key(self, tokens: Sequence[int]) -> Hashable:
        if self._depth(tokens) >= self.min_depth:
            return ("copy", self.copier.draft_key(tokens))
        return MODEL_KEY

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        if self._depth(tokens) >= self.min_depth:
            draft = self.copier.propose(tokens, k)
            if draft:
                self.copied_rounds += 1
                return draft
        self.model_rounds += 1
        return self.model.propose(tokens, min(k, self.model_k))

    def finish(self, tokens: Sequence[int]) -> None:
        self.copier.finish(tokens)
        self.model.finish(tokens)


def build(target: Target, spec) -> DraftModelProposer | CombinedProposer:
    """The draft method's proposer (method table): the draft model, copying
    where the context's end is matched deeply (unless ``draft_suffix_depth``
    is 0); a draft model given as a path or repo id is loaded once per
    target (``target.remembered``)."""
    draft = spec.draft
    if not isinstance(draft, Target):
        from ..loaders import load

        key = ("draft", str(draft))
        if key not in target.remembered:
            target.remembered[key] = load(draft)
        draft = target.remembered[key]
    check_compatible(target, draft)
    copies = spec.draft_suffix_depth > 0
    model = DraftModelProposer(
        draft,
        spec.draft_p_min,
        lazy_prefill=True,  # the draft model may never run (adaptive K, copies): read the prompt then
        cost=relative_cost(target, draft),
        min_prob=spec.draft_min_prob,
    )
    if not copies:
        return model
    copier = SuffixProposer(
        SuffixOptions(min_prob=spec.suffix_min_prob), target.memory if spec.memory else None
    )
    return CombinedProposer(model, copier, spec.draft_suffix_depth, model_k=spec.draft_length)
