"""Log-probabilities: the loop's (each token's, and its alternatives', equal
to the model's own at that position, with or without speculation, batched
or alone) and their OpenAI response shapes (``hf2q_py.server.logprobs``):
token strings and bytes from the vocabulary, chat's ``logprobs.content`` and
the legacy completions lists, chunk by chunk as a stream sends them."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from models import char_tokenizer, tiny_target
from test_engine import loopy_prompt

import hf2q_py
from hf2q_py.errors import Hf2qError

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


# -- the loop's log-probabilities --------------------------------------------------------
def reference_logprobs(target, prompt: list[int], tokens: list[int]) -> list[list[float]]:
    """log softmax of the model's logits at each generated position (one full forward)."""
    logits = target.model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1].astype(mx.float32)
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()


@pytest.mark.parametrize(
    "options",
    [dict(method="baseline"), dict(method="ngram", k=4, adaptive=False, memory=False), dict(method="ngram")],
    ids=["plain", "ngram-fixed", "ngram-adaptive"],
)
def test_each_tokens_logprob_and_alternatives_are_the_models_own_at_its_position(options):
    target = tiny_target("llama", scale=2.0)
    prompt = loopy_prompt(24)
    r = hf2q_py.generate(target, prompt, max_tokens=30, logprobs=3, **options)
    assert [e.token for e in r.logprobs] == r.tokens
    ref = reference_logprobs(target, prompt, r.tokens)
    for e, row in zip(r.logprobs, ref):
        assert e.logprob == pytest.approx(row[e.token], abs=1e-4) and e.logprob <= 0
        best = sorted(range(len(row)), key=lambda t: -row[t])[:3]
        assert [t for t, _ in e.top] == best
        assert [lp for _, lp in e.top] == pytest.approx([row[t] for t in best], abs=1e-4)
    if options["method"] == "ngram":
        assert r.stats.drafted > 0


def test_streamed_chunks_carry_the_logprobs_of_their_own_tokens_and_batches_equal_solo():
    target = tiny_target("llama", scale=2.0, tokenizer=True)
    prompt = loopy_prompt(24)
    chunks = list(hf2q_py.stream_generate(target, prompt, max_tokens=20, logprobs=0, method="ngram"))
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)
    assert all(e.top == [] for c in chunks for e in c.logprobs)
    solo = hf2q_py.generate(target, prompt, max_tokens=20, logprobs=2, method="ngram", memory=False)
    batched = hf2q_py.batch_generate(target, [prompt, [3, 4]], max_tokens=20, logprobs=2, memory=False)[0]
    assert batched.tokens == solo.tokens
    for a, b in zip(batched.logprobs, solo.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_logprobs_out_of_range_are_refused():
    target = tiny_target("llama")
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(Hf2qError, match="logprobs"):
            hf2q_py.generate(target, [1, 2], max_tokens=2, logprobs=bad)
