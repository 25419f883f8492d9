"""Following a copy through an edit.

A model copying a file with one change (a rename, a new argument) writes
the source's tokens, then a few tokens of its own, then the source again
where the edit ends. The suffix automaton's match collapses at the edit:
the longest earlier suffix now ends in the new tokens, which occur nowhere
(or somewhere unrelated, such as the user's request naming the new name),
and it only finds the copy again once several tokens after the edit match
deeply enough. :class:`CopyTrack` keeps the copy's place in its source
instead: every committed token that agrees with the source moves the place
on; one that disagrees begins an edit, and the place moves on as if the
edit replaced as many tokens as it wrote (a same-length substitution, as
most renames are), unless the newest token matches the source a little
further on, where the copy re-syncs (an edit that wrote more or fewer
tokens than it replaced). Once a token after the edit agrees with the
source there, drafts come from that place while the automaton's own match
is shallow.

Settings measured by replaying Qwen2.5-Coder 0.5B's answers in the
Claude-Code-shaped session (``benchmarks/bench_session_levers.py``):
drafting the same-length guess before any token confirms it, or over
deeper matches, lost more at the ends of copies (where the model moves on
to new text and the source's continuation is wrong) than it won at edits.
"""

from __future__ import annotations

from collections.abc import Sequence

#: A copy is followed once it ran this many tokens in agreement with its source.
MIN_RUN = 4
#: How far past where an edit began a re-sync looks for the newest token.
WINDOW = 32
#: Tokens after an edit began during which drafts resume from the copy.
MAX_GAP = 16
#: Consecutive disagreeing tokens after which the copy is given up.
MAX_MISS = 8
#: The deepest automaton match that resumed drafts override.
MAX_DEPTH = 2
#: Tokens in agreement with the source since an edit before its drafts resume.
MIN_AGREE = 1


class CopyTrack:
    """Where a copy in progress stands in its source ``seq`` (a token list
    that may grow; negative tokens end a remembered entry): ``pos`` is the
    index of the token expected next, for the context of length ``at``."""

    __slots__ = ("seq", "pos", "at", "run", "ran", "edit", "miss", "broke")

    def __init__(self, seq: Sequence[int], pos: int, at: int, run: int):
        self.seq, self.pos, self.at = seq, pos, at
        self.run = run  # tokens in agreement since the last disagreement
        self.ran = run  # the longest such run
        self.edit: int | None = None  # where in the source the latest edit began
        self.broke: int | None = None  # the context length at the latest edit's first token
        self.miss = 0  # consecutive disagreeing tokens

    def advance(self, tokens: Sequence[int]) -> None:
        """Follow the committed tokens past ``at``."""
        for i in range(self.at, len(tokens)):
            self._step(tokens[i], i)
        self.at = len(tokens)

    def _step(self, token: int, i: int) -> None:
        seq = self.seq
        if self.pos < len(seq) and seq[self.pos] == token:
            self.pos += 1
            self.run += 1
            self.ran = max(self.ran, self.run)
            self.miss = 0
            return
        if self.miss == 0:  # an edit begins here
            self.edit, self.broke = self.pos, i
        self.miss += 1
        self.run = 0
        if self.miss >= MAX_MISS:  # given up: only a new run of MIN_RUN tokens brings it back
            self.ran = 0
        j = self._find(token)
        if j is not None:  # the source goes on with this token a little further: re-synced
            self.pos, self.run, self.miss = j + 1, 1, 0
        else:  # as if the edit replaced as many tokens as it wrote
            self.pos += 1

    def _find(self, token: int) -> int | None:
        """The first place from where the edit began (within ``WINDOW``) holding ``token``."""
        seq, start = self.seq, self.edit or 0
        for j in range(start, min(len(seq), start + WINDOW)):
            if seq[j] == token:
                return j
            if seq[j] < 0:
                return None
        return None

    def resumes(self, depth: int, length: int) -> bool:
        """Whether drafts for a context of ``length`` tokens, whose longest
        earlier suffix is ``depth`` deep, should come from the copy: it ran
        ``MIN_RUN`` tokens, an edit began at most ``MAX_GAP`` tokens ago,
        the latest ``MIN_AGREE`` tokens agree with the source, and the
        automaton's match is at most ``MAX_DEPTH`` deep and does not reach
        back before the edit (one that does found the edit's own text
        earlier, and knows better)."""
        if self.broke is None or self.ran < MIN_RUN or self.run < MIN_AGREE:
            return False
        since = length - self.broke
        return since <= MAX_GAP and depth <= min(since, MAX_DEPTH)

    def drafts(self, n: int) -> list[int]:
        """Up to ``n`` tokens of the source from the copy's place, ending
        where a remembered entry ends."""
        out = []
        for t in self.seq[self.pos : self.pos + n]:
            if t < 0:
                break
            out.append(t)
        return out
