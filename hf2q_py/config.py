"""Typed options for generation: the method with its options, sampling, and the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from .errors import Hf2qError
from .methods import OPTIONS, method_named, validate_spec
from .sampling import SamplingConfig
from .validate import check_bool, check_int


def _default(name: str) -> Any:
    return OPTIONS[name].default


@dataclass
class SpecConfig:
    """Which proposer drafts, and how much: a ``method`` of the method table
    (``hf2q_py.methods``) and its options, one field each; the table holds
    the defaults, ranges and which method takes which option.

    ``k`` is the (maximum) draft length, by default the method's (32 for the
    n-gram suffix proposer, 16 for prompt lookup and the draft model, 8 otherwise); ``adaptive``
    lets the engine choose K in [0, k] each round from measured acceptance
    and cost.
    """

    method: str = "baseline"
    k: int | None = _default("k")
    adaptive: bool = _default("adaptive")
    ngram_min: int = _default("ngram_min")
    ngram_max: int = _default("ngram_max")
    draft: Any = _default("draft")  # draft model: a Target or a load() source
    draft_min_prob: float = _default("draft_min_prob")  # draft method: end a draft below this probability
    draft_p_min: float = _default("draft_p_min")
    draft_suffix_depth: int = _default(
        "draft_suffix_depth"
    )  # draft method: copy where the match is this deep
    skip_layers: Sequence[int] | str | None = _default("skip_layers")
    drafter: Any = _default("drafter")  # DFlash block drafter: a Drafter or a folder path
    ngram_proposer: str = _default("ngram_proposer")  # "suffix" (automaton) or "lookup" (prompt lookup)
    memory: bool = _default("memory")  # suffix proposer: draft from the Target's earlier generations
    suffix_min_prob: float = _default(
        "suffix_min_prob"
    )  # suffix proposer: stop a draft below this probability

    def validate(self) -> None:
        validate_spec(self)

    @property
    def draft_length(self) -> int:
        """``k``, or the method's default when it is None."""
        return self.k if self.k is not None else method_named(self.method).k_for(self)


@dataclass
class GenerationConfig:
    """Everything one generation needs besides the model and the prompt."""

    max_tokens: int = 256
    stop: Sequence[str] = ()
    chat_template: bool = True
    #: The first round decodes one token without drafts: a stream's first text
    #: comes after one decode instead of a wider verify (about one decode more in all).
    plain_first_token: bool = False
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def validate(self) -> None:
        if not isinstance(self.sampling, SamplingConfig):
            raise Hf2qError(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        if not isinstance(self.spec, SpecConfig):
            raise Hf2qError(f"spec must be a SpecConfig, got {type(self.spec).__name__}")
        self.sampling.validate()
        check_int("max-tokens", self.max_tokens, 1)
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in _iterable(self.stop)):
            raise Hf2qError(f"stop must be a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise Hf2qError("stop strings must not be empty")
        check_bool("chat_template", self.chat_template)
        check_bool("plain_first_token", self.plain_first_token)
        self.spec.validate()


def _iterable(value: Any) -> Any:
    try:
        return iter(value)
    except TypeError:
        raise Hf2qError(f"expected a list, got {value!r}") from None
