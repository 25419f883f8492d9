"""Constrained decoding: which tokens a grammar allows next, with llguidance.

A :class:`ConstraintSpec` says what the output must be (any JSON object, a
JSON schema, a regular expression or a Lark grammar); ``spec.build(target)``
gives one generation's :class:`Constraint` over the target's tokenizer.
The loop asks it, each round, how many of its drafts the grammar allows
(``plan``, which also gives the boolean mask of every position it will
verify), and tells it the tokens it committed (``commit``).

End of generation: the target's EOS ids are allowed exactly when the text
so far is complete under the grammar (``accepting``); once nothing else can
follow (``done``), they are the only tokens allowed.

Compiling is cached: the llguidance tokenizer per tokenizer, and the
compiled grammar per (tokenizer, spec), copied for each generation.
"""

from __future__ import annotations

import json
import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import Hf2qError, one_line

KINDS = ("json_object", "json_schema", "regex", "grammar")
#: JSON is written with fixed separators and no other whitespace, so a model
#: cannot spend its tokens on blank space (and the output stays one line).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Compiled grammars kept per tokenizer.
COMPILED_PER_TOKENIZER = 64


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match: ``kind`` one of :data:`KINDS`; ``text`` the
    JSON schema (as JSON text), the regular expression or the Lark grammar
    (empty for ``json_object``). ``after``: text the output starts with that
    the prompt already holds (a forced tool call's opening): the grammar has
    read it before the first generated token."""

    kind: str
    text: str = ""
    after: str = ""

    @classmethod
    def json_schema(cls, schema: Any) -> ConstraintSpec:
        """A JSON-schema spec from a schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise Hf2qError(f"json_schema: not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise Hf2qError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise Hf2qError(f"json_schema: not JSON data ({one_line(e)})") from None
        return cls("json_schema", text)

    @classmethod
    def from_options(
        cls,
        json_schema: Any = None,
        regex: str | None = None,
        grammar: str | None = None,
        json_object: bool = False,
    ) -> ConstraintSpec | None:
        """The spec that generation options ask for (at most one of them), or None."""
        given = [
            n
            for n, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
            if v is not None
        ]
        if json_object is not False:
            if json_object is not True:
                raise Hf2qError(f"json_object must be True or False, got {json_object!r}")
            given.append("json_object")
        if len(given) > 1:
            raise Hf2qError(f"give one output constraint, not {' and '.join(given)}")
        if not given:
            return None
        if json_schema is not None:
            return cls.json_schema(json_schema)
        if json_object:
            return cls("json_object")
        kind, text = ("regex", regex) if regex is not None else ("grammar", grammar)
        if not isinstance(text, str):
            raise Hf2qError(f"{kind} must be a string, got {type(text).__name__}")
        return cls(kind, text)

    def problem(self) -> str | None:
        """What is wrong with this spec (an invalid or unsupported schema, regex
        or grammar), as one line, or None."""
        if self.kind not in KINDS:
            return f"unknown constraint kind {self.kind!r} (choose from {', '.join(KINDS)})"
        if not isinstance(self.text, str):
            return f"the {self.kind} must be text, got {type(self.text).__name__}"
        if self.kind != "json_object" and not self.text.strip():
            return f"the {self.kind} is empty"
        return _problem(self.kind, self.text)

    def validate(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise Hf2qError(f"{self.kind}: {problem}")

    def grammar(self) -> str:
        """The llguidance grammar."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        return llguidance.LLMatcher.grammar_from_lark(self.text)

    def build(self, target: Any) -> Constraint:
        """One generation's grammar state over ``target``'s tokenizer."""
        self.validate()
        tokenizer = getattr(target, "tokenizer", None)
        if tokenizer is None:
            raise Hf2qError("structured output needs the model's tokenizer")
        eos = tuple(sorted(target.eos_token_ids))
        if not eos:
            raise Hf2qError("structured output needs the model's end-of-generation token ids")
        compiled, vocab = _compiled(tokenizer, eos, ConstraintSpec(self.kind, self.text))
        matcher = compiled.deep_copy()
        if self.after and not matcher.consume_tokens(
            list(tokenizer.encode(self.after, add_special_tokens=False))
        ):
            raise Hf2qError(f"the {self.kind} does not allow the answer's start {self.after!r}")
        return Constraint(matcher, vocab, int(target.vocab_size), eos)


class Constraint:
    """One generation's grammar state: an llguidance matcher over a
    vocabulary of ``vocab`` tokens; ``width`` is the model's logits width."""

    def __init__(self, matcher: Any, vocab: int, width: int, eos: tuple[int, ...]):
        self.matcher = matcher
        self.vocab = vocab
        self.width = width
        self.eos = eos

    @property
    def done(self) -> bool:
        """Nothing but the end of generation can follow."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is complete under the grammar (EOS is allowed)."""
        return self.matcher.is_accepting()

    def plan(self, drafts: list[int]) -> tuple[int, mx.array]:
        """How many leading ``drafts`` the grammar allows in order (n), and the
        (n + 1, width) boolean masks of the positions to verify: row i allows
        what may follow the committed tokens and ``drafts[:i]``. The grammar
        state is left as it was."""
        import llguidance.numpy as lln

        n = self.allowed(drafts)
        bitmask = np.zeros((n + 1, (self.vocab + 31) // 32), dtype=np.int32)
        consumed = 0
        for i in range(n + 1):
            if i and drafts[i - 1] in self.eos:  # past the end: only EOS (the loop stops there)
                bitmask[i:] = self._eos_words()
                break
            lln.fill_next_token_bitmask(self.matcher, bitmask, i)
            if i < n and drafts[i] not in self.eos:
                if not self.matcher.consume_token(drafts[i]):
                    raise Hf2qError(f"the grammar refused draft token {drafts[i]} it had allowed")
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return n, bitmask_to_mlx(bitmask, self.width)

    def _eos_words(self) -> np.ndarray:
        words = np.zeros((self.vocab + 31) // 32, dtype=np.uint32)
        for t in self.eos:
            if t < self.vocab:
                words[t // 32] |= np.uint32(1 << (t % 32))
        return words.view(np.int32)

    def allowed(self, drafts: list[int]) -> int:
        """How many leading ``drafts`` the grammar allows, in order."""
        ok = 0
        while ok < len(drafts) and 0 <= drafts[ok] < self.vocab and drafts[ok] not in self.eos:
            ok += 1
        n = self.matcher.validate_tokens(list(drafts[:ok])) if ok else 0
        if n == ok < len(drafts) and drafts[ok] in self.eos and self._complete_after(drafts[:ok]):
            n += 1  # an EOS draft where the text is complete ends the drafts
        return n

    def _complete_after(self, tokens: list[int]) -> bool:
        """Whether the text is complete after ``tokens`` (allowed ones); the state is kept."""
        if not tokens:
            return self.matcher.is_accepting()
        self.matcher.consume_tokens(list(tokens))
        complete = self.matcher.is_accepting()
        self.matcher.rollback(len(tokens))
        return complete

    def commit(self, tokens: list[int]) -> None:
        """Advance by tokens the loop committed (each allowed by the last plan)."""
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise Hf2qError(
                    f"the grammar does not allow token {t} here ({one_line(self.matcher.get_error())})"
                )


def bitmask_to_mlx(bitmask: np.ndarray, width: int) -> mx.array:
    """llguidance's bitmask rows (int32 words, bit j of word w = token 32w + j)
    as a (rows, width) boolean MLX array, False past the bitmask."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] >= width:
        bits = bits[:, :width]
    else:
        bits = np.pad(bits, ((0, 0), (0, width - bits.shape[1])))
    return mx.array(np.ascontiguousarray(bits).view(np.bool_))


# -- checking specs ---------------------------------------------------------------------------
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


@lru_cache(maxsize=256)
def _problem(kind: str, text: str) -> str | None:
    """llguidance's verdict on a spec, as one line (cached: the server checks every request)."""
    import llguidance

    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            return f"not valid JSON ({e})"
        if not isinstance(schema, dict):
            return f"a schema is a JSON object, got {type(schema).__name__}"
    try:
        grammar = ConstraintSpec(kind, text).grammar()
    except (ValueError, TypeError) as e:
        return one_line(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return None
    message = messages[0] if messages else "invalid"
    unimplemented = _UNIMPLEMENTED.search(message)
    if unimplemented:
        keys = ", ".join(k.strip().strip('"') for k in unimplemented.group(1).split(","))
        return f"unsupported schema feature(s): {keys}"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    regex_error = next((line for line in lines if line.startswith("error: ")), None)
    if "regex parse error" in message and regex_error:
        return f"invalid regular expression: {regex_error.removeprefix('error: ')}"
    return one_line(lines[0] if lines else message, limit=400)


# -- compiling, cached ------------------------------------------------------------------------
#: Per tokenizer object: its llguidance tokenizers (by EOS ids) and compiled grammars.
_CACHE: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _compiled(tokenizer: Any, eos: tuple[int, ...], spec: ConstraintSpec) -> tuple[Any, int]:
    """The compiled grammar of ``spec`` over ``tokenizer`` (a matcher to copy)
    and the size of the vocabulary its masks cover."""
    import llguidance

    per_tok = _CACHE.setdefault(tokenizer, {})
    ll_tok = _cached_ll_tokenizer(tokenizer, eos)
    grammars: OrderedDict = per_tok.setdefault(("grammars", eos), OrderedDict())
    matcher = grammars.get(spec)
    if matcher is None:
        matcher = llguidance.LLMatcher(ll_tok, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise Hf2qError(f"{spec.kind}: {one_line(matcher.get_error(), limit=400)}")
        grammars[spec] = matcher
        while len(grammars) > COMPILED_PER_TOKENIZER:
            grammars.popitem(last=False)
    grammars.move_to_end(spec)
    return matcher, ll_tok.vocab_size


def _cached_ll_tokenizer(tokenizer: Any, eos: tuple[int, ...]) -> Any:
    per_tok = _CACHE.setdefault(tokenizer, {})
    ll_tok = per_tok.get(("tokenizer", eos))
    if ll_tok is None:
        ll_tok = per_tok[("tokenizer", eos)] = ll_tokenizer(tokenizer, list(eos))
    return ll_tok


def special_tokens(target: Any, texts: list[str]) -> dict[str, int]:
    """Those of ``texts`` that are one token of ``target``'s vocabulary which
    the grammar engine reads as a special token (text never matches it; a
    grammar names it ``<[ID]>``), with that token's id. llguidance counts
    added tokens written like ``<tool_call>`` among them."""
    tokenizer = getattr(target, "tokenizer", None)
    eos = tuple(sorted(getattr(target, "eos_token_ids", ()) or ()))
    if tokenizer is None or not eos:
        return {}
    ll_tok = _cached_ll_tokenizer(tokenizer, eos)
    out = {}
    for text in texts:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) == 1 and ids[0] < ll_tok.vocab_size and ll_tok.is_special_token(ids[0]):
            out[text] = ids[0]
    return out


def ll_tokenizer(tokenizer: Any, eos: list[int]) -> Any:
    """llguidance's tokenizer for an mlx-lm ``TokenizerWrapper`` (or a Hugging
    Face tokenizer): read from the fast tokenizer's own definition where
    llguidance understands it, else from each token's decoded text."""
    import llguidance
    import llguidance.hf

    hf = _hf_tokenizer(tokenizer)
    try:
        return llguidance.hf.from_tokenizer(hf, eos_token=eos)
    except Exception:  # noqa: BLE001 - a tokenizer kind llguidance cannot read: spell the tokens out
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SpelledTokenizer(hf, eos)))


class _SpelledTokenizer:
    """A vocabulary as llguidance's generic wrapper reads it: each token's
    bytes (its decoded text), the special ids, and an encoder."""

    def __init__(self, hf: Any, eos: list[int]):
        size = len(hf)
        self.tokens = [hf.decode([i]).encode("utf-8") for i in range(size)]
        self.eos_token_id = eos[0]
        self.bos_token_id = getattr(hf, "bos_token_id", None)
        self.special_token_ids = sorted(set(getattr(hf, "all_special_ids", [])) | set(eos))
        self._hf = hf

    def __call__(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (or the tokenizer itself)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if hasattr(inner, "apply_chat_template") else tokenizer
