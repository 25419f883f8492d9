"""A Hugging Face fast tokenizer rebuilt from GGUF metadata.

Vocabulary kinds: byte-level BPE (``gpt2``, see ``gguf_bpe``),
SentencePiece-style (``llama``) and Gemma 4's BPE with byte fallback
(``gemma4``, both in ``gguf_spm``). Control tokens become
special tokens and user-defined tokens plain added tokens (both always
matched whole, as llama.cpp does); BOS/EOS are added as
``tokenizer.ggml.add_bos_token``/``add_eos_token`` say; the chat template
comes from the file; generation ends where llama.cpp's does (``gguf_eog``).
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError, UnsupportedModelError
from .gguf_eog import end_of_generation_ids
from .gguf_file import GGUFHeader

CONTROL, USER_DEFINED = 3, 4
KINDS = ("gpt2", "llama", "gemma4")
#: Whether a BOS token is added when the file does not say (llama.cpp's defaults).
_ADD_BOS_DEFAULT = {"gpt2": False, "llama": True, "gemma4": True}


def check_tokenizer(header: GGUFHeader) -> None:
    """Refuse a vocabulary kind that cannot be rebuilt, from the header alone."""
    meta = header.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError(f"{header.path.name}: GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    if kind not in KINDS:
        raise UnsupportedModelError(
            f"{header.path.name}: GGUF tokenizer model {kind!r} is not supported "
            f"(supported: gpt2 byte-level BPE, llama SentencePiece, gemma4 BPE with byte fallback)"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{header.path.name}: GGUF metadata lacks tokenizer.ggml.tokens")
    if kind == "gemma4" and not meta.get("tokenizer.ggml.merges"):
        raise ModelLoadError(f"{header.path.name}: a gemma4 vocabulary needs tokenizer.ggml.merges")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in meta and len(meta[key]) != len(tokens):
            raise ModelLoadError(
                f"{header.path.name}: {key} has {len(meta[key])} entries for {len(tokens)} tokens"
            )


def _fast_tokenizer(backend: Any, **kwargs: Any):
    """A ``PreTrainedTokenizerFast`` around ``backend`` without the deep copy
    its constructor makes of a ``tokenizer_object`` (seconds for 262k tokens)."""
    from transformers import PreTrainedTokenizerFast

    class GGUFTokenizerFast(PreTrainedTokenizerFast):
        def __init__(self, **kw: Any):
            self._tokenizer = backend
            super().__init__(**kw)

    return GGUFTokenizerFast(**kwargs)


def tokenizer_from_gguf(meta: dict[str, Any]):
    """An mlx-lm ``TokenizerWrapper`` from GGUF metadata."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind in ("llama", "gemma4"):
        from .gguf_spm import add_space_prefix, gemma4_tokenizer, spm_detokenizer, spm_tokenizer

        tok = spm_tokenizer(meta) if kind == "llama" else gemma4_tokenizer(meta)
        trim = kind == "llama" and add_space_prefix(meta)
        detokenizer = lambda _: spm_detokenizer(tokens, types, trim_space=trim)  # noqa: E731
    else:
        from .gguf_bpe import bpe_tokenizer

        tok = bpe_tokenizer(meta)
        detokenizer = BPEStreamingDetokenizer
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = (
        meta.get("tokenizer.ggml.add_bos_token", _ADD_BOS_DEFAULT[kind]) or kind == "gemma4"
    )  # llama.cpp's rule
    add_bos = add_bos and bos is not None
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None
    if add_bos or add_eos:
        head, tail = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
        specials = {t: tok.token_to_id(t) for t in (bos if add_bos else None, eos if add_eos else None) if t}
        tok.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}",
            pair=f"{head}$A{tail} {head}$B{tail}",
            special_tokens=list(specials.items()),
        )
    hf = _fast_tokenizer(
        tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown"),
        pad_token=token("padding"),
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    return TokenizerWrapper(hf, detokenizer, eos_token_ids=end_of_generation_ids(meta))
