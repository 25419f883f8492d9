"""Byte-level BPE vocabularies (``tokenizer.ggml.model`` = ``gpt2``) as a
``tokenizers`` model; the pre-tokenizer follows ``tokenizer.ggml.pre``."""

from __future__ import annotations

import warnings
from typing import Any

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(name: str | None):
    from tokenizers import Regex, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("smollm", "smaug-bpe"):
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    if name in ("qwen2", "deepseek-r1-qwen"):
        return pt.Sequence(
            [
                pt.Split(Regex(_QWEN2), behavior="isolated"),
                pt.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if name in ("llama-bpe", "llama3"):
        return pt.Sequence(
            [
                pt.Split(Regex(_LLAMA3), behavior="isolated"),
                pt.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if name not in (None, "default", "gpt-2", "gpt2"):
        warnings.warn(f"GGUF pre-tokenizer {name!r} is not known to hf2q-py; using GPT-2's", stacklevel=4)
    return byte_level


def bpe_tokenizer(meta: dict[str, Any]):
    """A ``tokenizers.Tokenizer`` (no added tokens yet) for a byte-level BPE vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok
