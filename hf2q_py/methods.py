"""Build the proposer and draft-length policy for a ``SpecConfig``."""

from __future__ import annotations

from pathlib import Path

from .config import SpecConfig
from .draft_length import AdaptiveK, FixedK, NoDrafts
from .proposers.base import PlainDecoding, Proposer
from .target import Target

#: Prior acceptance of a draft model's tokens (a same-family draft model, measured
#: on the code-editing workloads): adaptive K starts from it, then measures.
DRAFT_PRIOR_RATE = 0.8


def build_proposer(
    target: Target, spec: SpecConfig, *, seeded_sampling: bool = False
) -> tuple[Proposer, FixedK | AdaptiveK | NoDrafts]:
    """``seeded_sampling``: the run must repeat exactly, so a proposer that
    drafts from distributions gets a K that does not depend on timings."""
    spec.validate()
    if spec.method == "baseline":
        return PlainDecoding(), NoDrafts()
    timed = not (seeded_sampling and spec.method in ("draft", "layerskip", "dflash"))
    k = spec.draft_length
    policy = AdaptiveK(k, timed=timed) if spec.adaptive else FixedK(k)
    if spec.method == "ngram" and spec.ngram_proposer == "suffix":
        from .proposers.suffix import SuffixOptions, SuffixProposer

        options = SuffixOptions(min_prob=spec.suffix_min_prob, min_match=spec.ngram_min)
        proposer = SuffixProposer(options, target.memory if spec.memory else None)
        if isinstance(policy, AdaptiveK):
            policy.key_priors = dict(proposer.key_priors)
        return proposer, policy
    if spec.method == "ngram":
        from .proposers.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max), policy
    if spec.method == "draft":
        return _draft_method(target, spec, policy)
    if spec.method == "dflash":
        from .proposers.dflash import DFlashProposer, resolve_drafter

        drafter = spec.drafter
        if isinstance(drafter, (str, Path)):  # a folder: loaded once per target
            key = ("dflash", str(drafter))
            if key not in target.remembered:
                target.remembered[key] = resolve_drafter(drafter, target)
            drafter = target.remembered[key]
        drafter = resolve_drafter(drafter, target)
        return DFlashProposer(target, drafter), policy
    from .proposers.layer_skip import LayerSkipProposer

    skip = spec.skip_layers if spec.skip_layers is not None else "auto"
    return LayerSkipProposer(target, skip, k_max=k), policy


def _draft_method(target: Target, spec: SpecConfig, policy) -> tuple[Proposer, FixedK | AdaptiveK]:
    """A draft model, alone or (``draft_suffix_depth`` > 0) behind copies from the
    context. Adaptive K charges drafting per draft token and per source."""
    from .config import SUFFIX_DEFAULT_K
    from .proposers.draft_model import DraftModelProposer, check_compatible, relative_cost

    draft = spec.draft if isinstance(spec.draft, Target) else _load_draft(target, spec.draft)
    check_compatible(target, draft)
    k = spec.draft_length
    combined = spec.draft_suffix_depth > 0
    model = DraftModelProposer(draft, spec.draft_p_min, lazy_prefill=combined)
    proposer: Proposer = model
    if combined:  # copies are sized by the suffix proposer, up to its own cap
        from .proposers.combined import MODEL_KEY, CombinedProposer
        from .proposers.suffix import SuffixOptions, SuffixProposer

        copier = SuffixProposer(SuffixOptions(min_prob=spec.suffix_min_prob), target.memory if spec.memory else None)
        proposer = CombinedProposer(model, copier, spec.draft_suffix_depth, model_k=k)
        k = max(k, SUFFIX_DEFAULT_K)
        policy = AdaptiveK(k, timed=policy.timed) if isinstance(policy, AdaptiveK) else FixedK(k)
    if isinstance(policy, AdaptiveK):
        policy.split_drafting = True
        policy.prior_rate = DRAFT_PRIOR_RATE
        cost = relative_cost(target, draft)
        policy.draft_cost_priors = {None: cost}
        if combined:
            policy.key_priors = dict(proposer.key_priors)
            policy.draft_cost_priors = {MODEL_KEY: cost, **{key: 0.0 for key in proposer.key_priors}}
    return proposer, policy


def _load_draft(target: Target, source) -> Target:
    """A draft model given as a path or repo id, loaded once per target."""
    from .loaders import load

    key = ("draft", str(source))
    if key not in target.remembered:
        target.remembered[key] = load(source)
    return target.remembered[key]
