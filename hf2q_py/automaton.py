"""A suffix automaton of a token sequence with occurrence counts: what the
suffix proposer drafts from, over the context and over a Target's memory.

The automaton grows by one state (plus at most one clone) per token in
amortised constant time, so a round never rescans the context: the longest
suffix of the context that occurred earlier is the suffix link of the last
state, found in O(1). Each state counts its occurrences (end positions), so
a draft is a walk down the transitions choosing the most frequent
continuation, with ``count(w c) / count(w)`` as its conditional probability.
"""

from __future__ import annotations

from collections.abc import Sequence

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
