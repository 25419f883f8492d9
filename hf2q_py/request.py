"""Building a generation from a request: the prompt's token ids (chat
template, tools), the validated ``GenerationConfig``, the context check,
the ``Sequence`` with its proposer, policy and decider, and the ``Chunker``
that turns committed tokens into text (stop strings, log-probabilities).

This sits below the scheduler; ``hf2q_py.generation`` is the public face
above both.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .config import GenerationConfig, SpecConfig
from .constraints import ConstraintSpec
from .distributed import agree_seed
from .errors import Hf2qError, one_line
from .kv import kv_config
from .methods import build_proposer
from .sampling import SamplingConfig, TokenLogprob, make_decider
from .sequence import Sequence as Generation
from .stats import GenerationStats, Round
from .target import Target
from .target import _config_value as target_config_value
from .validate import check_unicode

_SPEC_FIELDS = {f.name for f in fields(SpecConfig)}
_SAMPLING_FIELDS = {f.name for f in fields(SamplingConfig)}
#: Options that make the config's ``constraint`` (``ConstraintSpec.from_options``).
_CONSTRAINT_OPTIONS = ("json_schema", "regex", "grammar", "json_object")
#: Options that make the config's ``kv`` (``kv_config``), as mlx-lm names them.
_KV_OPTIONS = ("kv_bits", "kv_group_size", "quantized_kv_start")


@dataclass
class GenerationChunk:
    """One streamed piece: new ``text`` and the ``tokens`` behind it, with
    their log-probabilities when asked for (``logprobs``); ``stop``: the
    stop string that ended the text (on the chunk it ended); ``ends``: where
    each token's text ends in ``text``, in characters (empty without a
    tokenizer)."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    stop: str | None = None
    ends: list[int] = field(default_factory=list)


def encode_prompt(target: Target, prompt: str | Sequence[int], chat_template: bool = True) -> list[int]:
    """Token ids for a prompt: strings go through the chat template when the
    model has one (unless ``chat_template`` is False), as one user message;
    id lists pass through."""
    if isinstance(prompt, str):
        check_unicode(prompt)
        if not prompt.strip():
            raise Hf2qError("the prompt is empty")
        tok = _tokenizer(target)
        if chat_template and getattr(tok, "has_chat_template", False):
            return encode_messages(target, [{"role": "user", "content": prompt}])
        return _checked(target, list(tok.encode(prompt)))
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise Hf2qError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise Hf2qError("the prompt is empty")
    vocab = target.vocab_size
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
            raise Hf2qError(f"prompt token {t!r} is not a token id of this model (vocabulary {vocab})")
    return ids


