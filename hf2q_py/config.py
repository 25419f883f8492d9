"""Typed options for generation; the CLI flags map onto these one to one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from .draft_length import validate_k
from .errors import Hf2qError
from .target import Target
from .validate import check_bool, check_float, check_int
from .proposers.ngram import validate_ngram
from .sampling import SamplingConfig

METHODS = ("baseline", "ngram", "draft", "layerskip", "dflash")
DEFAULT_K = {"ngram": 16}  # default maximum draft length per method; 8 for the others
NGRAM_PROPOSERS = ("suffix", "lookup")
SUFFIX_DEFAULT_K = 32  # the suffix proposer sizes its own drafts: a larger cap
#: Off by default: on the built-in model as its own draft, a 0.5 gate cut drafts that were all
#: accepted (fixed K = 4 at 0.62x of plain decoding, mlx-lm's ungated K = 4 at 0.85x); on Qwen2.5-Coder
#: 1.5B/0.5B code edits the rejected draft tokens had top probabilities 0.42-0.71.
DEFAULT_DRAFT_P_MIN = 0.0


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
    draft_p_min: float = DEFAULT_DRAFT_P_MIN  # draft method: end a draft before a token the draft is this unsure of
    draft_suffix_depth: int = 0  # draft method: copy (suffix proposer) where the match is this deep; 0: off
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
        check_bool("adaptive", self.adaptive)
        validate_ngram(self.ngram_min, self.ngram_max)
        check_float("draft-p-min", self.draft_p_min, 0.0, 1.0, hi_open=True)
        check_int("draft-suffix-depth", self.draft_suffix_depth, 0)
        if self.skip_layers is not None:
            check_skip_layers(self.skip_layers)
        if self.draft is not None and not isinstance(self.draft, (str, Path, Target)):
            raise Hf2qError(f"draft must be a Target or a model path, got {type(self.draft).__name__}")
        if self.ngram_proposer not in NGRAM_PROPOSERS:
            raise Hf2qError(
                f"unknown n-gram proposer {self.ngram_proposer!r}; choose one of {', '.join(NGRAM_PROPOSERS)}"
            )
        check_bool("memory", self.memory)
        check_float("suffix-min-prob", self.suffix_min_prob, 0.0, 1.0)
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


SKIP_RECIPES = "auto, alternate, early:N, middle:N or a list like 3,5,7"


def _is_number(text: str) -> bool:
    text = text.strip()
    return text.isascii() and text.isdigit()


def check_skip_layers(spec: Any) -> None:
    """The layer-skip set's form (its range needs the model: checked at build)."""
    if isinstance(spec, str):
        name, colon, arg = spec.partition(":")
        if spec in ("auto", "alternate"):
            return
        if name in ("early", "middle") and colon:
            if not _is_number(arg) or int(arg) < 1:
                raise Hf2qError(f"skip recipe {spec!r} needs a layer count >= 1, e.g. {name}:8")
            return
        items = [x.strip() for x in spec.split(",") if x.strip()]
        if not items or not all(_is_number(x) for x in items):
            raise Hf2qError(f"bad skip layers {spec!r}: use {SKIP_RECIPES}")
        return
    if isinstance(spec, (list, tuple)) and spec and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in spec
    ):
        return
    raise Hf2qError(f"skip layers must be {SKIP_RECIPES} (or a list of layer ids), got {spec!r}")


@dataclass
class GenerationConfig:
    """Everything one generation needs besides the model and the prompt."""

    max_tokens: int = 256
    stop: Sequence[str] = ()
    chat_template: bool = True
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
        self.spec.validate()


def _iterable(value: Any) -> Any:
    try:
        return iter(value)
    except TypeError:
        raise Hf2qError(f"expected a list, got {value!r}") from None
