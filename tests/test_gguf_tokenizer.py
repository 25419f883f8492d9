"""GGUF vocabularies rebuilt as tokenizers: SentencePiece-style ones equal
sentencepiece itself and transformers' independent GGUF converter."""

import pytest
from gguf_vocab import CONTROL, CORPUS, USER_DEFINED, processor, spm_metadata

from hf2q_py.errors import ModelLoadError, UnsupportedModelError
from hf2q_py.loaders.gguf_eog import end_of_generation_ids
from hf2q_py.loaders.gguf_file import GGUFHeader
from hf2q_py.loaders.gguf_spm import derive_merges
from hf2q_py.loaders.gguf_tokenizer import check_tokenizer, tokenizer_from_gguf
from hf2q_py.target import line_break_tokens

SPECIAL_TEXT = tuple(USER_DEFINED + CONTROL)


def reference(meta: dict, arch: str):
    """transformers' torch-free GGUF tokenizer converter (a separate implementation)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    return convert_gguf_tokenizer(arch, fields)[0]


# llama-style files prepend a space (Llama 2, Mistral); Gemma's do not.
@pytest.mark.parametrize("space_prefix,arch", [(True, "llama"), (False, "gemma3")])
def test_sentencepiece_ids_equal_the_references(space_prefix, arch):
    """Both references on text without special tokens (with them, llama.cpp
    prefixes each run after one, which transformers does not: below)."""
    meta = spm_metadata(space_prefix)
    tok = tokenizer_from_gguf(meta)
    ref = reference(meta, arch)
    sp = processor(space_prefix)
    for text in [*CORPUS, " leading space"]:
        ids = tok.encode(text, add_special_tokens=False)
        if not any(s in text for s in SPECIAL_TEXT):  # sentencepiece parses no special tokens
            assert ids == sp.encode(text), text
        if not (space_prefix and (text.startswith(" ") or any(s in text for s in SPECIAL_TEXT))):
            assert ids == ref.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("space_prefix", [True, False])
def test_each_run_of_text_between_special_tokens_is_tokenized_alone_as_llama_cpp_does(space_prefix):
    tok = tokenizer_from_gguf(spm_metadata(space_prefix))
    alone = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    for special in SPECIAL_TEXT:
        got = alone(f"ab{special}user\nx")
        assert got == alone("ab") + alone(special) + alone("user\nx"), special


@pytest.mark.parametrize("space_prefix", [True, False])
def test_line_break_tokens_are_the_tokens_whose_text_holds_one(space_prefix):
    """Literal newline pieces, user-defined ones and the byte-fallback <0x0A>."""
    tok = tokenizer_from_gguf(spm_metadata(space_prefix))
    decoded = {i for i in range(len(tok.vocab)) if "\n" in tok.decode([i])}
    assert len(decoded) >= 3
    assert line_break_tokens(tok) == decoded


def test_no_tokenizer_has_no_line_break_tokens():
    assert line_break_tokens(None) == frozenset()


@pytest.mark.parametrize("space_prefix", [True, False])
def test_sentencepiece_decode_inverts_encode(space_prefix):
    tok = tokenizer_from_gguf(spm_metadata(space_prefix))
    for text in CORPUS:
        if space_prefix and any(s in text for s in SPECIAL_TEXT):
            continue  # the run after a special token gained a space, as in llama.cpp
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_emoji_fall_back_to_byte_pieces():
    meta = spm_metadata(True)
    tok = tokenizer_from_gguf(meta)
    ids = tok.encode("😀", add_special_tokens=False)
    pieces = [meta["tokenizer.ggml.tokens"][i] for i in ids]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


@pytest.mark.parametrize("space_prefix", [True, False])
def test_streaming_detokenizer_rebuilds_the_text_token_by_token(space_prefix):
    tok = tokenizer_from_gguf(spm_metadata(space_prefix))
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        detok = tok.detokenizer
        detok.reset()
        for i in ids:
            detok.add_token(i)
        detok.finalize()
        assert detok.text == tok.decode(ids)
        if not (space_prefix and any(s in text for s in SPECIAL_TEXT)):
            assert detok.text == text


def test_bos_and_eos_follow_the_file_flags():
    text = "Hello world"
    plain = tokenizer_from_gguf(spm_metadata(True, add_bos=False)).encode(text)
    assert tokenizer_from_gguf(spm_metadata(True, add_bos=True)).encode(text) == [1] + plain
    assert tokenizer_from_gguf(spm_metadata(True, add_bos=True, add_eos=True)).encode(text) == [1] + plain + [
        2
    ]
    no_flag = {k: v for k, v in spm_metadata(True).items() if k != "tokenizer.ggml.add_bos_token"}
    assert tokenizer_from_gguf(no_flag).encode(text) == [1] + plain  # llama.cpp's default for these files


def test_control_tokens_are_special_and_user_defined_ones_are_not():
    tok = tokenizer_from_gguf(spm_metadata(True))
    ids = tok.encode("<ctrl>a<start_of_turn>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "a<start_of_turn>"
    assert tok.eos_token_ids == {2, 5}  # </s> and <end_of_turn> (user-defined here; ends all the same)


def test_turn_end_tokens_end_generation_beside_the_declared_eos():
    meta = spm_metadata(True)
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"][3] = "<|im_end|>"  # a control token
    assert tokenizer_from_gguf(meta).eos_token_ids == {2, 3, 5}


def _vocabulary(*texts: str, **declared: int) -> dict:
    meta = {"tokenizer.ggml.tokens": ["a", "b", *texts]}
    meta.update({f"tokenizer.ggml.{key}_token_id": i for key, i in declared.items()})
    return meta


def test_qwen_files_end_at_every_end_token_llama_cpp_infers():
    meta = _vocabulary("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", eos=3)
    assert end_of_generation_ids(meta) == [2, 3, 4, 5, 6]


def test_declared_end_tokens_end_whatever_their_text():
    meta = _vocabulary("<x>", "<y>", "<z>", eos=2, eot=3, eom=4)
    assert end_of_generation_ids(meta) == [2, 3, 4]


def test_declared_fim_tokens_replace_the_ones_found_by_text():
    meta = _vocabulary("<|fim_pad|>", "<my_pad>", fim_pad=3)
    assert end_of_generation_ids(meta) == [3]


def test_harmony_end_is_not_an_end_of_generation():
    assert end_of_generation_ids(_vocabulary("<|return|>", "<|call|>", "<|end|>")) == [2, 3]
    assert end_of_generation_ids(_vocabulary("<|end|>")) == [2]


def test_gemma4_slash_s_is_a_normal_token():
    assert end_of_generation_ids(_vocabulary("<turn|>", "<|tool_response>", "</s>", "<eos>")) == [2, 3, 5]
    assert end_of_generation_ids(_vocabulary("</s>")) == [2]


def test_merges_rank_pieces_by_score_then_id():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    merges = derive_merges(tokens, scores, [1] * len(tokens))
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def _header(meta: dict) -> GGUFHeader:
    from pathlib import Path

    return GGUFHeader(Path("x.gguf"), meta, {})


def test_unknown_vocabulary_kinds_are_named():
    meta = dict(spm_metadata(True), **{"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(UnsupportedModelError, match="x.gguf: GGUF tokenizer model 'rwkv' is not supported"):
        check_tokenizer(_header(meta))
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        check_tokenizer(_header({}))
    meta = dict(spm_metadata(True), **{"tokenizer.ggml.scores": [0.0]})
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.scores has 1 entries"):
        check_tokenizer(_header(meta))
