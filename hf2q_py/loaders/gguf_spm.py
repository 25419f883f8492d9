"""SentencePiece-style vocabularies (``tokenizer.ggml.model`` = ``llama``:
Llama 2, Mistral, Gemma 1-3, ...) as a ``tokenizers`` BPE model.

llama.cpp tokenizes these by repeatedly merging the adjacent pair whose
joined piece has the best score. That is BPE whose merges are every split of
every piece into two pieces, ranked by the joined piece's score (ties: lower
id first). Spaces become ``▁``; when ``tokenizer.ggml.add_space_prefix`` is
true (the default) a ``▁`` is prepended to the text and to every run of text
after a special or user-defined token; characters
missing from the vocabulary fall back to ``<0xXX>`` byte pieces.

Gemma 4's kind (``gemma4``) is the same piece table with real BPE merges
from the file (``tokenizer.ggml.merges``): llama.cpp turns spaces into ``▁``,
splits the text only into runs of newlines and runs of everything else, and
merges over each run; no space is prepended and a BOS always is.
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def derive_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) pair of pieces that joins into a normal piece, best
    joined piece first."""
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if types[i] not in (CONTROL, BYTE, UNKNOWN, UNUSED):
            first.setdefault(t, i)
    ranked = sorted(
        (i for t, i in first.items() if types[i] == NORMAL and len(t) > 1),
        key=lambda i: (-scores[i], i),
    )
    merges = []
    for i in ranked:
        t = tokens[i]
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in first and right in first:
                merges.append((left, right))
    return merges


def add_space_prefix(meta: dict[str, Any]) -> bool:
    return bool(meta.get("tokenizer.ggml.add_space_prefix", True))


def spm_tokenizer(meta: dict[str, Any]):
    """A ``tokenizers.Tokenizer`` (no added tokens yet) for a SentencePiece-style vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=derive_merges(tokens, scores, types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix(meta):
        # llama.cpp prepends a space to every run of text after a special
        # token (and at the start), even one that starts with a space
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence(steps)
    return tok


def gemma4_tokenizer(meta: dict[str, Any]):
    """A ``tokenizers.Tokenizer`` (no added tokens yet) for a ``gemma4`` vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _piece_bytes(token: str, ttype: int) -> bytes:
    if ttype == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.encode("utf-8")


def spm_detokenizer(tokens: list[str], types: list[int], trim_space: bool):
    """mlx-lm's streaming SentencePiece detokenizer, its piece table built from
    the GGUF token list (byte pieces by token type) rather than id by id."""
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, StreamingDetokenizer

    detok = SPMStreamingDetokenizer.__new__(SPMStreamingDetokenizer)
    StreamingDetokenizer.__init__(detok)
    detok.trim_space = trim_space
    detok.tokenmap = [_piece_bytes(t, ty) for t, ty in zip(tokens, types)]
    detok.reset()
    return detok
