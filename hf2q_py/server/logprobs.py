"""Log-probabilities in OpenAI's response shapes, from the loop's records.

The loop reports, per generated token, a :class:`TokenLogprob` (the token,
its log-probability, the most likely alternatives). Chat answers carry
``logprobs.content``: one ``{token, logprob, bytes, top_logprobs}`` per
token; text completions the legacy ``tokens``, ``token_logprobs``,
``top_logprobs`` and ``text_offset`` lists. A stream's chunk carries the
entries of its own tokens (text offsets going on from the chunk before).
Token strings and bytes come from the tokenizer's vocabulary: a token that
is only part of a character is written ``bytes:\\xNN...``, as OpenAI does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ..sampling import TokenLogprob


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte, inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return {c: b for b, c in chars.items()}


_BYTE_OF = byte_level_chars()


@lru_cache(maxsize=8)
def _is_byte_level(hf: Any) -> bool:
    backend = getattr(hf, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes a token stands for (byte-level BPE and SentencePiece byte
    pieces undone; otherwise its decoded text)."""
    hf = getattr(tokenizer, "_tokenizer", None)
    hf = hf if hasattr(hf, "convert_ids_to_tokens") else tokenizer
    piece = hf.convert_ids_to_tokens(int(token))
    if not isinstance(piece, str):
        return b""
    if _BYTE_PIECE.fullmatch(piece):
        return bytes([int(piece[3:5], 16)])
    if _is_byte_level(hf) and all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode("utf-8")
    return hf.decode([int(token)]).encode("utf-8")


def token_text(raw: bytes) -> str:
    """A token's text; ``bytes:\\xNN`` for bytes that are not whole characters."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token)
    return {"token": token_text(raw), "logprob": float(logprob), "bytes": list(raw)}


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``: ``content``, one entry per token."""
    content = [
        {
            **_entry(tokenizer, e.token, e.logprob),
            "top_logprobs": [_entry(tokenizer, t, lp) for t, lp in e.top],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], tokenizer: Any, before: bytes = b""
) -> tuple[dict[str, Any], bytes]:
    """A text completion's (or chunk's) legacy ``logprobs``, and the answer's
    bytes after these tokens. ``before``: the answer's bytes before them
    (a stream's earlier chunks); a text offset counts the whole characters
    before its token."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        raw = token_bytes(tokenizer, e.token)
        tokens.append(token_text(raw))
        offsets.append(len(before.decode("utf-8", "ignore")))
        before += raw
        top: dict[str, float] = {}
        for t, lp in e.top:
            top.setdefault(token_text(token_bytes(tokenizer, t)), float(lp))
        tops.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": [float(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, before


class LogprobWriter:
    """One response's ``logprobs`` bodies, chat or text completion; a stream's
    chunks in order (text offsets go on from chunk to chunk)."""

    def __init__(self, tokenizer: Any, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.before = b""  # the answer's bytes so far (text completions' offsets)

    def body(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return chat_logprobs(entries, self.tokenizer)
        out, self.before = completion_logprobs(entries, self.tokenizer, self.before)
        return out
