"""Build the proposer and draft-length policy for a ``SpecConfig``."""

from __future__ import annotations

from .config import SpecConfig
from .draft_length import AdaptiveK, FixedK
from .proposers.base import Proposer
from .target import Target


def build_proposer(target: Target, spec: SpecConfig) -> tuple[Proposer | None, FixedK | AdaptiveK | None]:
    spec.validate()
    if spec.method == "baseline":
        return None, None
    policy = AdaptiveK(spec.k) if spec.adaptive else FixedK(spec.k)
    if spec.method == "ngram":
        from .proposers.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max), policy
    raise NotImplementedError(f"method {spec.method!r} is not available yet")