def encode_messages(
    target: Target,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    prefix: str = "",
    template_options: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids for a conversation (``{"role": ..., "content": ...}`` dicts,
    roles system, user, assistant and, with tools, tool; an assistant message
    may carry ``tool_calls``) through the model's chat template, ending with
    the prompt for the assistant's next turn. ``tools`` (OpenAI function
    definitions) go to the template; ``prefix`` is text the answer is made to
    start with, after the generation prompt; ``template_options`` are more
    variables for the template (such as ``enable_thinking``)."""
    tok = _tokenizer(target)
    if not getattr(tok, "has_chat_template", False):
        raise Hf2qError("this model has no chat template: send the prompt as raw text (a text completion)")
    for m in messages:
        check_unicode(m["content"], f"a {m['role']} message")
        if m.get("tool_calls"):
            check_unicode(
                json.dumps(m["tool_calls"], ensure_ascii=False), f"a {m['role']} message's tool_calls"
            )
    if tools:
        check_unicode(json.dumps(list(tools), ensure_ascii=False), "tools")
    extra = {**(template_options or {}), **({"tools": list(tools)} if tools else {})}
    try:
        if prefix:
            text = tok.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False, **extra
            )
            ids = tok.encode(text + prefix, add_special_tokens=False)
        else:
            ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, **extra)
    except Exception as e:  # the template's own checks (role order, unknown roles) raise
        raise Hf2qError(f"the chat template refused these messages: {one_line(e)}") from None
    return _checked(target, list(ids))


def _tokenizer(target: Target) -> Any:
    if target.tokenizer is None:
        raise Hf2qError("this model has no tokenizer: pass the prompt as a list of token ids")
    return target.tokenizer


def _checked(target: Target, ids: list[int]) -> list[int]:
    """Token ids from the tokenizer, refused if empty or outside the vocabulary."""
    vocab = target.vocab_size
    if not ids:
        raise Hf2qError("the prompt encodes to no tokens")
    if vocab is not None and max(ids) >= vocab:
        raise Hf2qError(f"the tokenizer gives token id {max(ids)}, outside the model's vocabulary ({vocab})")
    return ids


def context_length(target: Target) -> int | None:
    """The model's maximum sequence length (``max_position_embeddings``), if known."""
    n = target_config_value(target.model, "max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def check_context(target: Target, ids: Sequence[int], max_tokens: int) -> int:
    """Refuse a prompt that fills the model's context; returns the number of
    tokens that still fit (``max_tokens`` or fewer)."""
    limit = context_length(target)
    if limit is None:
        return max_tokens
    if len(ids) >= limit:
        raise Hf2qError(
            f"the prompt has {len(ids)} tokens; this model's context holds {limit}, "
            "with room for at least one generated token"
        )
    return min(max_tokens, limit - len(ids))


def make_config(**options: Any) -> GenerationConfig:
    """A validated ``GenerationConfig`` from keyword options (those of
    ``stream_generate``); checks everything that needs no model."""
    asked = {k: options.pop(k) for k in _CONSTRAINT_OPTIONS if k in options}
    if asked:
        if options.get("constraint") is not None:
            raise Hf2qError(f"give constraint= or {', '.join(asked)}=, not both")
        options["constraint"] = ConstraintSpec.from_options(**asked)
    kv_asked = {k: options.pop(k) for k in _KV_OPTIONS if k in options}
    if kv_asked:
        if options.get("kv") is not None:
            raise Hf2qError(f"give kv= or {', '.join(kv_asked)}=, not both")
        options["kv"] = kv_config(**kv_asked)
    spec_opts = {k: v for k, v in options.items() if k in _SPEC_FIELDS}
    sampling_opts = {k: v for k, v in options.items() if k in _SAMPLING_FIELDS}
    gen_opts = {k: v for k, v in options.items() if k not in _SPEC_FIELDS | _SAMPLING_FIELDS}
    unknown = set(gen_opts) - {
        "max_tokens",
        "stop",
        "chat_template",
        "plain_first_token",
        "constraint",
        "logprobs",
        "kv",
    }
    if unknown:
        raise Hf2qError(f"unknown option(s): {', '.join(sorted(unknown))}")
    if isinstance(gen_opts.get("stop"), str):
        gen_opts["stop"] = (gen_opts["stop"],)
    config = GenerationConfig(
        spec=SpecConfig(**spec_opts), sampling=SamplingConfig(**sampling_opts), **gen_opts
    )
    config.validate()
    return config


def make_sequence(
    target: Target,
    ids: list[int],
    config: GenerationConfig,
    stats: GenerationStats,
    on_round: Callable[[Round], None] | None = None,
) -> Generation:
    """The ``Sequence`` of one generation of ``config`` (not started): its
    proposer, draft-length policy, decider and budget."""
    sampling = config.sampling
    seeded = sampling is not None and not sampling.greedy and sampling.seed is not None
    kv = target.kv if config.kv is None else config.kv
    target.check_kv(kv)
    proposer, policy = build_proposer(target, config.spec, seeded_sampling=seeded)
    if sampling is not None and not sampling.greedy and sampling.seed is None and target.sharding:
        # Every rank must draw the same random numbers: rank 0 picks the seed.
        sampling = replace(sampling, seed=agree_seed(target.sharding, random.getrandbits(62)))
    return Generation(
        target, ids, max_tokens=check_context(target, ids, config.max_tokens), proposer=proposer,
        policy=policy, eos_token_ids=target.eos_token_ids, stats=stats, on_round=on_round,
        decider=make_decider(sampling), plain_first_token=config.plain_first_token,
        logprobs=config.logprobs,
        constraint=config.constraint.build(target) if config.constraint is not None else None, kv=kv,
    )  # fmt: skip


class Chunker:
    """One generation's committed tokens as chunks: text through ``StopText``
    (stop strings), each chunk's log-probabilities aligned with its tokens.
    Without a config (a generation built from objects) or a tokenizer, the
    chunks carry tokens only."""

    def __init__(self, target: Target, config: GenerationConfig | None, stats: GenerationStats):
        tok = target.tokenizer if config is not None else None
        self.text = StopText(tok.detokenizer, config.stop) if tok is not None else None
        self.stats = stats
        self.keep_logprobs = config is not None and config.logprobs is not None
        self.pending: deque[TokenLogprob] = deque()  # log-probabilities of tokens held back
        self.sent = 0  # tokens given out
        self.stopped = False  # a stop string ended the text

    def feed(self, new: list[int], logprobs: list[TokenLogprob]) -> GenerationChunk:
        """The chunk of what ``new`` makes ready (possibly empty)."""
        self.pending.extend(logprobs)
        if self.text is None:
            return self._chunk("", [(t, 0) for t in new])
        piece, ready, self.stopped = self.text.feed(new)
        if self.stopped:
            self.stats.generated_tokens, self.stats.finish_reason = self.sent + len(ready), "stop"
            return self._chunk(piece, ready, self.text.matched)
        return self._chunk(piece, ready)

    def finish(self) -> GenerationChunk | None:
        """What is left once generation ended without a stop string."""
        if self.text is None:
            return None
        piece, ready = self.text.finish()
        return self._chunk(piece, ready) if piece or ready else None

    def _chunk(self, piece: str, ready: list[tuple[int, int]], stop: str | None = None) -> GenerationChunk:
        self.sent += len(ready)
        lps = [self.pending.popleft() for _ in ready] if self.keep_logprobs else None
        tokens, ends = [t for t, _ in ready], [e for _, e in ready] if self.text is not None else []
        return GenerationChunk(piece, tokens, self.stats, lps, stop, ends)


class StopText:
    """Tokens to text, ended by stop strings; text and tokens always end at
    the same place.

    ``feed`` takes a round's tokens and gives back the text and tokens that
    are ready: whole tokens that no stop string can still reach (with no stop
    strings, all of them). Once a stop string appears, the text and the
    tokens end before the token in which it begins (that token's text before
    the stop string is dropped with it), and nothing more comes. Only text
    not yet given out is held, so a round costs the same however long the
    text before it.
    """

    def __init__(self, detokenizer: Any, stops: Sequence[str] = ()):
        self.detok = detokenizer
        self.detok.reset()
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters a stop may still claim
        self.text = ""  # the text from character ``sent`` on
        self.sent = 0  # characters given out
        self.pending: list[tuple[int, int]] = []  # (token, where its text ends) not given out
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def end(self) -> int:
        """Characters decoded so far."""
        return self.sent + len(self.text)

    def feed(self, tokens: Sequence[int]) -> tuple[str, list[tuple[int, int]], bool]:
        """The text and tokens now ready (each with where its text ends in
        that text), and whether a stop string ended them."""
        for t in tokens:
            self.detok.add_token(t)
            self.text += self.detok.last_segment
            self.pending.append((t, self.end))
            stop_at = self._find_stop()
            if stop_at is not None:
                return (*self._take(stop_at), True)
        return (*self._take(self.end - self.hold), False)

    def finish(self) -> tuple[str, list[tuple[int, int]]]:
        """What is left once generation ended without a stop string."""
        self.detok.finalize()
        self.text += self.detok.last_segment
        piece = self.text
        ready = [(t, end - self.sent) for t, end in self.pending]
        if ready:  # what finalizing decoded belongs to the last token
            ready[-1] = (ready[-1][0], len(piece))
        self.sent, self.text, self.pending = self.end, "", []
        return piece, ready

    def _find_stop(self) -> int | None:
        """Where the first stop string begins (stop strings end in new text:
        they begin at or after what was given out); ``matched`` names it."""
        hits = [(i, s) for s in self.stops if (i := self.text.find(s)) >= 0]
        if not hits:
            return None
        at, self.matched = min(hits, key=lambda h: h[0])
        return self.sent + at

    def _take(self, limit: int) -> tuple[str, list[tuple[int, int]]]:
        """The pending tokens whose text ends by ``limit`` (each with where
        its text ends in that text), and that text."""
        n = 0
        while n < len(self.pending) and self.pending[n][1] <= limit:
            n += 1
        ready, self.pending = self.pending[:n], self.pending[n:]
        cut = ready[-1][1] - self.sent if ready else 0
        piece, self.text = self.text[:cut], self.text[cut:]
        start, self.sent = self.sent, self.sent + cut
        return piece, [(t, end - start) for t, end in ready]
