"""Suffix drafting: a suffix automaton over the context (and over what the
Target generated before) proposes the continuation that most often followed
the longest earlier occurrence of the current suffix.

The automaton grows by one state (plus at most one clone) per token in
amortised constant time, so a round never rescans the context: the longest
suffix of the context that occurred earlier is the suffix link of the last
state, found in O(1). Each state counts its occurrences (end positions), so
a draft is a walk down the transitions choosing the most frequent
continuation, with ``count(w c) / count(w)`` as its conditional probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Hashable, Sequence

from ..errors import Hf2qError
from .base import Draft, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..memory import DraftMemory

#: Count updates walk at most this many suffix links per new token, so a long
#: run of one token costs O(1) per token; deeper (shorter, very frequent)
#: strings then undercount, which only changes how drafts are scored.
COUNT_DEPTH = 64
#: A state with more continuations than this stops the draft walk (a shallow
#: match followed by anything: scanning it costs more than it can earn).
MAX_BRANCH = 48


class SuffixAutomaton:
    """Incremental suffix automaton of a token sequence with occurrence counts.

    State 0 is the root (the empty string). ``length[v]`` is the longest
    string of state v, ``link[v]`` its suffix link, ``nxt[v]`` its
    transitions, ``count[v]`` how many end positions its strings have, and
    ``end[v]`` the latest of them (1-based: the prefix length where it ends).
    """

    __slots__ = ("nxt", "link", "length", "count", "end", "last", "size")

    def __init__(self) -> None:
        self.nxt: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.count: list[int] = [0]
        self.end: list[int] = [0]
        self.last = 0
        self.size = 0  # tokens added

    def extend(self, tokens: Sequence[int]) -> None:
        nxt, link, length, count, end = self.nxt, self.link, self.length, self.count, self.end
        last, size = self.last, self.size
        for c in tokens:
            size += 1
            cur = len(length)
            nxt.append({})
            link.append(0)
            length.append(length[last] + 1)
            count.append(0)
            end.append(size)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][c]
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:
                    clone = len(length)
                    nxt.append(dict(nxt[q]))
                    link.append(link[q])
                    length.append(length[p] + 1)
                    count.append(count[q])
                    end.append(end[q])
                    while p != -1 and nxt[p].get(c) == q:
                        nxt[p][c] = clone
                        p = link[p]
                    link[q] = clone
                    link[cur] = clone
            last = cur
            v, depth = cur, 0
            while v > 0 and depth < COUNT_DEPTH:
                count[v] += 1
                end[v] = size
                v = link[v]
                depth += 1
        self.last, self.size = last, size

    def step(self, state: int, matched: int, c: int) -> tuple[int, int]:
        """Streaming match: from (state, matched length), read ``c``; returns
        the state of the longest suffix of the stream that occurs here."""
        nxt, link, length = self.nxt, self.link, self.length
        while state and c not in nxt[state]:
            state = link[state]
            matched = length[state]
        t = nxt[state].get(c)
        return (t, matched + 1) if t is not None else (0, 0)

    def draft(self, state: int, max_len: int, min_prob: float) -> tuple[list[int], float, int]:
        """Walk from ``state`` choosing the most frequent continuation (ties:
        the latest) while the draft's probability (the product of
        ``count(child) / sum of counts of the children``) stays >= ``min_prob``.
        Negative tokens (separators) end a draft. Returns the drafts, their
        expected accepted length (the sum of the running probabilities) and
        the state reached."""
        nxt, count, end = self.nxt, self.count, self.end
        out: list[int] = []
        prob, expected = 1.0, 0.0
        while len(out) < max_len:
            children = nxt[state]
            if not children:
                break
            if len(children) == 1:
                ((c, t),) = children.items()
            else:
                if len(children) > MAX_BRANCH:
                    break
                total, best, c, t = 0, (-1, -1), -1, -1
                for tok, child in children.items():
                    n = count[child]
                    total += n
                    if (n, end[child]) > best:
                        best, c, t = (n, end[child]), tok, child
                prob *= best[0] / total if total else 0.0
                if prob < min_prob:
                    break
            if c < 0:
                break
            out.append(c)
            expected += prob
            state = t
        return out, expected, state

    def split(self, state: int) -> bool:
        """Whether the earlier occurrences of ``state``'s strings continued
        with different tokens (or with none recorded): then the most frequent
        continuation is often wrong, whatever the match length."""
        return len(self.nxt[state]) != 1


def depth_class(depth: int) -> int:
    """Match depth classes for per-class acceptance: 0 (none), 1, 2, 3, 4
    (4-7), 8 (8-15), 16 (16-31), 32 (32 or more)."""
    if depth < 4:
        return depth
    return 4 if depth < 8 else 8 if depth < 16 else 16 if depth < 32 else 32


@dataclass
class SuffixOptions:
    """How drafts are sized. A draft stops where its probability falls below
    ``min_prob``, and is at most ``factor * match + offset`` tokens long (the
    engine's K caps it too): a short match earns a short draft."""

    min_prob: float = 0.1
    factor: float = 2.0
    offset: int = 2
    min_match: int = 1

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
    match depth's class and whether the match's earlier continuations split,
    so adaptive K learns how far each kind of match's drafts run.
    Generated tokens are added to the memory when generation ends."""

    name = "suffix"
    #: Prior acceptance rates per draft key (match-depth class, split):
    #: unsplit matches one rate per draft token; split ones (first token,
    #: later ones), as a split match's first token is often wrong (about 0.3
    #: at every depth) but a right start runs on as far as an unsplit one.
    #: Measured by offline replay of the built-in model's greedy answers to
    #: the bench workloads; adaptive K starts from these, not a flat guess.
    key_priors = {
        **{
            (d, False): p for d, p in {1: 0.45, 2: 0.6, 3: 0.75, 4: 0.85, 8: 0.93, 16: 0.96, 32: 0.98}.items()
        },
        **{
            (d, True): (0.3, p)
            for d, p in {1: 0.5, 2: 0.7, 3: 0.8, 4: 0.85, 8: 0.85, 16: 0.9, 32: 0.95}.items()
        },
    }

    def __init__(self, options: SuffixOptions | None = None, memory: DraftMemory | None = None):
        self.options = options or SuffixOptions()
        self.options.validate()
        self.memory = memory
        self._reset()

    def _reset(self) -> None:
        self.sam = SuffixAutomaton()
        self.tokens: list[int] = []
        self.prompt_len = 0
        self._mem_state = (0, 0)  # streaming match of the context in the memory
        self._mem_version = -1
        self._best: tuple[int, int, int] | None = None  # (source, state, depth); source 0 context, 1 memory
        self.source_used: int | None = None  # the source of the latest drafts

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
        if have < len(tokens) or self._best is None or remembered:
            new = list(tokens[have:])
            self.tokens.extend(new)
            self.sam.extend(new)
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

    def draft_key(self, tokens: Sequence[int]) -> Hashable:
        source, state, depth = self._sync(tokens)
        if depth < self.options.min_match:
            return 0
        sam = self.sam if source == 0 else self.memory.sam
        return depth_class(depth), sam.split(state)

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        source, state, depth = self._sync(tokens)
        o = self.options
        if depth < o.min_match:
            return Draft()
        max_len = min(k, int(o.factor * depth) + o.offset)
        sam = self.sam if source == 0 else self.memory.sam
        drafts, _, reached = sam.draft(state, max_len, o.min_prob)
        self.source_used = source
        if source == 1 and drafts:
            self.memory.touch(sam.end[reached])
        return Draft(drafts)

    def finish(self, tokens: Sequence[int]) -> None:
        """Remember the generation with the prompt's last ``memory.lead``
        tokens before it, so a retried prompt matches from its first token."""
        if self.memory is not None and len(tokens) > self.prompt_len:
            self.memory.add(
                tokens[max(0, self.prompt_len - self.memory.lead) :], len(tokens) - self.prompt_len
            )
