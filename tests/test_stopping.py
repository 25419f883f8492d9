"""Where generation stops: at a stop string (text and tokens cut at the same
place), at EOS (never emitted, sampling too) and at the end of the context."""

import pytest
from helpers import UNGATED
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError


def test_stop_strings_end_text_and_tokens_at_the_same_place():
    target = tiny_target("llama", scale=2.0, tokenizer=True)
    target.eos_token_ids = set()
    tok = target.tokenizer
    free = hf2q_py.generate(target, "hello world", max_tokens=40, chat_template=False, method="baseline")
    ends = [len(tok.decode(free.tokens[: i + 1])) for i in range(len(free.tokens))]
    assert tok.decode(free.tokens) == free.text
    unmatched = hf2q_py.generate(
        target, "hello world", max_tokens=40, chat_template=False, stop=["never"], method="baseline"
    )
    assert unmatched.text == free.text and unmatched.tokens == free.tokens  # text held back is not repeated
    for method in ("baseline", "ngram"):
        for first, n in ((10, 3), (0, 1), (25, 6)):
            stop = tok.decode(free.tokens[first : first + n])
            cut = free.text.find(stop)
            r = hf2q_py.generate(
                target, "hello world", max_tokens=40, stop=[stop, "never"], chat_template=False, method=method
            )
            # the tokens whose text ends before the stop string, and their text
            assert r.tokens == [t for t, e in zip(free.tokens, ends) if e <= cut]
            assert r.text == tok.decode(r.tokens) == free.text[: max([0] + [e for e in ends if e <= cut])]
            assert r.finish_reason == "stop" and r.stats.generated_tokens == len(r.tokens)
            chunks = list(
                hf2q_py.stream_generate(
                    target, "hello world", max_tokens=40, stop=[stop], chat_template=False, method=method
                )
            )
            assert "".join(c.text for c in chunks) == r.text
            assert [t for c in chunks for t in c.tokens] == r.tokens
            assert [c.stop for c in chunks] == [None] * (len(chunks) - 1) + [stop]  # the last chunk names it


@pytest.mark.parametrize("method", ["baseline", "ngram", "draft"])
def test_eos_ends_sampled_generation_without_being_emitted(method):
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(8) * 2  # repeats, so the n-gram proposer drafts
    opts = dict(method=method, temperature=0.9, seed=4)
    if method == "draft":
        opts.update(
            draft=tiny_target("llama", seed=1, scale=2.0),
            k=3,
            adaptive=False,
            **UNGATED,
        )
    free = hf2q_py.generate(target, prompt, max_tokens=30, **opts)
    eos = free.tokens[12]
    target.eos_token_ids = {eos}
    r = hf2q_py.generate(target, prompt, max_tokens=30, **opts)
    assert r.tokens == free.tokens[: free.tokens.index(eos)]
    assert r.finish_reason == "stop" and eos not in r.tokens


def test_a_prompt_that_fills_the_context_is_refused_and_generation_stops_at_its_end():
    target = tiny_target("qwen2")  # max_position_embeddings in its config
    target.model.args.max_position_embeddings = 16
    with pytest.raises(Hf2qError, match="context holds 16"):
        hf2q_py.generate(target, random_prompt(16), max_tokens=2, method="baseline")
    r = hf2q_py.generate(target, random_prompt(10), max_tokens=50, method="ngram")
    assert len(r.tokens) == 6 and r.finish_reason == "length"
