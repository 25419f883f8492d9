"""Typed options for generation: the method with its options (``SpecConfig``,
defined beside the method table), sampling, and the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from .constraints import ConstraintSpec
from .errors import Hf2qError
from .kv import KVConfig
from .methods import SpecConfig
from .sampling import MAX_TOP_LOGPROBS, SamplingConfig

__all__ = ["MAX_TOP_LOGPROBS", "GenerationConfig", "SpecConfig"]
from .validate import check_bool, check_int


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
    #: Keep each generated token's log-probability and this many most likely
    #: alternatives (0 to ``MAX_TOP_LOGPROBS``); None: none.
    logprobs: int | None = None
    #: How this generation's attention caches store keys and values; None:
    #: as its Target's ``kv`` says. A generation whose KV layout differs from
    #: its batch's runs alone.
    kv: KVConfig | None = None

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
            check_int("logprobs (top alternatives)", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.kv is not None:
            if not isinstance(self.kv, KVConfig):
                raise Hf2qError(f"kv must be a KVConfig, got {type(self.kv).__name__}")
            self.kv.validate()


def _iterable(value: Any) -> Any:
    try:
        return iter(value)
    except TypeError:
        raise Hf2qError(f"expected a list, got {value!r}") from None
