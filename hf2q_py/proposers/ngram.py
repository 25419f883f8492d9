"""Prompt-lookup (n-gram) drafting: copy what followed the latest n-gram
when it occurred earlier in the context. No model, no extra weights."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import Hf2qError
from ..validate import check_int
from .base import Draft, Proposer


class NgramIndex:
    """Incremental index of every n-gram (n in [min_n, max_n]) of a token list.

    ``first[n][gram]`` is the end position (exclusive) of the gram's earliest
    occurrence. ``extend`` indexes new tokens in O(max_n) each, so a lookup
    never rescans the context.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.first: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.first[n].setdefault(tuple(self.tokens[end - n : end]), end)

    def truncate(self, length: int) -> None:
        """Forget tokens past ``length`` (rebuilds: rare, only if history is rewritten)."""
        kept = self.tokens[:length]
        self.__init__(self.min_n, self.max_n)
        self.extend(kept)

    def lookup(self, k: int) -> list[int]:
        """Drafts for the current suffix: longest matching n first, earliest occurrence."""
        return self.match(k)[0]

    def match(self, k: int, max_depth: int = 32) -> tuple[list[int], int]:
        """``lookup``'s drafts and the match depth: how many tokens before the
        drafts agree with the current suffix (at least n, up to ``max_depth``).
        Deep matches are long copies in progress; their drafts are far more
        often right than a lone 1-gram's. Depth 0: no match."""
        end, depth = self.find(max_depth)
        return self.tokens[end : end + k] if depth else [], depth

    def find(self, max_depth: int = 32) -> tuple[int, int]:
        """Where the drafts start (the end of the matched occurrence) and the
        match depth; (0, 0) when nothing matches."""
        toks, size = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self.first[n].get(tuple(toks[size - n :]))
            if end is not None and end < size:
                depth = n
                while depth < max_depth and depth < end and toks[end - 1 - depth] == toks[size - 1 - depth]:
                    depth += 1
                return end, depth
        return 0, 0


#: The longest n-gram looked up (``--ngram-max``): the index keeps every
#: n-gram up to this length for every position of the context.
MAX_NGRAM = 16
#: The longest n-gram looked up by default (``ngram_max``).
DEFAULT_MAX_N = 5


def validate_ngram(min_n: int, max_n: int) -> None:
    check_int("ngram-min", min_n, 1, MAX_NGRAM)
    check_int("ngram-max", max_n, 1, MAX_NGRAM)
    if max_n < min_n:
        raise Hf2qError(f"ngram-max ({max_n}) must be >= ngram-min ({min_n})")


class NgramProposer(Proposer):
    """vLLM/hf2q prompt lookup: the longest suffix (<= max_n, >= min_n) of the
    committed tokens that occurred earlier; among equal lengths the earliest
    occurrence; drafts are the tokens that followed it."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = DEFAULT_MAX_N):
        validate_ngram(min_n, max_n)
        self.index = NgramIndex(min_n, max_n)
        self._found: tuple[int, int] | None = None  # index.find() for the current tokens

    def _sync(self, tokens: Sequence[int]) -> tuple[int, int]:
        """Index ``tokens`` (new ones only) and return where their drafts start
        and the match depth, found once per context."""
        have = len(self.index.tokens)
        if have > len(tokens) or (have and self.index.tokens[have - 1] != tokens[have - 1]):
            self.index.truncate(0)
            have = 0
        if have < len(tokens) or self._found is None:
            self.index.extend(tokens[have:])
            self._found = self.index.find(max_depth=16)
        return self._found

    def start(self, runtime, prompt, hidden, decider) -> None:
        self.index.truncate(0)
        self._found = None
        self._sync(prompt)

    def draft_key(self, tokens: Sequence[int]) -> int:
        """The match depth's class (0: no match; 1, 2, 3; 4: 4-7; 8: 8-15;
        16: 16 or more), so the draft length can follow how deep the copy runs."""
        depth = self._sync(tokens)[1]
        return depth if depth < 4 else 4 if depth < 8 else 8 if depth < 16 else 16

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        end, depth = self._sync(tokens)
        return Draft(self.index.tokens[end : end + k] if depth else [])


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """One-shot lookup over ``tokens`` (builds a fresh index)."""
    validate_ngram(min_n, max_n)
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index.lookup(k)


def lookup_by_rescan(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The same lookup written as its definition: a scan of the whole context
    per call. The reference for tests and benchmarks, not for generation."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n :])
        for start in range(0, size - n):
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []


def build(target, spec) -> Proposer:
    """The n-gram method's proposer (method table): the suffix proposer,
    drafting from the Target's memory unless ``memory`` is off, or prompt lookup."""
    if spec.ngram_proposer == "lookup":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    from .suffix import SuffixOptions, SuffixProposer

    options = SuffixOptions(min_prob=spec.suffix_min_prob, min_match=spec.ngram_min)
    return SuffixProposer(options, target.memory if spec.memory else None, target.line_breaks)
