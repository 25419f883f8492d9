"""Two draft sources in one: copy from the context (the suffix proposer)
where the current suffix occurred earlier at least ``min_depth`` tokens
deep, else run the draft model. A copy costs no draft forward; the draft
model catches up on the copied tokens in one batched forward the next time
it drafts, and reads the prompt only then (lazy prefill)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

from ..draft_length.profile import DraftProfile

from ..target import Target
from .base import BatchDrafter, Draft, Proposer
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
    under sampling stays exact either way. In a batch, copy rounds draft on
    the host and model rounds through the draft model's batch drafter
    (shared by every row drafting with the same model).
    """

    name = "draft"

    def __init__(self, model: DraftModelProposer, copier: SuffixProposer, min_depth: int, model_k: int):
        self.model, self.copier = model, copier
        self.min_depth, self.model_k = min_depth, model_k

    @property
    def profile(self) -> DraftProfile:
        """The draft model's profile for ``"model"`` rounds and the suffix
        proposer's for copy rounds (which cost no drafting); K up to ``COPY_K``."""
        model = self.model.profile.rekeyed(lambda key: MODEL_KEY)
        copies = self.copier.profile.rekeyed(lambda key: ("copy", key))
        return replace(model.merged(copies), min_k=COPY_K)

    @property
    def lazy_drafts(self) -> bool:
        return self.model.lazy_drafts

    def own_memory(self, tokens: int) -> tuple[tuple[Any, ...], int]:
        return self.model.own_memory(tokens)

    @property
    def batchable(self) -> bool:
        return self.model.batchable

    def goes_alone(self, tokens: Sequence[int]) -> bool:
        return self.model.goes_alone(tokens)

    def batch_drafter(self, batch: Any) -> tuple[Hashable, Callable[[], BatchDrafter]] | None:
        """The draft model's (copies need none)."""
        return self.model.batch_drafter(batch)

    def start(self, runtime, prompt: Sequence[int], hidden, decider) -> None:
        self.copier.start(runtime, prompt, hidden, decider)
        self.model.start(runtime, prompt, hidden, decider)

    def _depth(self, tokens: Sequence[int]) -> int:
        return self.copier.match_depth(tokens)

    def draft_key(self, tokens: Sequence[int]) -> Hashable:
        if self._depth(tokens) >= self.min_depth:
            return ("copy", self.copier.draft_key(tokens))
        return MODEL_KEY

    def route(self, tokens: Sequence[int], k: int) -> Draft | int:
        """Copies, where the context's end is matched deeply enough, else how
        many drafts the model makes (at most ``model_k``)."""
        if self._depth(tokens) >= self.min_depth:
            draft = self.copier.propose(tokens, k)
            if draft:
                return draft
        return min(k, self.model_k)

    def fallback(self, tokens: Sequence[int], k: int) -> Draft:
        """A batch row's drafts in a round its model drafts none for (the
        batch's plan found no step that pays): copies from a match however
        shallow, or followed through an edit, keyed as copy rounds (the
        batch's planner prices their width by their own acceptance); else none.
        Asked before the batch's planner decides (it prices them), so it only reads."""
        draft = self.copier.propose(tokens, k)
        if not draft:
            return Draft()
        return replace(draft, key=("copy", self.copier.draft_key(tokens)))

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        routed = self.route(tokens, k)
        return routed if isinstance(routed, Draft) else self.model.propose(tokens, routed)

    def update(self, tokens: Sequence[int], drafted: int, accepted: int, hidden) -> None:
        self.copier.update(tokens, drafted, accepted, hidden)
        self.model.update(tokens, drafted, accepted, hidden)

    def finish(self, tokens: Sequence[int]) -> None:
        self.copier.finish(tokens)
        self.model.finish(tokens)


def build(target: Target, spec) -> DraftModelProposer | CombinedProposer:
    """The draft method's proposer (method table): the draft model, copying
    where the context's end is matched deeply (unless ``draft_suffix_depth``
    is 0); a draft model given as a path or repo id is loaded once per
    target (``target.kept.draft_models``)."""
    draft = spec.draft
    if not isinstance(draft, Target):
        from ..loaders import load

        kept = target.kept.draft_models
        if str(draft) not in kept:
            kept[str(draft)] = load(draft)
        draft = kept[str(draft)]
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
        SuffixOptions(min_prob=spec.suffix_min_prob),
        target.memory if spec.memory else None,
        target.line_breaks,
    )
    return CombinedProposer(model, copier, spec.draft_suffix_depth, model_k=spec.draft_length)
