"""Reference files for ``hf2q-py ab``: another engine's greedy outputs, one case per JSON line.

    {"prompt": "Write a haiku.", "tokens": [504, 3271, 28], "engine": "llama.cpp"}
    {"prompt_ids": [1, 9690, 198], "text": "An old silent pond", "max_tokens": 64}

Fields of a case:

- ``prompt`` (text, sent through the model's chat template unless ``chat_template`` is
  false) or ``prompt_ids`` (token ids, used as given; a ``prompt`` beside them only names
  the case);
- the other engine's output: ``tokens`` (ids, compared token by token) and/or ``text``
  (compared byte by byte when there are no ``tokens``);
- optional: ``engine`` (a name for the report), ``max_tokens`` (the length the engine was
  asked for), ``finish_reason`` (``"stop"``: the engine ended at an end-of-sequence token;
  ``"length"``: at ``max_tokens``) and ``model`` (where the weights came from; not checked).

``hf2q-py ab --record FILE`` writes hf2q-py's own greedy outputs in this format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from ..errors import Hf2qError
from .files import read_text, write_text

#: The fields a case may have.
FIELDS = (
    "prompt",
    "prompt_ids",
    "chat_template",
    "tokens",
    "text",
    "engine",
    "max_tokens",
    "finish_reason",
    "model",
)
FINISH_REASONS = ("stop", "length")


@dataclass
class Reference:
    """One case of a reference file; ``where`` is ``path:line``."""

    where: str
    prompt: str | None
    prompt_ids: list[int] | None
    chat_template: bool
    tokens: list[int] | None
    text: str | None
    engine: str
    max_tokens: int | None = None
    finish_reason: str | None = None
    model: str | None = None

    @property
    def label(self) -> str:
        """The case's name in reports: its prompt text, else its first ids."""
        if self.prompt is not None:
            return self.prompt
        ids = self.prompt_ids or []
        return "ids " + " ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")

    def check_vocabulary(self, vocab_size: int | None) -> None:
        """Refuse ids outside a model's vocabulary of ``vocab_size``."""
        if vocab_size is None:
            return
        for name in ("prompt_ids", "tokens"):
            for t in getattr(self, name) or ():
                if t >= vocab_size:
                    raise Hf2qError(
                        f"{self.where}: {name} holds id {t}, outside the model's vocabulary ({vocab_size} ids)"
                    )


def read_references(path: str | Path) -> list[Reference]:
    """Every case of the reference file ``path`` (blank lines skipped); an
    ``Hf2qError`` naming the file and line for anything malformed."""
    text = read_text(path, "reference file")
    cases = [
        parse_reference(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()
    ]
    if not cases:
        raise Hf2qError(f"reference file {path} holds no cases")
    return cases


def parse_reference(line: str, where: str) -> Reference:
    """One JSON line of a reference file."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise Hf2qError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(item, dict):
        raise Hf2qError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - set(FIELDS))
    if unknown:
        raise Hf2qError(f"{where}: unknown field(s) {', '.join(unknown)}; the fields: {', '.join(FIELDS)}")
    prompt = _text(item, "prompt", where)
    prompt_ids = _ids(item, "prompt_ids", where)
    if prompt is None and prompt_ids is None:
        raise Hf2qError(f"{where}: give the prompt as 'prompt' (text) or 'prompt_ids' (token ids)")
    if prompt_ids == []:
        raise Hf2qError(f"{where}: prompt_ids is empty")
    if prompt is not None and not prompt.strip() and prompt_ids is None:
        raise Hf2qError(f"{where}: the prompt is empty")
    tokens, text = _ids(item, "tokens", where), _text(item, "text", where)
    if tokens is None and text is None:
        raise Hf2qError(f"{where}: the case has neither 'tokens' nor 'text' (the other engine's output)")
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise Hf2qError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if max_tokens is not None and tokens is not None and len(tokens) > max_tokens:
        raise Hf2qError(f"{where}: tokens holds {len(tokens)} ids, more than max_tokens ({max_tokens})")
    finish = item.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise Hf2qError(f"{where}: finish_reason must be one of {', '.join(FINISH_REASONS)}, got {finish!r}")
    chat = item.get("chat_template", True)
    if not isinstance(chat, bool):
        raise Hf2qError(f"{where}: chat_template must be true or false, got {chat!r}")
    return Reference(
        where,
        prompt,
        prompt_ids,
        chat,
        tokens,
        text,
        _text(item, "engine", where) or "reference",
        max_tokens,
        finish,
        _text(item, "model", where),
    )


def _text(item: dict[str, Any], name: str, where: str) -> str | None:
    value = item.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise Hf2qError(f"{where}: {name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Hf2qError(
            f"{where}: {name} is not valid Unicode (lone surrogate at character {e.start})"
        ) from None
    return value


def _ids(item: dict[str, Any], name: str, where: str) -> list[int] | None:
    value = item.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise Hf2qError(f"{where}: {name} must be a list of token ids, got {type(value).__name__}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise Hf2qError(f"{where}: {name} holds {t!r}, not a token id (an integer >= 0)")
    return value


def record_line(
    *,
    prompt: str | None,
    prompt_ids: Sequence[int],
    chat_template: bool,
    tokens: Sequence[int],
    text: str | None,
    max_tokens: int,
    ended: bool,
    model: str,
    engine: str = "hf2q-py",
) -> dict[str, Any]:
    """One case in the reference format: an engine's greedy output for a
    prompt (``prompt`` None: given as ids only; ``text`` None: no tokenizer)."""
    line = {
        "engine": engine,
        "model": model,
        "prompt": prompt,
        "chat_template": chat_template,
        "prompt_ids": list(prompt_ids),
        "max_tokens": max_tokens,
        "tokens": list(tokens),
        "text": text,
        "finish_reason": "stop" if ended else "length",
    }
    return {k: v for k, v in line.items() if v is not None}


def write_references(path: str | Path, lines: Sequence[dict[str, Any]]) -> None:
    """Write cases as JSON Lines (UTF-8, non-ASCII kept as is)."""
    write_text(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), "--record file")
