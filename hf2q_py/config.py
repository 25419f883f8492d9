"""Typed options for generation; the CLI flags map onto these one to one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .draft_length import validate_k
from .errors import Hf2qError
from .proposers.ngram import validate_ngram
from .sampling import SamplingConfig

METHODS = ("baseline", "ngram", "draft", "layerskip", "dflash")
DEFAULT_K = {"ngram": 16}  # default maximum draft length per method; 8 for the others
NGRAM_PROPOSERS = ("suffix", "lookup")
SUFFIX_DEFAULT_K = 32  # the suffix proposer sizes its own drafts: a larger cap


@dataclass
class SpecConfig:
    """Which proposer drafts, and how much.

    ``k`` is the (maximum) draft length, by default 16 for n-gram (copies run
    long and cost no drafting) and 8 otherwise; ``adaptive`` lets the engine
    choose K in [0, k] each round from measured acceptance and cost.
    """

    method: str = "baseline"
    k: int | None = None
    adaptive: bool = True
    ngram_min: int = 1
    ngram_max: int = 5
    draft: Any = None  # draft model: a Target or a load() source
    draft_p_min: float = 0.0
    skip_layers: Sequence[int] | str | None = None
    drafter: Any = None  # DFlash block drafter: a Drafter or a folder path
    ngram_proposer: str = "suffix"  # n-gram method: "suffix" (automaton) or "lookup" (prompt lookup)
    memory: bool = True  # n-gram suffix proposer: draft from the Target's earlier generations
    suffix_min_prob: float = 0.1  # suffix proposer: stop a draft below this probability

    def validate(self) -> None:
        if self.method not in METHODS:
            raise Hf2qError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.k is not None:
            validate_k(self.k)
        validate_ngram(self.ngram_min, self.ngram_max)
        if self.ngram_proposer not in NGRAM_PROPOSERS:
            raise Hf2qError(
                f"unknown n-gram proposer {self.ngram_proposer!r}; choose one of {', '.join(NGRAM_PROPOSERS)}"
            )
        if not 0.0 <= self.suffix_min_prob <= 1.0:
            raise Hf2qError(f"suffix-min-prob must be in [0, 1], got {self.suffix_min_prob}")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise Hf2qError(f"draft-p-min must be in [0, 1), got {self.draft_p_min}")
        if self.method == "draft" and self.draft is None:
            raise Hf2qError("method 'draft' needs a draft model (draft=... / --draft-model)")
        if self.method == "dflash" and self.drafter is None:
            raise Hf2qError("method 'dflash' needs a drafter (drafter=... / --drafter PATH)")

    @property
    def draft_length(self) -> int:
        """``k``, or the method's default when it is None."""
        if self.k is not None:
            return self.k
        if self.method == "ngram" and self.ngram_proposer == "suffix":
            return SUFFIX_DEFAULT_K
        return DEFAULT_K.get(self.method, 8)


@dataclass
class GenerationConfig:
    """Everything one generation needs besides the model and the prompt."""

    max_tokens: int = 256
    stop: Sequence[str] = ()
    chat_template: bool = True
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def validate(self) -> None:
        self.sampling.validate()
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise Hf2qError(f"max-tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not s for s in self.stop):
            raise Hf2qError("stop strings must not be empty")
        self.spec.validate()
