"""The method table: one row per speculative method, one entry per option.

Validation (``SpecConfig.validate``), the method-spec syntax
(``hf2q_py.method_spec``), the command-line flags and the ``ab`` and
``bench`` tools all read this table. A new proposer is one module with a
``build(target, spec)`` function plus one ``Method`` row here (and, for a new
option, one ``Option`` entry and the ``SpecConfig`` field of that name).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from .draft_length import MAX_K, NoDrafts, Policy, Timings, build_policy, validate_k
from .errors import Hf2qError
from .proposers.ngram import DEFAULT_MAX_N, MAX_NGRAM, validate_ngram
from .proposers.suffix import SuffixOptions
from .validate import check_bool, check_float, check_int, check_skip_layers

if TYPE_CHECKING:
    from .proposers.base import Proposer
    from .target import Target

#: How an option's value is written in a method spec: ``int``, ``float``,
#: ``bool`` (yes/no/true/false/1/0, or the bare name for true), ``choice``
#: (one of ``choices``), ``text`` (a path or name) and ``layers`` (a recipe
#: word or a bracketed list of integers, ``[3,5,7]``).
KINDS = ("int", "float", "bool", "choice", "text", "layers")


@dataclass(frozen=True)
class Option:
    """One method option: the ``SpecConfig`` field, the key in a method spec,
    and (with ``-`` for ``_``) the command-line flag."""

    name: str
    kind: str
    default: Any
    help: str  # what it does and its valid values, one line
    check: Callable[[Any], None]  # type and range of a Python value; raises Hf2qError
    choices: tuple[str, ...] = ()
    flag: str = ""  # command-line flag; "" means --name-with-dashes
    off_flag: str = ""  # bool: the flag that sets False; "" means --no-name
    words: dict[str, Any] = field(default_factory=dict)  # bare words in a spec that set it: fixed -> False
    noun: str = ""  # what a required option is, for messages: "a draft model"

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def cli_off_flag(self) -> str:
        return self.off_flag or "--no-" + self.name.replace("_", "-")


def _check_k(value: Any) -> None:
    if value is not None:
        validate_k(value)


def _check_choice(name: str, what: str, choices: tuple[str, ...]) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value not in choices:
            raise Hf2qError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")

    return check


def _check_draft(value: Any) -> None:
    from .target import Target

    if value is not None and not isinstance(value, (str, Path, Target)):
        raise Hf2qError(f"draft must be a Target or a model path, got {type(value).__name__}")


def _check_drafter(value: Any) -> None:
    """A folder path or a ``Drafter`` (checked against the target at build)."""
    from .proposers.dflash_drafter import Drafter

    if value is not None and not isinstance(value, (str, Path, Drafter)):
        raise Hf2qError(f"drafter must be a Drafter or a folder path, got {type(value).__name__}")


def _check_skip(value: Any) -> None:
    if value is not None:
        check_skip_layers(value)


NGRAM_PROPOSERS = ("suffix", "lookup")

#: The draft method's default ``draft_min_prob``: chosen by replaying the
#: draft-length policies against the real pair's recorded greedy answers and
#: the draft model's own probabilities (benchmarks/bench_draft_length.py --streams).
DEFAULT_DRAFT_MIN_PROB = 0.5

OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option("k", "int", None, f"most drafts per round, in [1, {MAX_K}] (default: the method's)", _check_k),
        Option(
            "adaptive",
            "bool",
            True,
            "choose K in [0, k] each round from measured acceptance and cost (default); "
            "off: always draft up to k",
            lambda v: check_bool("adaptive", v),
            flag="--adaptive",
            off_flag="--fixed-k",
            words={"fixed": False},
        ),
        Option(
            "ngram_proposer",
            "choice",
            "suffix",
            "n-gram drafts from a suffix automaton with counts (suffix, "
            "the default) or prompt lookup (lookup)",
            _check_choice("ngram_proposer", "n-gram proposer", NGRAM_PROPOSERS),
            choices=NGRAM_PROPOSERS,
        ),
        Option(
            "ngram_min",
            "int",
            1,
            f"shortest match that drafts, in [1, {MAX_NGRAM}]",
            lambda v: check_int("ngram-min", v, 1, MAX_NGRAM),
        ),
        Option(
            "ngram_max",
            "int",
            DEFAULT_MAX_N,
            f"longest n-gram looked up (lookup proposer), in [1, {MAX_NGRAM}] (default {DEFAULT_MAX_N})",
            lambda v: check_int("ngram-max", v, 1, MAX_NGRAM),
        ),
        Option(
            "memory",
            "bool",
            True,
            "suffix proposer: draft from the Target's earlier generations too (default on)",
            lambda v: check_bool("memory", v),
        ),
        Option(
            "suffix_min_prob",
            "float",
            SuffixOptions.min_prob,
            "suffix proposer: stop a draft where its estimated "
            f"probability falls below this, in [0, 1] (default {SuffixOptions.min_prob})",
            lambda v: check_float("suffix-min-prob", v, 0.0, 1.0),
        ),
        Option(
            "draft",
            "text",
            None,
            "the draft model: a GGUF file, model folder or cached repo id (Python: also a Target)",
            _check_draft,
            flag="--draft-model",
            noun="a draft model",
        ),
        Option(
            "draft_p_min",
            "float",
            0.0,
            "stop drafting when the draft model's top probability falls below this, in [0, 1)",
            lambda v: check_float("draft-p-min", v, 0.0, 1.0, hi_open=True),
        ),
        Option(
            "draft_min_prob",
            "float",
            DEFAULT_DRAFT_MIN_PROB,
            "end a draft at the token where the draft model's estimated probability that the whole "
            "draft is accepted (the product of its token probabilities) falls below this, in [0, 1] "
            f"(default {DEFAULT_DRAFT_MIN_PROB}; 0: never)",
            lambda v: check_float("draft-min-prob", v, 0.0, 1.0),
        ),
        Option(
            "draft_suffix_depth",
            "int",
            4,
            "draft method: where the context's end occurred earlier at least this "
            "many tokens deep, copy it (suffix proposer, no draft forward) instead of running the draft model; "
            "0: off",
            lambda v: check_int("draft-suffix-depth", v, 0),
        ),
        Option(
            "skip_layers",
            "layers",
            None,
            "layers to skip: auto (default), alternate, early:N, middle:N or layer ids "
            "([3,5,7] in a method spec, 3,5,7 after --skip-layers)",
            _check_skip,
        ),
        Option(
            "drafter",
            "text",
            None,
            "the DFlash drafter folder (Python: also a Drafter)",
            _check_drafter,
            noun="a drafter",
        ),
    )
}


@dataclass(frozen=True)
class Method:
    """One row of the table. ``build`` names ``module:function`` (relative to
    ``hf2q_py``), a function ``(target, spec) -> Proposer``, imported only
    when the method runs; None for plain decoding."""

    name: str
    summary: str
    options: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    default_k: int | Callable[[SpecConfig], int] = 8
    build: str | None = None
    draws_drafts: bool = False  # drafts drawn from distributions: with a seed, K must not depend on timings
    check: Callable[[SpecConfig], None] | None = None  # checks across options
    reads_layers: bool = False  # skips or reads the target's layers by index: not on a pipeline

    def k_for(self, spec: SpecConfig) -> int:
        return self.default_k(spec) if callable(self.default_k) else self.default_k

    def builder(self) -> Callable[[Target, SpecConfig], Proposer]:
        module, _, name = (self.build or "").partition(":")
        return getattr(importlib.import_module(module, __package__), name)


_SPECULATIVE = ("k", "adaptive")

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("baseline", "plain decoding, one token per forward", default_k=0),
        Method(
            "ngram",
            "copies from the context and earlier generations (suffix automaton, or prompt lookup)",
            (*_SPECULATIVE, "ngram_proposer", "ngram_min", "ngram_max", "memory", "suffix_min_prob"),
            default_k=lambda spec: 32 if spec.ngram_proposer == "suffix" else 16,
            build=".proposers.ngram:build",
            check=lambda spec: validate_ngram(spec.ngram_min, spec.ngram_max),
        ),
        Method(
            "draft",
            "a small model with the target's tokenizer",
            (
                *_SPECULATIVE,
                "draft",
                "draft_min_prob",
                "draft_p_min",
                "draft_suffix_depth",
                "memory",
                "suffix_min_prob",
            ),
            required=("draft",),
            default_k=16,
            build=".proposers.combined:build",
            draws_drafts=True,
        ),
        Method(
            "layerskip",
            "the target with some layers skipped (self-speculation)",
            (*_SPECULATIVE, "skip_layers"),
            build=".proposers.layer_skip:build",
            draws_drafts=True,
            reads_layers=True,
        ),
        Method(
            "dflash",
            "a block drafter reading the target's hidden states",
            (*_SPECULATIVE, "drafter"),
            required=("drafter",),
            build=".proposers.dflash:build",
            draws_drafts=True,
            reads_layers=True,
        ),
    )
}


def method_named(name: Any) -> Method:
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise Hf2qError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return method


def _default(name: str) -> Any:
    return OPTIONS[name].default


@dataclass
class SpecConfig:
    """Which proposer drafts, and how much: a ``method`` of the method table
    (``hf2q_py.methods``) and its options, one field each; the table holds
    the defaults, ranges and which method takes which option.

    ``method`` is ``ngram`` unless told: it drafts copies of earlier text
    and costs a few percent at most where there is nothing to copy;
    ``baseline`` is plain decoding. ``k`` is the (maximum) draft length, by
    default the method's (32 for the n-gram suffix proposer, 16 for prompt
    lookup and the draft model, 8 otherwise); ``adaptive`` lets the engine
    choose K in [0, k] each round from measured acceptance and cost.
    """

    method: str = "ngram"
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


def validate_spec(spec: SpecConfig) -> None:
    """Every option's type and range, no option of another method, the
    method's required options, then its checks across options."""
    method = method_named(spec.method)
    for option in OPTIONS.values():
        option.check(getattr(spec, option.name))
    for option in OPTIONS.values():
        if option.name not in method.options and getattr(spec, option.name) != option.default:
            raise Hf2qError(foreign_option(option.name, method))
    for name in method.required:
        if getattr(spec, name) is None:
            raise Hf2qError(
                f"method {method.name!r} needs {OPTIONS[name].noun}: give {OPTIONS[name].cli_flag} PATH "
                f"or {name}=PATH in the method spec (Python: {name}=...)"
            )
    if method.check is not None:
        method.check(spec)


