"""One engine under every API: a :class:`Conversation` becomes a worker job
(prompt ids, tool use, token budget and ``GenerationConfig`` made once, in
one place) and the job's output becomes neutral events
(:mod:`~hf2q_py.server.events`), ended when the client leaves.

A client that leaves (its connection closed) cancels its job: a running
generation leaves the batch between rounds (a prompt still prefilling,
between chunks), and a waiting one never starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..budget import MemoryRefused
from ..config import GenerationConfig
from ..constraints import ConstraintSpec, special_tokens
from ..errors import Hf2qError, one_line
from ..request import context_length, encode_prompt, make_config
from ..method_spec import parse_method
from ..methods import method_named
from .conversation import (
    Conversation,
    chat_template_text,
    encode_conversation,
    normalized,
    reasoning_history,
    template_options,
)
from ..reasoning import NoReasoning, Splitter, reasoning_format, splitter_for
from .events import Done, Event, Failure, Ping, Pipeline
from .freeform import answer_constraint
from .metrics import Metrics
from .tool_calls import ToolUse, quoted_views, tool_use
from .worker import Busy, Failed, Finished, Job, Piece, Worker

SHUTTING_DOWN = Failed(503, "the server is shutting down", "server_shutting_down")


class ApiError(Exception):
    """A request the server answers with an error (each API in its own envelope)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.failure = Failed(status, message, code)


@dataclass
class EngineConfig:
    """What the engine takes from the server's configuration."""

    method: str = "ngram"
    method_options: dict[str, Any] = field(default_factory=lambda: {"method": "ngram"})
    models: dict[str, Any] = field(default_factory=dict)  # "draft" (a Target), "drafter" (a folder)
    max_tokens: int = 512
    max_context: int | None = None
    temperature: float = 0.0


@dataclass
class Prepared:
    """A conversation made ready to run: its prompt ids, its use of tools
    (None: the answer is text), its config, its method's label and the
    texts it may copy drafts from."""

    conversation: Conversation
    ids: list[int]
    use: ToolUse | None
    config: GenerationConfig
    label: str
    drafting: list[list[int]]
    arrival: float


