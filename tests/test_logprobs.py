"""logprobs in OpenAI's response shapes (``hf2q_py.server.logprobs``): token
strings and bytes from the vocabulary, chat's ``logprobs.content`` and the
legacy completions lists, chunk by chunk as a stream sends them."""

from __future__ import annotations

import math

import pytest
from models import char_tokenizer

from hf2q_py.loaders.builtin import builtin_model_path
from hf2q_py.loaders.gguf_file import read_header
from hf2q_py.loaders.gguf_tokenizer import tokenizer_from_gguf
from hf2q_py.server.logprobs import TokenLogprob, chat_logprobs, completion_logprobs, token_bytes, token_text


@pytest.fixture(scope="module")
def smol():
    """The built-in model's byte-level BPE tokenizer (from its GGUF header)."""
    return tokenizer_from_gguf(read_header(builtin_model_path()).metadata)


def test_token_bytes_undo_byte_level_bpe_and_rebuild_the_text(smol):
    text = "héllo wörld 🎉\n\tdef f():"
    ids = smol.encode(text)
    assert b"".join(token_bytes(smol, t) for t in ids).decode("utf-8") == text
    space_hello = smol.encode(" hello")
    assert token_bytes(smol, space_hello[0]).startswith(b" ")


def test_a_token_that_is_part_of_a_character_is_written_as_bytes(smol):
    pieces = [token_bytes(smol, t) for t in smol.encode("🎉")]
    assert len(pieces) > 1  # the emoji takes several tokens here
    assert token_text(pieces[0]).startswith("bytes:\\x")
    assert token_text("é".encode()) == "é"


def test_character_vocabularies_give_each_tokens_text():
    tok = char_tokenizer()
    assert [token_bytes(tok, t) for t in tok.encode("a¡\n")] == [b"a", "¡".encode(), b"\n"]


def entries(tok, text: str) -> list[TokenLogprob]:
    ids = tok.encode(text)
    return [TokenLogprob(t, -0.1 * (i + 1), [(t, -0.1 * (i + 1)), (ids[0], -3.0)]) for i, t in enumerate(ids)]


def test_chat_logprobs_give_token_logprob_bytes_and_alternatives(smol):
    body = chat_logprobs(entries(smol, "Hi there"), smol)
    content = body["content"]
    assert body["refusal"] is None and "".join(e["token"] for e in content) == "Hi there"
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["bytes"] == list(first["token"].encode()) and math.isclose(first["logprob"], -0.1)
    assert [a["logprob"] for a in first["top_logprobs"]] == [-0.1, -3.0]
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_completion_logprobs_are_the_legacy_lists_with_text_offsets(smol):
    body, after = completion_logprobs(entries(smol, "one two"), smol)
    assert "".join(body["tokens"]) == "one two" and after == b"one two"
    assert body["text_offset"] == [
        sum(len(t) for t in body["tokens"][:i]) for i in range(len(body["tokens"]))
    ]
    assert body["token_logprobs"][0] == pytest.approx(-0.1)
    t0, t1 = body["tokens"][:2]
    assert body["top_logprobs"][0] == {t0: pytest.approx(-0.1)}  # the token and itself: one entry
    assert body["top_logprobs"][1] == {t1: pytest.approx(-0.2), t0: pytest.approx(-3.0)}


def test_streamed_chunks_carry_offsets_on_from_the_chunk_before(smol):
    all_entries = entries(smol, "alpha beta gamma")
    whole, _ = completion_logprobs(all_entries, smol)
    first, before = completion_logprobs(all_entries[:2], smol)
    second, _ = completion_logprobs(all_entries[2:], smol, before)
    assert first["text_offset"] + second["text_offset"] == whole["text_offset"]
    assert first["tokens"] + second["tokens"] == whole["tokens"]


def test_offsets_count_whole_characters_when_a_character_spans_tokens(smol):
    body, _ = completion_logprobs(entries(smol, "a🎉b"), smol)
    assert body["text_offset"][-1] == 2  # "b" follows two characters
