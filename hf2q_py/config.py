"""Typed options for generation: the method with its options (``SpecConfig``,
defined beside the method table), sampling, and the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from .constraints import ConstraintSpec
from .errors import Hf2qError
from .methods import SpecConfig
from .sampling import SamplingConfig
from .validate import check_bool, check_int


#: The most alternatives per token that ``logprobs`` asks for (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


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
    #: What the output must match (structured output), or None.
    constraint: ConstraintSpec | None = None
    #: Per generated token, its log-probability and this many most likely
    #: alternatives (0-20); None: off.
    logprobs: int | None = None

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
        if self.constraint is not None:
            if not isinstance(self.constraint, ConstraintSpec):
                raise Hf2qError(f"constraint must be a ConstraintSpec, got {type(self.constraint).__name__}")
            self.constraint.validate()
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        self._refuse_what_the_loop_cannot_do_yet()

    def _refuse_what_the_loop_cannot_do_yet(self) -> None:
        """PHASE 2 OF ISSUE 40 REPLACES THIS: the generation loop neither applies
        a constraint's masks nor reports logprobs yet, so a valid request for
        either is refused here, the one place every generation passes."""
        if self.constraint is not None:
            raise Hf2qError(
                f"structured output ({self.constraint.kind}) is not available yet: "
                "the generation loop does not apply grammar masks"
            )
        if self.logprobs is not None:
            raise Hf2qError("logprobs are not supported")


def _iterable(value: Any) -> Any:
    try:
        return iter(value)
    except TypeError:
        raise Hf2qError(f"expected a list, got {value!r}") from None
