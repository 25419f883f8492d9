"""Suffix drafting: a suffix automaton (``hf2q_py.automaton``) over the
context, and the Target's memory of what it generated before, proposes the
continuation that most often followed the longest earlier occurrence of the
current suffix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Hashable, Sequence

from ..automaton import SuffixAutomaton
from ..draft_length.profile import DraftProfile
from ..errors import Hf2qError
from .base import Draft, Proposer
from .copy_track import MIN_RUN, CopyTrack

if TYPE_CHECKING:  # pragma: no cover
    from ..memory import DraftMemory


def depth_class(depth: int) -> int:
    """Match depth classes for per-class acceptance: 0 (none), 1, 2, 3, 4
    (4-7), 8 (8-15), 16 (16-31), 32 (32 or more)."""
    if depth < 4:
        return depth
    return 4 if depth < 8 else 8 if depth < 16 else 16 if depth < 32 else 32


#: The highest prior rate of an unsplit copy's first draft at a line start.
LINE_START_RATE = 0.8
#: The first part of the draft key of drafts resumed from a copy after an edit
#: (``(RESUME, depth_class(tokens in agreement since the edit))``).
RESUME = "resume"


@dataclass
class SuffixOptions:
    """How drafts are sized. A draft stops where its probability falls below
    ``min_prob``, and is at most ``factor * match + offset`` tokens long (the
    engine's K caps it too): a short match earns a short draft. ``resume``:
    follow a copy through an edit and resume drafting from it (``CopyTrack``)."""

    min_prob: float = 0.1
    factor: float = 2.0
    offset: int = 2
    min_match: int = 1
    resume: bool = True

    def validate(self) -> None:
        if not 0.0 <= self.min_prob <= 1.0:
            raise Hf2qError(f"suffix min-prob must be in [0, 1], got {self.min_prob}")
        if self.factor < 0 or self.offset < 0:
            raise Hf2qError(f"suffix factor and offset must be >= 0, got {self.factor}, {self.offset}")
        if self.min_match < 1:
            raise Hf2qError(f"suffix min-match must be >= 1, got {self.min_match}")


class SuffixProposer(Proposer):
    """Drafts from a suffix automaton over the context and, when given, the
    Target's ``DraftMemory`` of earlier generations; of the two, the source
    whose match is longer drafts (the context on ties). ``draft_key`` is the
    match depth's class, whether the match's earlier continuations split and
    whether the drafts start a line (the last token is one of
    ``line_breaks``), so adaptive K learns how far each kind of match's
    drafts run. Generated tokens are added to the memory when generation ends."""

    name = "suffix"
    #: Prior acceptance rates per draft key (match-depth class, split, line
    #: start): unsplit matches one rate per draft token; split ones (first
    #: token, later ones), as a split match's first token is often wrong
    #: (about 0.3 at every depth) but a right start runs on as far as an
    #: unsplit one. An unsplit copy breaks off more often at a line start,
    #: where edits begin (code: the first draft right 0.82 of the time at
    #: depth 8 or more, against 0.97 within a line), so its first rate there
    #: is at most ``LINE_START_RATE``. Measured by offline replay of the
    #: built-in model's greedy answers to the bench workloads; adaptive K
    #: starts from these, not a flat guess.
    profile = DraftProfile(
        key_priors={
            **{
                (d, False, line): (min(p, LINE_START_RATE), p) if line else p
                for d, p in {1: 0.45, 2: 0.6, 3: 0.75, 4: 0.85, 8: 0.93, 16: 0.96, 32: 0.98}.items()
                for line in (False, True)
            },
            **{
                (d, True, line): (0.3, p)
                for d, p in {1: 0.5, 2: 0.7, 3: 0.8, 4: 0.85, 8: 0.85, 16: 0.9, 32: 0.95}.items()
                for line in (False, True)
            },
            **{(RESUME, d): p for d, p in {1: (0.6, 0.9), 2: 0.8, 3: 0.85, 4: 0.9, 8: 0.93}.items()},
        }
    )

    def __init__(
        self,
        options: SuffixOptions | None = None,
        memory: DraftMemory | None = None,
        line_breaks: frozenset[int] = frozenset(),
    ):
        self.options = options or SuffixOptions()
        self.options.validate()
        self.memory = memory
        self.line_breaks = line_breaks
        self._reset()

    def _reset(self) -> None:
        self.sam = SuffixAutomaton()
        self.tokens: list[int] = []
        self.prompt_len = 0
        self._mem_state = (0, 0)  # streaming match of the context in the memory
        self._mem_version = -1
        self._best: tuple[int, int, int] | None = None  # (source, state, depth); source 0 context, 1 memory
        self.source_used: int | None = None  # the source of the latest drafts
        self.copy: CopyTrack | None = None  # the copy in progress, followed through edits
        self._copy_source = 0

    def _sync(self, tokens: Sequence[int]) -> tuple[int, int, int]:
        have = len(self.tokens)
        if have > len(tokens) or (have and self.tokens[have - 1] != tokens[have - 1]):
            prompt_len = min(self.prompt_len, len(tokens))
            self._reset()
            self.prompt_len = prompt_len
            have = 0
        mem = self.memory
        new_for_memory: Sequence[int] = tokens[have:]
        remembered = mem is not None and mem.version != self._mem_version
        if remembered:  # the memory changed (another generation ended): match again
            self._mem_version = mem.version
            self._mem_state = (0, 0)
            new_for_memory = self.tokens[-mem.window :] + list(new_for_memory)
            if self._copy_source == 1:
                self.copy = None  # its positions were in the memory as it was
        if have < len(tokens) or self._best is None or remembered:
            new = list(tokens[have:])
            self.tokens.extend(new)
            self.sam.extend(new)
            if self.copy is not None:
                self.copy.advance(self.tokens)
            sam = self.sam
            state = sam.link[sam.last] if sam.last else 0
            best = (0, state, sam.length[state] if state > 0 else 0)
            if mem is not None and len(mem):
                s, m = self._mem_state
                step = mem.sam.step
                for c in (
                    new_for_memory[-mem.window :] if len(new_for_memory) > mem.window else new_for_memory
                ):
                    s, m = step(s, m, c)
                self._mem_state = (s, m)
                if m > best[2]:
                    best = (1, s, m)
            self._best = best
        return self._best

    def start(self, runtime, prompt, hidden, decider) -> None:
        self._reset()
        self.prompt_len = len(prompt)
        self._sync(prompt)

    def match_depth(self, tokens: Sequence[int]) -> int:
        """How many tokens deep the end of ``tokens`` occurred earlier (in the
        context or the memory): the length of the match a draft copies from."""
        return self._sync(tokens)[2]

    def _resuming(self, tokens: Sequence[int]) -> bool:
        """Whether the drafts come from the copy followed through an edit (``CopyTrack.resumes``)."""
        depth = self._sync(tokens)[2]
        return self.copy is not None and self.copy.resumes(depth, len(tokens))

    def draft_key(self, tokens: Sequence[int]) -> Hashable:
        if self._resuming(tokens):
            return RESUME, depth_class(self.copy.run)
        source, state, depth = self._sync(tokens)
        if depth < self.options.min_match:
            return 0
        sam = self.sam if source == 0 else self.memory.sam
        return depth_class(depth), sam.split(state), tokens[-1] in self.line_breaks

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        o = self.options
        if self._resuming(tokens):
            copy = self.copy
            drafts = copy.drafts(min(k, int(o.factor * copy.ran) + o.offset))
            if drafts:
                self.source_used = self._copy_source
                if self._copy_source == 1:
                    self.memory.touch(copy.pos + 1)
                return Draft(drafts)
        source, state, depth = self._sync(tokens)
        if depth < o.min_match:
            return Draft()
        max_len = min(k, int(o.factor * depth) + o.offset)
        sam = self.sam if source == 0 else self.memory.sam
        drafts, _, reached = sam.draft(state, max_len, o.min_prob)
        self.source_used = source
        if source == 1 and drafts:
            self.memory.touch(sam.end[reached])
        if drafts and depth >= MIN_RUN and o.resume:  # a copy in progress: follow it
            seq = self.tokens if source == 0 else self.memory.flat
            self.copy, self._copy_source = (
                CopyTrack(seq, sam.end[reached] - len(drafts), len(tokens), depth),
                source,
            )
        return Draft(drafts)

    def finish(self, tokens: Sequence[int]) -> None:
        """Remember the generation with the prompt's last ``memory.lead``
        tokens before it, so a retried prompt matches from its first token."""
        if self.memory is not None and len(tokens) > self.prompt_len:
            self.memory.add(
                tokens[max(0, self.prompt_len - self.memory.lead) :], len(tokens) - self.prompt_len
            )
