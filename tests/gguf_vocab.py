"""Tiny SentencePiece vocabularies trained in the test (by the sentencepiece
library itself, the reference), written as llama.cpp's converter writes them."""

from __future__ import annotations

import io
from functools import cache

import sentencepiece as spm

USER_DEFINED = ["<start_of_turn>", "<end_of_turn>", "\n\n"]
CONTROL = ["<ctrl>"]
TRAIN = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 12345 and 67890 appear here, 3.14 too.",
    "Café au lait, naïve façade, Ελληνικά.",
    "for i in range(10):\n        print(i)\n\n",
    "class Point:\n\tdef __init__(self, x):\n\t\tself.x = x\n",
]

#: Text every SentencePiece check encodes: code, Unicode, emoji (byte
#: fallback), digits, whitespace runs, special-token text.
CORPUS = [
    "Hello world",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "\tTabs\t\tand  spaces   mixed",
    "Unicode: café naïve Ελληνικά 日本語",
    "emoji 😀🎉👍🏽 and 🧑‍🚀",
    "digits 1234567890 3.14159",
    "runs    of     spaces      ",
    "<start_of_turn>user\nHi<end_of_turn>\n\n",
    "x<ctrl>y",
    "a",
    "",
]


@cache
def trained(space_prefix: bool) -> bytes:
    """A serialized SentencePiece BPE model; ``space_prefix`` is its ``add_dummy_prefix``."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN * 30),
        model_writer=buf,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=space_prefix,
        user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL,
        split_by_whitespace=False,
        allow_whitespace_only_pieces=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
        hard_vocab_limit=False,
    )
    return buf.getvalue()


def processor(space_prefix: bool) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_proto=trained(space_prefix))


def spm_metadata(space_prefix: bool, add_bos: bool = True, add_eos: bool = False) -> dict:
    """GGUF tokenizer metadata for the trained model, as convert_hf_to_gguf writes it."""
    sp = processor(space_prefix)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif piece in USER_DEFINED:
            types.append(4)
        else:
            types.append(1)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.ggml.add_eos_token": add_eos,
        "tokenizer.ggml.add_space_prefix": space_prefix,
    }


def gemma4_metadata() -> dict:
    """A ``gemma4`` vocabulary as Gemma 4's converter writes it: the trained
    pieces (no space prefix) with their BPE merges, scores -1000, a BOS always."""
    from hf2q_py.loaders.gguf_spm import derive_merges

    meta = spm_metadata(space_prefix=False)
    merges = derive_merges(
        meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"]
    )
    meta.update({
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.scores": [-1000.0] * len(meta["tokenizer.ggml.tokens"]),
        "tokenizer.ggml.add_bos_token": True,
    })  # fmt: skip
    return meta


def write_vocab(writer, meta: dict) -> None:
    """Add tokenizer metadata to a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" in meta:
        writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.unknown_token_id" in meta:
        writer.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    writer.add_add_bos_token(meta.get("tokenizer.ggml.add_bos_token", False))
    writer.add_add_eos_token(meta.get("tokenizer.ggml.add_eos_token", False))
    if "tokenizer.ggml.add_space_prefix" in meta:
        writer.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])


def bpe_metadata() -> dict:
    """A byte-level BPE vocabulary (``gpt2``): the 256 byte symbols, two merges, an EOS."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>"] + alphabet + ["ab", "abc"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["a b", "ab c"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