def foreign_option(name: str, method: Method) -> str:
    """The message for an option that another method takes."""
    owners = [m.name for m in METHODS.values() if name in m.options]
    return (
        f"option {name!r} belongs to {', '.join(owners)}, not to {method.name}; "
        f"{method.name} takes {allowed(method)}"
    )


def allowed(method: Method) -> str:
    """The keys a method spec of ``method`` accepts, for messages."""
    if not method.options:
        return "no options"
    words = [w for name in method.options for w in OPTIONS[name].words]
    return ", ".join([*method.options, *words])


def build_proposer(
    target: Target, spec: SpecConfig, *, seeded_sampling: bool = False
) -> tuple[Proposer, Policy]:
    """The proposer and draft-length policy for ``spec``, the policy made from
    the proposer's declared ``profile``. ``seeded_sampling``: the run must
    repeat exactly, so a proposer that drafts from distributions gets a K
    that does not depend on timings, nor on the Target's memory of earlier
    generations (which random draws a position uses depends on whether and
    from where it was drafted). An adaptive K times its rounds into the
    Target's ``Timings`` for the method (``target.kept.timings``), so later
    generations start from them."""
    spec.validate()
    method = method_named(spec.method)
    if method.build is None:
        from .proposers.base import PlainDecoding

        return PlainDecoding(), NoDrafts()
    sharding = target.sharding
    if method.reads_layers and sharding is not None and sharding.mode == "pipeline":
        raise Hf2qError(
            f"{spec.method} reads the target's layers by index, and a pipeline-sharded "
            "rank holds only some of them: use --shard tensor or another method"
        )
    if seeded_sampling and method.draws_drafts and spec.memory:
        spec = replace(spec, memory=False)
    proposer = method.builder()(target, spec)
    timings = target.kept.timings.setdefault(spec.method, Timings()) if spec.adaptive else None
    timed = not (seeded_sampling and method.draws_drafts)
    policy = build_policy(
        proposer.profile, spec.draft_length, adaptive=spec.adaptive, timed=timed, timings=timings
    )
    return proposer, policy
