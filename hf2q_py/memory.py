"""What a Target generated before, as a source of drafts for its next
requests (an agent's retry, a regenerated answer, the next edit of a file).

Bounded and least-recently-used: the memory keeps at most ``max_tokens``
tokens in at most ``max_entries`` generations; an entry is used when it is
added again or when its tokens are drafted. Drafts are only proposals, so
the memory never changes what is generated, only how fast.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence

from .errors import Hf2qError
from .automaton import SuffixAutomaton


class DraftMemory:
    """Earlier generations in one suffix automaton, each followed by its own
    separator (a negative token that matches nothing)."""

    #: On a rebuild, the context's last ``window`` tokens are matched again.
    window = 256
    #: Prompt tokens kept before each generation (they lead into it).
    lead = 32
    #: Eviction frees room down to this share of each bound.
    EVICT_TO = 0.75

    def __init__(self, max_tokens: int = 32768, max_entries: int = 64):
        if max_tokens < 1 or max_entries < 1:
            raise Hf2qError(f"memory bounds must be >= 1, got {max_tokens} tokens, {max_entries} entries")
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self.version = 0  # changes whenever the automaton does
        self.clear()

    def clear(self) -> None:
        """Forget every earlier generation."""
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # id -> tokens, least recent first
        self._ids: dict[tuple[int, ...], int] = {}
        self._next_id = 0
        self.tokens = 0
        self._rebuild()

    def __len__(self) -> int:
        """Tokens held."""
        return self.tokens

    def _rebuild(self) -> None:
        self.sam = SuffixAutomaton()
        self.flat: list[int] = []  # every entry's tokens and separator, in SAM order
        self._starts: list[int] = []  # SAM position where each laid-out entry starts
        self._layout: list[int] = []  # entry ids in SAM order
        self.version += 1
        for eid, toks in self.entries.items():
            self._append(eid, toks)

    def _append(self, eid: int, toks: tuple[int, ...]) -> None:
        self._starts.append(self.sam.size)
        self._layout.append(eid)
        self.sam.extend(toks)
        self.sam.extend((-1 - eid,))
        self.flat.extend(toks)
        self.flat.append(-1 - eid)

    def add(self, tokens: Sequence[int], generated: int | None = None) -> None:
        """Remember one generation (its first ``max_tokens`` tokens), whose
        last ``generated`` tokens (all by default) were generated and the
        others lead into it; adding one already held only marks it as
        recently used."""
        generated = len(tokens) if generated is None else generated
        if generated <= 0:
            return
        toks = tuple(tokens[: self.max_tokens])
        eid = self._ids.get(toks)
        if eid is not None:
            self.entries.move_to_end(eid)
            return
        eid = self._next_id
        self._next_id += 1
        evicted = False
        if self.tokens + len(toks) > self.max_tokens or len(self.entries) >= self.max_entries:
            evicted = self._evict(len(toks))
        self.entries[eid] = toks
        self._ids[toks] = eid
        self.tokens += len(toks)
        if evicted:
            self._rebuild()
        else:
            self._append(eid, toks)
            self.version += 1

    def _evict(self, incoming: int) -> bool:
        """Forget the least recently used generations until ``incoming`` more
        tokens and one more entry fit within ``EVICT_TO`` of each bound, so
        the automaton is rebuilt once per many additions (a rebuild walks
        every token held) rather than on every one."""
        tokens_to = max(0, int(self.max_tokens * self.EVICT_TO) - incoming)
        entries_to = max(0, int(self.max_entries * self.EVICT_TO) - 1)
        evicted = False
        while self.entries and (self.tokens > tokens_to or len(self.entries) > entries_to):
            _, old = self.entries.popitem(last=False)
            del self._ids[old]
            self.tokens -= len(old)
            evicted = True
        return evicted

    def touch(self, position: int) -> None:
        """Mark the entry holding SAM ``position`` (a 1-based end) as used."""
        i = bisect.bisect_right(self._starts, position - 1) - 1
        if i >= 0:
            eid = self._layout[i]
            if eid in self.entries:
                self.entries.move_to_end(eid)
