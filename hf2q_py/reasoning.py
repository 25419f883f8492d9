"""A reasoning model's thinking told apart from its answer, as the text streams in.

Reasoning models write their thinking into the text they generate, in a
syntax their tokenizer declares (:func:`reasoning_format`):

- ``tags``: a block between a start and an end marker: ``<think>`` ...
  ``</think>`` (Qwen3 and its successors, QwQ, DeepSeek-R1 and V3.1, GLM-4.5
  and later, MiniMax-M2, Kimi-K2-Thinking, SmolLM3, ...), ``<seed:think>``
  (Seed-OSS), ``<longcat_think>``, ``<|think:start|>``, and Gemma 4's
  thought channel ``<|channel>thought`` ... ``<channel|>``;
- ``harmony`` (gpt-oss): messages on channels, each
  ``<|channel|>NAME<|message|>`` ... ``<|end|>`` after
  ``<|start|>assistant``: ``analysis`` is the reasoning, ``final`` (and
  ``commentary`` to nobody) the answer, a message addressed
  ``to=functions.NAME`` a tool call.

A :class:`Splitter` reads the raw text piece by piece and gives back parts,
``("reasoning", text)`` and ``("answer", text)``: reasoning as soon as it is
written, holding back only what may be the start of a marker; markers never
reach either side. A reasoning block's text is trimmed of the whitespace
around it, and the answer after a block of the whitespace opening it. The
parts joined are the same however the text was cut. A splitter is primed
with the end of the prompt (:func:`splitter_for`), so a generation prompt
that opens a think block (Qwen3-Thinking, DeepSeek-R1) starts it in
reasoning, and one that closes an empty block (thinking switched off)
starts it in the answer. The splitter also keeps, in raw characters, which
text was reasoning, for counting reasoning tokens
(:class:`ReasoningTokens`).

Harmony's tool calls reach the answer re-written as
``<|channel|>commentary to=RECIPIENT<|message|>ARGUMENTS<|call|>``, which
the server's ``harmony`` tool-call format reads.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REASONING, ANSWER = "reasoning", "answer"
Part = tuple[str, str]

#: Think-tag pairs, in the order they are looked for in a vocabulary.
THINK_TAGS = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)
#: Gemma 4's thought channel: its two marker tokens, and how a thought opens.
GEMMA4_OPEN, GEMMA4_CLOSE = "<|channel>", "<channel|>"
GEMMA4_THOUGHT = GEMMA4_OPEN + "thought"
#: Harmony's (gpt-oss) structure tokens.
H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
H_RETURN, H_CALL, H_CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
#: How a harmony tool call reaches the answer: this, the recipient, ``<|message|>``, the arguments, ``<|call|>``.
HARMONY_CALL = H_CHANNEL + "commentary to="
#: A harmony header longer than this (without ``<|message|>``) is not a header: it is answer text.
HEADER_LIMIT = 256


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model family writes its reasoning: ``kind`` ``tags`` (a block
    between ``start`` and ``end``) or ``harmony``; ``anchors``: the ids of the
    tokens the prompt's end is read from (the splitter is primed with the
    prompt's text from the last of them on)."""

    kind: str
    start: str = ""
    end: str = ""
    anchors: frozenset[int] = frozenset()

    def splitter(self) -> Splitter:
        """A fresh splitter for one answer."""
        return HarmonySplitter() if self.kind == "harmony" else TagSplitter(self.start, self.end)


def reasoning_format(tokenizer: Any) -> ReasoningFormat | None:
    """The reasoning syntax a tokenizer declares (an mlx-lm ``TokenizerWrapper``
    or a Hugging Face tokenizer), or None for a model that does not reason in
    its text (its vocabulary holds no reasoning markers)."""
    if tokenizer is None:
        return None
    hf = getattr(tokenizer, "_tokenizer", None)
    hf = hf if hasattr(hf, "get_vocab") else tokenizer
    try:
        return _format_of(hf)
    except TypeError:  # an unhashable tokenizer: not cached
        return _format_of.__wrapped__(hf)


@functools.lru_cache(maxsize=8)
def _format_of(hf: Any) -> ReasoningFormat | None:
    try:
        vocab = hf.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary declares nothing
        return None
    if all(t in vocab for t in (H_START, H_CHANNEL, H_MESSAGE, H_END)):
        return ReasoningFormat("harmony", anchors=frozenset({vocab[H_START]}))
    for start, end in THINK_TAGS:
        if start in vocab and end in vocab:
            return ReasoningFormat("tags", start, end, frozenset({vocab[start], vocab[end]}))
    if GEMMA4_OPEN in vocab and GEMMA4_CLOSE in vocab:
        anchors = frozenset({vocab[GEMMA4_OPEN], vocab[GEMMA4_CLOSE]})
        return ReasoningFormat("tags", GEMMA4_THOUGHT, GEMMA4_CLOSE, anchors)
    return None


def splitter_for(tokenizer: Any, prompt: Sequence[int], answering: bool = False) -> Splitter:
    """The splitter of one answer to ``prompt`` (token ids), primed with the
    prompt's end; ``answering``: the answer starts outside reasoning whatever
    the prompt (a forced tool call). :class:`NoReasoning` for models that do
    not reason in their text."""
    fmt = reasoning_format(tokenizer)
    if fmt is None:
        return NoReasoning()
    splitter = fmt.splitter()
    last = next((i for i in range(len(prompt) - 1, -1, -1) if prompt[i] in fmt.anchors), None)
    if last is not None:
        splitter.prime(tokenizer.decode(list(prompt[last:]), skip_special_tokens=False))
    if answering:
        splitter.prime_answer()
    return splitter


def split_reasoning(tokenizer: Any, prompt: Sequence[int], text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, answer) text; a model that does not
    reason in its text (or no tokenizer): ``("", text)``."""
    if reasoning_format(tokenizer) is None:
        return "", text
    splitter = splitter_for(tokenizer, prompt)
    parts = splitter.feed(text) + splitter.finish()
    return (
        "".join(t for kind, t in parts if kind == REASONING),
        "".join(t for kind, t in parts if kind == ANSWER),
    )


# -- splitters ---------------------------------------------------------------------------------
class Splitter:
    """Splits raw text into reasoning and answer parts as it streams in.

    Besides the parts, a splitter keeps where reasoning lies in the raw text
    (``reasoning_at``) up to ``decided`` characters: the text after that is
    held back, its side not known yet."""

    def __init__(self) -> None:
        self.fed = 0  # raw characters fed since priming
        self.decided = 0  # raw characters whose side is known
        self.first = False  # the side before the first switch: reasoning?
        self.switches: list[int] = []  # raw offsets where the side changes
        self.sides: list[bool] = []  # the side from each switch on: reasoning?

    def feed(self, text: str) -> list[Part]:
        raise NotImplementedError

    def finish(self) -> list[Part]:
        """The parts of what was held back, once the text has ended."""
        raise NotImplementedError

    def prime(self, text: str) -> None:
        """Read ``text`` (the prompt's end) for its state, giving nothing out."""
        self.feed(text)
        self._forget()

    def prime_answer(self) -> None:
        """Start in the answer, whatever the prompt said."""
        raise NotImplementedError

    def reasoning_at(self, offset: int) -> bool:
        """Whether the raw character at ``offset`` (< ``decided``) is reasoning."""
        i = bisect.bisect_right(self.switches, offset) - 1
        return self.sides[i] if i >= 0 else self.first

    def _switch(self, offset: int, reasoning: bool) -> None:
        current = self.sides[-1] if self.sides else self.first
        if reasoning != current:
            self.switches.append(offset)
            self.sides.append(reasoning)

    def _forget(self) -> None:
        """Forget the text read so far, keeping the state it left."""
        self._restart(self.sides[-1] if self.sides else self.first)

    def _restart(self, reasoning: bool) -> None:
        """Count raw text from here, on the side ``reasoning`` says."""
        self.first = reasoning
        self.fed = self.decided = 0
        self.switches, self.sides = [], []


class NoReasoning(Splitter):
    """The splitter of a model that does not reason in its text: all of it is answer."""

    def feed(self, text: str) -> list[Part]:
        self.fed += len(text)
        self.decided = self.fed
        return [(ANSWER, text)] if text else []

    def finish(self) -> list[Part]:
        return []

    def prime_answer(self) -> None:
        pass


class SteppedSplitter(Splitter):
    """A splitter that holds raw text not decided yet in ``buf`` (a marker
    may begin in it) and reads it a step at a time (``_step``)."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = ""  # raw text not decided

    def feed(self, text: str) -> list[Part]:
        self.buf += text
        self.fed += len(text)
        out: list[Part] = []
        while self._step(out, final=False):
            pass
        self.decided = self.fed - len(self.buf)
        return out

    def finish(self) -> list[Part]:
        out: list[Part] = []
        while self._step(out, final=True):
            pass
        self.decided = self.fed
        self._ended()
        return out

    def _ended(self) -> None:
        """Drop what the text's end leaves held."""

    def _step(self, out: list[Part], final: bool) -> bool:
        """Read one piece of ``buf`` into ``out``; False when nothing more can be read now."""
        raise NotImplementedError


class TagSplitter(SteppedSplitter):
    """Reasoning between a ``start`` and an ``end`` marker, as many blocks as
    the model writes; an end marker outside a block is dropped."""

    def __init__(self, start: str, end: str):
        super().__init__()
        self.start, self.end = start, end
        self.thinking = False
        self.trim = False  # drop the whitespace opening the next text (after a marker)
        self.space = ""  # a block's trailing whitespace, held: dropped at the block's end

    def _ended(self) -> None:
        self.space = ""

    def prime(self, text: str) -> None:
        super().prime(text)
        self.buf = self.space = ""  # a marker cut by the prompt's end, or its spaces, stay the prompt's

    def prime_answer(self) -> None:
        self.thinking, self.trim, self.space, self.buf = False, False, "", ""
        self._restart(False)

    def _step(self, out: list[Part], final: bool) -> bool:
        """One decision on the held text; False when more text is needed."""
        if not self.buf:
            return False
        markers = (self.end,) if self.thinking else (self.start, self.end)
        hits = [(i, m) for m in markers if (i := self.buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            at = self.fed - len(self.buf) + i
            self._give(self.buf[:i], out)
            self.buf = self.buf[i + len(marker) :]
            if marker == self.start and not self.thinking:
                self._switch(at, True)
                self.thinking = True
            elif self.thinking:
                self._switch(at + len(marker), False)
                self.thinking = False
            self.trim, self.space = True, ""
            return True
        keep = 0 if final else partial_marker(self.buf, markers)
        self._give(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _give(self, text: str, out: list[Part]) -> None:
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        if not text:
            return
        if not self.thinking:
            out.append((ANSWER, text))
            return
        body = text.rstrip()
        if body:
            out.append((REASONING, self.space + body))
            self.space = text[len(body) :]
        else:
            self.space += text


_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_ROLE = re.compile(r"^" + re.escape(H_START) + r"\w*")


class HarmonySplitter(SteppedSplitter):
    """gpt-oss's messages: a header (role, ``<|channel|>NAME``, a recipient
    ``to=...``, a ``<|constrain|>`` type) up to ``<|message|>``, then the
    body up to ``<|end|>`` (or ``<|return|>``, ``<|call|>``); the next
    message begins with ``<|start|>``. ``analysis`` bodies are reasoning;
    bodies addressed to someone are tool calls, given to the answer in
    ``HARMONY_CALL`` form; every other body is answer."""

    ENDS = (H_END, H_RETURN, H_CALL)

    def __init__(self) -> None:
        super().__init__()
        self.body: str | None = None  # the open body's kind (REASONING, ANSWER, "call"); None: in a header

    def _ended(self) -> None:
        self.buf = ""  # a header cut short

    def prime(self, text: str) -> None:
        super().prime(text)
        if self.body is not None:
            self.buf = ""  # a marker cut by the prompt's end stays the prompt's
        # in a header, the prompt's part of it stays in ``buf``: the model writes the rest

    def prime_answer(self) -> None:
        self.body, self.buf = ANSWER, ""
        self._restart(False)

    def _step(self, out: list[Part], final: bool) -> bool:
        if self.body is None:
            return self._header(out, final)
        hits = [(i, m) for m in self.ENDS if (i := self.buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._give(self.buf[:i], out)
            if self.body == "call":
                out.append((ANSWER, H_CALL))
            self._switch(self.fed - len(self.buf) + i + len(marker), False)
            self.buf, self.body = self.buf[i + len(marker) :], None
            return True
        keep = 0 if final else partial_marker(self.buf, self.ENDS)
        self._give(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _header(self, out: list[Part], final: bool) -> bool:
        """A header read whole opens its body; one that cannot be a header is answer text."""
        i = self.buf.find(H_MESSAGE)
        if 0 <= i <= HEADER_LIMIT:
            head, at = self.buf[:i], self.fed - len(self.buf)
            self.buf = self.buf[i + len(H_MESSAGE) :]
            channel, recipient = _CHANNEL.search(head), _RECIPIENT.search(head)
            if recipient is not None:
                self.body = "call"
                out.append((ANSWER, HARMONY_CALL + recipient.group(1) + H_MESSAGE))
            else:
                self.body = REASONING if channel is not None and channel.group(1) == "analysis" else ANSWER
            self._switch(at, self.body == REASONING)
            return True
        plain = _ROLE.sub("", self.buf, count=1)
        if len(self.buf) >= HEADER_LIMIT + len(H_MESSAGE) or (final and plain and "<|" not in plain):
            self.body = ANSWER  # not a header: answer text (a role opening it is structure)
            self._switch(self.fed - len(self.buf), False)
            self.buf = plain
            return True
        return False

    def _give(self, text: str, out: list[Part]) -> None:
        if text:
            out.append((REASONING if self.body == REASONING else ANSWER, text))


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


# -- counting ----------------------------------------------------------------------------------
class ReasoningTokens:
    """Which of an answer's tokens are reasoning, as a splitter decides it: a
    token is reasoning when its text's last character is (the markers of a
    block count as its reasoning)."""

    def __init__(self) -> None:
        self.count = 0  # reasoning tokens decided
        self.fed = 0  # raw characters of the tokens added
        self.waiting: deque[tuple[int, Any]] = deque()  # (text end, payload) of tokens not decided

    def add(self, length: int, ends: Sequence[int], payloads: Sequence[Any] | None = None) -> None:
        """A text of ``length`` characters and its tokens, whose texts end
        ``ends`` characters into it, with an optional payload each (a
        log-probability)."""
        for j, end in enumerate(ends):
            self.waiting.append((self.fed + end, payloads[j] if payloads is not None else None))
        self.fed += length

    def settle(self, splitter: Splitter) -> list[Any]:
        """Decide the tokens the splitter has decided; the payloads of those in the answer."""
        answer = []
        while self.waiting and self.waiting[0][0] <= splitter.decided:
            end, payload = self.waiting.popleft()
            if splitter.reasoning_at(end - 1):
                self.count += 1
            else:
                answer.append(payload)
        return answer
