"""An answer as neutral events, the same for every API: text, reasoning, tool
calls as they are written, keep-alives, and the end.

The model's raw text goes through one :class:`Pipeline`: raw text ->
reasoning split (a :class:`ReasoningSplitter`: which text is the model's
reasoning and which its answer) -> tool split (``call_split``: content and
calls) -> events. Each API renders the events in its own shapes
(``openai_api``, ``anthropic_api``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..sampling import TokenLogprob
from ..stats import GenerationStats
from .call_split import CallDelta, CallEnd, CallSplitter, CallStart
from .tool_calls import ToolUse
from .worker import Failed


@dataclass
class TextDelta:
    """Answer text, with the log-probabilities of the tokens given out since
    the last text (when asked for)."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class ReasoningDelta:
    """Reasoning text (what a reasoning splitter reads as the model's thinking)."""

    text: str


@dataclass
class Ping:
    """Nothing new yet (a prompt still prefilling, a request waiting): a keep-alive."""


@dataclass
class Done:
    """The answer is over. ``finish``: ``stop`` (the model ended its turn),
    ``stop_sequence`` (``stop_sequence`` ended it), ``length`` (the token
    budget), ``tool_calls`` (it ended with calls); ``tokens``: every
    generated token; ``logprobs``: those of tokens whose text never came out
    as text (tool calls); ``reasoning_tokens``: how many of the tokens were
    reasoning (:attr:`Pipeline.reasoning_tokens`)."""

    stats: GenerationStats
    finish: str
    stop_sequence: str | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning_tokens: int = 0


@dataclass
class Failure:
    """The answer failed (before or after it began): status, message, code."""

    failed: Failed


Event = TextDelta | ReasoningDelta | CallStart | CallDelta | CallEnd | Ping | Done | Failure


class ReasoningSplitter(Protocol):
    """Splits raw text into ``("reasoning", text)`` and ``("answer", text)``
    parts as it streams in."""

    def feed(self, text: str) -> list[tuple[str, str]]: ...

    def finish(self) -> list[tuple[str, str]]: ...


class NoReasoning:
    """The splitter of a model that does not reason in its text: all of it is answer."""

    def feed(self, text: str) -> list[tuple[str, str]]:
        return [("answer", text)] if text else []

    def finish(self) -> list[tuple[str, str]]:
        return []


class Pipeline:
    """One answer's raw text -> reasoning split -> tool split -> events.
    ``use``: the request's tools (None: the answer is text only)."""

    def __init__(self, use: ToolUse | None, reasoning: ReasoningSplitter, logprobs: bool = False):
        self.reasoning = reasoning
        self.calls = CallSplitter(use) if use is not None else None
        self.logprobs = logprobs
        self.held: list[TokenLogprob] = []  # log-probabilities of tokens whose text is not out yet
        self.called = False  # a call ended
        self.reasoning_share = 0.0  # tokens of reasoning text (a round's tokens shared by characters)

    @property
    def reasoning_tokens(self) -> int:
        """How many tokens wrote reasoning: the tokens of each round that wrote
        it, a round that wrote both reasoning and answer counted by its share
        of characters."""
        return round(self.reasoning_share)

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None, tokens: int = 0) -> list[Event]:
        """The events of more raw text (written by ``tokens`` tokens)."""
        self.held.extend(logprobs or ())
        parts = self.reasoning.feed(text)
        thought = sum(len(t) for kind, t in parts if kind == "reasoning")
        if thought:
            self.reasoning_share += tokens * thought / sum(len(t) for _, t in parts)
        out = self._route(parts, final=False)
        if self.calls is None and self.held and not any(isinstance(e, TextDelta) for e in out):
            out.append(TextDelta("", self._take()))  # tokens with no whole character yet
        return out

    def finish(self) -> list[Event]:
        """The events of what the splitters still held once the answer ended."""
        return self._route(self.reasoning.finish(), final=True)

    def rest(self) -> list[TokenLogprob]:
        """Log-probabilities never given out with text (tool calls)."""
        return self._take() or []

    def _route(self, parts: list[tuple[str, str]], final: bool) -> list[Event]:
        out: list[Event] = []
        items: list = []
        for kind, text in parts:
            if kind == "reasoning":
                out += self._events(items)
                items = []
                out.append(ReasoningDelta(text))
            else:
                items += self.calls.feed(text) if self.calls is not None else [text]
        if final and self.calls is not None:
            items += self.calls.finish()
        return out + self._events(items)

    def _events(self, items: list) -> list[Event]:
        out: list[Event] = []
        for item in items:
            if isinstance(item, str):
                if item:
                    out.append(TextDelta(item, self._take()))
            else:
                self.called = self.called or isinstance(item, CallEnd)
                out.append(item)
        return out

    def _take(self) -> list[TokenLogprob] | None:
        if not self.logprobs:
            return None
        taken, self.held = self.held, []
        return taken