class Engine:
    """Prepares conversations, runs them on the worker, and gives their events."""

    def __init__(self, worker: Worker, config: EngineConfig, metrics: Metrics):
        self.worker, self.config, self.metrics = worker, config, metrics
        self.target = worker.target
        limit = context_length(self.target)
        if config.max_context is not None:
            limit = min(limit, config.max_context) if limit else config.max_context
        self.context = limit
        self.reasoning_format = reasoning_format(self.target.tokenizer)

    # -- requests --------------------------------------------------------------
    def prepare(self, conv: Conversation) -> Prepared:
        """Everything the generation needs; raises ApiError naming the problem."""
        arrival = time.perf_counter()
        try:
            use = self._tool_use(conv)
            ids = self._prompt(conv, use)
            max_tokens = self.budget(len(ids), conv.max_tokens)
            label, options = self._method(conv.method)
            sampling = {"temperature": self.config.temperature, **conv.sampling}
            config = make_config(
                max_tokens=max_tokens, stop=conv.stop, plain_first_token=conv.stream, **options,
                constraint=self._constraint(conv, use), logprobs=conv.logprobs,
                **sampling,
            )  # fmt: skip
            config.max_tokens = self._fitted(len(ids), config)
        except MemoryRefused as e:
            raise ApiError(e.status, one_line(e, limit=1000), e.code) from None
        except Hf2qError as e:
            raise ApiError(400, one_line(e, limit=1000)) from None
        return Prepared(conv, ids, use, config, label, self._quoted(conv, use), arrival)

    def _constraint(self, conv: Conversation, use: ToolUse | None) -> ConstraintSpec | None:
        """The answer's constraint: the request's own, joined with its tools'
        calls where freeform inputs have grammars (:func:`answer_constraint`)."""
        special = lambda texts: special_tokens(self.target, texts)  # noqa: E731
        return answer_constraint(use, conv.freeform, conv.constraint, special)

    def _fitted(self, prompt_tokens: int, config: GenerationConfig) -> int:
        """``max_tokens`` cut to what the memory budget holds for one request
        alone (a prompt that cannot fit: ``MemoryRefused``, 413); the
        scheduler cuts it again, if need be, for the method's draft width."""
        ledger = self.worker.scheduler.ledger
        if ledger is None:
            return config.max_tokens
        return ledger.clamp(prompt_tokens, config.max_tokens, config.kv or self.target.kv)

    def count(self, conv: Conversation) -> int:
        """The prompt tokens ``conv`` makes (as its generation would count them)."""
        try:
            return len(self._prompt(conv, self._tool_use(conv)))
        except Hf2qError as e:
            raise ApiError(400, one_line(e, limit=1000)) from None

    def budget(self, prompt_tokens: int, asked: int | None) -> int:
        """The answer's token budget: the asked number (else the server's
        default) cut to what the context leaves, as llama.cpp and Ollama do;
        a prompt that fills the context alone is refused."""
        if self.context is not None and prompt_tokens >= self.context:
            raise ApiError(
                400, f"prompt is too long: {prompt_tokens} tokens, and this server's context holds "
                f"{self.context} (the prompt and at least one generated token)", code="context_length_exceeded",
            )  # fmt: skip
        wanted = self.config.max_tokens if asked is None else asked
        return wanted if self.context is None else min(wanted, self.context - prompt_tokens)

    def _tool_use(self, conv: Conversation) -> ToolUse | None:
        if conv.prompt is not None:
            return None
        return tool_use(
            self.target.tokenizer, conv.tools, conv.tool_choice, conv.parallel_tool_calls, conv.call_id_prefix
        )

    def _prompt(self, conv: Conversation, use: ToolUse | None) -> list[int]:
        if conv.prompt is not None:
            return encode_prompt(self.target, conv.prompt, chat_template=False)
        if conv.prefill and use is not None and use.prefix:
            raise Hf2qError(
                "tool_choice: a forced call cannot follow a prefilled answer (a last assistant message)"
            )
        prefix = conv.prefill + (use.prefix if use is not None else "")
        options = template_options(self.target.tokenizer, conv.thinking)
        tools = use.tools if use is not None else None
        messages = reasoning_history(normalized(conv.messages), chat_template_text(self.target.tokenizer))
        return encode_conversation(self.target, messages, tools, prefix, options)

    def _quoted(self, conv: Conversation, use: ToolUse | None) -> list[list[int]]:
        """With tools in play: the conversation's long texts as a call would
        quote them, tokenized, for the n-gram proposer to copy drafts from."""
        tok = self.target.tokenizer
        if use is None or not use.tools or tok is None:
            return []
        return [list(tok.encode(text, add_special_tokens=False)) for text in quoted_views(conv.messages)]

    def _method(self, text: str | None) -> tuple[str, dict[str, Any]]:
        """The method spec (the request's, else the server's) with the server's models filled in."""
        if text is None:
            return self.config.method, dict(self.config.method_options)
        options = parse_method(text).options
        for key in ("draft", "drafter"):
            if key in options:
                raise Hf2qError(f"hf2q.method: {key} is chosen when the server starts, not per request")
            served = self.config.models.get(key)
            if key in method_named(options["method"]).options:
                if served is None and key == "draft":
                    raise Hf2qError(
                        "hf2q.method: this server has no draft model (start it with --draft-model)"
                    )
                if served is None and key == "drafter":
                    raise Hf2qError(
                        "hf2q.method: this server has no DFlash drafter (start it with --drafter PATH)"
                    )
                options[key] = served
        return text, options

    def reasoning(self, prep: Prepared) -> Splitter:
        """How the answer's raw text splits into reasoning and answer: by the
        syntax the model's tokenizer declares, primed with the prompt's end
        (a generation prompt that opens a think block starts in reasoning);
        a forced tool call and a constrained answer (``response_format``)
        start in the answer; a raw prompt (text completions) is all answer."""
        conv = prep.conversation
        if conv.prompt is not None or self.reasoning_format is None:
            return NoReasoning()
        forced = (prep.use is not None and bool(prep.use.prefix)) or conv.constraint is not None
        return splitter_for(self.target.tokenizer, prep.ids, answering=forced)

    # -- running ---------------------------------------------------------------
    def submit(self, prep: Prepared, loop: asyncio.AbstractEventLoop) -> Job:
        """The job, queued for the worker; ApiError 503 when the queue is
        full, 429 when too many requests wait for memory."""
        job = Job(prep.ids, prep.config, loop, drafting=prep.drafting)
        try:
            self.worker.submit(job)
        except Busy as e:
            raise ApiError(503, str(e), "server_busy") from None
        except MemoryRefused as e:
            raise ApiError(e.status, one_line(e, limit=1000), e.code) from None
        return job

    async def answer(
        self, prep: Prepared, job: Job, request: Request, ping: float | None = None
    ) -> AsyncIterator[Event]:
        """The job's events until :class:`Done` or :class:`Failure`; a
        :class:`Ping` every ``ping`` seconds without news. Ends early (and
        cancels the job) when the client leaves or the iteration is closed."""
        gone = asyncio.ensure_future(_disconnected(request))
        pipeline = Pipeline(prep.use, self.reasoning(prep), prep.config.logprobs is not None)
        ttft, tokens, stop = None, [], None
        try:
            async for event in _until(job.stream(), gone, ping):
                if event is None:
                    yield Ping()
                elif isinstance(event, Piece):
                    if ttft is None and event.tokens:
                        ttft = time.perf_counter() - prep.arrival
                    tokens.extend(event.tokens)
                    stop = event.stop or stop
                    ends = event.ends if len(event.ends) == len(event.tokens) else None
                    for e in pipeline.feed(event.text, event.logprobs, ends):
                        yield e
                elif isinstance(event, Failed):
                    yield Failure(event)
                    return
                else:
                    for e in self._ending(event, pipeline, prep, ttft, tokens, stop):
                        yield e
                    return
        finally:
            gone.cancel()
            job.cancel()

    def _ending(self, event: Finished, pipeline: Pipeline, prep: Prepared, ttft, tokens, stop) -> list[Event]:
        if event.cancelled:
            return [Failure(SHUTTING_DOWN)]
        out = pipeline.finish()
        stats = event.stats
        self.metrics.finished(stats, ttft, time.perf_counter() - prep.arrival)
        if stats.finish_reason == "length":
            finish = "length"
        elif pipeline.called:
            finish = "tool_calls"
        else:
            finish = "stop_sequence" if stop else "stop"
        stop = stop if finish == "stop_sequence" else None
        return [*out, Done(stats, finish, stop, tokens, pipeline.rest(), pipeline.reasoning_tokens)]


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until(events: AsyncIterator, gone: asyncio.Future, ping: float | None) -> AsyncIterator:
    """``events`` until ``gone`` completes; None after each ``ping`` seconds without one."""
    nxt = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({nxt, gone}, timeout=ping, return_when=asyncio.FIRST_COMPLETED)
            if nxt in done:
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield item
            elif gone in done:
                return
            else:
                yield None
    finally:
        if nxt is not None:
            nxt.cancel()
