"""A Hugging Face fast tokenizer rebuilt from GGUF metadata (BPE vocabularies).

The pre-tokenizer follows llama.cpp's ``tokenizer.ggml.pre`` name; control
tokens become special tokens; the chat template comes from the file.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import UnsupportedModelError

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(name: str | None):
    from tokenizers import Regex, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("smollm", "smaug-bpe"):
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    if name in ("qwen2", "deepseek-r1-qwen"):
        return pt.Sequence(
            [pt.Split(Regex(_QWEN2), behavior="isolated"), pt.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if name in ("llama-bpe", "llama3"):
        return pt.Sequence(
            [pt.Split(Regex(_LLAMA3), behavior="isolated"), pt.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if name not in (None, "default", "gpt-2", "gpt2"):
        warnings.warn(f"GGUF pre-tokenizer {name!r} is not known to hf2q-py; using GPT-2's", stacklevel=3)
    return byte_level


def tokenizer_from_gguf(meta: dict[str, Any]):
    """An mlx-lm ``TokenizerWrapper`` from GGUF metadata."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (only BPE 'gpt2' vocabularies); "
            "load the model from its Hugging Face folder instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (CONTROL, USER_DEFINED)
        ]
    )

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown"),
        pad_token=token("padding"),
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=eos_ids)
