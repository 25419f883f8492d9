"""The public generation API: ``generate``, ``stream_generate`` and
``batch_generate``, each a few lines over the one loop
(:class:`~hf2q_py.scheduler.Scheduler`), and ``generate_tokens`` for a
generation built from proposer and policy objects (replay, tests).

Building a request (prompt ids, options, context checks, text) is
``hf2q_py.request``'s; its public helpers are re-exported here.
"""

from __future__ import annotations

from collections import abc, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import GenerationConfig
from .draft_length import Policy
from .errors import Hf2qError
from .proposers.base import Proposer
from .reasoning import split_reasoning
from .request import (
    GenerationChunk,
    check_context,
    context_length,
    encode_messages,
    encode_prompt,
    make_config,
)
from .sampling import Greedy, TokenLogprob
from .budget import MemoryBudget
from .scheduler import Failure, Scheduler, SchedulerConfig
from .sequence import Sequence as Generation
from .stats import GenerationStats, Round
from .target import Target

__all__ = [
    "GenerationChunk",
    "GenerationResult",
    "batch_generate",
    "check_context",
    "context_length",
    "encode_messages",
    "encode_prompt",
    "generate",
    "generate_tokens",
    "make_config",
    "stream_generate",
]


@dataclass
class GenerationResult:
    """A finished generation: its tokens and text, the prompt's token ids,
    statistics, and each token's log-probability when asked for. A
    reasoning model's text is also given split (``hf2q_py.reasoning``):
    ``reasoning``, its thinking without the markers ("" when it has none),
    and ``content``, the answer (the text itself for other models)."""

    tokens: list[int]
    text: str
    prompt_tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    content: str | None = None

    def __post_init__(self) -> None:
        if self.content is None:
            self.content = self.text

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


class _Collect:
    """A scheduler sink that keeps one generation's chunks and its end
    (``tokenizer``: the one the text is split into reasoning and answer with)."""

    def __init__(self, ids: list[int], tokenizer: Any = None):
        self.ids, self.tokenizer = ids, tokenizer
        self.chunks: deque[GenerationChunk] = deque()
        self.stats: GenerationStats | None = None
        self.error: Hf2qError | None = None

    def chunk(self, chunk: GenerationChunk) -> None:
        self.chunks.append(chunk)

    def done(self, stats: GenerationStats, error: Hf2qError | None = None) -> None:
        self.stats, self.error = stats, error

    def raise_error(self) -> None:
        """The generation's failure, as it was raised (an unexpected error as itself)."""
        if self.error is not None:
            raise self.error.cause if isinstance(self.error, Failure) else self.error

    def result(self) -> GenerationResult:
        self.raise_error()
        chunks = list(self.chunks)
        lps = (
            [lp for c in chunks for lp in c.logprobs or ()]
            if chunks and chunks[0].logprobs is not None
            else None
        )
        text = "".join(c.text for c in chunks)
        reasoning, content = split_reasoning(self.tokenizer, self.ids, text)
        return GenerationResult(
            [t for c in chunks for t in c.tokens], text, self.ids, self.stats, lps, reasoning, content
        )


def _config(
    config: GenerationConfig | None, options: dict[str, Any], defaults: dict[str, Any]
) -> GenerationConfig:
    """The generation's config: the given one, or one made from keyword options."""
    if config is None:
        return make_config(**{**defaults, **options})
    if options:
        raise Hf2qError("pass either config= or keyword options, not both")
    if not isinstance(config, GenerationConfig):
        raise Hf2qError(f"config must be a GenerationConfig, got {type(config).__name__}")
    config.validate()
    return config


def stream_generate(
    target: Target,
    prompt: str | Sequence[int],
    *,
    on_round: Callable[[Round], None] | None = None,
    config: GenerationConfig | None = None,
    stats: GenerationStats | None = None,
    **options: Any,
) -> Iterator[GenerationChunk]:
    """Generate and yield text as it is decoded.

    Options (or a ``GenerationConfig``): ``max_tokens`` (default 256),
    ``stop``, ``chat_template``, ``logprobs``, an output constraint
    (``json_schema`` a schema dict or its JSON text, ``regex``, ``grammar``
    in Lark, or ``json_object=True``), sampling (``temperature``, ``top_p``,
    ``seed``, ...), the ``SpecConfig`` fields (``method``: ``ngram``
    unless given, ``baseline`` for plain decoding; ``k``, ``adaptive``,
    ``memory``, ...), and the KV cache's storage for this generation:
    ``kv_bits`` 4 or 8 (None: full precision), ``kv_group_size`` (32, 64 or
    128; default 64), ``quantized_kv_start`` (default 0), or
    ``kv=KVConfig(...)``; by default the Target's ``kv``. ``on_round`` receives a ``Round`` per round
    (profiling); each chunk carries the live ``GenerationStats`` (``stats``,
    if given, is filled), complete once the stream ends. Closing the
    iterator early ends the generation between rounds.
    """
    config = _config(config, options, {"max_tokens": 256})
    ids = encode_prompt(target, prompt, config.chat_template)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=1))
    sink = _Collect(ids)
    if stats is not None:
        stats.method = config.spec.method
    entry = scheduler.submit(ids, config, sink, on_round, stats=stats)
    return _drain(scheduler, sink, entry)


def _drain(scheduler: Scheduler, sink: _Collect, entry: Any) -> Iterator[GenerationChunk]:
    """Step ``scheduler`` until its one generation ends, yielding its chunks;
    closed early, the generation is cancelled and closed between rounds."""
    try:
        while not scheduler.idle:
            scheduler.step()
            while sink.chunks:
                yield sink.chunks.popleft()
        sink.raise_error()
    except GeneratorExit:
        entry.cancel()
        scheduler.run()  # closes it between rounds, its caches whole
        raise
    except BaseException:
        scheduler.fail_all(Hf2qError("interrupted"))
        raise


def generate(
    target: Target,
    prompt: str | Sequence[int],
    *,
    on_round: Callable[[Round], None] | None = None,
    config: GenerationConfig | None = None,
    **options: Any,
) -> GenerationResult:
    """Generate a completion; returns tokens, text and statistics. The
    method is ``ngram`` (speculation from copies) unless ``method`` says
    otherwise (``"baseline"``: plain decoding). See :func:`stream_generate`
    for the options."""
    config = _config(config, options, {"max_tokens": 256, "method": "ngram"})
    ids = encode_prompt(target, prompt, config.chat_template)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=1))
    sink = _Collect(ids, target.tokenizer)
    scheduler.submit(ids, config, sink, on_round)
    scheduler.run()
    return sink.result()


def batch_generate(
    target: Target,
    prompts: abc.Sequence[str | abc.Sequence[int]],
    *,
    max_batch: int = 8,
    on_round: Callable[[Round], None] | None = None,
    configs: abc.Sequence[GenerationConfig] | None = None,
    memory_budget: MemoryBudget | None = None,
    **options: Any,
) -> list[GenerationResult]:
    """Generate completions of several prompts at once, sharing forwards:
    up to ``max_batch`` run in one batch, each speculating with its own
    drafts; the results come back in the order of ``prompts``, each as
    ``generate`` would return it (greedy tokens equal, but at near-ties).

    ``configs``: one ``GenerationConfig`` per prompt instead of the keyword
    options (which :func:`stream_generate` lists). ``memory_budget``: a
    :class:`~hf2q_py.budget.MemoryBudget` the generations keep within
    (they wait for each other when it is full; a prompt that cannot fit
    raises ``MemoryRefused``).
    """
    if isinstance(prompts, str) or not isinstance(prompts, abc.Sequence):
        raise Hf2qError("prompts must be a list of prompts (strings or token id lists)")
    if configs is None:
        configs = [make_config(**{"max_tokens": 256, "method": "ngram", **options})] * len(prompts)
    elif options:
        raise Hf2qError("pass either configs= or keyword options, not both")
    elif len(configs) != len(prompts):
        raise Hf2qError(f"{len(configs)} configs for {len(prompts)} prompts")
    else:
        configs = [_config(c, {}, {}) for c in configs]
    kvs = {c.kv or target.kv for c in configs}
    kv = kvs.pop() if len(kvs) == 1 else None  # the batch stores as its generations do
    scheduler = Scheduler(target, SchedulerConfig(max_batch=max_batch, kv=kv, memory=memory_budget))
    sinks = []
    for prompt, config in zip(prompts, configs):
        ids = encode_prompt(target, prompt, config.chat_template)
        sinks.append(_Collect(ids, target.tokenizer))
        scheduler.submit(ids, config, sinks[-1], on_round)
    scheduler.run()
    return [s.result() for s in sinks]


def generate_tokens(
    target: Target,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    proposer: Proposer | None = None,
    policy: Policy | None = None,
    eos_token_ids: Sequence[int] = (),
    stats: GenerationStats | None = None,
    on_round: Callable[[Round], None] | None = None,
    decider: Greedy | None = None,
    plain_first_token: bool = False,
) -> Iterator[list[int]]:
    """Yield each round's newly committed tokens of a generation built from
    these objects (see ``Sequence``), run by the same loop. EOS ends
    generation (the EOS token itself is not yielded) and ``max_tokens`` is
    never exceeded, also inside an accepted block."""
    seq = Generation(
        target, prompt, max_tokens=max_tokens, proposer=proposer, policy=policy,
        eos_token_ids=eos_token_ids, stats=stats, on_round=on_round, decider=decider,
        plain_first_token=plain_first_token,
    )  # fmt: skip
    scheduler = Scheduler(target, SchedulerConfig(max_batch=1))
    sink = _Collect(list(prompt))
    entry = scheduler.submit(list(prompt), None, sink, sequence=seq)
    return (c.tokens for c in _drain(scheduler, sink, entry))
